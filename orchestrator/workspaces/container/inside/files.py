"""The file tools' runtime *inside* a sandbox container: one small stdlib-only program.

The host never opens a path in a live container's tree: ``read_file``, ``write_file``,
``glob``, ``grep`` (and pruning unchanged ``.worktreeinclude`` copies at close) run
this module's source in the container as ``python3 -c <source>``, as the sandbox user,
under the container's lockdown. This module imports nothing but the standard library
and nothing of orch, so the same text is importable on the host for unit tests.

Protocol (one request per process): stdin holds one JSON line, the request (``op``
and its arguments; ``size`` raw bytes follow it for ``write``); stdout holds one JSON
line, the reply (``ok``; on failure ``kind`` and ``message``; ``length`` raw bytes
follow it). Raw bytes cross unencoded, framed by those lengths. Every cap is enforced
here, before the data is produced: a read takes at most ``max_bytes`` (the host asks
for ``settings.max_read_bytes``), a walk stops after ``MAX_WALK`` entries, grep reads
at most ``GREP_FILE_BYTES`` of a file, and no reply is over ``MAX_REPLY`` bytes; the
host also caps what it accepts.

**Path rule.** A path is relative to ``/workspace``; an absolute path or one whose
``..`` leaves it is refused by its words. It is then resolved with symlinks followed
(``os.path.realpath``) and refused unless the result is still ``/workspace`` or
below. Only regular files are read (opened ``O_NONBLOCK``, checked with ``fstat``:
a FIFO never blocks, a device is never read); a write goes to a temp file in the same
directory, renamed over the target. Why following symlinks is safe here: the
container shares no host directory, so whatever a link (or a race that swaps a
directory for one between the check and the open) points at is a file of the
container's own filesystem: its read-only image, its tmpfs, its workspace volume,
all of which the sandbox user can read and write with ``bash`` anyway. The check
keeps the tools' meaning ("files of the workspace"); it is not what keeps the host
safe: the absence of any shared host path is.

**Hidden paths.** A request carries ``hidden``, the workspace-relative paths no tool may
use (``hiding.hidden_rels``; any component named ``.orch`` is always among them). A path
is refused when its words or its resolved path (relative to ``/workspace``) lie at or
below one of them (:func:`hidden_reason`, the host rule of ``hiding``, repeated here
because this program imports nothing of orch); a walk neither lists nor enters them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import stat
import sys
from typing import Any

ROOT = "/workspace"
MAX_WALK = 200_000  # directory entries one glob or grep may look at
MAX_REPLY = 8 * 1024 * 1024  # bytes of glob/grep reply
GREP_FILE_BYTES = 2 * 1024 * 1024  # a larger file is searched in its first 2 MiB only
GREP_LINE_CHARS = 300
MAX_REQUEST = 64 * 1024 * 1024  # bytes of a request line plus its data
SKIP_DIRS = frozenset({".git", ".orch", "node_modules", "__pycache__", ".venv"})
_MAX_DEPTH = 100
PRUNE_MAX = 16 * 1024 * 1024  # an include copy is at most 10 MiB (includes.INCLUDE_FILE_MAX)
STATE_NAME = ".orch"
REFUSED = "is hidden from agents (orch's state or a sandbox.hidden path); refused"
HIDDEN: list[str] = []  # this request's hidden paths (``handle`` sets them)


class Refused(Exception):
    """A path the tools may not use: ``kind`` says how the host reports it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _fold(parts: Any) -> tuple[str, ...]:
    return tuple(p.casefold() for p in parts if p not in ("", "."))


def hidden_reason(rel: str, hidden: Any) -> str | None:
    """Why the normalized workspace-relative ``rel`` may not be used, or None (the same
    rule as ``orchestrator.workspaces.hiding.hidden_reason``)."""
    parts = _fold(rel.split("/"))
    if STATE_NAME in parts:
        return f"{rel!r} {REFUSED}"
    for h in hidden:
        hp = _fold(str(h).split("/"))
        if hp and parts[: len(hp)] == hp:
            return f"{rel!r} {REFUSED}"
    return None


def _check_hidden(rel: str, shown: str) -> None:
    if (why := hidden_reason(rel, HIDDEN)) is not None:
        raise Refused("unsafe", why if rel == shown else f"{shown!r} {REFUSED}")


def _lexical(rel: str) -> str:
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise Refused("unsafe", "empty or invalid path")
    if rel.startswith("/"):
        raise Refused("unsafe", f"{rel!r} is absolute; paths are relative to the workspace")
    norm = os.path.normpath(rel)
    if norm == ".." or norm.startswith("../"):
        raise Refused("unsafe", f"{rel!r} leaves the workspace")
    _check_hidden(norm, norm)
    return norm


def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip("/") + "/")


