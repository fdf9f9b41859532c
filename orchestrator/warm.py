"""The warm process: ``orch`` commands forked from a process that has imported them already.

Importing the CLI, the engine and the model SDK takes about a second; the work of a
short command takes a few milliseconds. So the ``orch`` entry point (this module, standard
library only) first asks a *warm process* to run the command: a process of the same user,
environment, Python and orch code that has imported everything once and forks one child
per command. The child takes the caller's working directory and its stdin, stdout and
stderr (passed as descriptors over a Unix socket, ``SCM_RIGHTS``), then runs the very
same ``cli.main.main`` on the caller's argv; the caller relays signals to it and leaves
with its exit status. When no warm process answers, the command runs in its own process
as before, and then (at its exit) starts a warm process for the next one (which exits after
``ORCH_WARM_IDLE`` seconds without a command, default 60; ``0`` or
``ORCH_WORKER_HOST=0`` turns it off). One that cannot start (an import fails) leaves
``KEY.failed`` saying why, and commands of that key run alone without trying again.

What a command sees is what it would see in its own process: the environment is the
caller's own (sent whole, and the only one the command has), the warm process is
compatible by construction (the digest of the environment, the umask, the Python,
``sys.path``, the size and mtime of every orch source file, the installed distributions,
and what a process inherits besides (ids, groups, limits, priority, cgroup, CPUs,
interpreter flags) names the socket: any difference means another warm process), the
working directory and standard streams are the caller's own, and the warm process itself
never starts a thread or an event loop, so a fork copies no held lock.

Trust: the socket and its lock live in ``~/.orch/warm`` (mode 0700; ``~/.orch`` is
hidden from host-tier sandboxes). A connection is served only when its peer has our uid
and our mount, pid, network and user namespaces (``SO_PEERCRED`` and ``/proc``): a
process inside a sandbox is refused even where it could reach the socket, and so is one
that differs from the warm process in what a process inherits besides its environment
(limits, umask, groups, capabilities, ``no_new_privs``, seccomp, cgroup, OOM score,
priority, scheduling policy: read from ``/proc``, never taken from the message). The
message carries argv and the caller's whole environment, and the command runs with that
environment, never the warm process's: the socket's name (a digest) only picks a
compatible warm process and grants nothing. A caller without the API key runs its command
without it; one inside an agent's chain (``ORCH_PARENT_RUN_ID``...) stays in that chain,
at its depth, under its budgets.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

IDLE_DEFAULT_S = 60.0
VOLATILE_ENV = ("PWD", "OLDPWD", "SHLVL", "_")  # differ per shell; passed, never hashed
# what a terminal or a shell sends to the foreground job; the command gets them all
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGTSTP,
           signal.SIGCONT)  # fmt: skip
REPLY_TIMEOUT_S = 15.0  # to the fork; past it the caller says which pid to end
FAILED_FOR_S = 24 * 3600.0
NAMESPACES = ("mnt", "pid", "net", "user")
INHERITED_STATUS = frozenset(
    ("Uid", "Gid", "Groups", "Umask", "NoNewPrivs", "Seccomp", "Seccomp_filters", "CapInh")
    + ("CapPrm", "CapEff", "CapBnd", "CapAmb", "Cpus_allowed_list", "Mems_allowed_list")
)
MAX_MESSAGE = 256 * 1024
CODE = Path(__file__).resolve().parent
_INSTALLED = (".dist-info", ".egg-info", ".egg-link", ".pth")


def idle_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get("ORCH_WARM_IDLE", IDLE_DEFAULT_S)))
    except ValueError:
        return IDLE_DEFAULT_S


def enabled(argv: list[str]) -> bool:
    """Linux, not turned off, and a user command (internal ``_...`` ones run as they are)."""
    if sys.platform != "linux" or os.environ.get("ORCH_WORKER_HOST", "1") == "0":
        return False
    return idle_seconds() > 0 and not (argv and argv[0].startswith("_"))


def _umask() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return line.split()[1]
    return "?"


def _stamp(path: str, out: list[tuple[str, int, int]], depth: int = 0) -> None:
    """(path, size, mtime) of every source file under ``path`` (orch's own code)."""
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        for e in entries:
            if e.is_dir(follow_symlinks=False) and depth < 4 and e.name != "__pycache__":
                _stamp(e.path, out, depth + 1)
            elif e.name.endswith(".py"):
                st = e.stat()
                out.append((e.path, st.st_size, st.st_mtime_ns))


def inherited(pid: int | str) -> list[object]:
    """What process ``pid`` (or ``"self"``) passes on to a command besides its environment,
    as the kernel tells it: ids, groups, umask, capabilities, ``no_new_privs``, seccomp,
    CPUs and memory nodes, limits, cgroup, OOM score, priority and scheduling policy.
    OSError when it cannot be read."""
    status = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in INHERITED_STATUS:
            status[name] = value.split()
    limits = Path(f"/proc/{pid}/limits").read_text()
    cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    oom = Path(f"/proc/{pid}/oom_score_adj").read_text()
    number = 0 if pid == "self" else int(pid)
    scheduling = [os.getpriority(os.PRIO_PROCESS, number), os.sched_getscheduler(number)]
    return [sorted(status.items()), limits, cgroup, oom, scheduling]


def _process() -> list[object]:
    """What a process inherits besides its environment (:func:`inherited`), and the
    interpreter's flags."""
    try:
        kernel = inherited("self")
    except OSError:
        kernel = ["?"]
    return [kernel, list(sys.flags), sorted(map(str, sys._xoptions.items()))]


def key() -> str:
    """The digest of everything a command inherits from the process that runs it."""
    env = sorted((k, v) for k, v in os.environ.items() if k not in VOLATILE_ENV)
    code: list[tuple[str, int, int]] = []
    _stamp(str(CODE), code)
    installed = []  # an install, upgrade or removal changes these names
    for entry in sys.path:
        if entry.endswith(("site-packages", "dist-packages")):
            with contextlib.suppress(OSError):
                installed += sorted(n for n in os.listdir(entry) if n.endswith(_INSTALLED))
    blob = json.dumps([env, _umask(), sys.executable, sys.path, code, installed, _process()])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def warm_dir() -> Path | None:
    """``~/.orch/warm``, ours and closed to others; None when it cannot be made so."""
    home = os.environ.get("HOME")
    if not home:
        return None
    path = Path(home) / ".orch" / "warm"
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)  # (parents=True would make it 0755)
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return None
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
        return None
    return path if st.st_mode & 0o077 == 0 else None


