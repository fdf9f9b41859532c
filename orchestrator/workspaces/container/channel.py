"""The host's side of a sandbox container's program server (:mod:`.inside.server`), and the
exec helpers it shares with :mod:`.dockerexec`.

The server runs in one long-lived ``docker exec``; requests go down its stdin, answers
come up its stdout inside Docker's stream frames. Everything it sends is the sandbox's
words: it greets first (``{"hello": HELLO}`` after a zero length), every length is capped
before anything is read, and any breach ends it (:class:`Gone`): the caller then runs the
call by an exec of its own.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import signal
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ERR_CAP = 64 * 1024
FRAME_MAX = 1 << 20  # the server sends at most 64 KiB a frame: a longer one is a breach
HELLO = "orch-boxserve/1"
GREET_TIMEOUT_S = 10.0


@dataclass
class CallResult:
    code: int | None  # None: killed (timeout or overflow)
    out: bytes  # empty when streamed into a file
    err: bytes
    out_size: int  # stdout bytes seen (up to the cap + one frame)
    overflow: bool = False
    timed_out: bool = False


def recv_exact(sock: Any, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def cgroup_procs(container_id: str) -> list[int] | None:
    """Host pids in the container's cgroup (v1 or v2, cgroupfs or systemd), None if unseen."""
    cg, cid = "/sys/fs/cgroup", container_id
    for path in (
        f"{cg}/pids/docker/{cid}",
        f"{cg}/pids/system.slice/docker-{cid}.scope",
        f"{cg}/system.slice/docker-{cid}.scope",
        f"{cg}/docker/{cid}",
    ):
        with contextlib.suppress(OSError, ValueError):
            return [int(pid) for pid in Path(path, "cgroup.procs").read_text().split()]
    return None


@dataclass
class Capture:
    """A command's output as the host keeps it: up to ``keep`` bytes, the rest counted."""

    keep: int
    chunks: list[bytes] = field(default_factory=list)
    kept: int = 0
    dropped: int = 0
    heard: bool = False  # any answer came: the command may have run

    def add(self, data: bytes) -> None:
        take = data[: max(0, self.keep - self.kept)]
        if take:
            self.chunks.append(take)
            self.kept += len(take)
        self.dropped += len(data) - len(take)


def _ppid_sid(pid: int) -> tuple[int, int] | None:
    """A host process's parent and session, as the host's ``/proc`` says."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return int(fields[1]), int(fields[3])
    except (OSError, ValueError, IndexError):
        return None


def kill_sessions(container_id: str) -> int:
    """SIGKILL every process of the container's cgroup in a session that a process of the
    container started (the server's ``bash`` commands, and what they set up with
    ``setsid``), or whose leader is gone; returns how many. Spared: sessions led by a
    process started from outside (the init, the server, an exec and what it runs). Only
    the host's view counts: the cgroup and ``/proc``."""
    killed = 0
    for _ in range(3):  # what forked meanwhile goes in the next round
        seen = {pid: ps for pid in cgroup_procs(container_id) or [] if (ps := _ppid_sid(pid))}
        victims = [pid for pid, (_, sid) in seen.items() if sid not in seen or seen[sid][0] in seen]
        if not victims:
            break
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


def kill_exec_group(pgid: int, container_id: str) -> None:
    """SIGKILL process group ``pgid`` (an exec's), only once a process of the container's own
    cgroup is seen in it: never a group of this pid namespace that merely has that number."""
    if pgid <= 0:
        return
    for pid in cgroup_procs(container_id) or []:
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pgid:
                with contextlib.suppress(OSError):
                    os.killpg(pgid, signal.SIGKILL)
                return


class Gone(Exception):
    """The server exec ended or broke its protocol: the call goes by an exec of its own."""


