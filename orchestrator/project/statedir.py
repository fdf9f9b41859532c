"""The state directory (``<project>/.orch`` or ``$ORCH_HOME``): only ours, and no link in it.

orch acts on what its state says: reconcile kills the process groups and removes the
containers a run's resources name. So a state directory orch did not make is refused
before anything in it is read: one that came with a checkout (a state path tracked by
git), was copied, or belongs to someone else.

**Ours** means: a directory (never a symlink) owned by this uid, not group/other
writable, whose ``owner`` file holds the HMAC, under the user's key ``~/.orch/state.key``
(random, 0600, made once), of this uid and the directory's device and inode. orch writes
that mark when it makes the directory. A checkout or a copy is a new inode and cannot
forge the mark without the key; a move on the same filesystem keeps it. A directory
without a valid mark is claimed (marked, made 0700) only while it holds no state (a
clone's ``.orch/agents`` is configuration); one with state is refused (:class:`Refused`)
with what to do. A store of an older orch (no mark) is the user's to vouch for:
``orch adopt-state`` (:func:`adopt`) marks it if it passes every other check.

**No link**: every state path orch opens is checked here first (:func:`entry`, one
``lstat`` from a directory descriptor opened ``O_NOFOLLOW``), and files are opened by
:func:`open_file` (``openat`` + ``O_NOFOLLOW``, a regular file of ours with one link).
The directory is ours and 0700, so nobody else can swap an entry after the check; what
a ``git checkout`` or ``pull`` may still put there (git writes ignored paths too) is
found by the check: a tracked state path refuses the directory, a symlink or a foreign
file refuses the path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from ..errors import UsageError

STATE_DIR_MODE = 0o700
FILE_MODE = 0o600
MARK = "owner"
MARK_PREFIX = "orch-state-v1 "
KEY_FILE = "state.key"
# what orch writes in a state directory (orchignore.py names the same): any of these,
# present without a valid mark, is state orch did not make
STATE_NAMES = (
    "orch.db",
    "orch.db-wal",
    "orch.db-shm",
    "orch.db-journal",
    "logs",
    "worktrees",
    "worktrees.lock",
    "tmp",
)
STATE_SUFFIXES = (".sock", ".lock")
_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(UsageError):
    """A state directory (or a path in it) orch will not use: the message says why and
    what to do."""


def _is_state(name: str) -> bool:
    return name in STATE_NAMES or name == MARK or name.endswith(STATE_SUFFIXES)


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[int]:
    fd = os.open(path, _NOFOLLOW_DIR)
    try:
        yield fd
    finally:
        os.close(fd)


def _key() -> bytes:
    """The user's state key (``~/.orch/state.key``), made on first use."""
    return _key_of(os.environ.get("HOME") or str(Path.home()))