@contextlib.contextmanager
def address(sock_path: Path) -> Iterator[str]:
    """A path to bind or connect to: the path itself, or, when it is longer than a socket
    address may be, the same file reached through an open descriptor of its directory.
    (The worker host's socket uses it too.)"""
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


def environment() -> list[list[str]]:
    """This process's whole environment as the warm process gets it: the bytes of each
    name and value, decoded as Latin-1 (so that any byte string survives JSON)."""
    return [[k.decode("latin-1"), v.decode("latin-1")] for k, v in os.environb.items()]


def _namespaces(pid: int | str) -> list[str]:
    return [os.readlink(f"/proc/{pid}/ns/{ns}") for ns in NAMESPACES]


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(json.dumps(message).encode() + b"\n")


# -- the caller's side --------------------------------------------------------------------


class _Lines:
    """JSON lines read from a socket, one at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def next(self) -> dict[str, Any] | None:
        while b"\n" not in self.buf:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                return None
            if not chunk or len(self.buf) > MAX_MESSAGE:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            value = json.loads(line)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None


def _connect(sock_path: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        with address(sock_path) as name:
            sock.connect(name)
    except OSError:
        sock.close()
        return None
    if peer(sock)[1] != os.getuid():
        sock.close()
        return None
    return sock


def _start(key_: str, lock_fd: int) -> None:
    """Start a detached warm process that takes over the lock (its life)."""
    import subprocess

    serve = [sys.executable, "-m", "orchestrator.warmserve"]
    argv = [*serve, key_, str(lock_fd), json.dumps(sys.path)]
    with contextlib.suppress(OSError):
        subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, cwd="/", start_new_session=True, close_fds=True,
            pass_fds=(lock_fd,),
        )  # fmt: skip


def _start_then_close(key_: str, lock_fd: int) -> None:
    _start(key_, lock_fd)
    os.close(lock_fd)


def try_lock(lock_path: Path) -> int | None:
    """The lock's descriptor if nobody holds it (then the caller does), else None; OSError
    when it cannot be opened (also for a symlink). Worker hosts use it too (``hostlink``)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def owner(sock_path: Path) -> int | None:
    """The pid of the process listening on ``sock_path`` (a warm process), if one does."""
    sock = _connect(sock_path)
    if sock is None:
        return None
    with sock:
        return peer(sock)[0]


