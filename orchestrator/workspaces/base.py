"""The Workspace protocol: where an agent's files live and its commands run.

One module per isolation tier implements it (shared, worktree, container).
A workspace is opened and closed with ``async with``; it is the only place
that creates processes (and worktrees, containers), and it registers each
with its owner in the store through :class:`ResourceSink` as it starts them,
so a crashed owner's leftovers can be found and reaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self

MAX_CAPTURE = 1_000_000  # bytes of output kept per command; the rest is drained and dropped


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
class WorkspaceSpec:
    """Everything a tier needs to open a workspace for one run."""

    run_id: str
    chain_id: str
    agent: str
    description: str
    base: Path  # the spawner's workspace root: the user's tree for a root run
    sink: ResourceSink = field(default_factory=NullSink)
    options: dict[str, Any] = field(default_factory=dict)


class Workspace(Protocol):
    isolation: str
    root: Path  # host directory the file tools are confined to

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


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


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
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=dict(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    pgid = proc.pid  # start_new_session: the child leads its own group
    sink.register_resource(run_id, "pgroup", str(pgid))
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
    try:
        try:
            async with asyncio.timeout(timeout_s):
                await pump()
                await proc.wait()
        except TimeoutError:
            timed_out = True
    finally:
        # On timeout, cancel or normal exit: nothing of the group outlives the call.
        kill_group(pgid)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.shield(proc.wait())
        sink.release_resource(run_id, "pgroup", str(pgid))
    output = b"".join(chunks).decode("utf-8", errors="replace")
    return ProcessResult(
        exit_code=None if timed_out else proc.returncode,
        output=output,
        timed_out=timed_out,
        truncated_bytes=dropped,
    )
