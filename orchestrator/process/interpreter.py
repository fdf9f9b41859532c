"""orch's own interpreter: what it may load, and how orch starts its helpers with it.

Everything orch's interpreter loads is orch itself. A directory an agent can write that is
on orch's import path (a project installed editable in orch's venv puts its checkout
there through a ``.pth`` file; ``PYTHONPATH`` may name one) would let the agent plant a
``sitecustomize.py``, a ``usercustomize.py`` or a module that shadows one orch imports,
and the next ``orch`` command, the warm process or the worker host would run it with the
user's keys. So:

- the door (:func:`refusal`): a command that opens a project refuses, in one line, while
  any place orch's interpreter loads code from (``policy/imports.py``) is in or passes
  through a workspace of that project (the hook guard's ``passes_through`` rule), unless
  it is inside :data:`ORCH_ITSELF`, which every host-tier sandbox binds read-only (a venv
  inside the checkout); ``orch doctor`` reports the same;
- orch's helpers (the warm process, the worker host, a detached worker) start through
  :func:`helper_argv`: this interpreter with ``-I`` (no ``PYTHONPATH`` or other
  ``PYTHON*`` variable, no current or script directory, no user site directory) and orch's
  own code on its path, whatever directory they are started from.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..policy.hookguard import passes_through, workspaces
from ..policy.imports import Place, loaded_files, own_places

CODE = Path(__file__).resolve().parents[1]  # the orchestrator package
# orch's interpreter and package: read-only inside every host-tier sandbox (workspaces/host.py)
ORCH_ITSELF = (Path(sys.prefix), CODE.parent)
# ``-c`` rather than ``-m``: ``-I`` leaves out the current directory and PYTHONPATH, so
# orch's own directory goes on the path explicitly (last: it never shadows the stdlib)
_BOOT = (
    "import sys,runpy;d=sys.argv.pop(1);d in sys.path or sys.path.append(d);"
    "runpy.run_module(sys.argv.pop(1),run_name='__main__',alter_sys=True)"
)
FIX = (
    "install orch outside the project (`uv tool install orch` or `pipx install orch`) and "
    "run that orch"
)


def helper_argv(module: str, *args: str) -> list[str]:
    """How orch starts one of its own Python processes: ``python -m module args``, isolated
    from the environment's import hooks (``-I``), orch's own code on its path."""
    return [sys.executable, "-I", "-c", _BOOT, str(CODE.parent), module, *args]


def _typed_entry() -> bool:
    """``sys.path[0]`` is the directory a ``python -m``/``-c`` was typed in (it belongs to
    that one command, not to orch's installation; orch's helpers never have it)."""
    if sys.flags.safe_path or not sys.path:
        return False
    takes_value = ("-W", "-X", "--check-hash-based-pycs")
    argv = sys.orig_argv[1:]
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        if argv[i].startswith(("-m", "-c")):
            return True
        i += 2 if argv[i] in takes_value else 1
    return False


def helper_path() -> list[str]:
    """This process's module search path as a helper that serves it takes it (the warm
    process): without the directory a ``python -m`` was typed in, with orch's own code."""
    path = sys.path[1:] if _typed_entry() else list(sys.path)
    return path if str(CODE.parent) in path else [*path, str(CODE.parent)]


def _within(path: Path, dirs: list[Path]) -> bool:
    return any(path == d or path.is_relative_to(d) for d in dirs)


def _inside(path: str, dirs: list[Path], roots: list[Path]) -> bool:
    """``path`` is in one of ``dirs`` (bound read-only), and so is where its links lead,
    unless that is out of every workspace."""
    real = Path(os.path.realpath(path))
    if not _within(Path(os.path.abspath(path)), dirs):
        return False
    return _within(real, dirs) or passes_through(str(real), roots, Path("/")) is None


def _read_only(roots: list[Path]) -> list[Path]:
    """The directories of :data:`ORCH_ITSELF` a sandbox binds read-only inside a workspace
    (not one that is a workspace or holds one: that would leave the agent nothing)."""
    out = []
    for d in ORCH_ITSELF:
        real = Path(os.path.realpath(d))
        if not any(r == real or r.is_relative_to(real) for r in roots):
            out += [Path(os.path.abspath(d)), real]
    return out


def _lexically_in(path: str, prefixes: tuple[str, ...]) -> bool:
    return os.path.abspath(path).startswith(prefixes)


def offending(project_root: Path) -> tuple[Place, Path] | None:
    """The first place orch's interpreter loads code from that an agent of the project at
    ``project_root`` could write, and the workspace it is in; None when there is none."""
    roots = workspaces(project_root)
    kept = _read_only(roots)
    for place in own_places(skip_first=_typed_entry()):
        where = passes_through(place.path, roots, Path("/"))
        if where is not None and not _inside(place.path, kept, roots):
            return place, where
    prefixes = tuple(str(r).rstrip(os.sep) + os.sep for r in roots)
    for place in loaded_files():
        if _lexically_in(place.path, prefixes) and not _inside(place.path, kept, roots):
            where = passes_through(place.path, roots, Path("/"))
            return place, where or roots[0]
    return None


def refusal(project_root: Path) -> str | None:
    """The one line orch says instead of working on the project at ``project_root`` when
    its interpreter loads code from a place an agent there could write; None when not."""
    found = offending(project_root)
    if found is None:
        return None
    place, where = found
    fix = FIX
    if place.why == "PYTHONPATH":
        fix = f"take {place.path} out of PYTHONPATH (or {FIX})"
    return (
        f"orch's Python loads code from {place.path} ({place.why}), in {where}, which an "
        f"agent of this project can write: what it plants there would run in orch with your "
        f"keys; {fix}"
    )