def run(argv: list[str]) -> int | None:
    """Run ``orch argv`` in the warm process and return its exit status; None when no warm
    process took it (nothing ran: the caller runs it itself)."""
    if not enabled(argv) or not _streams_open():
        return None
    where = warm_dir()
    if where is None:
        return None
    k = key()
    sock = _connect(where / f"{k}.sock")
    if sock is None:
        failed = where / f"{k}.failed"
        with contextlib.suppress(OSError):  # one could not start here: not again for a day
            if time.time() - os.lstat(failed).st_mtime < FAILED_FOR_S:
                return None
        fd = None
        with contextlib.suppress(OSError):
            fd = try_lock(where / f"{k}.lock")
        if fd is not None:  # none lives: start one for the next command, once this one is
            atexit.register(_start_then_close, k, fd)  # done (the two would share the CPUs)
        return None
    with sock:
        return _Relay(sock).run(argv)


def _streams_open() -> bool:
    """stdin, stdout and stderr are open (a command run alone gets what the shell gave)."""
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
    except OSError:
        return False
    return True


class _Relay:
    """One command in the warm process, seen from its caller: signals go to it, its exit
    status comes back. Signals the caller ignores stay ignored (``nohup``, a script's
    background job); until the command exists a signal ends the caller and nothing runs;
    if the warm process dies, signals go to the command directly (its pidfd)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pidfd: int | None = None
        self.gone = False  # the warm process: signals then go through the pidfd
        self.previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.pidfd is None:  # no command yet: stop, go on, or leave (nothing has run)
            if signum == signal.SIGTSTP:
                os.kill(os.getpid(), signal.SIGSTOP)
            elif signum != signal.SIGCONT:
                os._exit(128 + signum)
            return
        if signum == signal.SIGTSTP:  # stop the command, then ourselves (the shell's ^Z)
            self._forward(signal.SIGTSTP)
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        self._forward(signum)

    def _forward(self, signum: int) -> None:
        if self.gone and self.pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, signum)
        else:
            _send(self.sock, {"signal": signum})

    def run(self, argv: list[str]) -> int | None:
        ignored = [int(s) for s in RELAYED if signal.getsignal(s) == signal.SIG_IGN]
        for s in RELAYED:
            if int(s) not in ignored:
                self.previous[int(s)] = signal.signal(s, self._on_signal)
        try:
            return self._run(argv, ignored)
        finally:
            if self.pidfd is None:  # not taken: the command runs here, with our handlers
                for num, handler in self.previous.items():
                    signal.signal(num, handler)
            elif self.pidfd >= 0:
                os.close(self.pidfd)

    def _run(self, argv: list[str], ignored: list[int]) -> int | None:
        env = environment()
        main_package = getattr(sys.modules.get("__main__"), "__package__", None)
        argv0 = sys.argv[0] if sys.argv else "orch"
        message = {"argv": argv, "env": env, "argv0": argv0, "package": main_package,
                   "ignored": [int(s) for s in ignored]}  # fmt: skip
        data = json.dumps(message).encode() + b"\n"
        if len(data) > MAX_MESSAGE:
            return None
        try:  # the directory's descriptor above 2: never taken for a standard stream
            cwd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            high = fcntl.fcntl(cwd, fcntl.F_DUPFD_CLOEXEC, 3)
        finally:
            os.close(cwd)
        try:
            self.sock.settimeout(REPLY_TIMEOUT_S)
            sent = socket.send_fds(self.sock, [data], [high, 0, 1, 2])
            self.sock.sendall(data[sent:])
        except OSError:
            return None
        finally:
            os.close(high)
        lines = _Lines(self.sock)
        started = lines.next()  # within REPLY_TIMEOUT_S
        if started is None:  # it may have forked: never run the command a second time
            owner = peer(self.sock)[0]
            print(f"orch: the warm process (pid {owner}) did not answer; end it (kill {owner}) "
                  "or set ORCH_WORKER_HOST=0 to run commands in their own process",
                  file=sys.stderr)  # fmt: skip
            return 1
        pid = started.get("pid")
        if not isinstance(pid, int):
            return None  # refused (it says so before any fork): nothing ran
        try:
            self.pidfd = os.pidfd_open(pid)  # the warm process has not reaped it: it is ours
        except OSError:
            self.pidfd = -1  # it ended already; its status is on the way
        self.sock.settimeout(None)
        ended = lines.next()
        if ended is None:  # the warm process died: wait for the command itself to end
            self.gone = True
            if self.pidfd >= 0:
                _wait_readable(self.pidfd)
            lost = "orch: the warm process ended before the command; its exit status is lost"
            print(
                f"{lost} (ORCH_WORKER_HOST=0 runs commands in their own process)", file=sys.stderr
            )
            return 1
        sig = ended.get("signal")
        if isinstance(sig, int):
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)  # leave as the command did
            return 128 + sig
        code = ended.get("exit")
        return code if isinstance(code, int) else 1


def _wait_readable(fd: int) -> None:
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    while not sel.select():
        pass
    sel.close()