def resolve(rel: str, root: str = ROOT) -> str:
    """The real path of ``rel`` beneath ``root`` (symlinks followed), or Refused."""
    norm = _lexical(rel)
    real = os.path.realpath(os.path.join(root, norm))
    real_root = os.path.realpath(root)
    if not _inside(real, real_root):
        raise Refused("unsafe", f"{rel!r} resolves outside the workspace (through a symlink)")
    _check_hidden(os.path.relpath(real, real_root), norm)  # a link to a hidden path, too
    return real


def read(rel: str, max_bytes: int, root: str = ROOT) -> tuple[bytes, int]:
    """At most ``max_bytes`` of the regular file ``rel``, and its whole size."""
    path = resolve(rel, root)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Refused("not_found", f"no such file: {rel}") from None
    except IsADirectoryError:
        raise Refused("is_dir", f"{rel} is a directory") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise Refused("is_dir", f"{rel} is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise Refused("unsafe", f"{rel} is not a regular file (a FIFO, socket or device)")
        chunks: list[bytes] = []
        left = max(0, int(max_bytes))
        while left > 0:
            data = os.read(fd, min(left, 1 << 20))
            if not data:
                break
            chunks.append(data)
            left -= len(data)
        return b"".join(chunks), st.st_size
    finally:
        os.close(fd)


def write(rel: str, data: bytes, root: str = ROOT) -> None:
    """Replace (or create) the file ``rel`` with ``data``: temp file, then rename."""
    norm = _lexical(rel)
    if norm == ".":
        raise Refused("is_dir", "cannot write to the workspace root itself")
    parent = resolve(os.path.dirname(norm) or ".", root)
    target = os.path.join(parent, os.path.basename(norm))
    _check_hidden(os.path.relpath(target, os.path.realpath(root)), norm)
    if os.path.isdir(target) and not os.path.islink(target):
        raise Refused("is_dir", f"{rel} is a directory")
    os.makedirs(parent, exist_ok=True)
    parent = resolve(os.path.dirname(norm) or ".", root)  # again, now that it exists
    tmp = os.path.join(parent, f".orch-tmp-{os.getpid()}-{os.path.basename(norm)}"[:255])
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(parent, os.path.basename(norm)))
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


# -- glob and grep ---------------------------------------------------------------------


def _pattern_parts(pattern: str) -> tuple[str, ...]:
    if not isinstance(pattern, str) or "\x00" in pattern:
        raise Refused("bad_request", "invalid glob pattern")
    if pattern.startswith("/") or ".." in pattern.split("/"):
        raise Refused("unsafe", "glob patterns must be relative to the workspace, without '..'")
    out: list[str] = []
    for part in pattern.split("/"):
        if part not in ("", ".") and not (part == "**" and out and out[-1] == "**"):
            out.append(part)
    if not out:
        raise Refused("bad_request", f"empty glob pattern {pattern!r}")
    return tuple(out)


def _match(pat: tuple[str, ...], names: tuple[str, ...]) -> bool:
    """Whether path components ``names`` match glob components ``pat`` (``**``: any number
    of components; a trailing one, at least one): the host's rule (``safeglob``), computed
    here bottom-up, one pattern component at a time from the last."""
    n = len(names)
    rest = [j == n for j in range(n + 1)]  # rest[j]: the pattern's tail matches names[j:]
    for i in range(len(pat) - 1, -1, -1):
        if pat[i] == "**" and i == len(pat) - 1:
            rest = [j < n for j in range(n + 1)]
        elif pat[i] == "**":
            below = [False] * (n + 1)
            for j in range(n - 1, -1, -1):
                below[j] = rest[j] or below[j + 1]
            rest = below
        else:
            one = [False] * (n + 1)
            for j in range(n):
                one[j] = rest[j + 1] and fnmatch.fnmatchcase(names[j], pat[i])
            rest = one
    return rest[0]


def _walk(top: str, prefix: str, budget: list[int], depth: int) -> Any:
    """Regular files below ``top`` (relative, sorted per directory); no symlink is listed
    or descended, ``SKIP_DIRS`` are not entered. Raises ``Refused("walk_limit")`` once
    ``budget`` entries were looked at."""
    try:
        with os.scandir(top) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        return
    dirs = []
    for entry in entries:
        budget[0] -= 1
        if budget[0] < 0:
            raise Refused("walk_limit", "walk limit reached")
        if hidden_reason(prefix + entry.name, HIDDEN) is not None:
            continue  # neither listed nor entered: its name is not shown either
        if entry.is_dir(follow_symlinks=False):
            if depth > 0 and entry.name not in SKIP_DIRS:
                dirs.append(entry)
        elif entry.is_file(follow_symlinks=False):
            yield prefix + entry.name
    for entry in dirs:
        yield from _walk(entry.path, f"{prefix}{entry.name}/", budget, depth - 1)


