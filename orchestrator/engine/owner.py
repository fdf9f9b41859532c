"""Who owns a run, and how it shows it is alive: identity and heartbeats.

Every run has an owner process (``node`` + ``pid`` + ``pid_start`` in its record):
:func:`me` and :func:`this_node` say who this process is (a pid with its start time,
``pgroups.process_start``, never mistaken for a later process that reuses it),
and :func:`owner_alive` says whether a record's owner still lives. The owner's
:class:`Supervisor` beats the heartbeat of the runs it holds and watches the store for
cancel requests (``orch cancel`` from another terminal). An owner on another node (a Ray
node, see ``cluster/``) cannot be asked by pid: it is gone once its heartbeat is older
than :data:`REMOTE_STALE_S`.

This module imports nothing of orch but the run record and the workspaces' process
identity: the store and the engine ask it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Protocol

from ..pgroups import process_start
from ..run import RunRecord, now
from ..workspaces.lifetime import stopped

HEARTBEAT_S = 1.0
REMOTE_STALE_S = 30.0  # a remote owner whose heartbeat is older is taken for gone
HAVE_PROC = Path("/proc/self/stat").exists()
_NODE: list[str] = []  # this process's node name, once known


def this_node() -> str:
    """Where this process runs, as run records name it: the host name, unless a Ray node
    set its own (:func:`set_node`)."""
    if not _NODE:
        _NODE.append(socket.gethostname())
    return _NODE[0]


def set_node(name: str) -> None:
    _NODE[:] = [name]


def foreign(record: RunRecord) -> bool:
    """Whether the run's owner is on another node (its pid is not one of ours)."""
    return record.node is not None and record.node != this_node()


def owner_alive(record: RunRecord, heartbeat_at: float | None = None) -> bool:
    if foreign(record):
        beat = heartbeat_at or record.started_at or record.created_at
        return now() - beat < REMOTE_STALE_S
    if record.pid is None:
        return False
    if not HAVE_PROC:  # no /proc (macOS): the pid alone, without the reuse check
        try:
            os.kill(record.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    started = process_start(record.pid)
    if started is None:
        return False
    return record.pid_start is None or record.pid_start == started


_ME: tuple[int, int | None] = (0, None)


def me() -> tuple[int, int | None]:
    """This process as an owner: its pid and start time (read once per process)."""
    global _ME
    pid = os.getpid()
    if _ME[0] != pid:  # first call, or a forked child
        _ME = (pid, process_start(pid))
    return _ME


class Beats(Protocol):
    """What a supervisor needs of the store."""

    def heartbeat(self, run_ids: list[str]) -> None: ...

    def cancel_requests(self, run_ids: list[str]) -> set[str]: ...

    def transient(self, error: BaseException) -> bool: ...


class Supervisor:
    """Runs beside the runs of one process: heartbeats and cancel requests."""

    def __init__(self, store: Beats, live: Callable[[], dict[str, asyncio.Task[RunRecord]]]):
        self.store = store
        self.live = live
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="orch-supervisor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await stopped(task)

    async def _loop(self) -> None:
        while True:
            try:
                self.tick()
            except Exception as e:
                if not self.store.transient(e):
                    raise
                # the store is away (said once by the store): beat again on the next tick
            await asyncio.sleep(HEARTBEAT_S / 4)

    def tick(self) -> None:
        jobs = self.live()
        ids = [rid for rid, job in jobs.items() if not job.done()]
        if not ids:
            return
        self.store.heartbeat(ids)
        for rid in self.store.cancel_requests(ids):
            job = jobs.get(rid)
            if job is not None and not job.done():
                job.cancel("cancel requested")


@contextlib.asynccontextmanager
async def supervised(
    store: Beats, live: Callable[[], dict[str, asyncio.Task[RunRecord]]]
) -> AsyncIterator[None]:
    """A :class:`Supervisor` beside the runs of a block."""
    supervisor = Supervisor(store, live)
    supervisor.start()
    try:
        yield
    finally:
        await supervisor.stop()
