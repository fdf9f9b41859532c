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

When the store is away (a failure its dialect calls ``transient``: a Postgres server
restarting, a SQLite file held locked), nothing is dropped: the queue is kept in order
(:class:`Outage`; past ``limit`` steps the oldest progress goes, said once, an ending
never) and tried again from the event loop with backoff (``RETRY_FIRST_S`` doubling to
``RETRY_MAX_S``). The outage is said in one line when it starts and one when the store
answers, and each run whose writes waited gets a ``store_unreachable`` and a
``store_back`` event then.

A store whose writes may wait on another process (SQLite: ``off_loop``) has a loop's
groups written by a writer thread of its own, one group at a time, without the queue's
lock (``add`` never waits); every other statement waits for the group in flight first,
and while the store is away a loop's statements never try it (``away``): the writer
thread's retries do."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..run import RunRecord

log = logging.getLogger(__name__)

GATHER_S = 0.002  # the queue gathers this long after its first write (a spawn's 4 turns)
OUTAGE_QUEUE = 5000  # steps kept while the store is away (``store_outage_queue``)
RETRY_FIRST_S = 0.1  # the first try again after a transient failure, doubling to:
RETRY_MAX_S = 5.0
RETRY_CHUNK = 200  # steps a retry writes a loop turn (what waited goes in several turns)

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
Transient = Callable[[BaseException], bool]  # the store is away (not a refusal of the write)
Event = Callable[[str, str, dict[str, Any]], Step]  # (run_id, kind, data) -> its insert


@dataclass(frozen=True)
class Queued:
    """A queued step, the run it writes for ("" for none), and for a run's ending what
    a journal keeps of it (an ending is never dropped by the bound)."""

    run_id: str
    step: Step
    ending: Any = None


@dataclass
class Outage:
    """The store is away: since when, what waited for it, when to try again."""

    since: float  # epoch seconds
    kept: int  # writes that waited
    runs: set[str] = field(default_factory=set)
    delay: float = RETRY_FIRST_S
    next_try: float = 0.0  # monotonic
    dropped: int = 0  # oldest progress dropped past the bound


