"""The Unix sockets of orch's own processes (the warm process, the worker host): one place
for their addresses, locks, peer checks, proofs and JSON lines.

Both listen on a socket file of a directory closed to others (mode 0700) and hidden from
every sandbox, and both check the uid of the other end (``SO_PEERCRED``): a socket's name
grants nothing. A lock file (``flock``) next to the socket is held by the living process,
so a caller that finds nobody answering and takes the lock knows none lives (a socket file
left is stale).

Both ends prove themselves before anything else is said (issue 38: a listener planted at
the predictable path got a caller's environment, API key included, and its terminal):

1. the client sends ``orch-hello NONCE_C``;
2. the server answers ``NONCE_S MAC(key, "server", NONCE_C, its pid)``; the client checks
   it against the pid the kernel gives for its peer, so a relay (a planted listener
   passing the exchange on to the real server) fails too;
3. the client's first line is ``MAC(key, "client", NONCE_S, its pid)``, checked by the
   server against its peer's pid before it reads on.

The key is the user's (``fs/private.py``: ``~/.orch/run/socket.key``, hidden from
every sandbox). A server also refuses, before it reads a byte, a peer in other namespaces
than its own (:func:`outside_sandboxes`): a process inside a sandbox that could reach the
socket anyway. Nothing secret is ever sent: an environment is compared by its digest
under the server's nonce (:func:`env_digest`), never sent.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import secrets
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


class Unproven(OSError):
    """The other end did not prove it is orch's own process of this user."""


HELLO = b"orch-hello "
NAMESPACES = ("mnt", "pid", "net", "user")
LINE_MAX = 256  # a hello or a proof line


def namespaces(pid: int | str) -> list[str]:
    return [os.readlink(f"/proc/{pid}/ns/{ns}") for ns in NAMESPACES]


def outside_sandboxes(pid: int) -> bool:
    """True when ``pid`` shares our mount, pid, network and user namespaces (no sandbox
    does: bubblewrap makes new ones, a container too); False when it cannot be read."""
    try:
        return namespaces(pid) == namespaces("self")
    except OSError:
        return False


def _mac(role: bytes, nonce: bytes, pid: int) -> str:
    from ..fs.private import socket_key

    text = role + b"\0" + nonce + b"\0" + str(pid).encode()
    return hmac.new(socket_key(), text, hashlib.sha256).hexdigest()


def env_digest(nonce: bytes, env: list[list[str]]) -> str:
    """The digest of an environment (``[name, value]`` pairs) under a server's nonce."""
    text = json.dumps(sorted(env)).encode()
    return hmac.new(nonce, text, hashlib.sha256).hexdigest()


def hello() -> tuple[bytes, bytes]:
    """(the client's first line, its nonce)."""
    nonce = secrets.token_bytes(16)
    return HELLO + nonce.hex().encode() + b"\n", nonce


def answer(line: bytes, peer_pid: int) -> tuple[bytes, bytes, str]:
    """The server's side of a client's hello: (its answer line, its nonce, the proof the
    client's next line must be); :class:`Unproven` when ``line`` is no hello."""
    if not line.startswith(HELLO) or not line.endswith(b"\n"):
        raise Unproven("expected a hello")
    try:
        theirs = bytes.fromhex(line[len(HELLO) :].strip().decode("ascii"))
    except ValueError:
        raise Unproven("expected a hello") from None
    if len(theirs) != 16:
        raise Unproven("expected a hello")
    nonce = secrets.token_bytes(16)
    proof = _mac(b"server", theirs, os.getpid())
    expected = _mac(b"client", nonce, peer_pid)
    return f"{nonce.hex()} {proof}\n".encode(), nonce, expected


def check_answer(line: bytes, mine: bytes, peer_pid: int) -> tuple[bytes, bytes]:
    """The client's check of the server's answer: (the client's proof line, the server's
    nonce); :class:`Unproven` when the server did not prove itself."""
    words = line.decode("ascii", "replace").split()
    if len(words) != 2 or not line.endswith(b"\n"):
        raise Unproven("the server did not prove itself")
    try:
        nonce = bytes.fromhex(words[0])
    except ValueError:
        raise Unproven("the server did not prove itself") from None
    if not hmac.compare_digest(words[1], _mac(b"server", mine, peer_pid)):
        raise Unproven("the server's proof is wrong")
    return (_mac(b"client", nonce, os.getpid()) + "\n").encode(), nonce


def read_line(sock: socket.socket, limit: int = LINE_MAX) -> bytes:
    """One line, read a byte at a time (the peer says nothing more until answered; none of
    what follows is taken): b"" on end of file."""
    got = b""
    while not got.endswith(b"\n") and len(got) < limit:
        byte = sock.recv(1)
        if not byte:
            break
        got += byte
    return got


def prove_server(sock: socket.socket) -> tuple[bytes, bytes]:
    """The client's half of the exchange (module doc), on a blocking socket with a timeout:
    (the proof line to send first, the server's nonce). :class:`Unproven` when the server
    did not prove itself; a server's JSON line (a refusal) raises ``ConnectionRefusedError``
    with it; nothing but the hello has been sent."""
    from ..fs.private import socket_key

    socket_key()  # (NoPrivateRoot, an OSError, before anything is sent)
    line, mine = hello()
    sock.sendall(line)
    got = read_line(sock, MAX_REFUSAL)
    if got.startswith(b"{"):
        raise ConnectionRefusedError(got.decode("utf-8", "replace").strip())
    return check_answer(got, mine, peer(sock)[0])


MAX_REFUSAL = 4096


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
