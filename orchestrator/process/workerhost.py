"""The worker host: one long-lived detached process that runs many background runs.

``orch task --background`` hands its queued run over a Unix socket in the state dir
(``detach.py`` is that side, and starts a host when none answers). The host adopts
each run in its one event loop: the run's record gets the host as its owner (pid and
start time), one :class:`~orchestrator.engine.owner.Supervisor` beats the heartbeats of
all its runs and obeys ``orch cancel``, and if the host dies, the next command's
reconcile ends its runs ``interrupted``, as for a worker of its own.

A handoff is refused unless it comes from the same uid (``SO_PEERCRED``) outside every
sandbox (our namespaces: else refused before a byte is read), both ends proved themselves
(``unixsock``), it carries the digest of the launcher's environment, that environment
and what else the launcher would pass on (limits, groups, umask, ``no_new_privs``...,
read from ``/proc``) are the host's own (every run here sees the host's: a launcher
without the API key, or with tighter limits, gets a worker of its own instead), and
names a run of this store that is a queued background root still owned by the peer that
asks (the launcher that just queued it).

Recipes (``rebuild.py``): runs whose project, launch (model, agent dirs, flags, trust
cap), settings and catalog are the same share one runner (one model client); a scripted model
plays its script once per run, so each scripted run has a runner of its own, as it had
a process of its own. The host exits ``host_idle_seconds`` (``ORCH_HOST_IDLE``) after
its last run ended; SIGTERM cancels its runs the normal way and then ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import Settings
from ..engine.owner import Supervisor, me
from ..errors import OrchError
from ..pgroups import process_start
from ..project.paths import project_root
from ..run import RunRecord, RunStatus
from ..store import RunStore, state_dir
from ..store.journal import JOURNAL, outlast
from .detach import MAX_LINE, own_worker, paths
from .executor import attach
from .inherit import comparable_env, inherited
from .rebuild import Recipe, recipe
from .unixsock import Unproven, answer, env_digest, listen, outside_sandboxes, peer, unlink_if_ours

if TYPE_CHECKING:
    from ..engine.runner import Runner

FIRST_RUN_GRACE_S = 10.0  # a new host waits this long for the run of the launcher that started it
TICK_S = 0.05
READ_TIMEOUT_S = 10.0
KEEP_IDLE_ENGINES = 8  # runners kept for later runs once their runs ended


@dataclass
class Slot:
    """A runner of the host and the runs it holds."""

    recipe: Recipe
    runner: Runner
    runs: set[str] = field(default_factory=set)
    used: float = field(default_factory=time.monotonic)


def log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{stamp} host {os.getpid()}: {message}", file=sys.stderr, flush=True)


def preload() -> None:
    """What the host imports early for a model: the model providers' SDKs (~1 s, once)."""
    from ..models import preload as preload_providers

    preload_providers()


