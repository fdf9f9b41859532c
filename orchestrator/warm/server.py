"""The warm process itself (see ``__init__.py``): import everything once, fork per command.

One thread, no event loop: a ``selectors`` loop over the listening socket, the callers of
live commands and a self-pipe for ``SIGCHLD``. Per command: check the peer, take its argv,
its environment and four descriptors (working directory, stdin, stdout, stderr), fork; the
child becomes the command (``cli.main.main`` with those, in the caller's environment),
the parent answers ``{"pid": ...}``, relays the caller's signals to the child's process
group, and answers ``{"exit": n}`` or ``{"signal": n}`` when it is reaped. A caller
that hangs up takes its command with it (``SIGTERM``, as a terminal's end would). The
process exits ``ORCH_WARM_IDLE`` seconds after its last command, removing its socket.
"""

from __future__ import annotations

import contextlib
import gc
import hmac
import io
import json
import os
import random
import selectors
import signal
import socket
import stat
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..process.inherit import CALLER_FLAGS, VOLATILE_ENV, inherited
from ..process.unixsock import (
    Unproven,
    answer,
    env_digest,
    listen,
    outside_sandboxes,
    peer,
    read_line,
    send,
    unlink_if_ours,
)
from ..process.warmhome import SERVED, idle_seconds, warm_dir
from .client import MAX_MESSAGE, RELAYED

ACCEPT_TIMEOUT_S = 2.0  # a caller sends its command right after connecting


@dataclass(frozen=True)
class Command:
    """What a caller asks for: its argv, its environment (bytes: ours, proven equal, with
    its volatile names), and how it was started (``argv[0]`` and ``__main__``'s package:
    click names the program from them)."""

    argv: list[str]
    env: dict[bytes, bytes]
    argv0: str
    package: str | None
    ignored: list[int]


PRELOADED = (  # and every model provider's (models.preload_modules)
    "orchestrator.engine.runner",
    "orchestrator.teams.driver",
    "orchestrator.workspaces.registry",
    "orchestrator.process.command",
)


def preload() -> None:
    """What the warm process imports once for every command: the CLI (every command and
    sub-app, built once here), the engine, the tools and the model providers
    (:data:`PRELOADED`). The one place that says what is preloaded."""
    import importlib

    import orchestrator.cli.main

    from ..models import preload_modules

    orchestrator.cli.main.command()
    for name in (*PRELOADED, *preload_modules()):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _child(conn: socket.socket, fds: list[int], command: Command) -> None:
    """Become the command; never returns."""
    try:
        os.setpgid(0, 0)  # first: a caller gone already still reaches this group
        for s in (*RELAYED, signal.SIGCHLD):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for num in command.ignored:  # what the caller ignores (nohup), the command ignores
            signal.signal(num, signal.SIG_IGN)
        conn.close()
        cwd, *stdio = fds
        os.fchdir(cwd)
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        adopt_environment(command.env)
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
        sys.stdout = _writer(1, sys.stdout)
        sys.stderr = _writer(2, sys.stderr)
        random.seed()
        sys.argv = [command.argv0, *command.argv]
        main_module = types.ModuleType("__main__")  # the caller's, as click names the program
        main_module.__package__ = command.package
        sys.modules["__main__"] = main_module
        from ..cli.common import reset_consoles
        from ..cli.main import main

        reset_consoles()
        main()  # leaves with os._exit
    except BaseException:  # noqa: BLE001 - a child must never return into the loop
        with contextlib.suppress(BaseException):
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def adopt_environment(env: dict[bytes, bytes]) -> None:
    """The caller's environment becomes the command's, whole: nothing of the warm
    process's stays (its API key, its chain). What the warm process derived from its own
    environment is derived again: the temporary directory (``TMPDIR``) and the cached bwrap
    choice (``ORCH_BWRAP``, ``PATH``); everything else orch reads from the environment it
    reads when a command asks (the consoles are made after this)."""
    import tempfile

    from ..bwrap.find import forget

    os.environb.clear()
    os.environb.update(env)
    tempfile.tempdir = None
    forget()


def _writer(fd: int, like: Any) -> io.TextIOWrapper:
    """A standard stream on ``fd`` as Python makes one at start-up (line-buffered on a
    terminal), with the encoding and error handler it gave ``like`` in this environment."""
    tty = os.isatty(fd)
    return io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
        encoding=getattr(like, "encoding", None),
        errors=getattr(like, "errors", None),
        line_buffering=tty,
        write_through=fd == 2,
    )


