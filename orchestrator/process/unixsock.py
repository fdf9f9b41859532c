"""The Unix sockets of orch's own processes (the warm process, the worker host): one place
for their addresses, locks, peer checks and JSON lines.

Both listen on a socket file of a directory closed to others (mode 0700), and both check
the uid of the other end (``SO_PEERCRED``): a socket's name grants nothing. A lock file
(``flock``) next to the socket is held by the living process, so a caller that finds
nobody answering and takes the lock knows none lives (a socket file left is stale).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def enabled() -> bool:
    """These processes need Linux (SO_PEERCRED, /proc); ``ORCH_WORKER_HOST=0`` turns them off."""
    return sys.platform == "linux" and os.environ.get("ORCH_WORKER_HOST", "1") != "0"


@contextlib.contextmanager
def address(sock_path: Path) -> Iterator[str]:
    """A path to bind or connect to: the path itself, or, when it is longer than a socket
    address may be, the same file reached through an open descriptor of its directory."""
    if len(os.fsencode(sock_path)) < 100:
        yield str(sock_path)
        return
    fd = os.open(sock_path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{sock_path.name}"
    finally:
        os.close(fd)


def peer(sock: Any) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class NotOurs(OSError):
    """The process listening on the socket is another user's."""


def _at(
    sock_path: Path, act: Callable[[socket.socket, str], None], timeout: float | None
) -> socket.socket:
    """A new Unix socket that ``act`` bound or connected to ``sock_path`` (closed on OSError)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout)
    try:
        with address(sock_path) as addr:
            act(sock, addr)
    except OSError:
        sock.close()
        raise
    return sock


def connect(sock_path: Path, timeout: float | None = None) -> socket.socket:
    """A connection to the process listening on ``sock_path``, checked to be one of our
    uid; OSError when nobody answers, :class:`NotOurs` when another user does."""
    sock = _at(sock_path, socket.socket.connect, timeout)
    if peer(sock)[1] != os.getuid():
        sock.close()
        raise NotOurs(f"{sock_path.name} belongs to another user")
    return sock


def listen(sock_path: Path, backlog: int) -> tuple[socket.socket, int]:
    """Bind and listen on ``sock_path`` (mode 0600; a file left there is replaced: the
    caller holds the lock, so nobody answers on it); returns the socket and the inode."""
    with contextlib.suppress(FileNotFoundError):
        sock_path.unlink()
    old = os.umask(0o177)
    try:
        sock = _at(sock_path, socket.socket.bind, None)
    finally:
        os.umask(old)
    sock.listen(backlog)
    return sock, os.lstat(sock_path).st_ino


def unlink_if_ours(path: Path, ino: int | None) -> None:
    """Remove our socket file (not one a later process put there)."""
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == ino:
            path.unlink()


def try_lock(lock_path: Path) -> int | None:
    """The lock's descriptor if nobody holds it (then the caller does), else None; OSError
    when it cannot be opened (also for a symlink)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def line(message: dict[str, Any]) -> bytes:
    """One JSON line, as both processes speak."""
    return json.dumps(message).encode() + b"\n"


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send one JSON line; a peer gone already is not an error."""
    with contextlib.suppress(OSError):
        sock.sendall(line(message))


class Lines:
    """JSON objects read from a socket, one line at a time (None: closed, or not JSON)."""

    def __init__(self, sock: socket.socket, limit: int) -> None:
        self.sock, self.buf, self.limit = sock, b"", limit

    def next(self) -> dict[str, Any] | None:
        while b"\n" not in self.buf:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                return None
            if not chunk or len(self.buf) > self.limit:
                return None
            self.buf += chunk
        raw, self.buf = self.buf.split(b"\n", 1)
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None
