"""The control paths a branch changes (``policy/controlpaths.py`` says what they are), read
from git: what ``orch worktrees merge`` refuses without ``--allow-control-files`` and what
every diff lists first.

Beyond the names: a manifest whose install-time parts changed (read as blobs, never
checked out), and links. A change to a file that a control path *links to* (``.mcp.json``
-> ``config/mcp.json``, ``.vscode`` -> ``editor/``), in the base or the branch, is a change
to that control path; and a changed link that points at a control path, out of the
repository or at an absolute path is listed too (a link is a pointer, never content).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .controlpaths import control_content, is_control_path, manifest_kind

if TYPE_CHECKING:
    import git as gitpython  # (at run time: project/gitpy.py, which branches.py imports)

LINK_MODE = "120000"
LINK_BYTES = 4096  # of a link's target read
DIFF_SAFE = ("--no-textconv", "--no-ext-diff", "--ignore-submodules=dirty")

Tree = dict[str, tuple[str, str]]  # path -> (mode, blob id)


def _tree(repo: gitpython.Repo, rev: str) -> Tree:
    out = repo.git.ls_tree("-r", "-z", "--full-tree", rev, strip_newline_in_stdout=False)
    entries: Tree = {}
    for line in out.split("\0"):
        head, sep, path = line.partition("\t")
        fields = head.split()
        if sep and len(fields) == 3:
            entries[path] = (fields[0], fields[2])
    return entries


def _blob(repo: gitpython.Repo, sha: str, limit: int) -> bytes:
    stream = repo.odb.stream(bytes.fromhex(sha))
    return bytes(stream.read(limit + 1))


def _target(repo: gitpython.Repo, path: str, sha: str) -> str | None:
    """Where the link at ``path`` points, relative to the repository's root; None: out of
    it, absolute, or not text."""
    try:
        raw = _blob(repo, sha, LINK_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not raw or raw.startswith("/"):
        return None
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(path), raw))
    return None if joined == ".." or joined.startswith("../") else joined


def _linked(repo: gitpython.Repo, tree: Tree, hooks: list[str]) -> set[str]:
    """What the control-path links of ``tree`` point at, inside the repository."""
    found = set()
    for path, (mode, sha) in tree.items():
        if mode == LINK_MODE and is_control_path(path, hooks):
            target = _target(repo, path, sha)
            if target and target != ".":
                found.add(target)
    return found


def _under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _link_to_control(repo: gitpython.Repo, tree: Tree, path: str, hooks: list[str]) -> bool:
    entry = tree.get(path)
    if entry is None or entry[0] != LINK_MODE:
        return False
    target = _target(repo, path, entry[1])
    return target is None or target == "." or is_control_path(target, hooks)


def _manifest(repo: gitpython.Repo, base: Tree, tip: Tree, path: str) -> bool:
    if manifest_kind(path) is None:
        return False
    limit = 1_000_001
    old = _blob(repo, base[path][1], limit) if path in base else None
    new = _blob(repo, tip[path][1], limit) if path in tip else None
    return control_content(path, old, new)


def changed_paths(repo: gitpython.Repo, base: str, tip: str) -> list[str]:
    """Every path ``tip`` changes against ``base``: deletions, both sides of a rename, and
    mode changes (a file made executable, a file made a link) included."""
    out = repo.git.diff(
        "--name-only",
        "-z",
        "--no-renames",
        *DIFF_SAFE,
        base,
        tip,
        "--",
        strip_newline_in_stdout=False,
    )
    return [p for p in dict.fromkeys(out.split("\0")) if p]


def control_paths(repo: gitpython.Repo, hooks: list[str], base: str, tip: str) -> list[str]:
    """The control paths among what ``tip`` changes against ``base`` (see the module)."""
    changed = changed_paths(repo, base, tip)
    if not changed:
        return []
    before, after = _tree(repo, base), _tree(repo, tip)
    linked = _linked(repo, before, hooks) | _linked(repo, after, hooks)
    return [
        p
        for p in changed
        if is_control_path(p, hooks)
        or _under(p, linked)
        or _link_to_control(repo, after, p, hooks)
        or _manifest(repo, before, after, p)
    ]
