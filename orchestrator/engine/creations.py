"""Storing admitted runs: all that one turn of the event loop admitted, in one transaction.

A reply that asks for a hundred children admits them in one loop turn, and storing each
(its chain's budgets checked in the same transaction: ``store.create_runs``) was a
transaction a child, most of a spawn's cost. :class:`Creations` holds what a turn
admitted and stores it when the turn ends, in order: a child's room counts the children
stored before it, so budgets hold as when each was stored alone. Each spawner waits for
its own answer: stored, or the ``ChainFull`` that refused it.

A spawner cancelled while it waits takes its run out of the turn's batch; one cancelled
just after its run was stored ends that run (``cancelled``), so no queued run is left
without anyone to run it.

A store that is away (``RunStore.transient``: a Postgres restart, a SQLite file another
process holds past a loop's short busy wait) does not refuse a child: its spawner tries
again with backoff, up to ``store_outage_s``, and its chain's budgets are checked when
the store answers, as always.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..run import RunRecord, RunStatus
from ..store import ChainRoom, RunStore


@dataclass
class _Waiting:
    record: RunRecord
    room: ChainRoom | None
    stored: asyncio.Future[None]


class Creations:
    """The runs admitted in this loop turn, stored together when it ends."""

    def __init__(self, store: RunStore, patience_s: float = 300.0) -> None:
        self.store = store
        self.patience_s = patience_s  # how long a spawner waits for a store that is away
        self._turn: list[_Waiting] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # whose turn is being gathered

    async def store_run(self, record: RunRecord, room: ChainRoom | None) -> None:
        """Store ``record`` with the turn's others; ``ChainFull`` when its chain had no room.
        While the store is away, tried again (0.05 s doubling to 2 s) up to ``patience_s``."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + self.patience_s, 0.05
        while True:
            try:
                return await self._once(record, room)
            except Exception as e:
                if not self.store.transient(e) or loop.time() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _once(self, record: RunRecord, room: ChainRoom | None) -> None:
        loop = asyncio.get_running_loop()
        waiting = _Waiting(record, room, loop.create_future())
        if self._loop is not loop:  # the first of this turn (a closed loop's turn is gone)
            self._loop, self._turn = loop, []
            loop.call_soon(self._write)
        self._turn.append(waiting)
        try:
            await waiting.stored
        except asyncio.CancelledError:
            if waiting in self._turn:  # not written yet: never will be
                self._turn.remove(waiting)
            elif waiting.stored.done() and not waiting.stored.cancelled():
                if waiting.stored.exception() is None:  # stored, and no one will run it
                    self.store.end(
                        record.run_id, RunStatus.CANCELLED, error="cancelled before it started"
                    )
            raise

    def _write(self) -> None:
        turn, self._turn, self._loop = self._turn, [], None
        turn = [w for w in turn if not w.stored.cancelled()]  # their spawners are gone
        if not turn:
            return
        try:
            refused = self.store.create_runs([(w.record, w.room) for w in turn])
        except Exception as e:  # the store failed: every spawner of the turn hears it
            for w in turn:
                if not w.stored.done():
                    w.stored.set_exception(e)
            return
        for w, full in zip(turn, refused, strict=True):
            if w.stored.done():
                continue
            if full is None:
                w.stored.set_result(None)
            else:
                w.stored.set_exception(full)
