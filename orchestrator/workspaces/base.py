"""The seams of an isolation tier: provisioning apart from execution.

- :class:`TierConfig`: one pydantic config per tier (``type`` is its name), the
  discriminated union of them is ``RunSpec.workspace`` (see ``registry.py``).
  ``provision`` makes the tier's :class:`Workspace`.
- :class:`Workspace` (provisioning): opened and closed with ``async with``; it
  creates the sandbox (nothing, a worktree, a container), registers what it
  starts with its owner through :class:`ResourceSink` so a crashed owner's
  leftovers can be reaped, and at close turns the work into artifacts.
- :class:`Runtime` (execution): what the tools use, and all they use, to run a
  command or read, write, list and search files *inside* the workspace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Protocol, Self

from pydantic import BaseModel, ConfigDict

from ..config import DEFAULT_COMMIT_EXCLUDE, SandboxSettings, Settings
from ..egress.proxy import Door
from ..egress.rules import Reach
from ..pgroups import group_ref, kill_tree, reap, spawn
from ..project.statedir import sign
from .lifetime import await_shielded, stopped
from .piped import Piped

MAX_CAPTURE = 1_000_000  # bytes of output kept per command; the rest is drained, dropped
OUTPUT_GRACE_S = 0.5  # after the command exits, how long its output may still arrive
STOP_WAIT_S = 5.0  # a stopped process's pipes: how long their last holders may take to go


@dataclass
class ProcessResult:
    exit_code: int | None  # None when killed for timeout / cancel
    output: str  # stdout and stderr interleaved
    timed_out: bool = False
    truncated_bytes: int = 0


@dataclass
class RunOutcome:
    """What a workspace is told at close: how the run ended and what to call its work."""

    status: str
    description: str = ""

    @classmethod
    def at_exit(
        cls, given: RunOutcome | None, exc_type: type[BaseException] | None, description: str
    ) -> RunOutcome:
        """The outcome a workspace closes with: the one it was told, else from how it exits."""
        if given is not None:
            return given
        cancelled = exc_type is not None and issubclass(exc_type, asyncio.CancelledError)
        return cls("cancelled" if cancelled else "failed", description)


class ResourceSink(Protocol):
    """Where workspaces register what they start (the store implements it)."""

    def register_resource(self, run_id: str, kind: str, ref: str) -> None: ...

    def release_resource(self, run_id: str, kind: str, ref: str) -> None: ...


class NullSink:
    def register_resource(self, run_id: str, kind: str, ref: str) -> None:
        return None

    def release_resource(self, run_id: str, kind: str, ref: str) -> None:
        return None


@dataclass
class ChainTally:
    """What the open workspaces of one chain in this process count together (made with a
    root's spec, handed to each child's through its parent's workspace)."""

    containers: int = 0  # container workspaces open (``sandbox.max_per_chain``)


@dataclass
class WorkspaceSpec:
    """Everything a tier needs to open a workspace for one run (``runner`` builds it from
    the settings and the run record: ``workspace_spec``)."""

    run_id: str
    chain_id: str
    agent: str
    description: str
    base: Path  # the spawner's workspace root: the user's tree for a root run
    sink: ResourceSink = field(default_factory=NullSink)
    sandbox: SandboxSettings = field(default_factory=SandboxSettings)  # validated once
    network: Reach = field(default_factory=lambda: Reach("none"))  # what commands reach
    egress: Door | None = None  # the run's way through the egress proxy (an allow-list)
    include: tuple[str, ...] = ()  # untracked files copied in, besides ``.worktreeinclude``
    extra_env: Mapping[str, str] = field(default_factory=dict)  # given to host-tier commands
    commit_exclude: tuple[str, ...] = tuple(DEFAULT_COMMIT_EXCLUDE)  # left out of auto-commits
    state_dir: Path | None = None  # orch's state dir: hidden, never copied in
    store_paths: tuple[Path, ...] = ()  # every path of the run store: hidden, never copied in
    parent: Workspace | None = None  # the spawner's open workspace (None for a root run)
    chain: ChainTally = field(default_factory=ChainTally)  # shared with the chain's others
    branch: str | None = None  # an existing orch/* branch to continue
    branch_base: str | None = None  # the commit a continued branch's work is measured from
    discard: bool = False  # a throwaway checkout: nothing the run changes is committed

    @classmethod
    def for_run(
        cls,
        settings: Settings,
        run: RunIdentity,
        *,
        base: Path,
        sink: ResourceSink,
        network: Reach,
        egress: Door | None,
        state_dir: Path,
        store_paths: Sequence[str | Path],
        parent: Workspace | None,
    ) -> WorkspaceSpec:
        """The spec of one run from the settings; ``network``: what its commands reach (its
        agent's or the settings', never wider than its parent's), and ``egress`` its door
        to the egress proxy when that is an allow-list; ``parent``: the spawner's open
        workspace, if any."""
        return cls(
            run_id=run.run_id,
            chain_id=run.chain_id,
            agent=run.agent,
            description=run.description,
            base=base,
            sink=sink,
            sandbox=settings.sandbox,
            network=network,
            egress=egress,
            include=tuple(settings.worktree_include),
            extra_env=dict(settings.extra_env),
            commit_exclude=(*DEFAULT_COMMIT_EXCLUDE, *settings.commit_exclude),
            state_dir=state_dir,
            store_paths=tuple(Path(p) for p in store_paths),
            parent=parent,
            chain=parent.spec.chain if parent is not None else ChainTally(),
        )


class RunIdentity(Protocol):
    """What a workspace knows of its run (a ``RunRecord`` is one)."""

    run_id: str
    chain_id: str
    agent: str
    description: str


@dataclass
class FileRead:
    data: bytes  # at most the bytes asked for
    size: int  # the file's whole size


class Runtime(Protocol):
    """Execution inside a workspace. Paths are relative to the workspace root."""

    root: Path  # where the workspace is on the host (shown to the model and to hooks)

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str]
    ) -> ProcessResult: ...

    def expect(self, env: Mapping[str, str]) -> None:
        """Commands with ``env`` may come (the agent has ``bash``): make ready, in the
        background, what the next ``exec`` needs (a host tier: its sandbox)."""

    async def read_file(self, path: str, *, max_bytes: int) -> FileRead: ...

    async def write_file(self, path: str, data: bytes) -> None: ...

    async def glob(self, pattern: str, *, limit: int) -> tuple[list[str], bool]:
        """Matching files, sorted, at most ``limit``; True when there were more."""

    async def grep(
        self, pattern: str, *, path: str | None, glob: str | None, limit: int
    ) -> list[str]: ...

    async def start(
        self, argv: list[str], *, env: Mapping[str, str], more: Mapping[str, str]
    ) -> Piped:
        """A long-lived process (an MCP server) where the run's commands run, with ``env``
        as a command's and ``more`` added inside; OrchError when this tier cannot."""


