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
stripped of relative entries and of those in a workspace, with no variable whose value
names a path in one (``VIRTUAL_ENV``...) and none that makes an interpreter load code by
itself (:data:`IMPORT_HOOKS`: ``PYTHONPATH``, ``NODE_OPTIONS``, ``LD_PRELOAD``...);
``ORCH_PROJECT_DIR`` holds the workspace, as ``cwd`` does in the event JSON.

An interpreter loads code of its own accord too: a Python whose venv has the project
installed editable has the checkout on its path (a ``.pth`` file), and imports a
``sitecustomize.py`` an agent wrote there. So :func:`interpreter_refusal` finds every
Python a hook starts (a command named ``python*``/``pypy*`` on the hook's ``PATH``, or a
script whose ``#!`` line names one, also through ``env``), asks it where it imports from
without running any of it (``policy/imports.py``) and refuses the hook when one of those
places is in or passes through a workspace (``-S`` on its command line: no site
directories). What a hook starts through another program (``uv run``, ``poetry run``,
``npx``, ``make``) is the user's to keep out of workspaces.
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
from ..fs.hostprograms import passes_through as passes_through
from ..fs.hostprograms import workspaces as workspaces
from .commands import shell_split
from .imports import Place, probe_places


class HookRefused(OrchError):
    """A hook that would run a file an agent could have written: the run fails closed."""


_SUBSTITUTION = re.compile(r"\$\(|`|[<>]\(")
_VARIABLE = re.compile(r"\$(?:\{([^}]*)\}|([A-Za-z_][A-Za-z_0-9]*)|[@*0-9])")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")
_SPLIT = re.compile(r"\|\||&&|[;&|\n()`]")
_REDIRECT = re.compile(r"^[0-9]*[<>&]+\|?")
_SCRIPT = re.compile(r"\.(py|pyc|pyz|sh|bash|zsh|js|mjs|cjs|ts|pl|pm|rb|php|lua|r|jar)$", re.I)
_NESTED = re.compile(r"[\s;&|<>()]")
_PYTHON = re.compile(r"^(python|pypy)[0-9.]*[a-z]?$")
# variables that make an interpreter (or the dynamic linker) load code nobody named
IMPORT_HOOKS = frozenset(
    {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONEXECUTABLE"}
    | {"PYTHONPLATLIBDIR", "PYTHONBREAKPOINT", "PYTHONWARNINGS", "PYTHONINSPECT"}
    | {"NODE_OPTIONS", "NODE_PATH", "NODE_REPL_EXTERNAL_MODULE", "RUBYOPT", "RUBYLIB"}
    | {"PERL5OPT", "PERL5LIB", "PERLLIB", "PERL5DB", "LD_PRELOAD", "LD_LIBRARY_PATH"}
    | {"LD_AUDIT", "BASH_ENV", "ENV", "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "CLASSPATH"}
    | {"JDK_JAVA_OPTIONS", "LUA_INIT", "LUA_PATH", "LUA_CPATH", "GCONV_PATH", "TCLLIBPATH"}
    | {"R_PROFILE", "R_PROFILE_USER", "GEM_PATH", "GEM_HOME", "RUBYLIB", "PHPRC"}
)
WHERE = "put the script outside every workspace (e.g. ~/.orch/hooks/) and name it by absolute path"
WHERE_PYTHON = (
    "name a Python whose environment has nothing in the project (e.g. /usr/bin/python3), "
    "or start it with -S"
)


def _candidates(word: str) -> Iterator[str]:
    word = _REDIRECT.sub("", word)
    yield from word.split("=", 1)  # NAME=value, --opt=value: each side


def _pathlike(word: str) -> bool:
    return "/" in word or word.startswith("~") or word in (".", "..") or bool(_SCRIPT.search(word))


def _parts(line: str, depth: int = 0) -> Iterator[list[str]]:
    """The words of every simple command of ``line`` as written (no wrapper stripped, the
    program's path kept), and of those in any word that is itself a command line (``sh -c
    '...'``, ``eval``, code)."""
    for part in _SPLIT.split(line.replace("\\\n", " ")):
        words = shell_split(part.strip())
        if words is None:  # an operator split a quoted string: drop the quotes
            words = part.replace('"', " ").replace("'", " ").replace("\\", "").split()
        yield words
        for word in words:
            if depth < 5 and _NESTED.search(word):
                yield from _parts(word, depth + 1)


def _words(line: str) -> Iterator[str]:
    """Every word of ``line`` (:func:`_parts`)."""
    for words in _parts(line):
        yield from words


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
    every workspace, a variable naming a path in one is left out, and so is every variable
    of :data:`IMPORT_HOOKS`."""
    roots = workspaces(workspace)
    out: dict[str, str] = {}
    for name, value in env.items():
        parts = value.split(os.pathsep)
        if name in IMPORT_HOOKS:
            continue
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


def _program(word: str, env: Mapping[str, str], cwd: Path) -> str | None:
    """The file a command word runs (through the hook's ``PATH`` when it has no ``/``)."""
    if "/" not in word and not word.startswith("~"):
        return shutil.which(word, path=env.get("PATH", ""))
    path = os.path.join(cwd, os.path.expanduser(word))
    return path if os.path.isfile(path) else None


def _shebang(path: str) -> list[str]:
    """The words of ``path``'s ``#!`` line; [] when it has none."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return []
    if not head.startswith(b"#!"):
        return []
    return head[2:].split(b"\n", 1)[0].decode(errors="replace").split()


def _pythons(
    words: list[str], env: Mapping[str, str], cwd: Path, depth: int = 0
) -> list[tuple[str, list[str]]]:
    """(interpreter, its arguments) for the Python a simple command starts, directly or as
    a script's ``#!`` interpreter (``env`` and its options followed)."""
    if not words or depth > 3:
        return []
    program = _program(words[0], env, cwd)
    if program is None:
        return []
    names = {os.path.basename(program), os.path.basename(os.path.realpath(program))}
    if any(_PYTHON.match(n) for n in names):
        return [(program, words[1:])]
    line = _shebang(program)
    if not line:
        return []
    if os.path.basename(line[0]) == "env":
        rest = [w for w in line[1:] if not w.startswith("-")]  # -S splits, -i empties
        return _pythons([*rest, program, *words[1:]], env, cwd, depth + 1)
    return _pythons([*line, program, *words[1:]], env, cwd, depth + 1)


def _site_runs(args: list[str]) -> bool:
    """Python's ``site`` runs for these arguments (no ``-S`` before the script or code)."""
    for arg in args:
        if not arg.startswith("-") or arg in ("-", "--"):
            return True
        letters = arg[1:] if not arg.startswith("--") else ""
        for letter in letters:
            if letter == "S":
                return False
            if letter in "cmWX":  # the rest of the word is its value
                if letter in "cm":
                    return True
                break
    return True


def interpreter_refusal(
    command: str, workspace: Path, env: Mapping[str, str], cwd: Path
) -> str | None:
    """Why ``command`` may not run as a hook: a Python it starts (with ``env``, from
    ``cwd``) loads code from a place in or through a workspace; or None."""
    roots = workspaces(workspace)
    seen: set[tuple[str, bool]] = set()
    for words in _parts(command):
        if (why := python_refusal(words, roots, env, cwd, seen)) is not None:
            return f"hook refused: {command!r}{why}; {WHERE_PYTHON}"
    return None


def python_refusal(
    words: list[str],
    roots: list[Path],
    env: Mapping[str, str],
    cwd: Path,
    seen: set[tuple[str, bool]] | None = None,
) -> str | None:
    """Why the Python that the simple command ``words`` starts (directly, or as a script's
    ``#!`` interpreter) may not run: ``": <the probe's error>"`` or ``" runs <python>, which
    loads code from <place> ..."``; None when it starts none or none that loads code from
    in or through ``roots``. (``seen``: the interpreters already asked.)"""
    seen = set() if seen is None else seen
    # the first word that starts a Python is the program (after any wrapper); the rest
    # are its arguments
    starts = next(filter(None, (_pythons(words[i:], env, cwd) for i in range(len(words)))), [])
    for python, args in starts:
        asked = (python, _site_runs(args))
        if asked in seen:
            continue
        seen.add(asked)
        places = probe_places(python, site_runs=asked[1], cwd=str(cwd), env=env)
        if isinstance(places, str):
            return f": {places}"
        if (found := _first_inside(places, roots)) is not None:
            place, where = found
            return (
                f" runs {python}, which loads code from {place.path} ({place.why}), in or "
                f"through {where}, a workspace an agent can write"
            )
    return None


def _first_inside(places: list[Place], roots: list[Path]) -> tuple[Place, Path] | None:
    for place in places:
        where = passes_through(place.path, roots, Path("/"))
        if where is not None:
            return place, where
    return None
