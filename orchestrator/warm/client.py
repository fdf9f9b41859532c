"""The caller's side of the warm process (see ``__init__.py``): ask it to run a command,
relay signals, leave with the command's exit status. Standard library only."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import selectors
import signal
import socket
import sys
import time
from typing import Any

from ..process.unixsock import (
    Lines,
    Unproven,
    connect,
    env_digest,
    peer,
    prove_server,
    send,
    try_lock,
)
from ..process.unixsock import enabled as processes_enabled
from ..process.warmhome import FAILED_FOR_S, VOLATILE_ENV, idle_seconds, warm_dir, warm_key

# what a terminal or a shell sends to the foreground job; the command gets them all
RELAYED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGTSTP,
    signal.SIGCONT,
)
REPLY_TIMEOUT_S = 15.0  # to the fork; past it the caller says which pid to end
PROOF_TIMEOUT_S = 5.0  # for the warm process to prove itself (it answers at once)
MAX_MESSAGE = 256 * 1024


def enabled(argv: list[str]) -> bool:
    """Linux, not turned off, and a user command (internal ``_...`` ones run as they are)."""
    if not processes_enabled():
        return False
    return idle_seconds() > 0 and not (argv and argv[0].startswith("_"))


def environment() -> tuple[list[list[str]], list[list[str]]]:
    """This process's environment as the warm process compares it: (the names and values
    it must hold already, the shell's volatile ones it takes from the caller), each as
    the bytes of name and value decoded as Latin-1 (any byte string survives JSON). Only
    the volatile ones are ever sent; the others go as a digest (nothing secret is sent)."""
    volatile = {name.encode() for name in VOLATILE_ENV}
    pairs = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in os.environb.items()]
    kept = [p for p in pairs if p[0].encode("latin-1") not in volatile]
    return kept, [p for p in pairs if p[0].encode("latin-1") in volatile]


def _start(key_: str, lock_fd: int, env: dict[bytes, bytes]) -> None:
    """Start a detached warm process that takes over the lock (its life), in ``env``: the
    caller's environment as it was before its command ran (the key names that one)."""
    import subprocess

    from ..process.interpreter import helper_argv, helper_path  # isolated: -I
    from ..process.warmhome import caller_flags

    path = json.dumps(helper_path())
    argv = helper_argv("orchestrator.warm.server", key_, str(lock_fd), path, caller_flags())
    with contextlib.suppress(OSError):
        subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            env=env,
            start_new_session=True,
            close_fds=True,
            pass_fds=(lock_fd,),
        )


def _start_then_close(key_: str, lock_fd: int, env: dict[bytes, bytes]) -> None:
    _start(key_, lock_fd, env)
    os.close(lock_fd)


def run(argv: list[str]) -> int | None:
    """Run ``orch argv`` in the warm process and return its exit status; None when no warm
    process took it (nothing ran: the caller runs it itself)."""
    if not enabled(argv) or not _streams_open():
        return None
    where = warm_dir()
    if where is None:
        return None
    k = warm_key()
    try:
        sock = connect(where / f"{k}.sock")
    except OSError:
        failed = where / f"{k}.failed"
        with contextlib.suppress(OSError):  # one could not start here: not again for a day
            if time.time() - os.lstat(failed).st_mtime < FAILED_FOR_S:
                return None
        fd = None
        with contextlib.suppress(OSError):
            fd = try_lock(where / f"{k}.lock")
        if fd is not None:  # none lives: start one for the next command, once this one is
            env = dict(os.environb)  # done (the two would share the CPUs)
            atexit.register(_start_then_close, k, fd, env)
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
            send(self.sock, {"signal": signum})

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

    def _prove(self) -> tuple[bytes, bytes] | None:
        """The warm process proves itself before anything is sent (``unixsock``): (our
        proof line, its nonce), or None (then nothing ran: the caller runs the command)."""
        try:
            self.sock.settimeout(PROOF_TIMEOUT_S)
            return prove_server(self.sock)
        except Unproven as e:
            print(
                f"orch: {e}: the process at the warm socket is not orch's; the command runs "
                "in its own process (nothing was sent to it)",
                file=sys.stderr,
            )
        except OSError:  # refused (it says why), leaving, or silent: nothing was sent
            pass
        return None

    def _run(self, argv: list[str], ignored: list[int]) -> int | None:
        proven = self._prove()
        if proven is None:
            return None
        proof, nonce = proven
        kept, volatile = environment()
        main_package = getattr(sys.modules.get("__main__"), "__package__", None)
        argv0 = sys.argv[0] if sys.argv else "orch"
        message = {
            "argv": argv,
            "env": env_digest(nonce, kept),
            "volatile": volatile,
            "argv0": argv0,
            "package": main_package,
            "ignored": [int(s) for s in ignored],
        }
        data = proof + json.dumps(message).encode() + b"\n"
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
        lines = Lines(self.sock, MAX_MESSAGE)
        started = lines.next()  # within REPLY_TIMEOUT_S
        if started is None:  # it may have forked: never run the command a second time
            owner = peer(self.sock)[0]
            print(
                f"orch: the warm process (pid {owner}) did not answer; end it (kill {owner}) "
                "or set ORCH_WORKER_HOST=0 to run commands in their own process",
                file=sys.stderr,
            )
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
            if sig not in (signal.SIGKILL, signal.SIGSTOP):  # no handler to reset for those
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