class Workspace(Protocol):
    isolation: str
    root: Path  # the workspace's directory on the host
    spec: WorkspaceSpec  # what it was opened with

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str]
    ) -> ProcessResult: ...

    def set_outcome(self, outcome: RunOutcome) -> None: ...

    def info(self) -> dict[str, Any]: ...

    def artifacts(self) -> list[dict[str, Any]]: ...

    def runtime(self) -> Runtime: ...


class TierConfig(BaseModel):
    """One isolation tier's settings for one run; ``type`` names the tier.

    Subclasses set ``type: Literal["<name>"]``; the trust order of the tiers is
    their order in ``registry.TIERS`` (weakest first).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str
    needs_git: ClassVar[bool] = False  # the tier makes a branch: the base must be a git repo

    def provision(self, spec: WorkspaceSpec) -> Workspace:
        raise NotImplementedError


def _exit_signal(proc: asyncio.subprocess.Process) -> asyncio.Task[None]:
    """A task that ends when the process exits, even while its pipes stay open.

    (``Process.wait`` also waits for the pipes, which a leftover background child
    can hold open for ever.) A pidfd says it at once; without one, poll.
    """

    async def watch() -> None:
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            while proc.returncode is None:  # noqa: ASYNC110 - no event to wait on without a pidfd
                await asyncio.sleep(0.02)
            return
        done: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not done.done():
                done.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await done
        finally:
            loop.remove_reader(fd)
            os.close(fd)

    return asyncio.create_task(watch())


async def _reaped(proc: asyncio.subprocess.Process) -> None:
    """Until asyncio's child watcher has reaped an exited ``proc`` (a moment), at most
    ``OUTPUT_GRACE_S``: ``Process.wait`` waits for the pipes too, which a job it left in
    the background may hold."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(OUTPUT_GRACE_S):
            await asyncio.shield(proc.wait())


