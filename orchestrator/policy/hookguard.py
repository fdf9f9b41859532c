"""Hooks never run a file an agent could have written.

Hooks run on the host, unsandboxed, with the user's rights, so what they run must be out of
every agent's reach. An agent writes its workspace: the repository's checkout (the shared
tier) and ``.orch/worktrees/*`` (the worktree tier). Before a hook runs, :func:`refusal`
reads its command the way the bash deny list does (``commands.command_words``: every simple
command, inside ``bash -c``, ``$(...)``, subshells too) and refuses it when

- a word, a redirection target, or the value of ``NAME=value`` / ``--opt=value`` that names
  a path (it has a ``/``, starts with ``~``, is ``.`` or ``..``, or ends like a script: ``.py``,
  ``.sh``...) lies in a workspace, or passes through one on the way (every symlink on the
  way is followed and checked, so a link outside pointing in, or a link inside pointing out,
  are both refused); a relative path counts as relative to the run's workspace, as if the
  hook ran there;
- a word expands a variable (``$NAME``, ``${...}``): what it names cannot be checked.

The hook then runs from a private empty directory (never the workspace), with ``PATH``
stripped of relative entries and of those in a workspace, and with no variable whose value
names a path in one (``PYTHONPATH``, ``VIRTUAL_ENV``...); ``ORCH_PROJECT_DIR`` holds the
workspace, as ``cwd`` does in the event JSON.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from ..errors import OrchError
from .commands import shell_split


class HookRefused(OrchError):
    """A hook that would run a file an agent could have written: the run fails closed."""


_SUBSTITUTION = re.compile(r"\$\(|`|[<>]\(")
_VARIABLE = re.compile(r"\$(?:\{([^}]*)\}|([A-Za-z_][A-Za-z_0-9]*)|[@*0-9])")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")
_SPLIT = re.compile(r"\|\||&&|[;&|\n()`]")
_REDIRECT = re.compile(r"^[0-9]*[<>&]+\|?")
_SCRIPT = re.compile(r"\.(py|pyc|pyz|sh|bash|zsh|js|mjs|cjs|ts|pl|pm|rb|php|lua|r|jar)$", re.I)
_NESTED = re.compile(r"[\s;&|<>()]")
_MAX_LINKS = 40
WHERE = "put the script outside every workspace (e.g. ~/.orch/hooks/) and name it by absolute path"


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


def passes_through(path: str, roots: list[Path], base: Path) -> Path | None:
    """The first place in ``roots`` that ``path`` (relative: to ``base``) names or passes
    through, following every symlink on the way; None when it never does."""
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
        if _in(step, roots):
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


def _candidates(word: str) -> Iterator[str]:
    word = _REDIRECT.sub("", word)
    yield from word.split("=", 1)  # NAME=value, --opt=value: each side


def _pathlike(word: str) -> bool:
    return "/" in word or word.startswith("~") or word in (".", "..") or bool(_SCRIPT.search(word))


def _words(line: str, depth: int = 0) -> Iterator[str]:
    """Every word of ``line`` as written (no wrapper stripped, the program's path kept), and
    those of any word that is itself a command line (``sh -c '...'``, ``eval``, code)."""
    for part in _SPLIT.split(line.replace("\\\n", " ")):
        words = shell_split(part.strip())
        if words is None:  # an operator split a quoted string: drop the quotes
            words = part.replace('"', " ").replace("'", " ").replace("\\", "").split()
        for word in words:
            yield word
            if depth < 5 and _NESTED.search(word):
                yield from _words(word, depth + 1)


def _expand(word: str, env: Mapping[str, str]) -> str | None:
    """``word`` with ``$NAME`` / ``${NAME}`` of ``env`` put in; None where a variable is not
    in ``env`` or is more than a name (``${X:-...}``, ``$1``): what it names is unknown."""
    unknown = False

    def put(m: re.Match[str]) -> str:
        nonlocal unknown
        name = m.group(1) if m.group(1) is not None else m.group(2)
        if name is None or not _NAME.match(name) or name not in env:
            unknown = True
            return ""
        return env[name]

    out = _VARIABLE.sub(put, word)
    return None if unknown else out


def refusal(command: str, workspace: Path, env: Mapping[str, str]) -> str | None:
    """Why ``command`` may not run as a hook of a run in ``workspace`` (with ``env``), or
    None. Conservative: what cannot be checked is refused."""
    roots = workspaces(workspace)
    if _SUBSTITUTION.search(command):
        return (
            f"hook refused: {command!r} substitutes a command's output, so what it runs "
            f"cannot be checked; {WHERE}"
        )
    for raw in _words(command):
        word = _expand(raw, env)
        if word is None:
            return (
                f"hook refused: {command!r} expands {raw!r}, which orch cannot check "
                f"(only $NAME of the hook's environment); {WHERE}"
            )
        for candidate in _candidates(word):
            if not candidate or not _pathlike(candidate):
                continue
            where = passes_through(candidate, roots, roots[0])
            if where is not None:
                return (
                    f"hook refused: {command!r} names {candidate!r}, which is in or passes "
                    f"through {where}, a workspace an agent can write; {WHERE}"
                )
    return None


def hook_env(env: Mapping[str, str], workspace: Path, cwd: Path) -> dict[str, str]:
    """``env`` without a way into a workspace: ``PATH`` keeps only absolute entries outside
    every workspace, and a variable naming a path in one is left out."""
    roots = workspaces(workspace)
    out: dict[str, str] = {}
    for name, value in env.items():
        parts = value.split(os.pathsep)
        if name == "PATH":
            keep = [p for p in parts if os.path.isabs(p) and passes_through(p, roots, cwd) is None]
            out[name] = os.pathsep.join(keep)
        elif not any(os.path.isabs(p) and passes_through(p, roots, cwd) for p in parts):
            out[name] = value
    out.update(ORCH_PROJECT_DIR=str(roots[0]), PWD=str(cwd))
    return out


@contextlib.contextmanager
def private_cwd(workspace: Path) -> Iterator[Path]:
    """A new empty directory (mode 0700) outside every workspace, removed afterwards."""
    roots = workspaces(workspace)
    parent = tempfile.gettempdir()
    if passes_through(parent, roots, Path("/")) is not None:
        parent = "/tmp"
    path = Path(tempfile.mkdtemp(prefix="orch-hook-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