def _make_key(dfd: int) -> bytes | None:
    """A new key in ``KEY_FILE`` of the directory ``dfd``, or None when one exists. The
    caller holds the directory's lock, so a racing process (or thread) never reads a key
    half written."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        fd = os.open(KEY_FILE, flags, FILE_MODE, dir_fd=dfd)
    except FileExistsError:
        return None
    try:
        key = secrets.token_hex(32).encode()
        os.fchmod(fd, FILE_MODE)
        os.write(fd, key + b"\n")
    finally:
        os.close(fd)
    return key


@functools.lru_cache(maxsize=8)
def _key_of(user_home: str) -> bytes:
    home = Path(user_home) / ".orch"
    home.mkdir(mode=STATE_DIR_MODE, exist_ok=True)
    with _opened(home) as dfd:
        st = os.fstat(dfd)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise Refused(f"{home} is not yours alone: chmod 700 it (it holds orch's keys)")
        fcntl.flock(dfd, fcntl.LOCK_EX)  # released with the descriptor
        if (made := _make_key(dfd)) is not None:
            return made
        fd = os.open(KEY_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        try:
            _check_file(os.fstat(fd), home / KEY_FILE)
            data = os.read(fd, 256).strip()
        finally:
            os.close(fd)
    if len(data) < 32:
        raise Refused(
            f"{home / KEY_FILE} is damaged: remove it (orch makes a new one, and its "
            "state directories then need `orch adopt-state`)"
        )
    return data


def _mark_for(st: os.stat_result) -> str:
    digest = hmac.new(_key(), f"{os.getuid()}:{st.st_dev}:{st.st_ino}".encode(), hashlib.sha256)
    return MARK_PREFIX + digest.hexdigest()


def _resource_mac(run_id: str, kind: str, ref: str) -> str:
    text = f"resource\0{os.getuid()}\0{run_id}\0{kind}\0{ref}"
    return hmac.new(_key(), text.encode(), hashlib.sha256).hexdigest()[:32]


def sign(run_id: str, kind: str, ref: str) -> str:
    """A resource's ref as registered: bound to its run and signed with the user's key, so
    a row another user (a shared Postgres store) or a planted store wrote proves nothing."""
    return f"{ref} #{_resource_mac(run_id, kind, ref)}"


def verified(run_id: str, kind: str, signed: str) -> str | None:
    """The ref :func:`sign` signed for this run and kind, or None."""
    ref, sep, mac = signed.rpartition(" #")
    if not sep or not hmac.compare_digest(mac, _resource_mac(run_id, kind, ref)):
        return None
    return ref


def _check_file(st: os.stat_result, path: Path) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise Refused(f"{path} is not a regular file: remove it and run again")
    if st.st_uid != os.getuid():
        raise Refused(f"{path} belongs to uid {st.st_uid}, not you: remove it and run again")
    if st.st_nlink != 1:
        raise Refused(f"{path} is hard-linked elsewhere: remove it and run again")


def _read_mark(dfd: int) -> str:
    try:
        fd = os.open(MARK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return ""
        return os.read(fd, 256).decode("ascii", "replace").strip()
    finally:
        os.close(fd)


def _write_mark(dfd: int, st: os.stat_result) -> None:
    """The mark, written to a temp file renamed over ``owner`` (a link there is replaced,
    never followed; processes marking at once write the same)."""
    tmp = f".{MARK}.{secrets.token_hex(6)}.orch-tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE, dir_fd=dfd)
    try:
        os.fchmod(fd, FILE_MODE)
        os.write(fd, (_mark_for(st) + "\n").encode())
    finally:
        os.close(fd)
    os.rename(tmp, MARK, src_dir_fd=dfd, dst_dir_fd=dfd)


def _make(path: Path) -> None:
    """A new state directory, marked before it appears: made under a temp name beside it,
    then renamed into place (another process that made it first wins)."""
    path.parent.mkdir(mode=STATE_DIR_MODE, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.orch-tmp")
    os.mkdir(tmp, STATE_DIR_MODE)
    try:
        with _opened(tmp) as dfd:
            os.fchmod(dfd, STATE_DIR_MODE)
            _write_mark(dfd, os.fstat(dfd))
        os.rename(tmp, path)  # a directory there (not empty: marked, or with state) stays
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp / MARK)
            os.rmdir(tmp)
        if not os.path.lexists(path):
            raise


def _tracked(path: Path) -> list[str]:
    """State paths under ``path`` that git tracks (in the index of the checkout holding
    it): a checkout brought them, or will overwrite them."""
    from ..errors import OrchError
    from .git import RepoPaths, git_sync

    with contextlib.suppress(OSError, OrchError):  # no git at all: nothing is tracked
        found = git_sync(
            "rev-parse",
            "--show-toplevel",
            "--absolute-git-dir",
            "--git-common-dir",
            repo=None,
            cwd=path.parent,
            check=False,
            timeout_s=30,
        )
        lines = found.out.splitlines()
        if found.code != 0 or len(lines) != 3:
            return []
        top, git_dir = Path(lines[0]), Path(lines[1])
        common = Path(lines[2]) if Path(lines[2]).is_absolute() else path.parent / lines[2]
        try:
            rel = path.resolve().relative_to(top.resolve())
        except ValueError:
            return []
        repo = RepoPaths(git_dir, top, common.resolve(), top)
        listed = git_sync(
            "ls-files", "-z", "--", str(rel), repo=repo, cwd=top, check=False, timeout_s=30
        )
        if listed.code != 0:
            return []
        names = [p for p in listed.out.split("\0") if p]
        return [p for p in names if _is_state(Path(p).relative_to(rel).parts[0])]
    return []


def _state_entries(dfd: int) -> list[str]:
    return sorted(n for n in os.listdir(dfd) if _is_state(n))


def _reason(path: Path, why: str, fix: str) -> Refused:
    return Refused(f"{path} {why} — orch did not create it and will not act on it; {fix}")


def _move_away(path: Path) -> str:
    return f"move it away (mv {path} {path}.untrusted) and run again"


def _verify(path: Path, *, adopting: bool = False) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        _make(path)
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise Refused(
            f"{path} is a symlink — orch never follows one for its state; "
            f"remove it (rm {path}) and run again"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{path} is not a directory: move it away and run again")
    if tracked := _tracked(path):
        raise _reason(
            path,
            f"came with the repository (git tracks {tracked[0]})",
            f"move it away (mv {path} {path}.untrusted) and stop tracking its state "
            f"(git rm -r --cached {' '.join(tracked[:3])}{' …' if len(tracked) > 3 else ''}), "
            "then run again",
        )
    with _opened(path) as dfd:
        st = os.fstat(dfd)
        if st.st_uid != os.getuid():
            raise _reason(path, f"belongs to uid {st.st_uid}", _move_away(path))
        present = _state_entries(dfd)
        marked = hmac.compare_digest(_read_mark(dfd), _mark_for(st))
        if marked and st.st_mode & 0o022:
            raise Refused(f"{path} is writable by others: chmod 700 {path} and run again")
        if not marked:
            state = [n for n in present if n != MARK]
            if state and not adopting:
                why = (
                    f"holds orch state ({state[0]}) under an owner mark that is not this "
                    "user's (copied, or made by another user)"
                    if MARK in present
                    else f"holds orch state ({state[0]}) without this user's owner mark "
                    "(copied, checked out, or made by an older orch)"
                )
                fix = (
                    _move_away(path)
                    + "; if an older orch of yours made it, run "
                    + f"`orch adopt-state -C {path.parent}`"
                )
                raise _reason(path, why, fix)
            os.fchmod(dfd, STATE_DIR_MODE)
            _write_mark(dfd, st)
        elif stat.S_IMODE(st.st_mode) != STATE_DIR_MODE:
            os.fchmod(dfd, STATE_DIR_MODE)
        for name in present:
            found = entry_stat(dfd, path, name)
            if name == "logs" and found is not None and stat.S_ISDIR(found.st_mode):
                with _opened(path / name) as logs:  # a log is appended to: no link there
                    for log in os.listdir(logs):
                        entry_stat(logs, path / name, log)


def entry_stat(dfd: int, state: Path, name: str) -> os.stat_result | None:
    """The lstat of ``name`` in the state directory (open as ``dfd``): None if missing;
    a symlink, a foreign or hard-linked file refuses it."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    path = state / name
    if stat.S_ISLNK(st.st_mode):
        raise Refused(
            f"{path} is a symlink — orch never follows one in its state directory; "
            f"remove it (rm {path}) and run again"
        )
    if stat.S_ISDIR(st.st_mode):
        if st.st_uid != os.getuid():
            raise Refused(f"{path} belongs to uid {st.st_uid}, not you: remove it and run again")
    elif stat.S_ISSOCK(st.st_mode):
        if st.st_uid != os.getuid():
            raise Refused(f"{path} belongs to uid {st.st_uid}, not you: remove it and run again")
    else:
        _check_file(st, path)
    return st


