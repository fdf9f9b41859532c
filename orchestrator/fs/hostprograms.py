"""The programs orch itself runs on the host come from where no agent can write.

orch starts programs on the host, unsandboxed, with the user's rights: git
(``project/gitprocess.py``), the ``env`` and ``bwrap`` that start every host-tier sandbox
(``bwrap/profile.py``, ``bwrap/find.py``), ``bash`` for ``orch sandbox build``. A program
found through the user's ``PATH`` as it is would be the agent's whenever that ``PATH`` names
a directory an agent can write: an activated ``.venv`` of the project (``.venv/bin`` is in
the checkout), a ``./node_modules/.bin``, a relative entry. So:

- :func:`host_path` is ``PATH`` (orch's own by default) with every relative entry left out,
  every entry in or passing through a workspace of the project (:func:`workspaces`: the
  checkout, the main checkout of a worktree; every symlink on the way followed,
  :func:`passes_through`) and every entry in or passing through *any* git checkout (a
  directory on the way holds a ``.git``): a sandbox of another project writes that one;
- :func:`host_program` finds a program on it (absolute path; cached per name and ``PATH``);
- programs with a fixed home are named by it: :data:`ENV` is ``/usr/bin/env``.

A workspace is what a sandbox may write: the checkout (or worktree) it runs in; the container
tier shares no host directory.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from pathlib import Path

_MAX_LINKS = 40
# ``env`` (it starts every host-tier sandbox with an empty environment): never looked up
ENV = next((p for p in ("/usr/bin/env", "/bin/env") if os.access(p, os.X_OK)), "/usr/bin/env")
FALLBACK_PATH = "/usr/local/bin:/usr/bin:/bin"


def workspaces(workspace: Path) -> list[Path]:
    """The directories an agent of this run (or of its chain) may write: the workspace, the
    checkout around it (the nearest directory up with a ``.git``: a run started in a
    subdirectory has a sibling that writes all of it) and, for a worktree
    (``<main>/.orch/worktrees/<id>``), the main checkout it came from."""
    roots = [Path(os.path.abspath(workspace))]
    for parent in roots[0].parents:
        if parent.name == "worktrees" and parent.parent.name == ".orch":
            roots.append(parent.parent.parent)
            break
    top = next((p for p in [roots[0], *roots[0].parents] if os.path.lexists(p / ".git")), None)
    if top is not None and top != Path("/"):
        roots.append(top)
    with contextlib.suppress(OSError):
        roots += [r.resolve() for r in roots]
    return list(dict.fromkeys(roots))


def _in(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def passes_through(
    path: str, roots: list[Path], base: Path, *, checkouts: bool = False
) -> Path | None:
    """The first place in ``roots`` that ``path`` (relative: to ``base``) names or passes
    through, following every symlink on the way; None when it never does. ``checkouts``:
    a directory on the way that holds a ``.git`` (any git checkout) counts as such a place."""
    todo = list(Path(os.path.join(base, os.path.expanduser(path))).parts)
    current = Path("/")
    links = 0
    while todo:
        part = todo.pop(0)
        if part == "/":
            current = Path("/")
            continue
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        step = current / part
        if _in(step, roots) or (checkouts and os.path.lexists(step / ".git")):
            return step
        try:
            target = os.readlink(step)
        except OSError:  # not a link, or not there (yet): the name itself was checked
            current = step
            continue
        links += 1
        if links > _MAX_LINKS:
            return step  # cannot be followed to its end: not provably outside
        todo = [*Path(target).parts, *todo]
    return None


@functools.lru_cache(maxsize=64)
def _safe(value: str, roots: tuple[Path, ...]) -> str:
    keep = [
        p
        for p in value.split(os.pathsep)
        if os.path.isabs(p) and passes_through(p, list(roots), Path("/"), checkouts=True) is None
    ]
    return os.pathsep.join(dict.fromkeys(keep))


def host_path(workspace: Path | None = None, value: str | None = None) -> str:
    """``value`` (default: orch's ``PATH``) with only absolute entries outside every git
    checkout and every workspace of ``workspace``'s project; the system directories when
    none is left."""
    if value is None:
        value = os.environ.get("PATH", os.defpath)
    roots = tuple(workspaces(workspace)) if workspace is not None else ()
    return _safe(value, roots) or FALLBACK_PATH


@functools.lru_cache(maxsize=64)
def _which(name: str, path: str) -> str | None:
    found = shutil.which(name, path=path)
    return os.path.abspath(found) if found is not None else None


def host_program(name: str, workspace: Path | None = None) -> str | None:
    """The absolute path of program ``name`` on :func:`host_path`, or None."""
    return _which(name, host_path(workspace))


def forget() -> None:
    """Drop what was looked up (a test changes ``PATH`` or plants a program)."""
    _safe.cache_clear()
    _which.cache_clear()
