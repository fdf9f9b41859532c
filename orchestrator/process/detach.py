"""Detaching a background run: hand it to the worker host, or give it a worker of its own.

``orch task --background`` stores its run ``queued`` (``Runner.spawn`` starts nothing for
a background root) and then, at the CLI's edge, calls :func:`detach`. One worker host
(``workerhost.py``) per state dir and environment hosts the detached runs of every
launcher that shares both. Its Unix socket and its lock file sit in the state dir (mode
0700): ``host-KEY.sock`` and ``host-KEY.lock``, where KEY is :func:`host_key`, the digest
of what a run inherits from its launcher (``inherit.py``: the environment, the umask, the
interpreter, orch's code) and of its store: launchers that differ there get hosts of their
own, as each got a worker of its own before, so no run ever sees another launcher's
environment, and an edit of orch's code gets a new host.

The lock (``flock``) is held by the living host: a launcher that finds nobody answering
and takes the lock knows no host lives (a socket file left is stale), starts one and
hands it the lock and its run on the command line; it returns at once, as it did with a
worker of its own. Racing launchers find the lock taken and wait for the new host to
answer. A handoff to a running host is, once both ends proved themselves (``unixsock``:
the host first, so nothing reaches a listener planted at the path), one JSON line each
way: ``{"run_id": ..., "env": ...}``, then ``{"ok": true, "pid": ...}`` or ``{"ok": false,
"error": ...}``; both ends check the other's uid (``SO_PEERCRED``) and the host refuses a
peer inside a sandbox before it reads a byte. ``env`` is the digest of the launcher's
environment under the host's nonce (never a value: no key leaves the launcher): the host
runs every run in its own environment, so it takes only a run whose launcher's
environment is exactly its own (the socket's name, a digest anyone may read, grants
nothing): a launcher without the API key, or with other settings, gets a worker of its
own (:func:`own_worker`).

:func:`detach` may wait (up to :data:`START_TIMEOUT_S` for a starting host): call it
outside an event loop, or through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import time
from pathlib import Path

from ..errors import OrchError
from ..fs.private import NoPrivateRoot
from ..pgroups import process_start
from ..project.statedir import entry, open_log
from ..run import RunRecord
from ..store import RunStore, state_dir, store_url
from .inherit import comparable_env, inheritance, key
from .interpreter import helper_argv
from .unixsock import (
    Lines,
    NotOurs,
    Unproven,
    connect,
    enabled,
    env_digest,
    line,
    prove_server,
    try_lock,
)

START_TIMEOUT_S = 20.0  # racing launchers wait this long for a starting host to answer
REPLY_TIMEOUT_S = 30.0  # the host builds the run's engine before it answers
MAX_LINE = 512 * 1024  # an answer line, at most


class HostUnavailable(Exception):
    """No host took the run; the message says why (it goes to the run's log)."""


class NoAnswer(HostUnavailable):
    """Nobody listens on the socket (none, stale, refused): a host may be started."""


class Unanswered(HostUnavailable):
    """The run id was sent but no answer came back: the store says whether a host took it."""


def host_env() -> dict[str, str]:
    """The environment a host gets (the launcher's; ``ORCH_HOME`` made absolute)."""
    env = dict(os.environ)
    if home := env.get("ORCH_HOME"):
        env["ORCH_HOME"] = str(Path(home).expanduser().resolve())
    return env


def host_key(store: str | None = None) -> str:
    """The digest of what a detached run inherits from its launcher, and of its store."""
    url = store_url(store) or "sqlite"  # only its digest is ever written anywhere
    return key([*inheritance(host_env(), search_path=False), url], 16)


def paths(state: Path, host: str) -> tuple[Path, Path]:
    """(socket, lock file) of the host for key ``host`` in the state dir ``state``."""
    return entry(state, f"host-{host}.sock"), entry(state, f"host-{host}.lock")


def ask(
    sock_path: Path, message: dict[str, object], timeout: float = REPLY_TIMEOUT_S
) -> dict[str, object]:
    """Send one JSON line to the host and read its one-line answer."""
    try:
        sock = connect(sock_path, REPLY_TIMEOUT_S)
    except NotOurs:
        raise HostUnavailable("the worker host socket belongs to another user") from None
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
            raise NoAnswer(f"no worker host answers at {sock_path.name}") from e
        raise HostUnavailable(f"cannot reach the worker host: {e}") from e
    with sock:
        try:
            sock.settimeout(timeout)
            proof, nonce = prove_server(sock)
        except Unproven as e:
            raise HostUnavailable(f"{sock_path.name} is not orch's worker host ({e})") from e
        except NoPrivateRoot as e:
            raise HostUnavailable(str(e)) from e
        except ConnectionRefusedError as e:  # refused before any exchange: it says why
            with contextlib.suppress(ValueError):
                said = json.loads(str(e))
                if isinstance(said, dict):
                    return said
            raise HostUnavailable(f"the worker host refused: {e}") from e
        except OSError as e:  # it hung up (leaving) or said nothing
            raise NoAnswer(f"the worker host did not prove itself: {e}") from e
        env = message.get("env")
        if isinstance(env, dict):  # its digest under the host's nonce, never its values
            pairs = [[str(k), str(v)] for k, v in comparable_env(env).items()]
            message = {**message, "env": env_digest(nonce, pairs)}
        try:
            sock.sendall(proof + line(message))
        except OSError as e:
            raise Unanswered(f"the worker host did not answer: {e}") from e
        reply = Lines(sock, MAX_LINE).next()
    if reply is None:
        raise Unanswered("the worker host hung up without an answer")
    return reply


def start_host(project_root: Path, state: Path, host: str, lock_fd: int, run_id: str) -> int:
    """Start a detached host (new session, logging to logs/host.log) that takes over the
    lock and adopts ``run_id`` first; returns its pid without waiting for it."""
    sock_path, _ = paths(state, host)
    with contextlib.suppress(FileNotFoundError):
        sock_path.unlink()  # left by a dead host: nobody answered on it, nobody holds the lock
    argv = helper_argv("orchestrator", "_host", "--key", host, "--lock-fd", str(lock_fd))
    argv += ["--run", run_id, "--launcher", str(os.getpid()), "-C", str(project_root)]
    with os.fdopen(open_log(state, "host.log"), "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=host_env(),
            start_new_session=True,
            close_fds=True,
            pass_fds=(lock_fd,),
        )
    return proc.pid


def _try(store: RunStore, sock_path: Path, run_id: str) -> int:
    try:
        reply = ask(sock_path, {"run_id": run_id, "env": host_env()})
    except Unanswered:
        record = store.get_run(run_id)  # a host that took it wrote its own pid
        if record is not None and record.pid is not None and record.pid != os.getpid():
            return record.pid  # the host took it and then went quiet: it is the owner now
        raise NoAnswer("the worker host closed as the run came") from None
    pid = reply.get("pid")
    if reply.get("ok") is not True or not isinstance(pid, int):
        raise HostUnavailable(f"the worker host refused the run: {reply.get('error')}")
    return pid


def hand_to_host(
    project_root: Path, run_id: str, store: RunStore, store_setting: str | None
) -> int:
    """Give a queued background run to the worker host of its state dir, or to a new one
    if none lives; returns the owner's pid or raises HostUnavailable."""
    if not enabled():
        raise HostUnavailable("worker hosts are off here (not Linux, or ORCH_WORKER_HOST=0)")
    state = state_dir(project_root)
    host = host_key(store_setting)
    sock_path, lock_path = paths(state, host)
    end = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return _try(store, sock_path, run_id)
        except NoAnswer:
            pass
        fd = try_lock(lock_path)
        if fd is not None:  # no host lives: start one, which keeps the lock
            try:
                return start_host(project_root, state, host, fd, run_id)
            finally:
                os.close(fd)
        if time.monotonic() > end:  # a host holds the lock but never answers
            raise HostUnavailable(f"the worker host did not answer within {START_TIMEOUT_S:g}s")
        time.sleep(0.01)  # one is starting (or leaving): it answers (or lets go) soon


def own_worker(project_root: Path, run_id: str, why: str = "") -> int:
    """Start a detached worker (new session: survives the terminal) for one queued run."""
    log = os.fdopen(open_log(state_dir(project_root), f"{run_id}.log"), "ab")
    try:
        if why:
            log.write(f"orch: {why}; this run gets a worker of its own\n".encode())
            log.flush()
        proc = subprocess.Popen(
            helper_argv("orchestrator", "_worker", run_id, "-C", str(project_root)),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        log.close()
    return proc.pid


def detach(
    project_root: Path, record: RunRecord, store: RunStore, store_setting: str | None
) -> RunRecord:
    """Hand a stored, queued background root to the worker host of its state dir (started
    when none lives), failing that to a worker of its own; the record names its new owner.
    ``store`` and ``store_setting`` are the launcher's (nothing is read again from disk)."""
    try:
        pid = hand_to_host(project_root, record.run_id, store, store_setting)
    except (HostUnavailable, OrchError, OSError) as e:
        pid = own_worker(project_root, record.run_id, f"no worker host ({e})")
    return store.update_run(record.run_id, pid=pid, pid_start=process_start(pid))