class Server:
    """The long-lived exec of :mod:`.inside.server`: program calls without an exec each. What
    it sends is the sandbox's: every length is capped before anything is read."""

    TRAILER_MAX = 2 * ERR_CAP + 4096  # the JSON escapes of 64 KiB of stderr fit

    def __init__(self, api: Any, container_id: str, exec_id: str, wrapped: Any) -> None:
        self.api, self.container_id, self.exec_id = api, container_id, exec_id
        self.wrapped = wrapped
        self.sock = getattr(wrapped, "_sock", wrapped)
        self.buf = bytearray()
        self.lock = threading.Lock()
        self.greeted = False
        self._pid = 0

    def pid(self) -> int:
        """The server exec's host pid, as dockerd says (0 when unknown)."""
        if not self._pid:
            with contextlib.suppress(Exception):
                self._pid = int(self.api.exec_inspect(self.exec_id).get("Pid") or 0)
        return self._pid

    def greet(self, deadline: float) -> None:
        """Read the server's greeting (once): Gone unless it is the one expected."""
        if not self.greeted:
            if self._take(4, deadline) != b"\0\0\0\0":
                raise Gone("no greeting: not the program server")
            try:
                hello = json.loads(self._line(deadline)).get("hello")
            except (ValueError, AttributeError):
                hello = None
            if hello != HELLO:
                raise Gone("a wrong greeting: not the program server")
            self.greeted = True

    def ready(self) -> bool:
        """Greeted (waiting up to ``GREET_TIMEOUT_S`` for it): False when it will not answer."""
        with self.lock:
            try:
                self.greet(time.monotonic() + GREET_TIMEOUT_S)
            except (Gone, OSError):
                return False
        return True

    def close(self) -> None:
        for close in (self.sock.close, self.wrapped.close):
            with contextlib.suppress(Exception):
                close()

    def _more(self, deadline: float) -> None:
        """Read one frame of the exec's stream; its stdout goes to ``buf``."""
        while True:
            self.sock.settimeout(max(0.05, deadline - time.monotonic()))
            header = recv_exact(self.sock, 8)
            if len(header) < 8:
                raise Gone("the server exec ended")
            kind, size = struct.unpack(">BxxxL", header)
            data = recv_exact(self.sock, size)
            if len(data) < size:
                raise Gone("the server exec ended")
            if kind == 1:
                self.buf += data
                return

    def _take(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n:
            self._more(deadline)
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def _line(self, deadline: float) -> bytes:
        while b"\n" not in self.buf:
            if len(self.buf) > self.TRAILER_MAX:
                raise Gone("the server's answer is too long")
            self._more(deadline)
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf[:] = rest
        return line

    def call(
        self,
        argv: list[str],
        stdin: bytes,
        env: dict[str, str],
        out_cap: int,
        timeout_s: float,
        out_file: IO[bytes] | None,
    ) -> CallResult:
        """Raises Gone (nothing to trust of what was read) or returns the call's result."""
        deadline = time.monotonic() + timeout_s
        request = json.dumps({"argv": argv, "env": env, "stdin": len(stdin)}).encode()
        out, seen = bytearray(), 0
        with self.lock:
            try:
                self.greet(deadline)
                self.sock.settimeout(max(0.1, deadline - time.monotonic()))
                self.sock.sendall(request + b"\n" + stdin)
                while n := struct.unpack(">I", self._take(4, deadline))[0]:
                    if seen + n > out_cap:  # over the cap: the server (and its program) go
                        self.kill()
                        return CallResult(None, b"", b"", seen + n, overflow=True)
                    data = self._take(n, deadline)
                    seen += n
                    if out_file is not None:
                        out_file.write(data)
                    else:
                        out += data
                trailer = json.loads(self._line(deadline))
            except TimeoutError:
                self.kill()
                return CallResult(None, b"", b"", seen, timed_out=True)
            except (OSError, ValueError, struct.error) as e:
                raise Gone(str(e)) from None
        code, err = (
            (trailer.get("code"), trailer.get("err")) if isinstance(trailer, dict) else (0, 0)
        )
        if type(code) is not int or not isinstance(err, str):
            raise Gone("the server's answer is malformed")
        return CallResult(code, bytes(out), err.encode()[:ERR_CAP], seen)

    def session(self, argv: list[str], env: dict[str, str], timeout_s: float, into: Capture) -> int:
        """A ``bash`` command in a session of its own (:mod:`.inside.server`): its output
        into ``into`` as it comes, its exit status returned; at its end, whatever the server
        said, nothing of it runs on (:func:`kill_sessions`). Raises Gone (the server
        ended, lied, or did not answer in ``timeout_s``: a backstop, the caller kills the
        command at its own timeout)."""
        deadline = time.monotonic() + timeout_s
        nonce = secrets.token_hex(8)  # the trailer names it: an answer out of step is Gone
        request = json.dumps({"argv": argv, "env": env, "stdin": 0, "session": nonce})
        with self.lock:
            try:
                self.greet(deadline)
                self.sock.settimeout(max(0.1, deadline - time.monotonic()))
                self.sock.sendall(request.encode() + b"\n")
                while n := struct.unpack(">I", self._take(4, deadline))[0]:
                    into.heard = True
                    if n > FRAME_MAX:
                        raise Gone("a frame over its cap")
                    into.add(self._take(n, deadline))
                into.heard = True
                trailer = json.loads(self._line(deadline))
            except (OSError, ValueError, struct.error) as e:  # TimeoutError is an OSError
                raise Gone(str(e)) from None
            finally:  # whatever it said: nothing of the command outlives the call
                kill_sessions(self.container_id)
        code = trailer.get("code") if isinstance(trailer, dict) else None
        if type(code) is not int or not 0 <= code <= 255 or trailer.get("id") != nonce:
            raise Gone("the server's answer is malformed")
        return code

    def kill(self) -> None:
        kill_exec_group(self.pid(), self.container_id)
        self.close()


@functools.cache
def _source() -> str:
    """The text of :mod:`.inside.server`, run in the container as ``python3 -u -c``."""
    from .inside import server

    return Path(server.__file__).read_text()


def start_server(
    client: Any, container_id: str, user: str, workdir: str, *, wait: bool = False
) -> Server | None:
    """Start :mod:`.inside.server` in a long-lived exec of the container (blocking, a few ms:
    the engine starts the process meanwhile; with ``wait``, until it greeted, so that a
    first call finds it ready). None when it could not be started or did not greet."""
    api = client.api
    try:
        made = api.exec_create(
            container_id,
            ["python3", "-u", "-c", _source()],
            stdin=True,
            stdout=True,
            stderr=True,
            workdir=workdir,
            user=user,
        )
        server = Server(api, container_id, str(made["Id"]), api.exec_start(made["Id"], socket=True))
    except Exception:  # noqa: BLE001 - no server: calls use execs
        return None
    if wait:
        try:
            server.greet(time.monotonic() + GREET_TIMEOUT_S)
        except (Gone, OSError, TimeoutError):
            server.close()
            return None
    return server
