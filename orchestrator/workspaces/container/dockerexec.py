"""Running processes in a started sandbox container through ``docker exec``.

:class:`Sandbox` is one container as its workspace uses it: :meth:`Sandbox.run` is a
``bash`` command (output interleaved, capped at ``MAX_CAPTURE``, killed with its
process group on timeout or cancel), :meth:`Sandbox.call` a program with bytes on
its stdin and its stdout taken back whole (capped: past ``out_cap`` the call is
killed and reported as overflowing) or streamed into a host file orch owns. Every
limit is enforced while reading: the host never holds more than the cap of any
output.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from ...config import SandboxSettings
from ...errors import OrchError
from ..base import MAX_CAPTURE, ProcessResult
from ..lifetime import await_shielded
from .channel import (
    ERR_CAP,
    CallResult,
    Capture,
    Gone,
    Server,
    cgroup_procs,
    kill_exec_group,
    kill_sessions,
    recv_exact,
    start_server,
)
from .docker import WORKSPACE, docker_errors

T = TypeVar("T")
BROKE = (
    "\n[the sandbox's program server broke during this command (killed, or something wrote "
    "into its stream); the command was stopped]"
)
KILL_GRACE_S = 5.0


def create_exec(api: Any, cid: str, argv: list[str], *, user: str, env: Mapping[str, str]) -> str:
    """An exec of ``argv`` in the container's workspace as ``user``, with stdin, stdout and
    stderr attached and exactly ``env``; its id."""
    made = api.exec_create(
        cid,
        argv,
        stdin=True,
        stdout=True,
        stderr=True,
        workdir=WORKSPACE,
        user=user,
        environment=dict(env),
    )
    return str(made["Id"])


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


def _in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` in a thread of its own (a long command never holds an executor
    worker); its result or exception on the returned future."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def body() -> None:
        try:
            result, error = fn(*args), None
        except Exception as e:  # reported on the loop
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop may be closed already
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=body, name="orch-served", daemon=True).start()
    return done


def oom_kills(container_id: str) -> int | None:
    """The container's OOM-kill count from its memory cgroup (v1 or v2), None if unreadable."""
    cg = "/sys/fs/cgroup"
    for path in (
        f"{cg}/memory/docker/{container_id}/memory.oom_control",
        f"{cg}/system.slice/docker-{container_id}.scope/memory.events",
        f"{cg}/docker/{container_id}/memory.events",
    ):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(path).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    return None


def _send(sock: Any, stdin: bytes | Path) -> None:
    """Write stdin and close it; a program that exits without reading it all is no error."""
    try:
        if isinstance(stdin, Path):
            with stdin.open("rb") as f:
                while chunk := f.read(1 << 20):
                    sock.sendall(chunk)
        elif stdin:
            sock.sendall(stdin)
        sock.shutdown(socket.SHUT_WR)
    except (BrokenPipeError, ConnectionResetError):
        pass