class Server:
    def __init__(
        self,
        listener: socket.socket,
        sock_path: Path,
        ino: int,
        lock_fd: int,
        env: dict[bytes, bytes] | None = None,
    ) -> None:
        self.listener, self.sock_path, self.ino, self.lock_fd = listener, sock_path, ino, lock_fd
        own = dict(os.environb) if env is None else env  # as we started: what callers share
        volatile = {name.encode() for name in VOLATILE_ENV}
        self.env = {k: v for k, v in own.items() if k not in volatile}
        self.sel = selectors.DefaultSelector()
        self.children: dict[int, socket.socket] = {}  # pid → its caller
        self.buffers: dict[socket.socket, bytes] = {}
        self.last = time.monotonic()
        self.stopped = False
        self.inherits = inherited("self")  # what a fork passes on besides the environment
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: None)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        self.sel.register(listener, selectors.EVENT_READ, "accept")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "signal")

    def loop(self) -> None:
        idle = idle_seconds()
        while True:
            timeout = None if self.children else max(0.0, self.last + idle - time.monotonic())
            for handle, _ in self.sel.select(timeout):
                if handle.data == "accept":
                    self._accept()
                elif handle.data == "signal":
                    if bytes([signal.SIGTERM]) in self._drain():
                        self._stop()  # take no more commands; finish the running ones
                    self._reap()
                else:
                    self._from_caller(handle.fileobj)  # type: ignore[arg-type]
            if not self.children and (self.stopped or time.monotonic() >= self.last + idle):
                self._stop()
                return

    def _stop(self) -> None:
        """Take no more commands: the socket's name goes first (no new caller reaches us),
        then every caller already queued hears so and runs its command itself."""
        if not self.stopped:
            self.stopped = True
            self.sel.unregister(self.listener)
            unlink_if_ours(self.sock_path, self.ino)
            self.listener.setblocking(False)
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = self.listener.accept()  # (raises once the backlog is empty)
                    _drop(conn, [], "the warm process is leaving")

    def _drain(self) -> bytes:
        got = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.wake_r, 256):
                got += chunk
        return got

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if self.stopped:  # past the end: say so, the caller runs the command itself
            _drop(conn, [], "the warm process is leaving")
            return
        refused = None
        pid = 0
        try:
            pid, uid, _ = peer(conn)
            if uid != os.getuid() or not outside_sandboxes(pid):
                refused = "refused: not a process of this user outside sandboxes"
            elif inherited(pid) != self.inherits:  # its limits, groups, no_new_privs...
                refused = "refused: the caller's limits, groups or privileges are not ours"
        except OSError:
            refused = "refused: the caller could not be checked"
        if refused is not None:  # before a byte is read, and before we prove anything
            _drop(conn, [], refused)
            return
        deadline = time.monotonic() + ACCEPT_TIMEOUT_S  # for the whole exchange
        fds: list[int] = []
        try:  # both prove themselves first (``unixsock``); then the command and its fds
            conn.settimeout(ACCEPT_TIMEOUT_S)
            reply, nonce, expected = answer(read_line(conn), pid)
            conn.sendall(reply)
            conn.settimeout(max(0.0, deadline - time.monotonic()) or 0.001)
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 4)
            while data and not data.endswith(b"\n") and len(data) < MAX_MESSAGE:
                conn.settimeout(max(0.0, deadline - time.monotonic()) or 0.001)
                chunk = conn.recv(MAX_MESSAGE)  # a long argv comes in more than one piece
                if not chunk:
                    break
                data += chunk
        except Unproven as e:
            _drop(conn, fds, f"refused: {e}")
            return
        except OSError:
            _drop(conn, fds)
            return
        proof, _, data = data.partition(b"\n")
        if not hmac.compare_digest(proof, expected.encode()):
            _drop(conn, fds, "refused: the caller did not prove itself")  # (its data unread)
            return
        try:
            command = self._check(data, fds, nonce)
        except (OSError, ValueError) as e:
            _drop(conn, fds, str(e))
            return
        if _hung_up(conn):  # it gave up waiting: it never learns of a fork, so none
            _drop(conn, fds)
            return
        self._fork(conn, fds, command)

    def _check(self, data: bytes, fds: list[int], nonce: bytes) -> Command:
        if len(fds) != 4 or not stat.S_ISDIR(os.fstat(fds[0]).st_mode):
            raise ValueError("expected a directory and three standard streams")
        message = json.loads(data) if data.strip() else None
        if not isinstance(message, dict):
            raise ValueError("not a command")
        argv, digest = message.get("argv"), message.get("env")
        argv0, package = message.get("argv0", "orch"), message.get("package")
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ValueError("argv must be a list of strings")
        ours = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in self.env.items()]
        if not isinstance(digest, str) or not hmac.compare_digest(
            digest, env_digest(nonce, ours)
        ):  # its socket's name says it is: a caller of another environment asks elsewhere
            raise ValueError("refused: the caller's environment is not this warm process's")
        env = {**self.env, **_environment(message.get("volatile"))}
        if not isinstance(argv0, str) or not (package is None or isinstance(package, str)):
            raise ValueError("argv0 and package must be strings")
        ignored = message.get("ignored", [])
        if not isinstance(ignored, list) or not all(i in RELAYED for i in ignored):
            raise ValueError("only relayed signals may be ignored")
        return Command(argv, env, argv0, package, [int(i) for i in ignored])

    def _fork(self, conn: socket.socket, fds: list[int], command: Command) -> None:
        pid = os.fork()
        if pid == 0:  # the command holds nothing of the warm process's
            signal.set_wakeup_fd(-1)
            self.sel.close()  # its epoll watches the listener and the other callers
            self.listener.close()
            for other in self.buffers:
                other.close()
            for fd in (self.wake_r, self.wake_w, self.lock_fd):
                os.close(fd)
            _child(conn, fds, command)
        with contextlib.suppress(OSError):  # (the child does it too: whoever is first)
            os.setpgid(pid, pid)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        self.buffers[conn] = b""
        self.sel.register(conn, selectors.EVENT_READ, pid)
        send(conn, {"pid": pid})

    def _from_caller(self, conn: socket.socket) -> None:
        pid = self.sel.get_key(conn).data
        try:
            chunk = conn.recv(4096)  # readable: does not block
        except OSError:
            chunk = b""
        if not chunk:  # the caller is gone: so is its command
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
            self.sel.unregister(conn)
            return
        buf = self.buffers[conn] + chunk
        *lines, self.buffers[conn] = buf.split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError, AttributeError):
                signum = json.loads(line).get("signal")
                if signum in RELAYED:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signum)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            if os.WIFSIGNALED(status):
                send(conn, {"signal": os.WTERMSIG(status)})
            else:
                send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(conn)
            self.buffers.pop(conn, None)
            conn.close()
            self.last = time.monotonic()