@dataclass
class Started:
    """A command's process, started in its own group and registered with its run."""

    proc: asyncio.subprocess.Process
    ref: str  # the signed group ref the sink holds (reconcile kills only what it signed)
    sink: ResourceSink
    run_id: str


async def start_process(
    argv: Sequence[str],
    *,
    cwd: Path | None,
    env: Mapping[str, str],
    sink: ResourceSink,
    run_id: str,
    stdin: bool = False,
    stderr: bool = False,
) -> Started:
    """Start argv in its own process group (stdin: a pipe, else /dev/null; ``stderr``: a
    pipe of its own, else with stdout), registered. (Cancelled while it starts, nothing of
    it is left: ``pgroups.spawn``.)"""
    proc = await spawn(
        *argv,
        cwd=cwd,
        env=dict(env),
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE if stderr else asyncio.subprocess.STDOUT,
    )
    ref = sign(run_id, "pgroup", group_ref(proc.pid))
    sink.register_resource(run_id, "pgroup", ref)
    return Started(proc, ref, sink, run_id)


async def stop_process(started: Started) -> None:
    """Kill a started process's whole tree (``pgroups.kill_tree``), reap it and forget it.
    Its stdin (a spare's: ``spare.py``) is closed first."""
    proc = started.proc
    if proc.stdin is not None and not proc.stdin.is_closing():
        proc.stdin.close()
    await await_shielded(_put_down(started, STOP_WAIT_S))


async def _put_down(started: Started, grace_s: float, *tasks: asyncio.Task[None]) -> None:
    """A started command's end, whatever ended it (shielded by its callers: a cancel meanwhile
    cuts none of it short): its tree killed (never ``proc.kill()``: Popen's poll can reap
    the child before asyncio's watcher, which then reports 255), what is left in its pipe
    read for a moment (``tasks[0]``, the reader), its pipes and process reaped, ``tasks``
    stopped, its group released."""
    proc = started.proc
    kill_tree(proc.pid)
    if tasks:
        await asyncio.wait({tasks[0]}, timeout=OUTPUT_GRACE_S)
    await reap(proc, grace_s)
    await stopped(*tasks)
    started.sink.release_resource(started.run_id, "pgroup", started.ref)


async def run_process(
    argv: Sequence[str],
    *,
    cwd: Path | None,
    env: Mapping[str, str],
    timeout_s: float,
    sink: ResourceSink,
    run_id: str,
) -> ProcessResult:
    """Run argv in its own process group; kill the whole group on timeout or cancel."""
    started = await start_process(argv, cwd=cwd, env=env, sink=sink, run_id=run_id)
    return await finish_process(started, timeout_s=timeout_s)


async def finish_process(started: Started, *, timeout_s: float) -> ProcessResult:
    """Collect a started command's output until it exits or ``timeout_s`` passes; then (and
    on cancel) kill its whole tree."""
    proc = started.proc
    chunks: list[bytes] = []
    kept = 0
    dropped = 0

    async def pump() -> None:
        nonlocal kept, dropped
        assert proc.stdout is not None
        while data := await proc.stdout.read(65536):
            if kept < MAX_CAPTURE:
                take = data[: MAX_CAPTURE - kept]
                chunks.append(take)
                kept += len(take)
                dropped += len(data) - len(take)
            else:
                dropped += len(data)

    timed_out = False
    reader = asyncio.create_task(pump())
    exited = _exit_signal(proc)
    try:
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.wait({reader, exited}, return_when=asyncio.FIRST_COMPLETED)
                if not exited.done():  # its output is closed but it works on
                    await exited
                elif not reader.done():
                    # Done, but something it left in the background holds the pipe open:
                    # give the output a moment; the group is stopped below.
                    await asyncio.wait({reader}, timeout=OUTPUT_GRACE_S)
        except TimeoutError:
            timed_out = True
    finally:
        # On timeout, cancel or normal exit: nothing of the tree outlives the call. After a
        # normal exit the leader is reaped first: a group left empty needs no search.
        if exited.done() and proc.returncode is None:
            await await_shielded(_reaped(proc))
        await await_shielded(_put_down(started, OUTPUT_GRACE_S, reader, exited))
    output = b"".join(chunks).decode("utf-8", errors="replace")
    return ProcessResult(
        exit_code=None if timed_out else proc.returncode,
        output=output,
        timed_out=timed_out,
        truncated_bytes=dropped,
    )
