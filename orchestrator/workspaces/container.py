"""Container tier: the agent's own worktree and branch, its commands run in a locked-down container.

The worktree (and its branch, commit and removal) is a :class:`WorktreeWorkspace`;
this module adds a Docker container around it. File tools act on the worktree on
the host (``root``); ``bash`` runs in the container with ``cwd /workspace``.

What one container mounts; its own host directories (its "slot") are under
``<main repo>/.orch/sandboxes/<name>/``:

- the worktree directory ``.orch/worktrees/<run_id>`` is bind-mounted read-write at
  ``/workspace``. A cold start creates it empty, starts the container and makes the
  worktree in it (``git worktree add`` accepts an empty directory) at the same time; a
  pooled slot (``pool.py``) mounted ``<slot>/work`` and renames it into place on claim
  (the bind mount follows the directory).
- the repository's git dir is mounted read-only at ``/orch/common``;
- ``gitdir/`` (read-write at ``/orch/gitdir``) is the container's private copy of
  the worktree's git admin dir (HEAD, index, ``commondir`` = ``/orch/common``);
- ``links/`` is mounted read-only over ``<git dir>/worktrees`` and holds one symlink,
  ``<worktree name>`` → ``/orch/gitdir``, so the worktree's ``.git`` file resolves
  inside the container. ``git status/diff/log`` work there; the repository's
  config, hooks, objects and refs are read-only (``git add/commit`` inside fail:
  orch commits the work on the branch at the end, on the host).
- ``claim.json`` (not mounted) names the worktree and its gitdir, so whoever removes
  the container (also a crash reconcile) can restore the worktree's ``.git`` file
  before host-side git touches it.

When orch runs as root the container runs as ``sandbox.uid`` (never 0): the worktree's
contents are chowned to it, its top directory and ``.git`` file stay orch's (so host git
sees no "dubious ownership" and the container cannot rewrite ``.git``), and a default
POSIX ACL gives the sandbox user read-write on everything else, including files the
host tools create later. As non-root, the container runs as your uid:gid.

Every container is labelled (``orch.run_id``, ``orch.chain_id``, ``orch.owner_pid``,
``orch.created_at``, ...), runs ``sleep <ttl_s>`` as its main process (so a SIGKILLed
orch cannot leak it forever; it is ``auto_remove``), is registered with the run as
resource ``container`` and removed (not just stopped) at close, whatever the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Literal, Self, TypeVar

from ..errors import OrchError
from ..repo import locate, orch_dir
from .base import (
    MAX_CAPTURE,
    ProcessResult,
    ResourceSink,
    RunOutcome,
    Runtime,
    TierConfig,
    WorkspaceSpec,
)
from .host import HostRuntime
from .pool import (
    MANAGED,
    WORKSPACE,
    Slot,
    attach_tree,
    claim_slot,
    create_container,
    docker_client,
    docker_errors,
    make_slot,
    owner_labels,
    process_start,
    release_slot,
    remove_by_id,
    sandbox_settings,
    sandbox_user,
    start_container,
)
from .worktree import WorktreeWorkspace, await_shielded, continued

__all__ = ["ContainerWorkspace", "docker_client", "reap_by_label", "remove_container"]

T = TypeVar("T")

KILL_GRACE_S = 5.0


# -- removal and reaping (sync: reconcile and the CLI call these) ------------------------


def remove_container(container_id: str) -> None:
    """Remove a container (running or not) and release its slot: used by crash reconcile."""
    client = docker_client()
    try:
        labels = remove_by_id(client, container_id)
    finally:
        client.close()
    if labels.get("orch.slot"):
        release_slot(Path(labels["orch.slot"]))


def _owner_alive(labels: Mapping[str, str]) -> bool:
    try:
        pid = int(labels.get("orch.owner_pid", ""))
    except ValueError:
        return False
    started = process_start(pid)
    recorded = labels.get("orch.owner_start", "")
    return started is not None and (not recorded or recorded == str(started))


def list_containers(client: Any) -> list[dict[str, Any]]:
    """Every orch container (found by label), with its labels and whether its owner lives."""
    with docker_errors():
        found = client.api.containers(all=True, filters={"label": f"{MANAGED}=true"})
    return [{"id": c["Id"], "image": c.get("Image", ""), "state": c.get("State", ""),
             "status": c.get("Status", ""), "labels": c.get("Labels") or {},
             "owner_alive": _owner_alive(c.get("Labels") or {})} for c in found]  # fmt: skip


def reap_by_label(run_ids: set[str] | None = None) -> list[str]:
    """Remove orch containers whose owner process is dead (of ``run_ids`` only, if given)."""
    client = docker_client()
    removed: list[str] = []
    try:
        for c in list_containers(client):
            labels = c["labels"]
            if c["owner_alive"] or (
                run_ids is not None and labels.get("orch.run_id") not in run_ids
            ):
                continue
            remove_by_id(client, c["id"])
            if labels.get("orch.slot"):
                release_slot(Path(labels["orch.slot"]))
            removed.append(c["id"])
    finally:
        client.close()
    return removed


# -- running one command ----------------------------------------------------------------


class _Pump:
    """Reads one exec's output in its own thread (so a long command never holds an executor
    worker) and resolves ``done`` on the loop when the stream ends."""

    def __init__(self, api: Any, exec_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.api, self.exec_id, self.loop = api, exec_id, loop
        self.done: asyncio.Future[None] = loop.create_future()
        self.chunks: list[bytes] = []
        self.kept = self.dropped = 0
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name=f"orch-exec-{exec_id[:8]}", daemon=True).start()

    def _run(self) -> None:
        stream = None
        try:
            stream = self.api.exec_start(self.exec_id, stream=True, demux=False)
            for data in stream:
                take = data[: max(0, MAX_CAPTURE - self.kept)]
                self.chunks.append(take)
                self.kept += len(take)
                self.dropped += len(data) - len(take)
        except BaseException as e:  # reported on the loop
            self.error = e
        finally:
            if stream is not None:  # a stream's socket is ours to close: shut it, drop the response
                for close in (stream.close, stream._response.close):
                    with contextlib.suppress(Exception):
                        close()
        with contextlib.suppress(RuntimeError):  # the loop may be closed already
            self.loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


def _cgroup_procs(container_id: str) -> list[int] | None:
    """Host pids in the container's cgroup (v1 or v2, cgroupfs or systemd), None if unseen."""
    cg, cid = "/sys/fs/cgroup", container_id
    for path in (f"{cg}/pids/docker/{cid}", f"{cg}/pids/system.slice/docker-{cid}.scope",
                 f"{cg}/system.slice/docker-{cid}.scope", f"{cg}/docker/{cid}"):  # fmt: skip
        with contextlib.suppress(OSError, ValueError):
            return [int(pid) for pid in Path(path, "cgroup.procs").read_text().split()]
    return None


