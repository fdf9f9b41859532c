"""The processes orch starts: each the leader of a session of its own, and how each ends.

- :func:`spawn` starts one (``asyncio.create_subprocess_exec``, a new session) under a
  subreaper of its own (``reaper.py``: what leaves the command's parent, a ``setsid`` and a
  double fork, stays below it and ends with it), so that a cancel can land at any moment:
  one that arrives while the process is being made lets the start finish, then stops the
  process and all it started, and re-raises. (Cancelled there, asyncio kills the leader
  alone and then waits for its pipes, which whatever the leader started may hold for as
  long as it runs.)
- :func:`kill_tree` kills a group and what its members started outside it. A bwrap
  sandbox is a session of its own, tied to bwrap by a parent-death signal it sets only
  once it runs: bwrap killed before that leaves the sandbox, and its command, running.
- :func:`reap` waits for a killed process, and for its pipes a bounded time.
- After a crash: :func:`group_ref` is how a group is registered; :func:`kill_group_ref`
  and :func:`kill_marked` kill what a registration proves is ours, never a stranger that
  reuses an id (the proof is a start time, :func:`process_start`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

RUN_MARK = "ORCH_PARENT_RUN_ID"  # every command of a run gets it (host tiers: by --setenv)
PIPE_POLL_S = 0.02  # how often a reap looks whether the pipes have closed
STOP_WAIT_S = 0.2  # how long a kill waits for a process it stopped to be stopped
OUTPUT_GRACE_S = 0.5  # after a command ends, how long what it left may still write to it


async def spawn(
    *argv: str, contain: bool = True, grace_s: float = OUTPUT_GRACE_S, **options: Any
) -> asyncio.subprocess.Process:
    """``argv`` started in a session of its own (``options`` as for
    ``asyncio.create_subprocess_exec``) under a subreaper of its own (``contain``; not a
    bwrap sandbox, whose PID namespace holds it: :func:`contained`). Cancelled while it
    starts, it stops what it started before it re-raises: nothing outlives the cancel,
    nothing waits for it. A program that cannot be found or run raises as
    ``create_subprocess_exec`` does."""
    starting = asyncio.ensure_future(_start(argv, contain, grace_s, options))
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        await asyncio.shield(_discard(starting))
        raise


async def _start(
    argv: tuple[str, ...], contain: bool, grace_s: float, options: dict[str, Any]
) -> asyncio.subprocess.Process:
    if not contain or in_namespace(argv):
        return await asyncio.create_subprocess_exec(*argv, start_new_session=True, **options)
    wrapped, fd = contained(argv, options.get("env"), options.get("cwd"), grace_s)
    fds = (*options.pop("pass_fds", ()), fd)
    try:
        return await asyncio.create_subprocess_exec(
            *wrapped, start_new_session=True, pass_fds=fds, **options
        )
    finally:
        os.close(fd)


def in_namespace(argv: Sequence[str]) -> bool:
    """True for a bwrap sandbox with a PID namespace of its own: when bwrap's child (its
    PID 1) ends, the kernel kills everything in it; nothing there can leave it."""
    words = list(argv)
    if words and Path(words[0]).name == "env":  # ``env -i bwrap ...`` (``bwrap.profile``)
        words = words[1:]
        while words and (words[0].startswith("-") or "=" in words[0]):
            words = words[1:]
    return bool(words) and Path(words[0]).name.startswith("bwrap") and "--unshare-pid" in words


def contained(
    argv: Sequence[str], env: Mapping[str, str] | None, cwd: object, grace_s: float
) -> tuple[list[str], int]:
    """``argv`` under orch's subreaper (``reaper.py``): the argv to start and the
    descriptor to pass it (the caller closes it once started). The program is found here,
    as ``create_subprocess_exec`` finds it (``env``'s ``PATH``, ``cwd``), and one that
    cannot be raises the same error. The command's words go in a memory file, not on
    the subreaper's command line."""
    if any("\0" in word for word in argv):
        raise ValueError("embedded null byte")  # (as subprocess refuses it)
    program = _program(argv[0], env, cwd)
    fd = os.memfd_create("orch-command")  # (made inheritable in the subreaper alone)
    try:
        words = [f"{grace_s:g}", program, *argv]
        os.write(fd, b"\0".join(os.fsencode(w) for w in words))
    except BaseException:
        os.close(fd)
        raise
    return [sys.executable, "-I", "-S", "-c", _reaper_source(), str(fd)], fd


def _program(name: str, env: Mapping[str, str] | None, cwd: object) -> str:
    """The file ``name`` runs, found as ``subprocess`` finds it; raises its errors."""
    if os.sep in name:
        candidates = [name]
    else:
        candidates = [os.path.join(d, name) for d in os.get_exec_path(env)]
    here = os.fspath(cwd) if isinstance(cwd, (str, os.PathLike)) else os.getcwd()
    denied = None
    for candidate in candidates:
        path = os.path.join(here, candidate)  # (an absolute candidate stays as it is)
        if os.path.isfile(path):
            if os.access(path, os.X_OK):
                return os.path.abspath(path)
            denied = denied or path
    if denied is not None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)


