"""Host-side copies into a sandbox: the ``.worktreeinclude`` files, the one way in.

Every tier that copies files of the user's tree into a run's workspace goes through here:
the worktree tier writes them into the new worktree (:func:`write_includes`), the
container tier tars them (``container.transfer.write_archive``). Both read with
:func:`include_files`:

- beneath the source root through :mod:`orchestrator.fs.safefs`: no symlink is followed at
  any component (a listed symlink, a symlinked directory, a directory swapped for a
  symlink while the copy runs: none is read), regular files only, no hard link, each file
  and the whole capped;
- never from ``.git``, ``.orch``, the state directory wherever ``$ORCH_HOME`` puts it,
  any path of a run store (``store_paths``), or a ``sandbox.hidden`` path, when those lie
  inside the tree: what the OS sandbox hides is never handed in by a copy.

:func:`write_includes` writes beneath the destination root the same way (safefs: parents
made without following a link, the file renamed into place, an existing path left alone).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..fs.safefs import Beneath, TooManyEntries, UnsafePath
from ..project.git import RepoPaths, git
from .base import WorkspaceSpec

INCLUDE_FILE = ".worktreeinclude"
INCLUDE_FILE_MAX = 10 * 1024 * 1024  # one included file; larger ones are skipped
INCLUDE_TOTAL_MAX = 64 * 1024 * 1024
NEVER = (".git", ".orch")  # top-level directories never copied


def excluded_paths(spec: WorkspaceSpec, home: str | None = None) -> list[Path]:
    """The paths a copy never takes from: the state dir, every store path and the run's
    ``sandbox.hidden`` (``~/`` under ``home``)."""
    home = home or os.environ.get("HOME") or "/"
    found = [spec.state_dir] if spec.state_dir is not None else []
    found += spec.store_paths
    for text in spec.sandbox.hidden:
        found.append(Path(home) / text[2:] if text.startswith("~/") else Path(text))
    return found


async def untracked(repo: RepoPaths, rels: list[str]) -> list[str]:
    """The paths of ``rels`` that git does not track in ``repo`` (includes are copies of
    ignored or untracked files; tracked ones come with the checkout or the bundle)."""
    tracked: set[str] = set()
    for i in range(0, len(rels), 200):
        chunk = [f":(literal){r}" for r in rels[i : i + 200]]
        listed = await git("ls-files", "-z", "--", *chunk, repo=repo, check=False)
        tracked.update(p for p in listed.out.split("\0") if p)
    return [r for r in rels if r not in tracked]


def _inside(tree: Path, paths: Iterable[Path]) -> list[str]:
    """``paths`` that lie inside ``tree`` (as written or resolved), relative to it."""
    roots = {os.path.abspath(tree), os.path.realpath(tree)}
    rels: set[str] = set()
    for path in paths:
        for candidate in {os.path.abspath(path), os.path.realpath(path)}:
            for root in roots:
                if candidate == root:
                    rels.add("")  # the whole tree is excluded
                elif candidate.startswith(root + "/"):
                    rels.add(candidate[len(root) + 1 :])
    return sorted(rels)


def _blocked(rel: str, never: list[str]) -> bool:
    if rel.split("/")[0] in NEVER:
        return True
    return any(n == "" or rel == n or rel.startswith(n + "/") for n in never)


def include_files(
    tree: Path, patterns: Iterable[str], excluded: Iterable[Path] = ()
) -> dict[str, bytes]:
    """Files of ``tree`` named by its ``.worktreeinclude`` and ``patterns`` (globs; a
    directory means all below it), read with safefs beneath the tree: relative path ->
    content. Nothing under ``.git``, ``.orch`` or an ``excluded`` path. Blocking."""
    never = _inside(tree, excluded)
    found: dict[str, bytes] = {}
    total = 0
    with Beneath(tree) as fs:
        try:
            text, _ = fs.read(INCLUDE_FILE, 64 * 1024)
            listed = text.decode("utf-8", "replace").splitlines()
        except (OSError, UnsafePath):
            listed = []
        for raw in [*patterns, *listed]:
            pattern = raw.strip().lstrip("/").rstrip("/")
            if not pattern or pattern.startswith("#"):
                continue
            for pat in (pattern, f"{pattern}/**"):
                try:
                    rels, _ = fs.glob(pat, limit=10_000, skip_dirs=set(NEVER))
                except (ValueError, UnsafePath, TooManyEntries):
                    continue
                for rel in rels:
                    if rel in found or _blocked(rel, never):
                        continue
                    try:
                        data, size = fs.read(rel, INCLUDE_FILE_MAX)
                    except (OSError, UnsafePath):
                        continue
                    if size > INCLUDE_FILE_MAX or total + size > INCLUDE_TOTAL_MAX:
                        continue
                    found[rel] = data
                    total += size
    return found


def write_includes(dest: Path, files: Mapping[str, bytes]) -> dict[str, tuple[int, int]]:
    """Write ``files`` beneath ``dest`` with safefs (no link followed; a path that already
    exists, as anything, is left alone). Returns (size, mtime_ns) of each copy. Blocking."""
    copied: dict[str, tuple[int, int]] = {}
    with Beneath(dest) as fs:
        for rel, data in files.items():
            try:
                fs.stat(rel)
                continue  # there already (committed, or a link): not ours to replace
            except FileNotFoundError:
                pass
            except (OSError, UnsafePath):
                continue
            try:
                fs.write(rel, data)
                st = fs.stat(rel)
            except (OSError, UnsafePath):
                continue
            copied[rel] = (st.st_size, st.st_mtime_ns)
    return copied