def glob(pattern: str, limit: int, root: str = ROOT) -> tuple[list[str], bool]:
    """Sorted regular files matching ``pattern`` (``**`` spans directories), at most
    ``limit``; True when there were more or the walk hit its limit."""
    pat = _pattern_parts(pattern)
    fixed = 0
    while fixed < len(pat) - 1 and not re.search(r"[*?\[]", pat[fixed]):
        fixed += 1
    rest = pat[fixed:]
    depth = _MAX_DEPTH if "**" in rest else len(rest) - 1
    prefix = "/".join(pat[:fixed])
    literal = 0
    while literal < len(pat) and not re.search(r"[*?\[]", pat[literal]):
        literal += 1
    _check_hidden("/".join(pat[:literal]), pattern)  # a named hidden path is refused
    try:
        top = resolve(prefix or ".", root)
    except Refused:
        return [], False
    if not os.path.isdir(top):
        return [], False
    found: list[str] = []
    more = False
    size = 0
    try:
        for rel in _walk(top, prefix + "/" if prefix else "", [MAX_WALK], depth):
            if _match(rest, tuple(rel.split("/")[fixed:])):
                if len(found) >= limit or size > MAX_REPLY:
                    more = True
                    break
                found.append(rel)
                size += len(rel) + 4
    except Refused:
        more = True
    return sorted(found), more


def grep(pattern: str, path: str | None, glob_: str | None, limit: int, root: str = ROOT) -> Any:
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise Refused("bad_request", f"invalid regular expression: {e}") from None
    hits: list[str] = []
    size = 0
    if path and os.path.isfile(resolve(path, root)):
        read(path, 0, root)  # what is wrong with a named file is said
        files = [_lexical(path)]
    else:
        prefix = (path or "").strip("/")
        sub = f"{prefix}/**/{glob_ or '*'}" if prefix else f"**/{glob_ or '*'}"
        files, _ = glob(sub, 100_000, root)
    for rel in files:
        try:
            data, _ = read(rel, GREP_FILE_BYTES, root)
        except (OSError, Refused):
            continue
        if b"\x00" in data[:8192]:
            continue
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if regex.search(line):
                hit = f"{rel}:{n}: {line[:GREP_LINE_CHARS]}"
                hits.append(hit)
                size += len(hit) + 4
                if len(hits) >= limit or size > MAX_REPLY:
                    return hits
    return hits


def prune(files: dict[str, str], root: str = ROOT) -> list[str]:
    """Delete the copies whose content still has the given sha256 (unchanged includes)."""
    removed = []
    for rel, digest in files.items():
        try:
            path = resolve(rel, root)
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size > PRUNE_MAX:
                continue  # a link, a directory, or too big to be an unchanged copy
            data, _ = read(rel, st.st_size + 1, root)
            if hashlib.sha256(data).hexdigest() == digest:
                os.unlink(path)
                removed.append(rel)
        except (OSError, Refused):
            continue
    return removed


# -- the program -----------------------------------------------------------------------


def handle(request: dict[str, Any], data: bytes, root: str = ROOT) -> tuple[dict[str, Any], bytes]:
    """One request: the reply header and the raw bytes that follow it."""
    op = request.get("op")
    HIDDEN[:] = [str(h) for h in request.get("hidden") or []]
    try:
        if op == "read":
            got, size = read(request["path"], int(request["max_bytes"]), root)
            return {"ok": True, "size": size, "length": len(got)}, got
        if op == "write":
            write(request["path"], data, root)
            return {"ok": True, "length": 0}, b""
        if op == "glob":
            found, more = glob(request["pattern"], int(request["limit"]), root)
            body = json.dumps({"files": found, "more": more}).encode()
        elif op == "grep":
            hits = grep(
                request["pattern"],
                request.get("path"),
                request.get("glob"),
                int(request["limit"]),
                root,
            )
            body = json.dumps({"hits": hits}).encode()
        elif op == "prune":
            body = json.dumps({"removed": prune(dict(request["files"]), root)}).encode()
        else:
            raise Refused("bad_request", f"unknown op {op!r}")
        return {"ok": True, "length": len(body)}, body
    except Refused as e:
        return {"ok": False, "kind": e.kind, "message": str(e)}, b""
    except (KeyError, TypeError, ValueError) as e:
        return {"ok": False, "kind": "bad_request", "message": f"bad request: {e}"}, b""
    except OSError as e:
        kind = "not_found" if isinstance(e, FileNotFoundError) else "os"
        kind = "is_dir" if isinstance(e, IsADirectoryError) else kind
        return {"ok": False, "kind": kind, "message": f"{e.strerror or e}"}, b""


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    line = stdin.readline(65536)
    try:
        request = json.loads(line)
        size = int(request.get("size", 0))
        if not 0 <= size <= MAX_REQUEST:
            raise ValueError("size out of range")
        data = stdin.read(size)
    except ValueError as e:
        reply, body = {"ok": False, "kind": "bad_request", "message": str(e)}, b""
    else:
        reply, body = handle(request, data)
    stdout.write(json.dumps(reply).encode() + b"\n")
    stdout.write(body)
    stdout.flush()


if __name__ == "__main__":
    main()
