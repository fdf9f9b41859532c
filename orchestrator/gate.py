"""ChainGate: at most ``max_chain_running`` runs of one chain work at once.

A run takes a place before it starts (until then it waits ``queued``) and gives
it back when it ends. A run that waits for its own children gives its place
back for as long as it waits (``pause``/``resume``, counted, since one reply's
task calls wait concurrently): otherwise a tree deeper than the budget would
wait on itself for ever. Cancellation-safe: a place is released only if held.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


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