def _in_loop() -> bool:
    """Whether this thread runs an event loop."""
    return asyncio._get_running_loop() is not None


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
        *,
        transient: Transient = lambda _e: False,
        event: Event | None = None,
        where: str = "",
        limit: int = OUTAGE_QUEUE,
        off_loop: bool = False,
    ) -> None:
        self._transaction = transaction
        self._load = load  # a run as this process knows it (``Again`` if out of date)
        self._reload = reload or load  # a run as the store has it
        self._save = save
        self._progress_commit = progress_commit  # first in a transaction of progress only
        self._transient = transient
        self._event = event
        self._where = where
        self.limit = limit
        self._pending: list[Queued] = []
        self._lock = threading.RLock()
        # the loop a flush is scheduled on (one at a time: what a write or a read takes in
        # first does not schedule another; a loop closed before its turn ended is replaced)
        self._scheduled: asyncio.AbstractEventLoop | None = None
        self.outage: Outage | None = None  # the store is away (see the module's doc)
        self._retrying: asyncio.TimerHandle | None = None
        # ``off_loop``: a loop's groups are written by a thread of their own; every other
        # statement waits for the group in flight first (``_settled``): order is kept
        self._off_loop = off_loop
        self._idle = threading.Condition(self._lock)
        self._flying: list[Queued] = []  # the group the writer thread is writing
        self._in_flight = False
        self._writer: ThreadPoolExecutor | None = None
        self._writer_pid = 0

    def add(self, step: Step, run_id: str = "") -> None:
        """Queue ``step`` for the next group's transaction (``GATHER_S`` after the first);
        with no running loop in this thread, write it (and what is queued) now."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            self._pending.append(Queued(run_id, step))
            if self.outage is not None:  # waits with the rest; the retry is scheduled
                self.outage.kept += 1
                self.outage.runs.add(run_id)
                self._bound()
                if loop is not None:
                    self._retry_later(loop)
                return
            if loop is None:  # written now, after what is queued; its failure is the caller's
                self._pending.pop()
                self.flush()
                self._apply([step])
            elif self._scheduled is not loop:
                self._scheduled = loop
                loop.call_later(GATHER_S, self._gathered, loop)

    def away(self) -> int:
        """The writes waiting for a store away, if this thread runs a loop (``off_loop``)."""
        if not self._off_loop or self.outage is None or not _in_loop():
            return 0
        with self._lock:
            return max(1, len(self._pending) + len(self._flying))

    def keep(self, step: Step, run_id: str, ending: Any) -> None:
        """Queue a run's ending that the store could not take (it is away): after what is
        queued, never dropped, tried again with the rest."""
        with self._lock:
            self._keep([], Queued(run_id, step, ending))

    def endings(self) -> list[Any]:
        """What the journal keeps of each ending still waiting for the store."""
        with self._lock:
            return [q.ending for q in [*self._flying, *self._pending] if q.ending is not None]

    def forget_endings(self) -> None:
        """Drop the waiting endings (journaled: the next command writes them)."""
        with self._lock:
            self._settled()
            self._pending = [q for q in self._pending if q.ending is None]

    def _gathered(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if self._scheduled is loop:
                self._scheduled = None
            if self._off_loop:
                self._send(loop)
            else:
                self.flush()

    def close(self) -> None:
        """Write what is queued and end the writer thread (a later group starts another)."""
        with self._lock:
            self.flush()
            writer, self._writer = self._writer, None
        if writer is not None and self._writer_pid == os.getpid():
            writer.shutdown(wait=False)

    def _settled(self) -> None:
        """(Under the lock.) Wait for the group the writer thread is writing."""
        if self._writer_pid != os.getpid():  # a forked child: no writer thread here
            self._in_flight, self._flying = False, []
        while self._in_flight:
            self._idle.wait()

    def _send(self, loop: asyncio.AbstractEventLoop, most: int | None = None) -> None:
        """(Under the lock.) Hand what is queued to the writer thread (one group at a time;
        while the store is away, once its next try is due)."""
        if self._in_flight or not self._pending:
            return
        if most is None and self.outage is not None and time.monotonic() < self.outage.next_try:
            return
        if self._writer is None or self._writer_pid != os.getpid():
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="orch-store")
            self._writer_pid = os.getpid()
        cut = len(self._pending) if most is None else most
        self._flying, self._pending = self._pending[:cut], self._pending[cut:]
        self._in_flight = True
        self._writer.submit(self._write_off, self._flying, loop)

    def _write_off(self, queued: list[Queued], loop: asyncio.AbstractEventLoop) -> None:
        """(The writer thread, without the lock: ``add`` never waits for the store.)"""
        try:
            left = self._write(queued)
        except BaseException as e:  # never leaves the group in flight: kept, said
            log.warning("orch: a group of progress writes failed: %s", e)
            left = queued
        with self._lock:
            self._in_flight, self._flying = False, []
            if left:
                self._keep(left)
            elif self.outage is not None and not self._pending:
                self._back(queue=True)
            elif self.outage is not None:  # the rest of what waited, the next turn
                self.outage.next_try = time.monotonic()
            self._idle.notify_all()
            more = bool(self._pending)
        if more:
            try:
                loop.call_soon_threadsafe(self._resume, loop)
            except RuntimeError:  # the loop is closed: the next statement writes them
                pass

    def _resume(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if self.outage is not None:
                self._retry_later(loop)
            else:
                self._send(loop)

    def _write(self, queued: list[Queued]) -> list[Queued]:
        """Write ``queued`` in one transaction, else step by step (a step refused alone is
        logged and dropped); what is left when the store is away."""
        try:
            self._apply([q.step for q in queued])
        except Exception as e:
            if self._transient(e):
                return queued
            for i, one in enumerate(queued):
                try:
                    self._apply([one.step])
                except Exception as e:
                    if self._transient(e):
                        return queued[i:]
                    log.warning("orch: a progress write was dropped: %s", e)
        return []

    def flush(self, *, now: bool = False, most: int | None = None) -> None:
        """Write what is queued, in one transaction (when the group has gathered, or before
        any other statement of the store); what fails is tried step by step, and a step that
        fails alone is logged and dropped: progress never fails a caller's own statement.
        While the store is away, only once its next try is due (or ``now``), and ``most``
        steps at a time (the loop's retries: each turn stays short)."""
        with self._lock:
            self._settled()
            if not self._pending:
                return
            if self.outage is not None and self._off_loop and _in_loop():
                return  # the writer thread tries again (the loop never waits for the store)
            if not now and self.outage is not None and time.monotonic() < self.outage.next_try:
                return
            cut = len(self._pending) if most is None else most
            queued, self._pending = self._pending[:cut], self._pending[cut:]
            if left := self._write(queued):
                self._keep(left)
                return
            if self._pending and self.outage is not None:  # the rest, the next turns
                self.outage.next_try = time.monotonic()
                return
            self._back()

    def _keep(self, queued: list[Queued], *last: Queued) -> None:
        """The store is away: keep ``queued`` first in the queue (and ``last`` after it),
        try again later."""
        self._pending[:0] = queued
        self._pending.extend(last)
        if self.outage is not None and last:
            self.outage.kept += len(last)
            self.outage.runs.update(q.run_id for q in last)
        outage = self.outage
        if outage is None:
            outage = self.outage = Outage(since=time.time(), kept=len(self._pending))
            outage.runs.update(q.run_id for q in self._pending)
            log.warning(
                "orch: the store at %s is unreachable; keeping %d writes until it answers",
                self._where,
                len(self._pending),
            )
            outage.next_try = time.monotonic() + outage.delay
        elif queued:  # a try failed again
            outage.delay = min(outage.delay * 2, RETRY_MAX_S)
            outage.next_try = time.monotonic() + outage.delay
        self._bound()
        try:
            self._retry_later(asyncio.get_running_loop())
        except RuntimeError:  # no loop here: the next statement of the store tries again
            pass

    def _bound(self) -> None:
        """Past ``limit`` kept steps, the oldest progress goes (said once an outage)."""
        outage = self.outage
        over = len(self._pending) - self.limit
        if outage is None or over <= 0:
            return
        kept: list[Queued] = []
        for q in self._pending:
            if over > 0 and q.ending is None:
                over -= 1
                outage.dropped += 1
                if outage.dropped == 1:
                    log.warning(
                        "orch: the store at %s is still unreachable; past %d writes kept, "
                        "the oldest progress is dropped",
                        self._where,
                        self.limit,
                    )
                continue
            kept.append(q)
        self._pending = kept

    def _retry_later(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.outage is None or (self._retrying is not None and not self._retrying.cancelled()):
            return
        delay = max(0.0, self.outage.next_try - time.monotonic())
        self._retrying = loop.call_later(delay, self._retry, loop)

    def _retry(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._retrying = None
            if self._off_loop:
                self._send(loop, most=RETRY_CHUNK)  # its end schedules what follows
                return
            self.flush(now=True, most=RETRY_CHUNK)
            if self.outage is not None and not loop.is_closed():
                self._retry_later(loop)

    def _back(self, *, queue: bool = False) -> None:
        """The store answers again: say so once, and write the outage in each waiting
        run's events (``queue``: with the next group)."""
        outage, self.outage = self.outage, None
        if outage is None:
            return
        if self._retrying is not None:
            self._retrying.cancel()
            self._retrying = None
        until = time.time()
        log.warning(
            "orch: the store at %s answers again; %d writes that waited were written "
            "(unreachable %.1f s)",
            self._where,
            outage.kept - outage.dropped,
            until - outage.since,
        )
        if self._event is None:
            return
        data = {"since": outage.since, "until": until, "kept": outage.kept}
        data["dropped"] = outage.dropped
        steps = [
            (run_id, self._event(run_id, kind, data))
            for run_id in sorted(r for r in outage.runs if r)
            for kind in ("store_unreachable", "store_back")
        ]
        if queue:
            self._pending.extend(Queued(run_id, step) for run_id, step in steps)
            return
        try:
            self._apply([step for _, step in steps])
        except Exception as e:  # said, not raised: the writes themselves are in
            log.warning("orch: the store outage could not be written in the runs' events: %s", e)

    @contextmanager
    def joined(self) -> Iterator[Query]:
        """A transaction for a caller's own statements that first writes what is queued.

        The queue goes under a savepoint (its commit is the caller's: as durable as the
        caller's own statements, never asynchronous); if it fails, each step is
        tried under one of its own and a failing one is logged and dropped. The caller's
        statements follow, and its failure is its own: the transaction is rolled back and
        the queue, untouched by it, is written on its own before the error goes on (kept,
        if the store is away)."""
        with self._lock:
            self._settled()
            queued, self._pending = self._pending, []
            try:
                with self._transaction() as q:
                    if queued:
                        self._within(q, [one.step for one in queued])
                    yield q
            except BaseException as e:
                if queued:
                    if isinstance(e, Exception) and self._transient(e):
                        self._keep(queued)
                    else:
                        self._pending[:0] = queued
                        self.flush()
                raise
            if queued:
                self._back()

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
                    if self._transient(e):
                        raise  # the whole transaction fails: the queue is kept
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
