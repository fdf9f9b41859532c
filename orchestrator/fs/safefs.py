"""Race-free host file primitives beneath a workspace root.

A process sharing the workspace (say a sandboxed agent's leftover background
job) can swap a directory for a symlink between a path check and the open
after it. So no path is checked and then opened: each is resolved *from a fd
of the root, opened once*, by ``openat2(2)`` with ``RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`` where the kernel (>= 5.6) and
seccomp allow it (probed per ``Beneath``: ``uses_openat2``), else by a walk
from the root fd, one ``openat(dir, name, O_NOFOLLOW)`` per component.

**Symlink rule: no symlink is ever followed**, wherever it points, in any
component. Reading or writing through one raises ``UnsafePath`` naming it;
``walk``/``glob`` neither list nor descend symlinks; ``stat`` is an lstat;
``remove``/``remove_tree`` unlink a link, never its target. So ``normalize(rel)``
*is* the path that gets opened, and lexical policy checks on it are sound.

Absolute paths and ``..`` above the root are refused lexically. ``read`` opens
``O_PATH``, checks for a regular file with one link, then opens that very inode
through ``/proc/self/fd`` (a FIFO never blocks, a device is never opened) and
reads at most ``max_bytes``. ``write`` renames a temp file from the same
directory over the destination: atomic, and a link there is never written
through. Linux only (elsewhere: import-safe, walk fallback, no O_PATH).

**Refuse rule**: a ``Beneath`` made with ``refuse`` (the workspace's hidden paths, see
``workspaces/hiding.py``) asks it about every normalized path before opening it, and a
walk or glob neither lists nor enters what it refuses; a glob whose literal leading
components are refused raises. Since the normalized path is the file opened (the
symlink rule above, ``..`` by its words, hard links refused), the check holds. Walking
and glob matching live in :mod:`orchestrator.fs.safeglob`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import stat
import sys
from collections.abc import Callable, Collection, Generator, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from .safeglob import LIST_FLAGS as _LIST_FLAGS
from .safeglob import Refuse, Walk, match_parts, pattern_parts
from .safeglob import TooManyEntries as TooManyEntries
from .safeglob import UnsafePath as UnsafePath

DEFAULT_MAX_READ = 10 * 1024 * 1024
DEFAULT_SKIP_DIRS = frozenset({".git", ".orch", "node_modules", "__pycache__", ".venv"})
MAX_WALK_ENTRIES = 200_000
_MAX_DEPTH = 100  # walk recurses; directories deeper than this are not listed

_O_PATH: int = getattr(os, "O_PATH", 0)
_O_CLOEXEC: int = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = (_O_PATH or os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | _O_CLOEXEC
_SYS_OPENAT2 = 437  # the same number on every Linux architecture
_RESOLVE = 0x08 | 0x04 | 0x02  # RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
_Parts = tuple[str, ...]
_Gen = Generator[str, None, None]


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _load_syscall() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    c = ctypes
    fn.argtypes = [c.c_long, c.c_int, c.c_char_p, c.POINTER(_OpenHow), c.c_size_t]
    return fn


_syscall: Any = _load_syscall() if sys.platform == "linux" else None


def _openat2(dirfd: int, path: str, flags: int) -> int:
    how = _OpenHow(flags, 0, _RESOLVE)
    while True:
        fd = int(_syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how), 24))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err), path)


def normalize(rel: str) -> str:
    """``rel`` as the root-relative path actually opened ('' is the root): empty and ``.``
    components dropped, ``..`` applied lexically. UnsafePath if absolute or above the root."""
    return "/".join(_parts(rel))


def _parts(rel: str) -> _Parts:
    if not isinstance(rel, str):
        raise TypeError(f"path must be str, not {type(rel).__name__}")
    if "\x00" in rel:
        raise UnsafePath("the path contains a NUL byte; refused")
    if rel.startswith("/"):
        raise UnsafePath(f"{rel!r} is absolute; give a path relative to the workspace root")
    out: list[str] = []
    for part in rel.split("/"):
        if part == "..":
            if not out:
                raise UnsafePath(f"{rel!r} climbs out of the workspace with '..'; refused")
            out.pop()
        elif part not in ("", "."):
            out.append(part)
    return tuple(out)


def _read_upto(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    while limit > 0 and (chunk := os.read(fd, min(limit, 1 << 20))):
        chunks.append(chunk)
        limit -= len(chunk)
    return b"".join(chunks)


class Beneath:
    """File operations beneath ``root`` on root-relative paths, race-free against path
    swaps. Holds one fd of the root: a context manager (or ``close``). Thread-safe."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        use_openat2: bool = True,
        refuse: Refuse | None = None,
    ) -> None:
        self.root = Path(os.path.abspath(root))
        self._refuse = refuse
        self._real = os.path.realpath(self.root)
        self._fd = os.open(self.root, _DIR_FLAGS & ~os.O_NOFOLLOW)
        self.uses_openat2 = use_openat2 and _syscall is not None and self._probe()

    def _probe(self) -> bool:
        try:
            os.close(_openat2(self._fd, ".", _DIR_FLAGS))
            return True
        except OSError:  # ENOSYS: an old kernel; EPERM: a seccomp filter; the walk is safe too
            return False

    def __enter__(self) -> Beneath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def relative(self, path: str) -> str:
        """An absolute ``path`` lexically under the root, made relative; other paths as they
        are (so the other methods refuse an absolute one)."""
        if path.startswith("/"):
            norm = os.path.normpath(path)
            for root in (str(self.root), self._real):
                if norm == root or norm.startswith(root + "/"):
                    return norm[len(root) + 1 :]
        return path

    def _guard(self, parts: _Parts) -> None:
        """UnsafePath if the path opened is one the ``refuse`` rule forbids (every
        operation passes here with the very path it opens: no link is ever followed)."""
        if self._refuse is not None and parts and (why := self._refuse("/".join(parts))):
            raise UnsafePath(why)

    def _open(self, rel: str, parts: _Parts, flags: int) -> int:
        self._guard(parts)
        flags |= os.O_NOFOLLOW | _O_CLOEXEC
        try:
            if self.uses_openat2:
                return _openat2(self._fd, "/".join(parts) or ".", flags)
            dfd = self._walk_to(rel, parts[:-1])
            try:
                return os.open(parts[-1] if parts else ".", flags, dir_fd=dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            raise self._explain(e, rel, parts) from None

    def _walk_to(self, rel: str, parts: _Parts, *, create: bool = False) -> int:
        """An fd of directory ``parts``, one O_NOFOLLOW step at a time (mkdir missing ones)."""
        self._guard(parts)
        fd = os.open(".", _DIR_FLAGS, dir_fd=self._fd)
        try:
            for i, name in enumerate(parts):
                if create:  # EEXIST for anything already there, a symlink too
                    with suppress(FileExistsError):
                        os.mkdir(name, 0o777, dir_fd=fd)
                try:
                    nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    raise self._explain(e, rel, parts[: i + 1]) from None
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextmanager
    def _dir(self, rel: str, parts: _Parts, *, create: bool = False) -> Iterator[int]:
        if self.uses_openat2 and not create:
            fd = self._open(rel, parts, _DIR_FLAGS)
        else:
            fd = self._walk_to(rel, parts, create=create)
        try:
            yield fd
        finally:
            os.close(fd)

    def _explain(self, e: OSError, rel: str, parts: _Parts) -> Exception:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            link = self._find_symlink(parts)
            if link is not None:
                return self._symlink_error(rel, *link)
            if e.errno == errno.ELOOP:
                return UnsafePath(f"{rel!r} goes through a symlink; file tools never follow them")
        if e.errno == errno.EXDEV:
            return UnsafePath(f"{rel!r} resolves outside the workspace; refused")
        if e.errno == errno.ENXIO:
            return UnsafePath(f"{rel!r} is a socket or device, not a regular file; refused")
        e.filename = rel
        return e

    def _find_symlink(self, parts: _Parts) -> tuple[str, str] | None:
        """The first symlink among ``parts``' prefixes and its target (for messages only)."""
        for i in range(1, len(parts) + 1):
            prefix = "/".join(parts[:i])
            try:
                return prefix, os.readlink(prefix, dir_fd=self._fd)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: exists, not a symlink
                    return None
        return None

    @staticmethod
    def _symlink_error(rel: str, link: str, target: str) -> UnsafePath:
        target = target if len(target) <= 200 else target[:200] + "..."
        what = "is a symlink" if link == normalize(rel) else f"goes through symlink {link!r}"
        hint = "file tools never follow symlinks; use the real path if it is in the workspace"
        return UnsafePath(f"{rel!r} {what} (-> {target!r}); {hint}")

    def _check_file(self, rel: str, parts: _Parts, st: os.stat_result) -> None:
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", rel)
        if stat.S_ISLNK(st.st_mode):
            link = self._find_symlink(parts) or ("/".join(parts), "?")
            raise self._symlink_error(rel, *link)
        if not stat.S_ISREG(st.st_mode):
            m = st.st_mode
            kind = "FIFO" if stat.S_ISFIFO(m) else "socket" if stat.S_ISSOCK(m) else "device"
            raise UnsafePath(f"{rel!r} is a {kind}, not a regular file; refused")
        if st.st_nlink > 1:
            why = "it may be the same file as one outside the workspace"
            raise UnsafePath(f"{rel!r} has {st.st_nlink} hard links ({why}); refused")

    def read(self, rel: str, max_bytes: int = DEFAULT_MAX_READ) -> tuple[bytes, int]:
        """At most ``max_bytes`` of regular file ``rel``, and the file's full size."""
        parts = _parts(rel)
        pfd = self._open(rel, parts, _O_PATH or _READ_FLAGS)
        try:
            st = os.fstat(pfd)
            self._check_file(rel, parts, st)
            # the very inode behind the O_PATH fd, opened for reading
            fd = os.open(f"/proc/self/fd/{pfd}", _READ_FLAGS) if _O_PATH else os.dup(pfd)
        finally:
            os.close(pfd)
        try:
            return _read_upto(fd, max_bytes), st.st_size
        finally:
            os.close(fd)

    def stat(self, rel: str) -> os.stat_result:
        """lstat of ``rel`` (a final symlink is reported as one); UnsafePath if a directory
        on the way is a symlink."""
        return self._stat(rel, _parts(rel))

    def _stat(self, rel: str, parts: _Parts) -> os.stat_result:
        fd = self._open(rel, parts, _O_PATH or _READ_FLAGS)  # O_PATH|O_NOFOLLOW: an lstat
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def _is(self, rel: str, test: Callable[[int], bool]) -> bool:
        parts = _parts(rel)  # lexical refusals raise
        try:
            return test(self._stat(rel, parts).st_mode)
        except (OSError, UnsafePath):
            return False

    def is_file(self, rel: str) -> bool:
        """``rel`` is a regular file (a symlink to one is not); False on any error."""
        return self._is(rel, stat.S_ISREG)

    def is_dir(self, rel: str) -> bool:
        """``rel`` is a directory (a symlink to one is not); False on any error."""
        return self._is(rel, stat.S_ISDIR)

    def write(self, rel: str, data: bytes, *, make_parents: bool = True) -> None:
        """Atomically replace (or create) regular file ``rel`` with ``data``, creating missing
        parent directories unless not ``make_parents``. An existing file keeps its mode bits;
        an existing directory, symlink, special or hard-linked file is refused."""
        parts = _parts(rel)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "the workspace root is a directory", rel)
        name = parts[-1]
        self._guard(parts)
        with self._dir(rel, parts[:-1], create=make_parents) as d:
            try:
                old = os.stat(name, dir_fd=d, follow_symlinks=False)
                self._check_file(rel, parts, old)
                perm: int | None = stat.S_IMODE(old.st_mode) & 0o777
            except FileNotFoundError:
                perm = None
            tmp = f".{name[:40]}.{secrets.token_hex(6)}.orch-tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC
            fd = os.open(tmp, flags, 0o666, dir_fd=d)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    if perm is not None:
                        os.fchmod(fd, perm)
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
            except BaseException:
                with suppress(OSError):
                    os.unlink(tmp, dir_fd=d)
                raise

    def remove(self, rel: str) -> None:
        """Unlink file ``rel`` (a symlink itself, never its target); IsADirectoryError for
        a directory."""
        parts = _parts(rel)
        if not parts:
            raise IsADirectoryError(errno.EISDIR, "the workspace root is a directory", rel)
        self._guard(parts)
        with self._dir(rel, parts[:-1]) as d:
            os.unlink(parts[-1], dir_fd=d)

    def remove_tree(self, rel: str) -> None:
        """Delete ``rel`` and all below it through dir fds; symlinks are unlinked, never
        followed. FileNotFoundError if ``rel`` does not exist."""
        parts = _parts(rel)
        if not parts:
            raise UnsafePath("refusing to remove the workspace root itself")
        self._guard(parts)
        with self._dir(rel, parts[:-1]) as d:
            _rmtree_at(d, parts[-1])

    def walk(
        self,
        rel_dir: str = "",
        *,
        skip_dirs: Collection[str] = DEFAULT_SKIP_DIRS,
        max_entries: int = MAX_WALK_ENTRIES,
    ) -> _Gen:
        """Root-relative paths of the regular files below ``rel_dir``, depth first, each
        directory's files in name order. Symlinks are neither listed nor descended, nor are
        directories named in ``skip_dirs`` (below ``rel_dir``) nor paths the ``refuse``
        rule forbids (neither listed nor entered). Raises TooManyEntries once
        ``max_entries`` directory entries have been visited."""
        return self._walk(rel_dir, _parts(rel_dir), skip_dirs, max_entries, _MAX_DEPTH)

    def _walk(self, rel: str, parts: _Parts, skip: Collection[str], limit: int, depth: int) -> _Gen:
        fd = self._open(rel, parts, _LIST_FLAGS)
        walk = Walk(skip, [limit] * 2, self._refuse)
        yield from walk.files(fd, "".join(p + "/" for p in parts), depth)

    def glob(
        self,
        pattern: str,
        limit: int = 1000,
        *,
        skip_dirs: Collection[str] = DEFAULT_SKIP_DIRS,
        max_entries: int = MAX_WALK_ENTRIES,
    ) -> tuple[list[str], bool]:
        """Sorted regular files matching ``pattern`` (``*``, ``?``, ``[...]`` within a name,
        ``**`` for any number of directories; a trailing ``**`` matches every file below),
        at most ``limit``. The bool is true if there were more or the walk hit its limit.
        UnsafePath if the pattern's literal leading components name a refused path."""
        pat = pattern_parts(pattern)
        literal = 0
        while literal < len(pat) and not re.search(r"[*?\[]", pat[literal]):
            literal += 1
        self._guard(pat[:literal])
        fixed = 0  # leading components without wildcards: walk from there
        while fixed < len(pat) - 1 and not re.search(r"[*?\[]", pat[fixed]):
            fixed += 1
        rest = pat[fixed:]
        depth = _MAX_DEPTH if "**" in rest else len(rest) - 1
        found: list[str] = []
        truncated = False
        paths = self._walk(pattern, pat[:fixed], skip_dirs, max_entries, depth)
        try:
            for path in paths:
                if match_parts(rest, tuple(path.split("/")[fixed:])):
                    if len(found) == limit:
                        truncated = True
                        break
                    found.append(path)
        except (FileNotFoundError, NotADirectoryError, UnsafePath):
            pass  # the fixed prefix is missing, a file or a symlink: no matches
        except TooManyEntries:
            truncated = True
        finally:
            paths.close()
        return sorted(found), truncated


def _rmtree_at(parent: int, name: str, top: bool = True) -> None:
    try:
        try:
            os.unlink(name, dir_fd=parent)  # a file or a symlink: gone, target untouched
            return
        except IsADirectoryError:
            pass
        try:
            fd = os.open(name, _LIST_FLAGS, dir_fd=parent)
        except OSError as e:
            if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            os.unlink(name, dir_fd=parent)  # swapped for a file or symlink meanwhile
            return
        try:
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and st.st_mode & 0o700 != 0o700:
                os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)  # a read-only dir of ours
            with os.scandir(fd) as it:
                names = [entry.name for entry in it]
            for child in names:
                _rmtree_at(fd, child, False)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=parent)
    except FileNotFoundError:
        if top:  # below the top, someone else removed it first
            raise
