"""A host-tier run's commands, each in a fresh OS sandbox made ahead of time.

Every ``bash`` call of the shared and worktree tiers runs in a sandbox of its own
(``host.confined``: new namespaces, the run's mounts, its whitelisted environment).
Making one costs ≈ 6 ms of CPU, most of it in the kernel, and on two cores a hundred
children calling ``bash`` at once wait ≈ 0.6 s for their sandboxes alone. So
:class:`Shell` makes the *next* command's sandbox while the model thinks: a sandbox
whose shell waits for one command on its stdin (``LOADER``), then runs it itself
(``eval``: no second shell to start, half the time of a hundred commands at once), with
stdin from ``/dev/null`` as a fresh call has and nothing of the loader left in the
shell (its variable is unset; a syntax error's echo shows that ``unset``). The engine says
when the model is asked (``Runtime.expect``, for agents that have ``bash``): the first
time one is made ``SPARE_FIRST_S`` after the request (when a fan-out's children have all
sent theirs), later ``SPARE_AFTER_S`` after it, so that a quick reply (a run's final
answer most of all) costs no sandbox.

Nothing is shared between two commands: a spare serves one command and is gone with it
(its process group killed, its PID namespace with it); a spare made for another
environment, or one that died, is dropped and the command gets a sandbox made on the
spot. A command holding a NUL (no shell can receive it) takes the fresh path, which
refuses it as it always did. The spare is registered as a process group of its run as
soon as it exists, so a crash leaves nothing reconcile would not kill, and the run's
close kills it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

from ..errors import OrchError
from .base import (
    ProcessResult,
    Started,
    WorkspaceSpec,
    finish_process,
    start_process,
    stop_process,
)
from .host import confined
from .lifetime import stopped
from .piped import Tail

# reads one NUL-ended command from stdin, then runs it in this shell, stdin /dev/null
LOADER = 'IFS= read -r -d "" c || exit 126; exec </dev/null; eval "unset c; $c"'
SPARE_AFTER_S = 0.3  # after a request is sent: when the next sandbox is made
# the first: at once, but after the loop's turn (a hundred children send their first
# requests before their sandboxes are made)
SPARE_FIRST_S = 0.05


class Shell:
    """How a host-tier workspace runs its commands (see the module's doc)."""

    def __init__(
        self,
        spec: WorkspaceSpec,
        workspace: Path,
        read_only_within: tuple[Path, ...],
        hidden_within: tuple[Path, ...],
    ) -> None:
        self.spec = spec
        self.workspace = workspace
        self.read_only_within = read_only_within
        self.hidden_within = hidden_within
        self._spare: asyncio.Future[Started] | None = None
        self._spare_env: dict[str, str] = {}
        self._later: asyncio.TimerHandle | None = None
        self._dropping: set[asyncio.Task[None]] = set()
        self._closed = False
        self._asked = False  # expect was called before: the next spare waits SPARE_AFTER_S
        self.spares_used = 0  # commands that ran in a sandbox made ahead (for tests, bench)

    def expect(self, env: Mapping[str, str]) -> None:
        """A command with ``env`` may come (the model is asked): make its sandbox, in the
        background, ``SPARE_FIRST_S`` later the first time, ``SPARE_AFTER_S`` after that (a
        reply sooner than that, a run's final answer most of all, wastes none)."""
        if self._closed or self.spec.sandbox.os != "bwrap" or self._later is not None:
            return
        if self._spare is not None and self._spare_env == dict(env):
            return
        delay = SPARE_AFTER_S if self._asked else SPARE_FIRST_S
        self._asked = True
        loop = asyncio.get_running_loop()
        self._later = loop.call_later(delay, self._make_spare, dict(env))

    def _make_spare(self, env: dict[str, str]) -> None:
        self._later = None
        if self._closed:
            return
        self._drop()
        self._spare_env = env
        self._spare = asyncio.ensure_future(self._make(env))

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str]
    ) -> ProcessResult:
        if self._later is not None:
            self._later.cancel()
            self._later = None
        spare = await self._take(env) if "\x00" not in command else None
        if spare is not None:
            try:
                fed = await _feed(spare, command)
            except BaseException:
                await stop_process(spare)
                raise
            if fed:
                self.spares_used += 1
                return await finish_process(spare, timeout_s=timeout_s)
            await stop_process(spare)  # it died before it could take the command
        started = await self._start(["bash", "-c", command], dict(env))
        return await finish_process(started, timeout_s=timeout_s)

    async def aclose(self) -> None:
        """Kill the spare (if any): nothing of the shell outlives its workspace."""
        self._closed = True
        if self._later is not None:
            self._later.cancel()
            self._later = None
        spare, self._spare = self._spare, None
        if spare is not None:
            with contextlib.suppress(Exception):
                await stop_process(await asyncio.shield(spare))
        while self._dropping:
            await asyncio.wait(set(self._dropping))

    async def start(
        self, argv: list[str], env: Mapping[str, str], more: Mapping[str, str]
    ) -> HostPiped:
        """A long-lived process (an MCP server) in a sandbox of its own, as a command's but
        with stdin and stderr pipes; registered as a process group of the run. Never
        unsandboxed: with ``sandbox.os = "off"`` it is refused."""
        if self._closed:
            raise OrchError("the workspace is closed")
        if self.spec.sandbox.os != "bwrap":
            raise OrchError('an MCP server runs only in the OS sandbox (sandbox.os = "bwrap")')
        started = await self._start(argv, dict(env), stdin=True, stderr=True, more=more)
        return HostPiped(started)

    async def _make(self, env: dict[str, str]) -> Started:
        return await self._start(["bash", "-c", LOADER], env, stdin=True)

    async def _start(
        self,
        argv: list[str],
        env: dict[str, str],
        *,
        stdin: bool = False,
        stderr: bool = False,
        more: Mapping[str, str] | None = None,
    ) -> Started:
        """``argv`` started in the workspace under the run's OS sandbox (``host.confined``;
        ``more``: set inside as given), registered as a process group of the run."""
        argv, process_env = confined(
            argv,
            spec=self.spec,
            workspace=self.workspace,
            read_only_within=self.read_only_within,
            env=env,
            hidden_within=self.hidden_within,
            more=more,
        )
        return await start_process(
            argv,
            cwd=self.workspace,
            env=process_env,
            sink=self.spec.sink,
            run_id=self.spec.run_id,
            stdin=stdin,
            stderr=stderr,
        )

    async def _take(self, env: Mapping[str, str]) -> Started | None:
        """The spare, if one was made for ``env`` and still waits; it is the caller's."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        try:
            started = await asyncio.shield(spare)
        except Exception:  # it could not be made: the fresh path says why
            return None
        if self._spare_env != dict(env) or started.proc.returncode is not None:
            await stop_process(started)
            return None
        return started

    def _drop(self) -> None:
        """Stop the spare in the background (made for another environment)."""
        spare, self._spare = self._spare, None
        if spare is not None:

            async def drop() -> None:
                with contextlib.suppress(Exception):
                    await stop_process(await spare)

            task = asyncio.ensure_future(drop())
            self._dropping.add(task)
            task.add_done_callback(self._dropping.discard)


async def _feed(started: Started, command: str) -> bool:
    """Hand the spare its command; False when it is gone (then it never ran it)."""
    stdin = started.proc.stdin
    if stdin is None or started.proc.returncode is not None:
        return False
    try:
        stdin.write(os.fsencode(command) + b"\0")
        await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


class HostPiped:
    """A process of :meth:`Shell.start`: its pipes; ``stop`` kills its group."""

    def __init__(self, started: Started) -> None:
        self.started = started
        self.tail = Tail()
        self._drain = asyncio.ensure_future(self._drain_stderr())
        self._stopping: asyncio.Future[None] | None = None

    async def _drain_stderr(self) -> None:
        err = self.started.proc.stderr
        assert err is not None
        while chunk := await err.read(65536):
            self.tail.add(chunk)

    async def send(self, data: bytes) -> None:
        stdin = self.started.proc.stdin
        if stdin is None or stdin.is_closing() or self.started.proc.returncode is not None:
            raise ConnectionResetError("the process is gone")
        stdin.write(data)
        await stdin.drain()

    async def receive(self) -> bytes:
        out = self.started.proc.stdout
        assert out is not None
        return await out.read(65536)

    def stderr_tail(self) -> str:
        return self.tail.text()

    async def stop(self) -> None:
        """Once, whoever asks first; a cancelled caller leaves it running to its end, and the
        next caller waits for that."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        await stop_process(self.started)
        proc = self.started.proc
        with contextlib.suppress(Exception):  # its pipes end with it (what is left, dropped)
            async with asyncio.timeout(1.0):
                await asyncio.gather(self._drain, _to_end(proc.stdout))
        await stopped(self._drain)
        transport = getattr(proc, "_transport", None)  # a pipe something else held open
        if transport is not None:
            transport.close()


async def _to_end(stream: asyncio.StreamReader | None) -> None:
    """Read ``stream`` to its end, keeping nothing."""
    while stream is not None and await stream.read(65536):
        pass