class Sandbox:
    """One started container: commands and program calls as the sandbox user."""

    def __init__(self, client: Any, container_id: str, cfg: SandboxSettings, user: str) -> None:
        self.client, self.container_id, self.cfg, self.user = client, container_id, cfg, user
        self.dead = ""  # why the container can run no more commands
        self.server: Server | None = None
        self._busy = False  # a call is in the server: the next one goes by an exec
        self._revive = False  # the server broke after it answered: start another one
        self._restarts = 2  # how many times
        self._visible: bool | None = None  # see _seen
        self._daemons: list[Any] = []  # long-lived execs' streams (start_daemon)

    def start_server(self) -> None:
        """Start the container's program server (:mod:`.inside.server`; a few ms, it greets
        later). Calls with ``via_server=True`` go through it while it answers; without
        python3 in the image they use execs."""
        self.server = start_server(self.client, self.container_id, self.user, WORKSPACE)

    def close(self) -> None:
        """Let the server exec go (the container's removal ends it anyway)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        for kept in self._daemons:
            with contextlib.suppress(Exception):
                kept.close()
        self._daemons.clear()  # (each exec's socket and its wrapper)

    def start_daemon(self, argv: list[str], ready: bytes, timeout_s: float) -> None:
        """Start ``argv`` as a long-lived exec of its own (blocking) and wait until its
        stdout says ``ready``; OrchError with its last words if it does not. Started from
        outside, it is no command's leftover (``kill_sessions`` spares it); the container's
        removal ends it."""
        api = self.client.api
        with docker_errors(self.cfg.image):
            exec_id = create_exec(api, self.container_id, argv, user=self.user, env={})
            wrapped = api.exec_start(exec_id, socket=True)
        sock = getattr(wrapped, "_sock", wrapped)
        said, deadline = bytearray(), time.monotonic() + timeout_s
        try:
            while ready not in said and len(said) < 65536:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                header = recv_exact(sock, 8)
                if len(header) < 8:
                    break
                said += recv_exact(sock, struct.unpack(">BxxxL", header)[1])
        except OSError:  # TimeoutError too
            pass
        self._daemons += [sock, wrapped]
        if ready not in said:
            self.close()
            last = bytes(said).decode("utf-8", "replace").strip().splitlines() or ["no answer"]
            raise OrchError(last[-1][:200])

    async def _api(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        def call() -> T:
            with docker_errors(self.cfg.image):
                return fn(*args, **kwargs)

        return await asyncio.to_thread(call)

    # -- bash ---------------------------------------------------------------------------

    async def run(self, command: str, timeout_s: float, env: Mapping[str, str]) -> ProcessResult:
        """A ``bash`` command: through the program server when it is there and free (in a
        session of its own, its group killed at its end, timeout or cancel), else by an
        exec of its own (also when the server dies or lies meanwhile)."""
        if self.dead:
            raise OrchError(self.dead)
        cid = self.container_id
        extra = {
            k: v
            for k, v in env.items()
            if k in self.cfg.env_whitelist and k not in ("PATH", "HOME")
        }
        oom_before = oom_kills(cid)
        argv = [self.cfg.shell, "-c", command]
        end = time.monotonic() + timeout_s
        served = await self._served(argv, extra, timeout_s)
        if served is None:
            served = await self._exec(argv, extra, max(0.05, end - time.monotonic()))
        code, output, dropped = served
        if code == 137:
            after = oom_kills(cid)
            if after is not None and oom_before is not None and after > oom_before:
                output += f"\n[killed: out of memory (sandbox mem_limit {self.cfg.mem_limit})]"
        return ProcessResult(
            exit_code=code, output=output, timed_out=code is None, truncated_bytes=dropped
        )

    async def _served(
        self, argv: list[str], env: dict[str, str], timeout_s: float
    ) -> tuple[int | None, str, int] | None:
        """``(exit code or None when timed out, output, bytes dropped)`` of a command run
        through the server; None when there is no free server, or it broke before a word of
        its answer (then nothing of the command runs on: its sessions are killed). When it
        broke later the command may have run: it is not run again (``BROKE``)."""
        if self.server is None and self._revive and self._restarts > 0:
            self._revive, self._restarts = False, self._restarts - 1
            await asyncio.to_thread(self.start_server)
        server = self.server
        if server is None or self._busy or not self._seen():
            return None
        if not server.greeted:  # a new one: its start is not the command's time
            self._busy = True
            try:
                greeted = await await_shielded(asyncio.to_thread(server.ready))
            finally:
                self._busy = False
            if not greeted:
                self._lose(server)
                return None
        self._busy = True
        into = Capture(MAX_CAPTURE)
        done = _in_thread(server.session, argv, env, timeout_s + 2 * KILL_GRACE_S, into)
        timed_out = False
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.wait({done})
        except TimeoutError:
            timed_out = True
        finally:
            if not done.done():  # a timeout or a cancel: the command goes, with its group
                await await_shielded(self._stop(server, done))
                if not done.done() or done.exception() is not None:
                    self._lose(server)
            self._busy = False
        output = b"".join(into.chunks).decode("utf-8", errors="replace")
        if done.done() and done.exception() is None:
            return None if timed_out else done.result(), output, into.dropped
        await asyncio.to_thread(kill_sessions, self.container_id)
        self._lose(server)
        if timed_out:
            return None, output, into.dropped
        if not into.heard:  # not a word back: by an exec of its own
            return None
        return 137, output + BROKE, into.dropped

    def _seen(self) -> bool:
        """The host sees the container's processes (its cgroup): it can stop a command of
        the server (:func:`.channel.kill_sessions`). Else bash goes by execs."""
        if self._visible is None:
            self._visible = cgroup_procs(self.container_id) is not None
        return self._visible

    async def _stop(self, server: Server, done: asyncio.Future[int]) -> None:
        """Kill a command of the server, as the host sees it (:func:`.channel.kill_sessions`);
        if the server does not answer then, it goes too."""
        await asyncio.to_thread(kill_sessions, self.container_id)
        await asyncio.wait({done}, timeout=KILL_GRACE_S)
        if not done.done():
            self._lose(server)
            await asyncio.wait({done}, timeout=KILL_GRACE_S)
            await asyncio.to_thread(kill_sessions, self.container_id)

    def _lose(self, server: Server) -> None:
        """The server broke: killed (with what it runs); a new one if this one answered."""
        if self.server is server:
            self.server = None
            self._revive = server.greeted
        server.kill()

    async def _exec(
        self, argv: list[str], env: dict[str, str], timeout_s: float
    ) -> tuple[int | None, str, int]:
        cid, api = self.container_id, self.client.api
        made = await self._api(
            api.exec_create,
            cid,
            argv,
            stdout=True,
            stderr=True,
            workdir=WORKSPACE,
            user=self.user,
            environment=env,
        )
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
        return None if timed_out else info.get("ExitCode"), output, pump.dropped

    def _dead_error(self, error: BaseException) -> OrchError:
        if self.dead:
            return OrchError(self.dead)
        return OrchError(f"the sandbox container stopped answering ({str(error)[:160]})")

    async def _end_exec(self, pump: _Pump) -> dict[str, Any]:
        """Kill what is left of the exec's process group; make sure the command is over."""
        cid, api = self.container_id, self.client.api
        info: dict[str, Any] = {}
        deadline = time.monotonic() + KILL_GRACE_S
        while True:
            with contextlib.suppress(OrchError):
                info = await self._api(api.exec_inspect, pump.exec_id)
            kill_exec_group(int(info.get("Pid") or 0), cid)
            if pump.done.done() or time.monotonic() > deadline:
                break
            await asyncio.wait({pump.done}, timeout=0.25)
        if not pump.done.done():  # the last resort: nothing in the container survives
            self.dead = (
                "the sandbox container was killed to stop a command that would not die; "
                "this run can run no more commands"
            )
            with contextlib.suppress(OrchError):
                await self._api(api.kill, cid)
            await asyncio.wait({pump.done}, timeout=KILL_GRACE_S)
        return info

    # -- programs with stdin and a capped stdout -----------------------------------------

    async def call(
        self,
        argv: Sequence[str],
        stdin: bytes | Path = b"",
        *,
        out_cap: int,
        timeout_s: float,
        env: Mapping[str, str] | None = None,
        out_file: IO[bytes] | None = None,
        via_server: bool = False,
    ) -> CallResult:
        """Run ``argv`` in ``/workspace`` with ``stdin`` (bytes, or a host file orch owns,
        streamed); stdout kept (or written to
        ``out_file``) up to ``out_cap`` bytes, stderr up to 64 KiB. Past the cap or the
        timeout the program's process group is killed. Runs in a thread: a cancel waits
        for it (it is bounded by ``timeout_s``). ``via_server``: through the server exec
        when it answers (no exec of its own), else as always."""
        if self.dead:
            raise OrchError(self.dead)
        server = self.server if via_server and not self._busy else None
        if server is not None and isinstance(stdin, bytes):
            self._busy = True
            try:
                got = await await_shielded(
                    asyncio.to_thread(
                        server.call,
                        list(argv),
                        stdin,
                        dict(env or {}),
                        out_cap,
                        timeout_s,
                        out_file,
                    )
                )
                if got.overflow or got.timed_out:
                    self._lose(server)  # killed with its program: the next call by an exec
                return got
            except Gone:  # killed, or lying: from the start, by an exec of its own
                self._lose(server)
                if out_file is not None:
                    out_file.seek(0)
                    out_file.truncate()
            finally:
                self._busy = False
        return await await_shielded(
            asyncio.to_thread(
                self._call_sync, list(argv), stdin, out_cap, timeout_s, dict(env or {}), out_file
            )
        )

    def _call_sync(
        self,
        argv: list[str],
        stdin: bytes | Path,
        out_cap: int,
        timeout_s: float,
        env: dict[str, str],
        out_file: IO[bytes] | None,
    ) -> CallResult:
        api, cid = self.client.api, self.container_id
        deadline = time.monotonic() + timeout_s
        with docker_errors(self.cfg.image):
            exec_id = create_exec(api, cid, argv, user=self.user, env=env)
            wrapped = api.exec_start(exec_id, socket=True)
        sock = getattr(wrapped, "_sock", wrapped)
        out, err = bytearray(), bytearray()
        seen, overflow, timed_out = 0, False, False
        try:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            _send(sock, stdin)
            while True:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                header = recv_exact(sock, 8)
                if len(header) < 8:
                    break
                kind, size = struct.unpack(">BxxxL", header)
                data = recv_exact(sock, size)
                if kind == 1:
                    seen += len(data)
                    if seen > out_cap:
                        overflow = True
                        break
                    if out_file is not None:
                        out_file.write(data)
                    else:
                        out += data
                elif len(err) < ERR_CAP:
                    err += data[: ERR_CAP - len(err)]
        except TimeoutError:
            timed_out = True
        except OSError as e:
            raise self._dead_error(e) from None
        finally:
            with contextlib.suppress(Exception):
                sock.close()
            with contextlib.suppress(Exception):
                wrapped.close()
        info: dict[str, Any] = {}
        end = time.monotonic() + KILL_GRACE_S
        while True:
            with contextlib.suppress(Exception):
                info = api.exec_inspect(exec_id)
            if overflow or timed_out:
                kill_exec_group(int(info.get("Pid") or 0), cid)
            if not info.get("Running") or time.monotonic() > end:
                break
            time.sleep(0.02)
        code = None if overflow or timed_out else info.get("ExitCode")
        return CallResult(code, bytes(out), bytes(err), seen, overflow, timed_out)
