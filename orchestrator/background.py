"""Ownership across processes: heartbeats, cancel requests, detached workers, reconcile.

Every run has an owner process (``node`` + ``pid`` + ``pid_start`` in its record). The
owner's :class:`Supervisor` beats the heartbeat of the runs it holds and
watches the store for cancel requests (``orch cancel`` from another terminal).
Any ``orch`` command first calls :func:`reconcile`: a queued or running run
whose owner is gone becomes ``interrupted`` (its partial output kept), and what
it owned is reaped: process groups killed, worktrees salvaged (work committed
to the branch, never deleted), containers salvaged the same way (work exported to
the branch) and removed. An owner on another node (a Ray node, see ``executors/``)
cannot be asked by pid: it is gone once its heartbeat is older than
:data:`REMOTE_STALE_S`, and its resources are its node's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from .run import RunRecord, RunStatus, now
from .statedir import open_log, verified
from .store import RunStore, state_dir
from .workspaces.base import kill_group_ref, process_start

HEARTBEAT_S = 1.0
SIGNED = ("pgroup", "container")  # refs signed at registration (statedir.sign)
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


class Supervisor:
    """Runs beside the runs of one process: heartbeats and cancel requests."""

    def __init__(self, store: RunStore, live: Callable[[], dict[str, asyncio.Task[RunRecord]]]):
        self.store = store
        self.live = live
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="orch-supervisor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self) -> None:
        while True:
            self.tick()
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
    store: RunStore, live: Callable[[], dict[str, asyncio.Task[RunRecord]]]
) -> AsyncIterator[None]:
    """A :class:`Supervisor` beside the runs of a block."""
    supervisor = Supervisor(store, live)
    supervisor.start()
    try:
        yield
    finally:
        await supervisor.stop()


def reap(store: RunStore, run_id: str) -> list[str]:
    """Reap what a run whose owner is gone left behind; returns what was done."""
    done: list[str] = []
    for res in store.resources(run_id):
        kind, signed = res["kind"], res["ref"]
        ref = verified(run_id, kind, signed) if kind in SIGNED else signed
        if ref is None:  # a row this user's orch did not write: nothing of it is touched
            done.append(
                f"left {kind} {signed.split(' ')[0][:24]} alone: not registered by this user's orch"
            )
        elif kind == "pgroup":
            if kill_group_ref(ref):
                done.append(f"killed process group {ref.partition(':')[0]}")
        elif kind == "worktree":
            from .workspaces.worktree import salvage_worktree

            art = asyncio.run(salvage_worktree(Path(ref), run_id, "interrupted", proven=True))
            if art:
                done.append(f"kept work on branch {art.get('branch')} at {art.get('commit')}")
        elif kind in ("container", "checkpoint"):  # work salvaged, then the container removed
            from .workspaces.container.export import reap_resource

            done.extend(reap_resource(store.get_run(run_id), kind, ref))
        store.release_resource(run_id, kind, signed)
    return done


def reconcile(store: RunStore) -> list[RunRecord]:
    """Mark runs whose owner is gone as interrupted and reap their resources."""
    fixed: list[RunRecord] = []
    live = store.list_runs(statuses=[RunStatus.QUEUED, RunStatus.RUNNING])
    beats: dict[str, float | None] = {}
    if any(foreign(rec) for rec in live):  # their heartbeats say whether they are alive
        beats = {r["run_id"]: r.get("heartbeat_at") for r in store.list_raw(since=now())}
    for rec in live:
        if owner_alive(rec, beats.get(rec.run_id)):
            continue
        current = store.get_run(rec.run_id)  # the owner may have ended it since the listing
        if current is None or current.status.ended:
            continue
        # a remote owner's resources are on its node: nothing of them is here to reap
        actions = [] if foreign(rec) else reap(store, rec.run_id)
        where = f" on {rec.node}" if foreign(rec) else ""
        error = f"interrupted: owner process {rec.pid}{where} is gone"
        if actions:
            error += " (" + "; ".join(actions) + ")"
        output = current.output or current.summary
        updated = store.end(rec.run_id, RunStatus.INTERRUPTED, error=error, output=output)
        if updated is not None:
            fixed.append(updated)
    return fixed


def spawn_worker(project_root: Path, run_id: str) -> int:
    """Hand a queued background run to the worker host of its state dir (``workerhost.py``,
    started when none lives); failing that, start a worker of its own. Returns the pid of
    the process that owns the run."""
    from .errors import OrchError
    from .hostlink import HostUnavailable, hand_to_host

    try:
        return hand_to_host(project_root, run_id)
    except (HostUnavailable, OrchError, OSError) as e:
        return own_worker(project_root, run_id, f"no worker host ({e})")


def own_worker(project_root: Path, run_id: str, why: str = "") -> int:
    """Start a detached worker (new session: survives the terminal) for one queued run."""
    log = os.fdopen(open_log(state_dir(project_root), f"{run_id}.log"), "ab")
    try:
        if why:
            log.write(f"orch: {why}; this run gets a worker of its own\n".encode())
            log.flush()
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "_worker", run_id, "-C", str(project_root)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        log.close()
    return proc.pid
