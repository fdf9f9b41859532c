"""Group commit: a store's progress writes of a couple of milliseconds, in one transaction.

A run's progress is many small writes: an event per tool call and per result, the
activity line, the conversation after each turn, the process group of each command
registered and released. A hundred children working at once made each its own
transaction (≈ 20 a child, 0.25-1 ms each on one core). Those writes answer nothing
to their caller, so :class:`WriteBehind` queues them and writes what was queued in the
``GATHER_S`` after the first of them (and the loop turn that ends in) in one
transaction, each run changed in it loaded and saved once. Waiting one loop turn was
not enough: a child's spawn runs four turns in its first millisecond, each with a write
of its own, and those transactions stood between the ``task`` call and the child's
first request.

Order and visibility are kept: every other store call (a read, an ``update_run`` whose
answer is used, an ending) writes the queue first, so this process always reads what
it wrote; other processes see it ``GATHER_S`` later. A call that writes takes the queue
into its own transaction (:meth:`WriteBehind.joined`): the queue first, under a
savepoint, then the call's statements, one commit for both. A run that ends here has
its store flushed (``Runner.run_handle``): nothing waits for a turn that never comes.
Without a running event loop in the calling thread (a command's synchronous code, a
worker thread) a write is made at once, after what is queued, and its failure is the
caller's. A queued write that fails is logged and dropped: it is progress, never a
result or the user's work, and what failed with it is tried again on its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from ..run import RunRecord

log = logging.getLogger(__name__)

# how long the queue gathers after its first write: a child's spawn runs four loop turns
# in its first millisecond, each with writes, and a fan-out's turns follow one another
GATHER_S = 0.002

Query = Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]  # as ``sql.Query``

Load = Callable[[Query, str], RunRecord | None]
Save = Callable[[Query, RunRecord], None]


class Again(Exception):
    """Raised by a save when what the unit loaded was out of date: the unit is undone to
    its savepoint and made once more, every run read from the store (``reload``)."""


class Unit:
    """One transaction of queued writes: its query, and the runs they change (each loaded
    at its first change and saved once, at the end)."""

    def __init__(self, q: Query, load: Load) -> None:
        self.q = q
        self._load = load
        self.runs: dict[str, RunRecord | None] = {}

    def run(self, run_id: str) -> RunRecord | None:
        """The run to change (None if there is none): saved when the unit ends."""
        if run_id not in self.runs:
            self.runs[run_id] = self._load(self.q, run_id)
        return self.runs[run_id]


Step = Callable[[Unit], None]


def statement(sql: str, args: Sequence[Any]) -> Step:
    """A step that runs one statement."""

    def step(unit: Unit) -> None:
        unit.q(sql, args)

    return step


class WriteBehind:
    """The queue of one store's progress writes (see the module's doc)."""

    def __init__(
        self,
        transaction: Callable[[], AbstractContextManager[Query]],
        load: Load,
        save: Save,
        progress_commit: str = "",
        reload: Load | None = None,
    ) -> None:
        self._transaction = transaction
        self._load = load  # a run as this process knows it (``Again`` if out of date)
        self._reload = reload or load  # a run as the store has it
        self._save = save
        self._progress_commit = progress_commit  # first in a transaction of progress only
        self._pending: list[Step] = []
        self._lock = threading.RLock()
        # the loop a flush is scheduled on (one at a time: what a write or a read takes in
        # first does not schedule another; a loop closed before its turn ended is replaced)
        self._scheduled: asyncio.AbstractEventLoop | None = None

    def add(self, step: Step) -> None:
        """Queue ``step`` for the next group's transaction (``GATHER_S`` after the first);
        with no running loop in this thread, write it (and what is queued) now."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            self._pending.append(step)
            if loop is None:  # written now, after what is queued; its failure is the caller's
                self._pending.pop()
                self.flush()
                self._apply([step])
            elif self._scheduled is not loop:
                self._scheduled = loop
                loop.call_later(GATHER_S, self._gathered, loop)

    def _gathered(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if self._scheduled is loop:
                self._scheduled = None
            self.flush()

    def flush(self) -> None:
        """Write what is queued, in one transaction (when the group has gathered, or before
        any other statement of the store); what fails is tried step by step, and a step that
        fails alone is logged and dropped: progress never fails a caller's own statement."""
        with self._lock:
            steps, self._pending = self._pending, []
            if not steps:
                return
            try:
                self._apply(steps)
            except Exception:
                for step in steps:
                    try:
                        self._apply([step])
                    except Exception as e:  # progress only: said, not raised
                        log.warning("orch: a progress write was dropped: %s", e)

    @contextmanager
    def joined(self) -> Iterator[Query]:
        """A transaction for a caller's own statements that first writes what is queued.

        The queue goes under a savepoint (its commit is the caller's: as durable as the
        caller's own statements, never asynchronous); if it fails, each step is
        tried under one of its own and a failing one is logged and dropped. The caller's
        statements follow, and its failure is its own: the transaction is rolled back and
        the queue, untouched by it, is written on its own before the error goes on."""
        with self._lock:
            steps, self._pending = self._pending, []
            try:
                with self._transaction() as q:
                    if steps:
                        self._within(q, steps)
                    yield q
            except BaseException:
                if steps:
                    self._pending[:0] = steps
                    self.flush()
                raise

    def _within(self, q: Query, steps: list[Step]) -> None:
        q("SAVEPOINT behind", ())
        try:
            self._unit(q, steps)
        except Exception:
            q("ROLLBACK TO SAVEPOINT behind", ())
            for step in steps:
                q("SAVEPOINT step", ())
                try:
                    self._unit(q, [step])
                except Exception as e:  # progress only: said, not raised
                    q("ROLLBACK TO SAVEPOINT step", ())
                    log.warning("orch: a progress write was dropped: %s", e)
                q("RELEASE SAVEPOINT step", ())
        q("RELEASE SAVEPOINT behind", ())

    def _apply(self, steps: list[Step]) -> None:
        with self._transaction() as q:
            if self._progress_commit:
                q(self._progress_commit, ())
            self._unit(q, steps)

    def _unit(self, q: Query, steps: list[Step]) -> None:
        """The steps, each changed run saved once; made again from fresh reads if a run
        read as this process last wrote it had been changed by another (``Again``)."""
        q("SAVEPOINT unit", ())
        try:
            self._steps(q, steps, self._load)
        except Again:
            q("ROLLBACK TO SAVEPOINT unit", ())
            self._steps(q, steps, self._reload)
        q("RELEASE SAVEPOINT unit", ())

    def _steps(self, q: Query, steps: list[Step], load: Load) -> None:
        unit = Unit(q, load)
        for step in steps:
            step(unit)
        for record in unit.runs.values():
            if record is not None:
                self._save(q, record)