@functools.cache
def _reaper_source() -> str:
    return (Path(__file__).parent / "reaper.py").read_text()


async def _discard(starting: asyncio.Future[asyncio.subprocess.Process]) -> None:
    """Let a start the caller gave up on finish (it takes moments), then end its process."""
    try:
        proc = await starting
    except Exception:  # noqa: BLE001 - it never started: nothing to end
        return
    kill_tree(proc.pid)
    await reap(proc)


async def reap(proc: asyncio.subprocess.Process, grace_s: float = 5.0) -> None:
    """Wait for a killed ``proc`` to end and for its output pipes to close, ``grace_s`` at
    most: a process outside its group may hold them, and then they are closed here."""
    transport = getattr(proc, "_transport", None)  # asyncio has no public way to close
    try:  # a subprocess's pipes
        async with asyncio.timeout(grace_s):
            await asyncio.shield(proc.wait())  # (3.11: at once when the exit was seen)
            while transport is not None and not _pipes_closed(transport):  # noqa: ASYNC110 - no event says so
                await asyncio.sleep(PIPE_POLL_S)
    except TimeoutError:
        if transport is not None:
            transport.close()


def _pipes_closed(transport: asyncio.SubprocessTransport) -> bool:
    pipes = (transport.get_pipe_transport(fd) for fd in (1, 2))
    return all(pipe is None or pipe.is_closing() for pipe in pipes)


def kill_tree(pgid: int) -> None:
    """SIGKILL process group ``pgid`` and every process its members started outside it
    (a ``setsid``; a bwrap sandbox), with what those started. The group is stopped first,
    and each process found outside it before its own children are looked for: none
    starts another meanwhile. Without a living leader (a command that exited and left
    background jobs) its members are found by their group."""
    try:
        os.killpg(pgid, signal.SIGSTOP)
    except (ProcessLookupError, PermissionError):
        return  # no member left (and nothing it started is reachable)
    outside: list[int] = []
    seen: set[int] = set()
    leader = _stat(pgid)
    if leader is not None and leader[0] not in "ZX" and int(leader[2]) == pgid:
        todo = [pgid]  # the leader's tree: the usual case, and no search of every process
    else:  # its members outlived it: found by their group
        todo = [int(p) for p in _pids() if _group(p) == pgid]
    while todo:
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            _until_stopped(pid)  # (a fork under way when the stop was sent still completes)
            for kid in _children(pid):
                if kid not in seen and _group(kid) not in (pgid, None):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(kid, signal.SIGSTOP)
                    outside.append(kid)
                todo.append(kid)
        # a process that exited meanwhile left its children to a subreaper walked before
        # (``reaper.py``): look again until nothing new is found
        todo = [kid for pid in seen for kid in _children(pid) if kid not in seen]
        for kid in todo:
            if _group(kid) not in (pgid, None):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(kid, signal.SIGSTOP)
                outside.append(kid)
    for pid in outside:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _until_stopped(pid: int) -> None:
    """Until ``pid`` has stopped (or ended): a stop is delivered when it next leaves the
    kernel, and a fork it is making meanwhile still completes. Bounded: a process in an
    uninterruptible wait stops only when it leaves it."""
    deadline = time.monotonic() + STOP_WAIT_S
    while (fields := _stat(pid)) is not None and fields[0] not in "TtZX":
        if time.monotonic() > deadline:
            return
        time.sleep(0.0001)


