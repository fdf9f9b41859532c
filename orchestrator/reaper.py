"""The subreaper every command orch starts outside a PID namespace runs under.

``pgroups.spawn`` starts ``python -I -S -c <this file's text> FD`` (orch's interpreter,
no import path of the environment's: nothing of it is a file anyone else wrote) with FD a
memory file holding, NUL-separated, the grace in seconds, the program's path
and the command's argv. This process marks itself a child subreaper
(``PR_SET_CHILD_SUBREAPER``), forks the command and waits. A process that leaves its
parent (a ``setsid`` and a double fork, ``setsid -f``, a daemon) is re-parented to it by
the kernel, never to init: everything the command started stays below it, however it
left its group or session, and the kernel holds no other way out (but for a process
that kills this one: one of the user's, unsandboxed, can).

When the command ends, what it left is given ``grace`` seconds, only while one of them
still holds the command's stdout or stderr (its output may still come, as before), and is
then stopped, found and killed whole; this process then exits as the command did (its
code, or its signal). SIGTERM, SIGINT or SIGHUP ends the command and all it started the
same way. SIGKILL (``pgroups.kill_tree``) stops this process with its group first and
walks its children: what it adopted is found there.

The command gets the environment this process was started with, as it was (read back
from ``/proc/self/environ``: Python's own start may add ``LC_CTYPE``), and the signal
dispositions of a fresh process. Stdlib only: it runs isolated (``-I -S``), not as a
module of orch.
"""

from __future__ import annotations

# ``_signal``: ``signal`` without its enums, which were a third of this process's start
import _signal as signal  # type: ignore[import-not-found]
import ctypes
import errno
import os
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.02
STOP_WAIT_S = 0.2
ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Ended(Exception):
    """A signal asked this process (and so the command) to end."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _ask(signum: int, frame: object) -> None:
    raise Ended(signum)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found += [int(c) for c in f.read().split()]
        except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN: by parent ids
            return [p for p in _pids() if _parent(p) == pid]
        except OSError:
            continue
    return found


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _below() -> list[int]:
    """Every living process below this one."""
    found: list[int] = []
    todo = _children(os.getpid())
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.append(pid)
            todo += _children(pid)
    return found


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "X"


def _reap_any() -> None:
    """Reap every child that has ended (adopted ones included), without waiting."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _end_all() -> None:
    """Stop everything below, until a walk finds nothing new (a fork under way, a process
    re-parented here meanwhile), then kill it all and reap it."""
    stopped: set[int] = set()
    while True:
        new = [p for p in _below() if p not in stopped]
        if not new:
            deadline = time.monotonic() + STOP_WAIT_S  # each stop lands, then look again
            while any(_state(p) not in "TtZX" for p in stopped):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.001)
            new = [p for p in _below() if p not in stopped]
            if not new:
                break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                pass
            stopped.add(pid)
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _pipes() -> set[str]:
    """What this process's stdout and stderr are, when they are pipes ("pipe:[inode]")."""
    held = set()
    for fd in (1, 2):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("pipe:"):
            held.add(target)
    return held


def _holds(pid: int, pipes: set[str]) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in pipes:
                return True
        except OSError:
            continue
    return False


def _environment() -> dict[bytes, bytes]:
    with open("/proc/self/environ", "rb") as f:
        entries = f.read().split(b"\0")
    env = {}
    for entry in entries:
        name, sep, value = entry.partition(b"=")
        if sep and name:
            env[name] = value
    return env


def _exec(path: bytes, argv: list[bytes], env: dict[bytes, bytes]) -> None:
    """In the child: a fresh process's signal dispositions, then the command."""
    for signum in (signal.SIGPIPE, signal.SIGXFSZ, *ENDING):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    try:
        os.execve(path, argv, env)
    except OSError as e:
        name = argv[0].decode(errors="replace") if argv else "?"
        os.write(2, f"orch: cannot run {name}: {e.strerror}\n".encode())
        os._exit(127 if e.errno == errno.ENOENT else 126)


def _exit_as(status: int) -> None:
    """End this process as the command ended: its exit code, or its signal."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core of ours for its crash
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # a signal that does not end a process
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def main() -> None:
    fd = int(sys.argv[1])
    data = os.pread(fd, os.fstat(fd).st_size, 0)
    os.close(fd)
    grace_text, path, *argv = data.split(b"\0")
    grace = float(grace_text)
    env = _environment()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        os.write(2, b"orch: cannot keep the command's processes together (prctl)\n")
        os._exit(126)
    pipes = _pipes()
    for signum in ENDING:
        signal.signal(signum, _ask)
    signal.pthread_sigmask(signal.SIG_BLOCK, ENDING)  # none lands between fork and exec
    child = os.fork()
    if child == 0:
        _exec(path, argv, env)
    status = 0
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, ENDING)
        null = os.open(os.devnull, os.O_RDWR)  # the command's pipes are the command's
        for n in (0, 1, 2):
            os.dup2(null, n)
        while True:  # the command's end (what it left is reaped meanwhile)
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                break
        end = time.monotonic() + grace  # its output may still come from what it left
        while time.monotonic() < end:
            _reap_any()
            left = _below()
            if not any(_holds(p, pipes) for p in left):
                break
            time.sleep(POLL_S)
    except Ended as asked:
        for signum in ENDING:
            signal.signal(signum, signal.SIG_IGN)
        _end_all()
        os._exit(128 + asked.signum)
    for signum in ENDING:
        signal.signal(signum, signal.SIG_IGN)
    _end_all()
    _exit_as(status)


if __name__ == "__main__":
    main()
