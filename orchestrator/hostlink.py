"""The launcher's side of the worker host: find it, start it, hand it a queued run.

One worker host (``orchestrator/workerhost.py``) per state dir and environment hosts
the detached runs of every launcher that shares both. Its Unix socket and its lock file
sit in the state dir (mode 0700): ``host-KEY.sock`` and ``host-KEY.lock``, where KEY is
a digest of what a run inherits from its launcher (the environment, the umask, the
Python and the orch code): launchers that differ there get hosts of their own, as each
got a worker of its own before, so no run ever sees another launcher's environment.

The lock (``flock``) is held by the living host: a launcher that finds nobody answering
and takes the lock knows no host lives (a socket file left is stale), starts one and
hands it the lock and its run on the command line; it returns at once, as it did with a
worker of its own. Racing launchers find the lock taken and wait for the new host to
answer. A handoff to a running host is one JSON line each way: ``{"run_id": ..., "env":
...}``, then ``{"ok": true, "pid": ...}`` or ``{"ok": false, "error": ...}``; both ends
check the other's uid (``SO_PEERCRED``). ``env`` is the launcher's whole environment: the
host runs every run in its own environment, so it takes only a run whose launcher's
environment is exactly its own (the socket's name, a digest anyone may read, grants
nothing): a launcher without the API key, or with other settings, gets a worker of its
own. :func:`hand_to_host` returns the owner's pid, or raises HostUnavailable and the
caller starts a worker of the run's own (``background.py``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from .statedir import entry, open_log
from .store import state_dir
from .warm import address, peer, try_lock

START_TIMEOUT_S = 20.0  # racing launchers wait this long for a starting host to answer
REPLY_TIMEOUT_S = 30.0  # the host builds the run's engine before it answers
MAX_LINE = 512 * 1024  # a handoff carries the launcher's environment
VOLATILE_ENV = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})  # differ per shell, unused by runs
CODE = Path(__file__).resolve().parent


class HostUnavailable(Exception):
    """No host took the run; the message says why (it goes to the run's log)."""


def enabled() -> bool:
    """Hosts need Linux (SO_PEERCRED, /proc); ``ORCH_WORKER_HOST=0`` turns them off."""
    return sys.platform == "linux" and os.environ.get("ORCH_WORKER_HOST", "1") != "0"


def _umask() -> str:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return line.split()[1]
    except OSError:
        pass
    return "?"


def host_env() -> dict[str, str]:
    """The environment a host gets (the launcher's; ``ORCH_HOME`` made absolute)."""
    env = dict(os.environ)
    if home := env.get("ORCH_HOME"):
        env["ORCH_HOME"] = str(Path(home).expanduser().resolve())
    return env


def store_setting(project_root: Path) -> str | None:
    """The ``store`` setting of the project, as every command reads it (``ORCH_STORE`` wins)."""
    from .agent_trust import load_trusted

    return load_trusted(project_root)[0].store


def comparable_env(env: dict[str, str]) -> dict[str, str]:
    """An environment as a host compares it with its own: without the shell's volatile names."""
    return {k: v for k, v in env.items() if k not in VOLATILE_ENV}


def env_key(store: str | None = None) -> str:
    """The digest of what a detached run inherits from its launcher, and of its store."""
    from .store import store_url

    env = {k: v for k, v in host_env().items() if k not in VOLATILE_ENV}
    url = store_url(store) or "sqlite"  # only its digest is ever written anywhere
    blob = json.dumps([sorted(env.items()), _umask(), sys.executable, str(CODE), url])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def paths(state: Path, key: str) -> tuple[Path, Path]:
    """(socket, lock file) of the host for ``key`` in the state dir ``state``."""
    return entry(state, f"host-{key}.sock"), entry(state, f"host-{key}.lock")


class NoAnswer(HostUnavailable):
    """Nobody listens on the socket (none, stale, refused): a host may be started."""


class Unanswered(HostUnavailable):
    """The run id was sent but no answer came back: the store says whether a host took it."""


def _connect(sock_path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(REPLY_TIMEOUT_S)
    try:
        with address(sock_path) as addr:
            sock.connect(addr)
    except OSError as e:
        sock.close()
        if e.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
            raise NoAnswer(f"no worker host answers at {sock_path.name}") from e
        raise HostUnavailable(f"cannot reach the worker host: {e}") from e
    if peer(sock)[1] != os.getuid():
        sock.close()
        raise HostUnavailable("the worker host socket belongs to another user")
    return sock


def ask(
    sock_path: Path, message: dict[str, object], timeout: float = REPLY_TIMEOUT_S
) -> dict[str, object]:
    """Send one JSON line to the host and read its one-line answer."""
    sock = _connect(sock_path)
    try:
        sock.settimeout(timeout)
        sock.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n") and len(data) < MAX_LINE:
            chunk = sock.recv(MAX_LINE)
            if not chunk:
                break
            data += chunk
    except OSError as e:
        raise Unanswered(f"the worker host did not answer: {e}") from e
    finally:
        sock.close()
    try:
        reply = json.loads(data)
    except ValueError as e:
        raise Unanswered("the worker host hung up without an answer") from e
    if not isinstance(reply, dict):
        raise HostUnavailable("the worker host sent something that is not an answer")
    return reply


def _handoff(sock_path: Path, run_id: str) -> int:
    reply = ask(sock_path, {"run_id": run_id, "env": host_env()})
    pid = reply.get("pid")
    if reply.get("ok") is not True or not isinstance(pid, int):
        raise HostUnavailable(f"the worker host refused the run: {reply.get('error')}")
    return pid


def start_host(project_root: Path, state: Path, key: str, lock_fd: int, run_id: str) -> int:
    """Start a detached host (new session, logging to logs/host.log) that takes over the
    lock and adopts ``run_id`` first; returns its pid without waiting for it."""
    sock_path, _ = paths(state, key)
    with contextlib.suppress(FileNotFoundError):
        sock_path.unlink()  # left by a dead host: nobody answered on it, nobody holds the lock
    argv = [sys.executable, "-m", "orchestrator", "_host", "--key", key, "--lock-fd",
            str(lock_fd), "--run", run_id, "--launcher", str(os.getpid()),
            "-C", str(project_root)]  # fmt: skip
    with os.fdopen(open_log(state, "host.log"), "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=host_env(),
            start_new_session=True, close_fds=True, pass_fds=(lock_fd,),
        )  # fmt: skip
    return proc.pid


def _owner(project_root: Path, run_id: str) -> int | None:
    """The run's owner pid as stored (a host that took it wrote its own)."""
    from .store import open_store

    store = open_store(project_root, store_setting(project_root))
    try:
        record = store.get_run(run_id)
    finally:
        store.close()
    return None if record is None else record.pid


def _try(project_root: Path, sock_path: Path, run_id: str) -> int:
    try:
        return _handoff(sock_path, run_id)
    except Unanswered:
        owner = _owner(project_root, run_id)
        if owner is not None and owner != os.getpid():
            return owner  # the host took it and then went quiet: it is the owner now
        raise NoAnswer("the worker host closed as the run came") from None


def hand_to_host(project_root: Path, run_id: str) -> int:
    """Give a queued background run to the worker host of its state dir, or to a new one
    if none lives; returns the owner's pid or raises HostUnavailable."""
    if not enabled():
        raise HostUnavailable("worker hosts are off here (not Linux, or ORCH_WORKER_HOST=0)")
    state = state_dir(project_root)
    key = env_key(store_setting(project_root))
    sock_path, lock_path = paths(state, key)
    end = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return _try(project_root, sock_path, run_id)
        except NoAnswer:
            pass
        fd = try_lock(lock_path)
        if fd is not None:  # no host lives: start one, which keeps the lock
            try:
                return start_host(project_root, state, key, fd, run_id)
            finally:
                os.close(fd)
        if time.monotonic() > end:  # a host holds the lock but never answers
            raise HostUnavailable(f"the worker host did not answer within {START_TIMEOUT_S:g}s")
        time.sleep(0.01)  # one is starting (or leaving): it answers (or lets go) soon