def _kill_group(pgid: int, container_id: str) -> None:
    """SIGKILL process group ``pgid`` (an exec's), only once a process of the container's own
    cgroup is seen in it: never a group of this pid namespace that merely has that number."""
    if pgid <= 0:
        return
    for pid in _cgroup_procs(container_id) or []:
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pgid:
                with contextlib.suppress(OSError):
                    os.killpg(pgid, signal.SIGKILL)
                return


def _oom_kills(container_id: str) -> int | None:
    """The container's OOM-kill count from its memory cgroup (v1 or v2), None if unreadable."""
    cg = "/sys/fs/cgroup"
    for path in (f"{cg}/memory/docker/{container_id}/memory.oom_control",
                 f"{cg}/system.slice/docker-{container_id}.scope/memory.events",
                 f"{cg}/docker/{container_id}/memory.events"):  # fmt: skip
        with contextlib.suppress(OSError, ValueError):
            for line in Path(path).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    return None


class _HeldSink:
    """Forwards to the run's sink, holding calls back until :meth:`flush`: the container is
    registered before the worktree, so a reaper removes the container (restoring ``.git``)
    before it salvages the worktree."""

    def __init__(self, sink: ResourceSink) -> None:
        self.sink = sink
        self.held: list[tuple[Callable[[str, str, str], None], tuple[str, str, str]]] | None = []

    def register_resource(self, run_id: str, kind: str, ref: str) -> None:
        self._call(self.sink.register_resource, (run_id, kind, ref))

    def release_resource(self, run_id: str, kind: str, ref: str) -> None:
        self._call(self.sink.release_resource, (run_id, kind, ref))

    def _call(self, fn: Callable[[str, str, str], None], args: tuple[str, str, str]) -> None:
        if self.held is None:
            fn(*args)
        else:
            self.held.append((fn, args))

    def flush(self) -> None:
        held, self.held = self.held or [], None
        for fn, args in held:
            fn(*args)