def _environment(pairs: object) -> dict[bytes, bytes]:
    """The caller's volatile names (``PWD``...) from its message: [name, value] pairs of
    Latin-1 strings; no other name."""
    if not isinstance(pairs, list):
        raise ValueError("the caller's environment is missing")
    env: dict[bytes, bytes] = {}
    for pair in pairs:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError("the environment must be [name, value] pairs of strings")
        if not all(isinstance(x, str) for x in pair):
            raise ValueError("the environment must be [name, value] pairs of strings")
        try:
            name, value = (x.encode("latin-1") for x in pair)
        except UnicodeEncodeError:
            raise ValueError("the environment must be Latin-1 decoded bytes") from None
        if not name or b"=" in name or b"\0" in name or b"\0" in value:
            raise ValueError("not an environment variable name or value")
        if name.decode("latin-1") not in VOLATILE_ENV:
            raise ValueError(f"{pair[0]!r} is not a name a caller may set here")
        env[name] = value
    return env


def _drop(conn: socket.socket, fds: list[int], error: str | None = None) -> None:
    """Run nothing for this caller: close what it sent, tell it why (when there is a why:
    then it runs the command itself), hang up."""
    for fd in fds:
        os.close(fd)
    if error is not None:
        send(conn, {"error": error})
    conn.close()


def _hung_up(conn: socket.socket) -> bool:
    """True when the caller has closed its end (it gave up waiting)."""
    timeout = conn.gettimeout()
    conn.setblocking(False)
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        conn.settimeout(timeout)


def serve(key: str, lock_fd: int, path: list[str], callers: list[object]) -> None:
    """Run a warm process for ``key`` holding ``lock_fd`` until it has been idle long enough
    (``path``: its callers' module search path; ``callers``: their interpreter's flags)."""
    sys.path[:] = path
    env = dict(os.environb)  # as started, before any import: what the callers' digest names
    where = warm_dir()
    if where is None:
        return
    os.set_inheritable(lock_fd, False)
    try:
        preload()
        problem = None
    except Exception as e:  # noqa: BLE001 - whatever it is, commands run alone (and say it)
        problem = f"importing orch failed: {type(e).__name__}: {e}"
    if problem is None and threading.active_count() != 1:
        problem = "an import started a thread (a fork would copy its held locks)"
    if problem is not None:  # no warm process for this key: callers stop starting one
        with contextlib.suppress(OSError):
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(where / f"{key}.failed", flags, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(problem + "\n")
        return
    from ..process.command import not_dumpable

    not_dumpable()  # it holds the API key: its /proc entries are closed to our own uid
    gc.collect()
    gc.freeze()  # the forked children do not dirty the preloaded objects' pages
    sock_path = where / f"{key}.sock"
    listener, ino = listen(sock_path, 64)  # (one left by a dead one goes: we hold the lock)
    SERVED[:] = [key]  # what the commands it forks answer for a key (warmhome.warm_key)
    CALLER_FLAGS[:] = [callers]
    try:
        Server(listener, sock_path, ino, lock_fd, env).loop()
    finally:
        SERVED.clear()
        CALLER_FLAGS.clear()
        unlink_if_ours(sock_path, ino)  # (a later one's socket, after `rm -rf ~/.orch`, stays)
        listener.close()
        os.close(lock_fd)
    os._exit(0)  # nothing to tear down: the preloaded modules only cost time


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4]))