def state_path(project_root: Path) -> Path:
    """Where the state dir of a project is (``$ORCH_HOME`` or ``<project>/.orch``), made or
    not, checked or not (``orch doctor`` looks without making anything)."""
    env = os.environ.get("ORCH_HOME")
    return Path(env).expanduser() if env else project_root / ".orch"


def state_dir(project_root: Path) -> Path:
    """``$ORCH_HOME`` or ``<project>/.orch``, checked to be ours (module doc): made (0700,
    marked, with orch's ``.gitignore``) if missing; :class:`Refused` otherwise."""
    return checked_dir(state_path(project_root))


def checked_dir(path: Path) -> Path:
    """``path`` as a state directory: made if missing, verified (module doc)."""
    from .orchignore import ensure_state_ignore

    path = Path(os.path.abspath(path))
    _verify(path)
    ensure_state_ignore(path)
    return path


def adopt(path: Path) -> Path:
    """Mark an unmarked state directory as ours (``orch adopt-state``): the user vouches
    for it; every other check (a symlink, git, the owner, links inside) still applies."""
    path = Path(os.path.abspath(path))
    if not path.is_dir():
        raise UsageError(f"{path} is not a directory: there is no state to adopt")
    _verify(path, adopting=True)
    return path


def entry(state: Path, rel: str, *, directory: bool = False) -> Path:
    """The path ``state/rel`` after checking every component under ``state`` is no symlink
    (and an existing last one is ours: a regular file or socket, or with ``directory`` a
    directory, made 0700 if missing). For what opens by path: SQLite, sockets, git."""
    parts = Path(rel).parts
    with _opened(state) as top:
        fd = os.dup(top)
        try:
            here = state
            for i, name in enumerate(parts):
                last = i == len(parts) - 1
                st = entry_stat(fd, here, name)
                if not last or directory:
                    if st is None:
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(name, STATE_DIR_MODE, dir_fd=fd)
                        entry_stat(fd, here, name)
                    elif not stat.S_ISDIR(st.st_mode):
                        raise Refused(f"{here / name} is not a directory: remove it and run again")
                    if not last:
                        nxt = os.open(name, _NOFOLLOW_DIR, dir_fd=fd)
                        os.close(fd)
                        fd, here = nxt, here / name
        finally:
            os.close(fd)
    return state.joinpath(*parts)


def open_file(state: Path, rel: str, flags: int, mode: int = FILE_MODE) -> int:
    """An fd of ``state/rel`` opened without following a link anywhere under ``state``
    (``O_NOFOLLOW`` on the file, checked directories above it): a regular file of ours
    with one link, else :class:`Refused`."""
    path = entry(state, str(Path(rel).parent), directory=True) if Path(rel).parent.parts else state
    with _opened(path) as dfd:
        name = Path(rel).name
        try:
            fd = os.open(
                name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dfd
            )
        except OSError as e:
            if e.errno == 40:  # ELOOP: a symlink there
                raise Refused(
                    f"{path / name} is a symlink — orch never follows one in its "
                    f"state directory; remove it (rm {path / name}) and run again"
                ) from None
            raise
        try:
            _check_file(os.fstat(fd), path / name)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd


def open_log(state: Path, name: str) -> int:
    """``state/logs/name`` for appending (0600), opened without following links."""
    return open_file(state, f"logs/{name}", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
