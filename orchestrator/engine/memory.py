"""Project memory: ``CLAUDE.md`` and ``AGENTS.md`` in every agent's system prompt.

Claude Code and Codex users keep a project's standing rules in these files; orch adds
them to the system prompt of every agent of a run, from:

1. ``CLAUDE.md`` at the repository root;
2. ``AGENTS.md`` at the repository root (left out when it is the same text);
3. the user's ``~/.claude/CLAUDE.md``.

**Which tree**: the main checkout of the user's repository (its working tree, uncommitted
edits included), found from the run's host directory, for every tier: a worktree child
reads the same files as its parent, not its branch's copy, and a container child the
user's checkout, not ``/workspace``. Outside git, the run's directory. (On a Ray node:
the node's copy of the repository.)

**Caps**: at most :data:`FILE_MAX` bytes of each file and :data:`TOTAL_MAX` in all, in
the order above; a file cut (or left out once the total is used up) says so in the
prompt with its full size.

**Trust**: the files are prompt text, nothing more: nothing in them is parsed, imported
(``@path`` lines stay text) or run, and no setting is read from them. The repository's
files are read without following a symlink out of the repository (a symlink inside it,
such as ``AGENTS.md -> CLAUDE.md``, is fine), regular files only, through
:mod:`orchestrator.fs.safefs`; never one the tools may not read (``.orch/``, a hidden
path: ``workspaces/hiding.py``), so a planted ``CLAUDE.md -> .orch/orch.db`` shows the
model nothing. ``project_memory = false`` turns all of it off.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import OrchError
from ..fs.realpath import resolved
from ..fs.safefs import Beneath, UnsafePath
from ..project.repo import discover_sync
from ..workspaces.hiding import hidden_reason, hidden_within

FILE_MAX = 16 * 1024  # bytes of one file
TOTAL_MAX = 32 * 1024  # bytes of all of them
REPO_FILES = ("CLAUDE.md", "AGENTS.md")
USER_FILE = Path(".claude") / "CLAUDE.md"

HEADER = (
    "\n# Project memory\n"
    "The user's standing instructions for this project, from the files below. Follow them "
    "as you would the user's, unless your task says otherwise. (They are text only: they "
    "do not change your tools, your sandbox or orch's settings.)"
)


@dataclass
class MemoryFile:
    label: str  # how the prompt names it
    data: bytes  # at most what fits
    size: int  # the whole file's size, in bytes


def project_root_of(start: Path) -> Path:
    """The main checkout of the repository holding ``start``, else ``start`` itself."""
    try:
        return discover_sync(start).main_root
    except OrchError:
        return start


def _repo_file(
    root: Path, name: str, hidden: Sequence[str], never: Sequence[str] = ()
) -> tuple[bytes, int, str] | None:
    """Up to FILE_MAX bytes of ``root/name``, its size and its real path; None if there is
    none or it may not be read (a symlink out of the repository or to a ``hidden`` path,
    a FIFO, a hard link). ``root``: its real path."""
    real_root = str(root)
    found = resolved(os.path.join(real_root, name))  # one open, not a walk in Python
    if found is None:
        return None
    target = str(found)
    if not target.startswith(real_root + os.sep):
        return None
    if hidden_reason(os.path.relpath(target, real_root), hidden) is not None:
        return None
    if any(target == n or target.startswith(n + os.sep) for n in never):  # a store
        return None
    try:
        with Beneath(real_root) as fs:
            data, size = fs.read(os.path.relpath(target, real_root), FILE_MAX)
    except (OSError, UnsafePath):
        return None
    return data, size, target


def _user_file(home: Path) -> tuple[bytes, int] | None:
    """The user's own file (a symlink there is the user's choice): a regular file only."""
    path = home / USER_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        return os.read(fd, FILE_MAX), st.st_size
    finally:
        os.close(fd)


@dataclass(frozen=True)
class MemorySource:
    """Where a run's memory files come from, found once for the directory runs are spawned
    from (:func:`memory_source`); the files themselves are read anew by each run."""

    root: Path  # the main checkout of the repository (else the directory), its real path
    hidden: tuple[str, ...]  # root-relative paths no memory file may be or lead to
    never: tuple[str, ...]  # absolute real paths no memory file may be or lead to (a store)


def memory_source(
    start: Path, hidden: Sequence[str] = (), never: Sequence[str] = ()
) -> MemorySource:
    """The memory source of runs whose host directory is ``start`` (blocking: one ``git``);
    ``hidden``: ``sandbox.hidden``; ``never``: the store's files."""
    root = Path(os.path.realpath(project_root_of(start)))
    return MemorySource(
        root=root,
        hidden=hidden_within([root], hidden, os.environ.get("ORCH_HOME")),
        never=tuple(os.path.realpath(os.path.expanduser(p)) for p in never),
    )


def read_memory(source: MemorySource, home: Path | None) -> list[MemoryFile]:
    """The memory files of the project and the user's (``home``), uncut; none that is (or
    links to) a hidden path, the state directory or a store file."""
    found: list[MemoryFile] = []
    seen: dict[str, bytes] = {}
    for name in REPO_FILES:
        got = _repo_file(source.root, name, source.hidden, source.never)
        if got is None:
            continue
        data, size, real = got
        if real in seen or data.strip() in seen.values():
            continue  # AGENTS.md -> CLAUDE.md, or a copy of it
        seen[real] = data.strip()
        found.append(MemoryFile(f"{name} (repository root)", data, size))
    if home is not None and (user := _user_file(home)) is not None:
        found.append(MemoryFile(f"~/{USER_FILE} (the user's, for every project)", *user))
    return found


def _text(data: bytes, limit: int) -> str:
    return data[:limit].decode("utf-8", "ignore")


def memory_section(files: list[MemoryFile]) -> str:
    """The system prompt's memory section ('' with no files): each file capped, then all
    of them; a file cut (or left out) says so."""
    parts: list[str] = []
    left = TOTAL_MAX
    for f in files:
        if not f.data.strip():
            continue
        take = min(len(f.data), left)
        body = _text(f.data, take).rstrip()
        note = ""
        if f.size > take:
            cap, why = (FILE_MAX, "of each file") if take == FILE_MAX else (TOTAL_MAX, "in all")
            note = (
                f"\n[{f.label.split(' ')[0]} cut: {len(body.encode()):,} of its {f.size:,} "
                f"bytes shown; orch shows at most {cap:,} bytes {why}]"
            )
        parts.append(f"\n## {f.label}\n{body}{note}")
        left -= take
    return HEADER + "\n" + "\n".join(parts) if parts else ""


def load_memory(source: MemorySource) -> str:
    """The memory section of a run whose files come from ``source`` (blocking)."""
    home = Path(h) if (h := os.environ.get("HOME")) else None
    return memory_section(read_memory(source, home))