def _children(pid: int) -> list[int]:
    """``pid``'s children (from ``/proc/PID/task/*/children``, else by their parent ids)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for tid in tasks:
        try:
            found += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN
            return [int(p) for p in _pids() if (f := _stat(p)) is not None and int(f[1]) == pid]
        except OSError:
            continue
    return found


def _group(pid: int | str) -> int | None:
    fields = _stat(pid)
    return None if fields is None else int(fields[2])


def _pids() -> list[str]:
    return [e for e in os.listdir("/proc") if e.isdigit()]


def _stat(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat`` from its state on (the name, which may hold anything, cut off)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def group_ref(pgid: int) -> str:
    """How a process group is registered: its id and its leader's start time."""
    return f"{pgid}:{process_start(pgid) or 0}"


def process_start(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (None if gone or a zombie)."""
    fields = _stat(pid)
    if fields is None or fields[0] == "Z":
        return None
    return int(fields[19])


def kill_group_ref(ref: str) -> int:
    """Kill a registered group after a crash, never a stranger that reuses its id.

    The proof is the leader's start time (``/proc/PID/stat``): while the leader lives, it
    must equal the recorded one exactly; once it is gone, only members of that group of
    this uid started no earlier than the recorded leader are killed. A ref without a start
    time (or 0: an unreadable one) proves nothing and kills nothing. Returns how many
    processes were signalled.
    """
    pgid_text, _, start_text = ref.partition(":")
    try:
        pgid, start = int(pgid_text), int(start_text or 0)
    except ValueError:
        return 0
    if start <= 0 or pgid <= 1:
        return 0  # no proof (a start time of 0 or none never means "kill anyway")
    leader = process_start(pgid)
    if leader is not None and leader != start:
        return 0  # the id now leads another group
    below: set[int] = set()
    try:
        ours = leader is not None and os.stat(f"/proc/{pgid}").st_uid == os.getuid()
    except OSError:
        ours = False  # gone meanwhile
    if ours:  # the subreaper lives: what it adopted, in sessions of their own, is below it
        below = _tree(pgid)
        kill_tree(pgid)
    return len(below) + _kill_ours_since(
        start, lambda pid, fields: int(fields[2]) == pgid and int(pid) not in below
    )


def _tree(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        if (p := todo.pop()) not in found:
            found.add(p)
            todo += _children(p)
    return found


def kill_marked(run_id: str, ref: str) -> int:
    """Kill what a run started that left its process group (bwrap makes the sandboxed
    command a session of its own; when bwrap's parent is killed before the sandbox has
    its parent-death signal, the sandbox outlives the group's kill): processes of this
    uid, started no earlier than the registered group's leader (``ref``, as for
    :func:`kill_group_ref`), that carry the run's mark. Returns how many were signalled."""
    try:
        since = int(ref.partition(":")[2] or 0)
    except ValueError:
        return 0
    if since <= 0:
        return 0  # no proof, no kill
    return _kill_ours_since(since, lambda pid, fields: _marked(pid, run_id))


def _kill_ours_since(since: int, chosen: Callable[[str, list[str]], bool]) -> int:
    """SIGKILL this uid's processes (never this one) started no earlier than ``since``
    (clock ticks) that ``chosen(pid, stat fields)`` picks; returns how many were signalled."""
    killed = 0
    for name in _pids():
        if int(name) == os.getpid():
            continue
        fields = _stat(name)
        if fields is None or int(fields[19]) < since:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != os.getuid():
                continue  # never another user's process
        except OSError:
            continue  # gone meanwhile
        if chosen(name, fields):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(name), signal.SIGKILL)
                killed += 1
    return killed


def _marked(pid: str, run_id: str) -> bool:
    """True if the process carries ``run_id``'s mark: in its environment (a command), or
    as bwrap's ``--setenv`` for the command it sandboxes (bwrap's own processes)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    mark = f"{RUN_MARK}={run_id}".encode()
    setenv = f"--setenv\0{RUN_MARK}\0{run_id}\0".encode()
    return mark in environ.split(b"\0") or setenv in argv