class WorkerHost:
    def __init__(self, store: RunStore, state: Path, key: str, lock_fd: int | None) -> None:
        self.store = store
        self.lock_fd = lock_fd  # held while we answer: no other host starts meanwhile
        self.state = state
        self.sock_path, self.lock_path = paths(state, key)
        self.slots: list[Slot] = []
        self.shared: dict[str, Slot] = {}
        self.live: dict[str, asyncio.Task[None]] = {}  # run id -> the task following it
        self.adopted: set[str] = set()
        self.env = comparable_env(dict(os.environ))  # the launcher's that started us
        self.inherits = inherited("self")  # its limits, groups, umask, privileges
        self.pending = 0  # connections being answered
        self.idle_seconds = 60.0
        self.terminating = False
        self.pools = contextlib.AsyncExitStack()
        self._sdk: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._server: asyncio.AbstractServer | None = None
        self._ino: int | None = None

    # -- the socket -----------------------------------------------------------------------
    def _listen(self) -> socket.socket:
        sock, self._ino = listen(self.sock_path, 128)  # the launcher holds the lock
        sock.setblocking(False)
        return sock

    def _unlink(self) -> None:
        unlink_if_ours(self.sock_path, self._ino)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.pending += 1
        try:
            reply = await self._answer(reader, writer)
            if reply is not None:
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except Exception as e:  # one connection's trouble never ends the host
            log(f"a connection ended badly: {type(e).__name__}: {e}")
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            self.pending -= 1

    async def _answer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> dict[str, object] | None:
        pid, uid, _ = peer(writer.get_extra_info("socket"))
        if uid != os.getuid():  # refused before a byte is read, and before we prove anything
            log(f"refused a connection of uid {uid} (pid {pid})")
            return {"ok": False, "error": "another user"}
        if not outside_sandboxes(pid):
            log(f"refused a connection from inside a sandbox (pid {pid})")
            return {"ok": False, "error": "a process inside a sandbox"}
        async with asyncio.timeout(READ_TIMEOUT_S):
            hello = await reader.readline()
        if not hello:
            return None  # a launcher checking that we answer
        try:
            reply, nonce, expected = answer(hello, pid)
        except Unproven as e:
            return {"ok": False, "error": str(e)}
        writer.write(reply)
        await writer.drain()
        # read its lines first, even to refuse it: closing with them unread would break the
        # caller's pipe before it could read why
        async with asyncio.timeout(READ_TIMEOUT_S):
            proof = await reader.readline()
            line = await reader.readline()
        if not hmac.compare_digest(proof.rstrip(b"\n"), expected.encode()):
            log(f"refused a connection from pid {pid}: it did not prove itself")
            return {"ok": False, "error": "the launcher did not prove itself"}
        try:
            msg = json.loads(line)
        except ValueError:
            msg = None
        ok = isinstance(msg, dict) and set(msg) == {"run_id", "env"}
        run_id, env = (msg.get("run_id"), msg.get("env")) if ok else (None, None)
        if not isinstance(run_id, str) or not 0 < len(run_id) <= 64:
            return {"ok": False, "error": 'expected one line {"run_id": ..., "env": ...}'}
        ours = [[k, v] for k, v in self.env.items()]
        if not isinstance(env, str) or not hmac.compare_digest(env, env_digest(nonce, ours)):
            log(f"refused {run_id[:64]!r} from pid {pid}: its launcher's environment is not ours")
            return {"ok": False, "error": "the launcher's environment is not this host's"}
        try:
            same = inherited(pid) == self.inherits
        except OSError:
            same = False
        if not same:
            log(f"refused {run_id[:64]!r} from pid {pid}: its limits or privileges are not ours")
            return {"ok": False, "error": "the launcher's limits or privileges are not this host's"}
        why = self.adopt(run_id, (pid,))
        if why is not None:
            log(f"refused {run_id[:64]!r} from pid {pid}: {why}")
            return {"ok": False, "error": why}
        return {"ok": True, "pid": os.getpid()}

    # -- runs -----------------------------------------------------------------------------
    def adopt(self, run_id: str, owners: tuple[int, ...]) -> str | None:
        """Start a handed-over run, queued by one of ``owners`` (the launcher that asks);
        None, or why it is refused."""
        if self.terminating:
            return "the host is stopping"
        if run_id in self.adopted:
            return "already handed over"
        record = self.store.get_run(run_id)
        if record is None:
            return "no such run in this store"
        if record.status != RunStatus.QUEUED or not record.background or record.parent_run_id:
            return f"not a queued background run ({record.status.value})"
        if record.pid not in owners:
            return "the run was queued by another process"
        try:
            workdir = record.planned().spec.workdir
            if state_dir(project_root(workdir)).resolve() != self.state.resolve():
                return "the run belongs to another state dir"
            slot = self._slot(recipe(workdir, record.launch))
        except Exception as e:  # a run's runner failing to build is that run's, not the host's
            return f"cannot build its runner: {type(e).__name__}: {e}"
        handle = slot.runner.start(run_id)  # the job runs from our next await on
        if handle.job is None:
            self._release(slot)
            return "it is no longer queued"
        self.adopted.add(run_id)
        pid, pid_start = me()  # ours from now on (the launcher may read it before we answer)
        self.store.update_run(run_id, pid=pid, pid_start=pid_start)
        slot.runs.add(run_id)
        self.idle_seconds = slot.recipe.settings.host_idle_seconds
        if self._sdk is None and not slot.recipe.scripted:
            self._sdk = asyncio.create_task(asyncio.to_thread(preload), name="orch-sdk")
        self.live[run_id] = asyncio.create_task(
            self._follow(slot, run_id, handle.job), name=f"orch-host-{run_id}"
        )
        log(f"adopted {run_id} ({len(self.live)} live)")
        return None

    def _slot(self, made: Recipe) -> Slot:
        current = None if made.scripted else self.shared.get(made.key)
        if current is not None and current.recipe.catalog == made.catalog:
            current.used = time.monotonic()
            return current
        slot = Slot(made, attach(made.runner(self.store)))
        self.slots.append(slot)
        if not made.scripted:
            self.shared[made.key] = slot
            if current is not None:
                self._release(current)
        return slot

    def _release(self, slot: Slot) -> None:
        """Drop a slot without runs that no later run can share."""
        if slot.runs or (self.shared.get(slot.recipe.key) is slot and not slot.recipe.scripted):
            return
        if slot in self.slots:
            self.slots.remove(slot)
            task = asyncio.create_task(slot.runner.models.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _follow(self, slot: Slot, run_id: str, job: asyncio.Task[RunRecord]) -> None:
        try:
            record = self.store.require_run(run_id)
            if slot.runner.settings.sandbox.pool_size > 0:
                try:
                    await self.pools.enter_async_context(slot.runner.warm_pool(record))
                except OrchError as e:  # one open already (same settings), or no engine
                    log(f"container pool for {run_id}: {e}")
            await asyncio.wait({job})
            if not job.cancelled() and (exc := job.exception()) is not None:
                log(f"run {run_id} raised {type(exc).__name__}: {exc}")
            if any(k.run_id == run_id for k in self.store.unwritten()):
                log(f"{run_id} ended; its ending waits for the store")  # ``_outlast``
                return
            final = self.store.get_run(run_id)
            if final is not None and not final.status.ended:
                # its job ended but its run did not: ended here, never left queued under a
                # living host (a cancel would wait on it, reconcile never see it)
                why = "cancelled" if job.cancelled() else "its job ended without an ending"
                status = RunStatus.CANCELLED if job.cancelled() else RunStatus.FAILED
                final = self.store.end(run_id, status, error=why) or final
            log(f"{run_id} ended {final.status.value if final else '?'}")
        except Exception as e:  # one run's trouble never ends the host
            log(f"following {run_id}: {type(e).__name__}: {e}")
        finally:
            slot.runs.discard(run_id)
            slot.used = time.monotonic()
            self.live.pop(run_id, None)
            self._release(slot)
            self._trim()

    async def _outlast(self) -> None:
        """Never exit with a run's ending unwritten: while the store is away, wait for it
        (``store_outage_s``), then keep what is left in the state dir's journal."""
        waiting = [k.run_id for k in self.store.unwritten()]
        if not waiting:
            return
        limit = max(
            (s.runner.settings.store_outage_s for s in self.slots),
            default=Settings.model_fields["store_outage_s"].default,
        )
        log(f"the store is away: waiting up to {limit:.0f} s to record {', '.join(waiting)}")
        if kept := await outlast(self.store, self.state, limit):
            log(f"{', '.join(kept)} kept in {JOURNAL}: the next orch command records them")

    def _trim(self) -> None:
        idle = sorted((s for s in self.shared.values() if not s.runs), key=lambda s: s.used)
        for slot in idle[: max(0, len(idle) - KEEP_IDLE_ENGINES)]:
            del self.shared[slot.recipe.key]
            self._release(slot)

    def jobs(self) -> dict[str, asyncio.Task[RunRecord]]:
        return {rid: job for s in self.slots for rid, job in s.runner.jobs.items()}

    def terminate(self) -> None:
        """SIGTERM: every run is cancelled the normal way (work committed), then the host ends."""
        if self.terminating:
            return
        self.terminating = True
        log("SIGTERM: cancelling every run")
        for slot in self.slots:
            for rid in slot.runs:
                job = slot.runner.jobs.get(rid)
                if job is not None:
                    job.cancel("the worker host was stopped")

    # -- lifetime -------------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self.live or self.pending)

    def _stop_answering(self) -> None:
        """Stop answering and let go of the lock: a launcher may start a new host now."""
        self._unlink()
        if self._server is not None:
            self._server.close()
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def _idle_limit(self) -> float:
        override = os.environ.get("ORCH_HOST_IDLE")
        if override:
            with contextlib.suppress(ValueError):
                return max(0.0, float(override))
        return self.idle_seconds

    async def _until_idle(self) -> None:
        started = last_busy = time.monotonic()
        while not self.terminating:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            if self._busy():
                last_busy = now
                continue
            idle = self._idle_limit()
            if not self.adopted:  # nothing handed over yet: wait a little for a launcher
                idle = max(idle, FIRST_RUN_GRACE_S - (last_busy - started))
            if now - last_busy >= idle:
                return

    def _first(self, root: Path, run_id: str, launcher: int) -> None:
        """The run of the launcher that started us (on our command line, not the socket)."""
        why = self.adopt(run_id, (launcher, os.getpid()))
        if why is None:
            return
        log(f"cannot run {run_id} here: {why}")
        record = self.store.get_run(run_id)
        if record is not None and record.status == RunStatus.QUEUED:
            if record.pid in (launcher, os.getpid()) and run_id not in self.adopted:
                pid = own_worker(root, run_id, f"the worker host could not run it ({why})")
                self.store.update_run(run_id, pid=pid, pid_start=process_start(pid))

    async def serve(self, root: Path, first: tuple[str, int] | None) -> int:
        loop = asyncio.get_running_loop()
        try:
            self._server = await asyncio.start_unix_server(
                self._client, sock=self._listen(), limit=MAX_LINE
            )
            log(f"listening on {self.sock_path.name}")
        except OSError as e:  # runs what it was started with, then ends
            log(f"cannot listen on {self.sock_path.name} ({e}): only the first run is hosted")
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.terminate)
        supervisor = Supervisor(self.store, self.jobs)
        supervisor.start()
        try:
            if first is not None:
                self._first(root, *first)
            await self._until_idle()
            self._stop_answering()
            while self._busy():  # runs (and connections) taken in before the socket closed
                await asyncio.gather(*self.live.values(), return_exceptions=True)
                await asyncio.sleep(TICK_S)
        finally:
            self._stop_answering()
            await self._outlast()
            await supervisor.stop()
            for slot in self.slots:
                with contextlib.suppress(Exception):
                    await slot.runner.models.aclose()
            await asyncio.gather(*self._closing, return_exceptions=True)
            await self.pools.aclose()
            if self._sdk is not None:
                await asyncio.gather(self._sdk, return_exceptions=True)
        log("no run left: exiting")
        return 0


def serve(
    root: Path,
    key: str,
    store: RunStore,
    *,
    lock_fd: int | None,
    first: tuple[str, int] | None,
) -> int:
    """The host process's main: serve until idle (or SIGTERM), then close everything.
    ``store`` is the store of the launcher that started it (its key says which)."""
    if lock_fd is not None:
        os.set_inheritable(lock_fd, False)  # never held on by a command a run starts
    try:
        host = WorkerHost(store, state_dir(root), key, lock_fd)
        return asyncio.run(host.serve(root, first))
    finally:
        store.close()
