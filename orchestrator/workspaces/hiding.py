"""What no tool may touch inside a workspace: orch's state and the hidden paths.

``bash`` runs under bubblewrap, which covers the hidden paths with an empty mount; the
file tools (``read_file``, ``write_file``, ``edit_file``, ``glob``, ``grep``) open paths
themselves, so they carry the same list as **workspace-relative paths** and refuse any
path at or below one of them (a walk prunes them: their names are never listed).

The list, for one workspace (:func:`hidden_rels`):

- every path component named ``.orch``: orch's state directory (the store, logs,
  worktrees) of this project or of any project nested in it;
- the state directory itself (``$ORCH_HOME``) when it lies inside the workspace;
- orch's private root (``fs/private.py``: its sockets' key, the egress proxy's doors, the
  dashboard's opener pages), wherever ``HOME`` puts it (:func:`private_paths`: every host
  sandbox covers it too);
- the hidden secret paths (``~/.ssh``, … and ``sandbox.hidden``) that lie inside the
  workspace, or inside the tree it mirrors (a worktree is a checkout of the user's tree,
  a container a clone of it): ``/repo/secrets.env`` is hidden as ``secrets.env`` in every
  worktree and container of ``/repo`` too. A relative ``sandbox.hidden`` entry names a
  path relative to the workspace root.

The rule (:func:`hidden_reason`) is lexical on the path *that is opened*: on the host,
:mod:`orchestrator.fs.safefs` follows no symlink, applies ``..`` by its words and refuses
hard-linked files, so the normalized relative path is the file; in a container
:mod:`.inside.files` applies the same rule to the path after resolving it. Names are compared
case-folded (a case-insensitive filesystem cannot spell its way around the list).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..bwrap.profile import default_hidden
from ..fs import private
from ..fs.realpath import resolved_lax
from .base import WorkspaceSpec

STATE_NAME = ".orch"
REFUSED = "is hidden from agents (orch's state or a sandbox.hidden path); refused"


def _fold(parts: Iterable[str]) -> tuple[str, ...]:
    return tuple(p.casefold() for p in parts if p not in ("", "."))


def hidden_reason(rel: str, hidden: Sequence[str]) -> str | None:
    """Why the normalized workspace-relative ``rel`` may not be used, or None."""
    parts = _fold(rel.split("/"))
    if STATE_NAME in parts:
        return f"{rel!r} {REFUSED}"
    for h in hidden:
        hp = _fold(h.split("/"))
        if hp and parts[: len(hp)] == hp:
            return f"{rel!r} {REFUSED}"
    return None


def _candidates(path: Path) -> set[Path]:
    out = {Path(os.path.abspath(path))}
    try:
        out.add(resolved_lax(path))
    except (OSError, RuntimeError):
        pass
    return out


def _within(path: Path, roots: Iterable[set[Path]]) -> set[str]:
    """``path`` relative to each root it lies strictly below (lexically and resolved);
    ``roots``: each root's ``_candidates``."""
    found: set[str] = set()
    ways = _candidates(path)
    for candidates in roots:
        for r in candidates:
            for p in ways:
                if p != r and p.is_relative_to(r):
                    found.add(p.relative_to(r).as_posix())
    return found


def hidden_rels(spec: WorkspaceSpec, mirrors: Sequence[Path]) -> tuple[str, ...]:
    """The workspace-relative hidden paths of a workspace that mirrors the host
    directories ``mirrors`` (its own root on the host, and the tree it was made from)."""
    state_dir = str(spec.state_dir) if spec.state_dir is not None else None
    return hidden_within(mirrors, spec.sandbox.hidden, state_dir)


def inherited(spec: WorkspaceSpec, root: Path) -> tuple[str, ...] | None:
    """The hidden paths of the spawner's open workspace when it is this very host directory
    and was made with the same hidden settings: what ``hidden_rels`` would find here, or
    more (a worktree parent also mirrors the tree it came from), found before any agent of
    this run could plant anything. None when they cannot be taken over."""
    parent = spec.parent
    if parent is None or parent.root != root or parent.isolation == "container":
        return None
    if parent.spec.sandbox.hidden != spec.sandbox.hidden:
        return None
    if parent.spec.state_dir != spec.state_dir:
        return None
    hidden = getattr(parent, "hidden", None)
    if not isinstance(hidden, tuple) or not all(isinstance(h, str) for h in hidden):
        return None
    return hidden


def hidden_within(
    mirrors: Sequence[Path], entries: Sequence[str], state_dir: str | None
) -> tuple[str, ...]:
    """The hidden paths (``sandbox.hidden`` ``entries``, the state dir, the usual secrets)
    relative to a tree that mirrors ``mirrors``; ``.orch`` always."""
    home = Path(os.environ.get("HOME") or Path.home())
    rels: set[str] = {STATE_NAME}
    absolute: list[Path] = []
    for entry in entries:
        if entry.startswith("~/"):
            absolute.append(home / entry[2:])
        elif entry.startswith("/"):
            absolute.append(Path(entry))
        elif norm := os.path.normpath(entry).strip("/"):
            if norm != "." and not norm.startswith(".."):
                rels.add(norm)
    if state_dir:
        absolute.append(Path(state_dir))
    absolute += private_paths()
    roots = [_candidates(m) for m in mirrors]
    for path in default_hidden(home, *absolute):
        rels |= _within(path, roots)
    return tuple(sorted(rels))


def private_paths() -> tuple[Path, ...]:
    """orch's private root, made (a sandbox covers only what exists when it starts): what
    no sandbox of any tier may see (a container sees no host path at all)."""
    try:
        return (private.private_root(),)
    except OSError:
        return (private.expected_root(),)


def mirrored(root: Path) -> list[Path]:
    """``root``, and the main checkout when ``root`` is a worktree orch made
    (``<main>/.orch/worktrees/<run>``, told by its words: no git runs in a tree a
    sandbox wrote): a shared child in its parent's worktree hides what the worktree does."""
    parts = root.parts
    if len(parts) >= 4 and parts[-3] == STATE_NAME and parts[-2] == "worktrees":
        return [root, Path(*parts[:-3])]
    return [root]


def absolute_hidden(root: Path, rels: Sequence[str]) -> tuple[Path, ...]:
    """``rels`` as paths under the host workspace ``root`` (for bubblewrap to cover)."""
    return tuple(root / rel for rel in rels)
