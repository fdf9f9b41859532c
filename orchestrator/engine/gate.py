"""ChainGate: at most ``max_chain_running`` runs of one chain work at once.

A run takes a place before it starts (until then it waits ``queued``) and gives
it back when it ends. A run that waits for its own children gives its place
back for as long as it waits (``pause``/``resume``, counted, since one reply's
task calls wait concurrently): otherwise a tree deeper than the budget would
wait on itself for ever. Cancellation-safe: a place is released only if held.

:class:`Places` keeps a process's gates (one per chain) and its slots (a parent's
children at once, ``max_parallel_children``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ..run import RunRecord


class ChainGate:
    def __init__(self, places: int) -> None:
        self._places = asyncio.Semaphore(places)
        self._held: set[str] = set()
        self._waits: dict[str, int] = {}
        self.peak = 0  # most runs working at once (for tests and `orch tree`)

    @property
    def working(self) -> int:
        return len(self._held)

    async def enter(self, run_id: str) -> None:
        await self._places.acquire()
        self._held.add(run_id)
        self.peak = max(self.peak, len(self._held))

    def leave(self, run_id: str) -> None:
        self._waits.pop(run_id, None)
        if run_id in self._held:
            self._held.discard(run_id)
            self._places.release()

    @contextlib.asynccontextmanager
    async def waiting(self, run_id: str) -> AsyncIterator[None]:
        """While ``run_id`` waits for its children, its place is free for them."""
        count = self._waits.get(run_id, 0)
        self._waits[run_id] = count + 1
        if count == 0 and run_id in self._held:
            self._held.discard(run_id)
            self._places.release()
        try:
            yield
        except BaseException:
            # Cancelled (or failing) while waiting: the run is ending, and its children may
            # hold every place; waiting for one here would never end.
            self._done_waiting(run_id)
            raise
        if self._done_waiting(run_id) == 0:
            await self._reenter(run_id)  # cancelled here: no place taken, none leaked

    def _done_waiting(self, run_id: str) -> int:
        left = self._waits.get(run_id, 1) - 1
        if left > 0:
            self._waits[run_id] = left
        else:
            self._waits.pop(run_id, None)
        return max(left, 0)

    async def _reenter(self, run_id: str) -> None:
        if run_id not in self._held:
            await self._places.acquire()
            self._held.add(run_id)
            self.peak = max(self.peak, len(self._held))


class Places:
    """Where the runs of one process wait for their place: their parent's slots, then
    their chain's gate (a chain's ``running`` budget, else ``max_chain_running``)."""

    def __init__(self, per_parent: int, per_chain: int) -> None:
        self.per_parent = per_parent
        self.per_chain = per_chain
        self._gates: dict[str, ChainGate] = {}  # chain id -> its gate
        self._slots: dict[str, asyncio.Semaphore] = {}  # parent run id -> its children's

    def gate(self, record: RunRecord) -> ChainGate:
        """The in-process gate of the record's chain."""
        gate = self._gates.get(record.chain_id)
        if gate is None:
            budgets = record.plan.budgets if record.plan else None
            gate = ChainGate(budgets.running if budgets else self.per_chain)
            self._gates[record.chain_id] = gate
        return gate

    @contextlib.asynccontextmanager
    async def taken(self, record: RunRecord) -> AsyncIterator[None]:
        """Wait for a slot beside the run's siblings, then for a place in its chain
        (queued until then); give both back at its end."""
        slot = None
        if record.parent_run_id is not None:
            slot = self._slots.setdefault(record.parent_run_id, asyncio.Semaphore(self.per_parent))
        acquired = False
        gate = self.gate(record)
        try:
            if slot is not None:
                await slot.acquire()
                acquired = True
            await gate.enter(record.run_id)
            yield
        finally:
            gate.leave(record.run_id)
            if acquired and slot is not None:
                slot.release()
            if record.depth == 0 and gate.working == 0:
                self._gates.pop(record.chain_id, None)
            self._slots.pop(record.run_id, None)