# -- the workspace ----------------------------------------------------------------------


class ContainerWorkspace:
    isolation = "container"

    def __init__(self, spec: WorkspaceSpec) -> None:
        self.spec = spec
        self.cfg = sandbox_settings(spec.options)
        self.root: Path = spec.base.resolve()  # the worktree once entered
        self._sink = _HeldSink(spec.sink)
        self.worktree = WorktreeWorkspace(replace(spec, sink=self._sink))
        self.slot: Slot | None = None
        self.pooled = False
        self.uid = self.gid = 0
        self._client: Any = None
        self._moved: Path | None = None  # where the slot's work dir was renamed to
        self._tree_in = False
        self._registered = False
        self._open = False
        self._dead = ""  # why the container can run no more commands
        self._outcome: RunOutcome | None = None

    async def __aenter__(self) -> Self:
        try:
            await await_shielded(self._start())
        except BaseException:
            await await_shielded(self._close(RunOutcome("failed", self.spec.description)))
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        outcome = RunOutcome.at_exit(self._outcome, exc_type, self.spec.description)
        await await_shielded(self._close(outcome))

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str]
    ) -> ProcessResult:
        if not self._open:  # never run anywhere else by mistake
            raise OrchError("the container workspace is not open; use it inside `async with`")
        if self._dead:
            raise OrchError(self._dead)
        return await self._exec(command, timeout_s, env)

    def set_outcome(self, outcome: RunOutcome) -> None:
        self._outcome = outcome

    def info(self) -> dict[str, Any]:
        cid = self.slot.container_id[:12] if self.slot else None
        user = f"{self.uid}:{self.gid}"
        return {**self.worktree.info(), "isolation": self.isolation, "container": cid,
                "image": self.cfg.image, "user": user, "pooled": self.pooled}  # fmt: skip

    def artifacts(self) -> list[dict[str, Any]]:
        return self.worktree.artifacts()

    def runtime(self) -> Runtime:
        return HostRuntime(self.root, self.exec)

    # -- opening ------------------------------------------------------------------------

    async def _api(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        def call() -> T:
            with docker_errors(self.cfg.image):
                return fn(*args, **kwargs)

        return await asyncio.to_thread(call)

    async def _start(self) -> None:
        self.uid, self.gid = sandbox_user(self.cfg)
        locating = asyncio.create_task(locate(self.root))  # a parent's worktree: its admin dir
        try:
            self._client = await asyncio.to_thread(docker_client)
        finally:
            await asyncio.gather(locating, return_exceptions=True)
        repo = locating.result()  # not a repository: UsageError
        main_root, common = repo.main_root, repo.common_dir
        slot = claim_slot(common, self.cfg)
        if slot is not None:  # warm: the container runs already
            self.slot, self.pooled = slot, True
            self._register(slot.container_id)
            await self._attach(main_root)
        else:  # cold: start the container while the worktree is made
            target = orch_dir(main_root) / "worktrees" / self.spec.run_id
            self.slot = await asyncio.to_thread(
                make_slot, main_root, common, self.uid, self.gid, target
            )
            self._moved = target
            results = await asyncio.gather(
                self._boot(), self._attach(main_root), return_exceptions=True
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        self._sink.flush()
        self._open = True
        if os.geteuid() != 0:
            probe_w = await self._exec(f"test -w {WORKSPACE}", 30, {})
            if probe_w.exit_code != 0:
                raise OrchError(
                    f"the sandbox user {self.uid}:{self.gid} cannot write the worktree mounted at "
                    f"{WORKSPACE} ({self.root}): run orch as the owner of the repository, or set "
                    "sandbox.user to its uid:gid (rootless Docker / userns-remap shift uids)"
                )

    def _register(self, container_id: str) -> None:
        self.spec.sink.register_resource(self.spec.run_id, "container", container_id)
        self._registered = True

    async def _boot(self) -> None:
        assert self.slot is not None and self._client is not None
        labels = owner_labels(self.spec.run_id, self.spec.chain_id, self.spec.agent)
        cid = await asyncio.to_thread(
            create_container, self._client, self.cfg, self.slot, self.uid, self.gid, labels
        )
        self._register(cid)
        await asyncio.to_thread(start_container, self._client, cid)

    async def _attach(self, main_root: Path) -> None:
        """Move the slot's (mounted) work dir into place and make the worktree in it."""
        assert self.slot is not None
        target = orch_dir(main_root) / "worktrees" / self.spec.run_id
        if self.slot.work != target:  # a pooled slot: its container runs already
            await asyncio.to_thread(os.rename, self.slot.work, target)
            self._moved = target
        await self.worktree.__aenter__()
        self._tree_in = True
        if self.worktree.root != target:
            raise OrchError(f"the worktree was made at {self.worktree.root}, not in {target}")
        self.root = target
        await asyncio.to_thread(attach_tree, self.slot, target, self.uid, self.gid)

    # -- commands -----------------------------------------------------------------------

    async def _exec(self, command: str, timeout_s: float, env: Mapping[str, str]) -> ProcessResult:
        assert self.slot is not None and self._client is not None
        cid, api = self.slot.container_id, self._client.api
        extra = {k: v for k, v in env.items()
                 if k in self.cfg.env_whitelist and k not in ("PATH", "HOME")}  # fmt: skip
        oom_before = _oom_kills(cid)
        made = await self._api(
            api.exec_create, cid, [self.cfg.shell, "-c", command], stdout=True, stderr=True,
            workdir=WORKSPACE, user=f"{self.uid}:{self.gid}", environment=extra,
        )  # fmt: skip
        pump = _Pump(api, str(made["Id"]), asyncio.get_running_loop())
        timed_out = False
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(pump.done)
        except TimeoutError:
            timed_out = True
        finally:
            info = await await_shielded(self._end_exec(pump))
        if pump.error is not None and not timed_out:
            raise self._dead_error(pump.error)
        output = b"".join(pump.chunks).decode("utf-8", errors="replace")
        code = None if timed_out else info.get("ExitCode")
        if code == 137:
            after = _oom_kills(cid)
            if after is not None and oom_before is not None and after > oom_before:
                output += f"\n[killed: out of memory (sandbox mem_limit {self.cfg.mem_limit})]"
        return ProcessResult(
            exit_code=code, output=output, timed_out=timed_out, truncated_bytes=pump.dropped
        )

    def _dead_error(self, error: BaseException) -> OrchError:
        if self._dead:
            return OrchError(self._dead)
        return OrchError(f"the sandbox container stopped answering ({str(error)[:160]})")

    async def _end_exec(self, pump: _Pump) -> dict[str, Any]:
        """Kill what is left of the exec's process group; make sure the command is over."""
        assert self.slot is not None
        cid, api = self.slot.container_id, self._client.api
        info: dict[str, Any] = {}
        deadline = time.monotonic() + KILL_GRACE_S
        while True:
            with contextlib.suppress(OrchError):
                info = await self._api(api.exec_inspect, pump.exec_id)
            _kill_group(int(info.get("Pid") or 0), cid)
            if pump.done.done() or time.monotonic() > deadline:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(pump.done), 0.25)
        if not pump.done.done():  # the last resort: nothing in the container survives
            self._dead = (
                "the sandbox container was killed to stop a command that would not die; "
                "this run can run no more commands"
            )
            with contextlib.suppress(OrchError):
                await self._api(api.kill, cid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(pump.done), KILL_GRACE_S)
        return info

    # -- closing ------------------------------------------------------------------------

    async def _close(self, outcome: RunOutcome) -> None:
        self._open = False
        failure: OrchError | None = None
        slot = self.slot
        if slot is not None:
            if slot.container_id and self._client is not None:
                try:
                    await asyncio.to_thread(remove_by_id, self._client, slot.container_id)
                except OrchError as e:
                    failure = e
                else:
                    if self._registered:
                        self.spec.sink.release_resource(
                            self.spec.run_id, "container", slot.container_id
                        )
            await asyncio.to_thread(release_slot, slot.dir)
        self._sink.flush()
        if self._tree_in:
            self._tree_in = False
            self.worktree.set_outcome(outcome)
            await self.worktree.__aexit__(None, None, None)
        elif self._moved is not None:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._moved.rmdir)  # empty: the worktree was never made
        if self._client is not None:
            self._client.close()
            self._client = None
        if failure is not None:
            raise failure


class ContainerConfig(TierConfig):
    """``isolation: container``: the run's own worktree in a locked-down Docker sandbox."""

    type: Literal["container"] = "container"
    branch: str | None = None
    base: str | None = None
    needs_git: ClassVar[bool] = True

    def provision(self, spec: WorkspaceSpec) -> ContainerWorkspace:
        return ContainerWorkspace(continued(spec, self.branch, self.base))
