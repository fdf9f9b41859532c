"""The user's MCP servers start only from the user's programs.

A server of the user's (``~/.orch/mcp.json``, a user's agent's own ``mcpServers``) gets the
user's ``env`` (tokens, database URLs), so what it starts must be out of every agent's reach,
as a hook's must (``hookguard.py``). Before it is started in the run's sandbox, on the host:

- its command is resolved to an absolute path: a bare name through the ``PATH`` it would
  get, with every relative entry and every entry in (or passing through) a workspace left
  out; a relative path (``./x``, ``bin/x``) is refused;
- that path, and every argument that names an absolute path, must pass through no
  workspace (every symlink on the way followed: a ``PATH`` entry outside that links into the
  checkout is refused too), else the server is not started (one line). A path inside an
  argument counts too: the value of ``--opt=value``, each item of a ``:``/``,``/``;`` list,
  and one glued to an option (``-I/checkout/lib``, ``-X/abs``, ``--include/abs``);
- a Python it starts (the command, or a script's ``#!`` interpreter) must load no code from a
  workspace by itself: it is asked where it imports from, with the environment the server
  gets, as the hook guard asks (``hookguard.python_refusal``: a venv outside the checkout
  with the project installed editable has the checkout on its path through a ``.pth``, and
  would import an agent's ``sitecustomize.py`` with the server's secrets);
- it starts with that absolute path and that ``PATH``.

A repository's server (``.mcp.json``, a repository agent's ``mcpServers``) is the repository's
own program with the repository's values: it starts as declared, in the sandbox.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..bwrap.profile import ENV_WHITELIST
from ..errors import OrchError
from ..fs.hostprograms import passes_through, workspaces
from .hookguard import WHERE_PYTHON, python_refusal

if TYPE_CHECKING:
    from ..mcpclient.declared import ServerDecl

_WHERE = "install it outside every workspace and name it by absolute path in ~/.orch/mcp.json"
_LIST = re.compile(r"[=:,;]")
# an option with a path glued to it: -I/abs, -X~/x, --include/abs
_GLUED = re.compile(r"^(?:-[A-Za-z]|--[A-Za-z0-9][A-Za-z0-9_.-]*)(?=[/~])")


def workspace_roots(*workspace: Path) -> list[Path]:
    """Every directory an agent of a run in ``workspace`` (or of its chain) may write."""
    roots: list[Path] = []
    for w in workspace:
        roots += [r for r in workspaces(w) if r not in roots]
    return roots


def safe_path(value: str, roots: list[Path]) -> str:
    """``value`` (a ``PATH``) without relative entries and entries in a workspace."""
    keep = [
        p
        for p in value.split(os.pathsep)
        if os.path.isabs(p) and passes_through(p, roots, Path("/")) is None
    ]
    return os.pathsep.join(dict.fromkeys(keep))


def users_server(decl: ServerDecl, roots: list[Path], env: Mapping[str, str]) -> ServerDecl:
    """``decl`` (the user's stdio server) with its command an absolute path outside every
    workspace in ``roots`` and a ``PATH`` without them; OrchError (one line) when it cannot."""
    command = decl.command or ""
    path = safe_path(decl.env.get("PATH", env.get("PATH", os.defpath)), roots)
    if "/" not in command:
        found = shutil.which(command, path=path) if command else None
        if found is None:
            raise OrchError(
                f"its command {command!r} is not on PATH outside the workspaces (PATH entries "
                f"in a workspace are left out); {_WHERE}"
            )
    else:
        found = os.path.expanduser(command)
        if not os.path.isabs(found):
            raise OrchError(f"its command {command!r} is a relative path; {_WHERE}")
    for word in [found, *decl.args]:
        for side in _named(word):
            if not os.path.isabs(os.path.expanduser(side)):
                continue
            where = passes_through(side, roots, Path("/"))
            if where is not None:
                raise OrchError(
                    f"{side!r} is in or passes through {where}, a workspace an agent can "
                    f"write; {_WHERE}"
                )
    # what the server's Python imports by itself, with the environment it gets in the sandbox
    probe_env = {k: v for k, v in env.items() if k in ENV_WHITELIST}
    probe_env.update(decl.env, PATH=path)
    why = python_refusal([found, *decl.args], roots, probe_env, Path("/"))
    if why is not None:
        raise OrchError(f"its command {found!r}{why}; {WHERE_PYTHON}")
    return decl.model_copy(update={"command": found, "env": {**decl.env, "PATH": path}})


def _named(word: str) -> list[str]:
    """The paths ``word`` may name: itself, each side of ``=`` and item of a list, and a
    path glued to an option."""
    out = [word, *_LIST.split(word)]
    out += [piece[m.end() :] for piece in out if (m := _GLUED.match(piece)) is not None]
    return list(dict.fromkeys(out))
