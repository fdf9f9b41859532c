"""One hardened git process: what it gets and how it runs (no drivers; ``git.py`` adds
those and is what callers use).

Host git runs on trees agents wrote (worktrees) and on repository config an agent in a
worktree could edit. Every git process orch starts is built by :func:`prepare` and run by
:func:`run_sync` or :func:`run_async` (through :func:`orchestrator.project.git.git`,
:func:`~orchestrator.project.git.git_sync` or :func:`~orchestrator.project.git.spawn_sync`):

- **environment from scratch**: ``PATH`` without relative entries and entries in a git
  checkout or workspace, and git found on it by absolute path (``fs/hostprograms.py``: a
  ``.venv/bin/git`` an agent planted never runs),
  ``HOME=/dev/null`` (no directory: nothing there to plant), ``LANG/LC_ALL=C``,
  ``GIT_CONFIG_NOSYSTEM``, ``GIT_CONFIG_GLOBAL=/dev/null``, ``GIT_ATTR_NOSYSTEM``,
  ``GIT_TERMINAL_PROMPT=0``, ``GIT_OPTIONAL_LOCKS=0``, ``GIT_NO_REPLACE_OBJECTS``,
  ``GIT_EDITOR=true`` and the author/committer identity a caller passes: no API keys, no
  ``GIT_*`` redirections.
- **config forced** through ``GIT_CONFIG_COUNT``/``KEY_n``/``VALUE_n`` (command-line
  scope: beats repository config, inherited by git's children): :data:`FORCED_CONFIG`,
  ``core.hooksPath=/dev/null`` (no hook can exist below a device, and no directory orch
  makes is one an agent could rewrite: issue 38), ``core.excludesFile`` = the user's
  global ignore file (data, read with ``git config --file``).
- **explicit repository**: callers pass :class:`RepoPaths`; ``GIT_DIR`` and
  ``GIT_WORK_TREE`` are set, so a ``.git`` file planted in a tree is never read. A
  linked worktree's ``GIT_DIR`` is its admin dir ``<common>/worktrees/<name>`` (git
  finds the common dir from it), found through the common dir
  (:func:`orchestrator.project.repo.locate`). Only ``rev-parse`` runs without one, to
  discover the user's own repository (:func:`orchestrator.project.repo.discover`).
- a timeout (the process group is killed); :class:`GitError` names the command and
  git's first error line.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import OrchError
from ..fs.hostprograms import host_path, host_program
from ..pgroups import kill_tree, reap, spawn

GIT_TIMEOUT_S = 300.0
IDENTITY_KEYS = frozenset(
    f"GIT_{who}_{what}" for who in ("AUTHOR", "COMMITTER") for what in ("NAME", "EMAIL", "DATE")
)
FORCED_CONFIG: tuple[tuple[str, str], ...] = (
    ("core.fsmonitor", "false"),
    ("core.untrackedCache", "false"),  # mtimes must not hide files
    ("core.attributesFile", os.devnull),
    ("core.pager", "cat"),
    ("core.editor", "true"),
    ("core.sshCommand", "false"),
    ("core.useReplaceRefs", "false"),
    ("submodule.recurse", "false"),
    ("status.submoduleSummary", "false"),
    ("diff.ignoreSubmodules", "dirty"),
    ("fetch.recurseSubmodules", "false"),
    ("diff.external", ""),  # empty: git fails instead of running anything
    ("protocol.allow", "never"),
    ("protocol.file.allow", "never"),
    ("credential.helper", ""),
    ("commit.gpgSign", "false"),
    ("tag.gpgSign", "false"),
    ("log.showSignature", "false"),
    ("merge.verifySignatures", "false"),
    ("gpg.program", "false"),
    ("gpg.openpgp.program", "false"),
    ("gpg.x509.program", "false"),
    ("gpg.ssh.program", "false"),
    ("rerere.enabled", "false"),
    ("gc.auto", "0"),
    ("maintenance.auto", "false"),
    ("color.ui", "false"),
)
# commands that never apply attributes-driven drivers (no checkout, no worktree diff)


class GitError(OrchError):
    """A git command failed; the message names it and gives git's first error line."""

    def __init__(self, args: Sequence[str], where: object, detail: str, code: int | None = None):
        self.command = ["git", *args]
        self.detail = detail
        self.code = code
        super().__init__(f"git {_command_name(args)} failed in {where}: {detail}")


def _command_name(args: Sequence[str]) -> str:
    rest = list(args)
    while rest and rest[0].startswith("-"):  # global options: -c key=value, --no-pager...
        rest = rest[2:] if rest[0] == "-c" else rest[1:]
    if len(rest) > 1 and rest[0] in ("worktree", "stash", "submodule", "config"):
        return " ".join(rest[:2])
    return rest[0] if rest else "command"


@dataclass
class GitResult:
    code: int
    out: str
    err: str


@dataclass(frozen=True)
class RepoPaths:
    """Where one git command works: ``GIT_DIR``, ``GIT_WORK_TREE``, and the main checkout."""

    git_dir: Path  # <common dir> for the main checkout, <common>/worktrees/<name> for a worktree
    work_tree: Path | None
    common_dir: Path
    main_root: Path  # the directory holding .orch (the main checkout)

    def main(self) -> RepoPaths:
        return RepoPaths(self.common_dir, self.main_root, self.common_dir, self.main_root)


@dataclass(frozen=True)
class GitCommand:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    args: tuple[str, ...]


def first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip().removeprefix("fatal: ").removeprefix("error: ")
    return "no output"


# -- the environment ----------------------------------------------------------------------

_user: dict[tuple[str, str], tuple[str, list[str]]] = {}
# What git gets where it would want a directory: a device, below which nothing can ever be
# made (no directory of orch's own, under an environment-chosen TMPDIR, to be rewritten).
NO_DIR = "/dev/null"


def _git_executable(workspace: Path | None) -> str:
    found = host_program("git", workspace)
    if found is None:
        raise OrchError(
            "git is not installed (outside every git checkout on PATH); install git or use "
            "isolation 'shared'"
        )
    return found


def _user_settings() -> tuple[str, list[str]]:
    """From the user's global git config (read as data, one ``--file`` at a time): the
    global ignore file (else /dev/null) and the ``safe.directory`` entries."""
    key = (os.environ.get("HOME") or str(Path.home()), os.environ.get("XDG_CONFIG_HOME", ""))
    if key in _user:
        return _user[key]
    home = Path(key[0])
    xdg = Path(key[1] or home / ".config") / "git"
    excludes, safe = str(xdg / "ignore"), []
    for config in (xdg / "config", home / ".gitconfig"):  # later files win, as in git
        if not config.is_file():
            continue
        for name in ("core.excludesFile", "safe.directory"):
            cmd = prepare(
                ("config", "--file", str(config), "--get-all", name),
                None,
                cwd=Path("/"),
                user=False,
            )
            values = [v for v in run_sync(cmd, 30.0).out.splitlines() if v.strip()]
            if values and name == "core.excludesFile":
                excludes = str(Path(values[-1]).expanduser())
            elif values:
                safe += values
    _user[key] = (excludes if os.path.isfile(excludes) else os.devnull, safe)
    return _user[key]


def user_excludes_file() -> str:
    """The user's global ignore file (``core.excludesFile``), os.devnull when none."""
    return _user_settings()[0]


def hardened_env(
    identity: Mapping[str, str] | None = None,
    config: Sequence[tuple[str, str]] = (),
    *,
    user: bool = True,
) -> dict[str, str]:
    """The whole environment of a git process: nothing of ``os.environ`` but ``PATH``.

    ``user``: honour the user's global ignore file (else none: reading the user's config).
    """
    env = {
        "PATH": host_path(),
        "HOME": NO_DIR,
        "LANG": "C",
        "LC_ALL": "C",
        "LANGUAGE": "C",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_SYSTEM": os.devnull,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_ATTR_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_OPTIONAL_LOCKS": "0",
        "GIT_NO_REPLACE_OBJECTS": "1",
        "GIT_PAGER": "cat",
        "GIT_EDITOR": "true",
        "GIT_SEQUENCE_EDITOR": "true",
        "GIT_MERGE_AUTOEDIT": "no",
    }
    for key, value in (identity or {}).items():
        if key not in IDENTITY_KEYS:
            raise ValueError(f"{key} is not an author/committer variable")
        env[key] = value
    excludes = _user_settings()[0] if user else os.devnull
    forced = [
        ("core.hooksPath", NO_DIR),
        ("core.excludesFile", excludes),
        *FORCED_CONFIG,
        *config,
    ]
    env["GIT_CONFIG_COUNT"] = str(len(forced))
    for n, (key, value) in enumerate(forced):
        env[f"GIT_CONFIG_KEY_{n}"] = key
        env[f"GIT_CONFIG_VALUE_{n}"] = value
    return env


def prepare(
    args: Sequence[str],
    repo: RepoPaths | None,
    *,
    cwd: Path | None = None,
    identity: Mapping[str, str] | None = None,
    config: Sequence[tuple[str, str]] = (),
    user: bool = True,
) -> GitCommand:
    """The argv, environment and cwd of one hardened git command (every spawn goes here).

    Without ``repo`` only ``rev-parse`` may run: discovering the user's repository from
    ``cwd`` (with the user's ``safe.directory`` entries; explicit ``GIT_DIR`` skips that
    ownership check). Every other command gets ``GIT_DIR``/``GIT_WORK_TREE`` from ``repo``.
    """
    args = tuple(args)
    if repo is None:
        if cwd is None or not args or args[0] not in ("rev-parse", "config"):
            raise ValueError(f"git {' '.join(args[:1])} needs an explicit repository")
        if args[0] == "config":  # only ``config --file``: no repository at all
            if "--file" not in args:
                raise ValueError("git config without a repository needs --file")
            env = hardened_env(identity, config, user=False)
            env["GIT_CEILING_DIRECTORIES"] = str(cwd.parent)
        else:
            safe = [("safe.directory", d) for d in _user_settings()[1]] if user else []
            env = hardened_env(identity, [*config, *safe], user=user)
        where = cwd
    else:
        env = hardened_env(identity, config, user=user)
        env["GIT_DIR"] = str(repo.git_dir)
        if repo.work_tree is not None:
            env["GIT_WORK_TREE"] = str(repo.work_tree)
        where = cwd or repo.work_tree or repo.git_dir
        if not where.is_dir():
            where = repo.git_dir
    workspace = repo.main_root if repo is not None else where
    env["PATH"] = host_path(workspace)
    return GitCommand([_git_executable(workspace), *args], env, where, args)


# -- running ------------------------------------------------------------------------------


def checked(cmd: GitCommand, result: GitResult, check: bool) -> GitResult:
    """``result``; with ``check`` a non-zero exit raises :class:`GitError`."""
    if check and result.code != 0:
        raise GitError(cmd.args, cmd.cwd, first_line(result.err or result.out), result.code)
    return result


def _result(code: int | None, out: bytes, err: bytes) -> GitResult:
    return GitResult(code or 0, out.decode(errors="replace"), err.decode(errors="replace"))


def _not_started(cmd: GitCommand, e: OSError) -> OrchError:
    if not cmd.cwd.is_dir():
        return OrchError(f"{cmd.cwd} does not exist")
    return OrchError(f"git could not start ({e}); install git or use isolation 'shared'")


def run_sync(cmd: GitCommand, timeout_s: float) -> GitResult:
    """Run ``cmd`` to its end; past ``timeout_s`` its process group is killed."""
    try:
        proc = subprocess.Popen(
            cmd.argv,
            cwd=cmd.cwd,
            env=cmd.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as e:
        raise _not_started(cmd, e) from e
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        raise GitError(cmd.args, cmd.cwd, f"timed out after {timeout_s:.0f}s") from None
    except BaseException:
        kill_tree(proc.pid)
        proc.wait()
        raise
    return _result(proc.returncode, out, err)


async def run_async(cmd: GitCommand, timeout_s: float) -> GitResult:
    """:func:`run_sync` on the event loop; cancelled (even while it starts), it kills the
    process group first."""
    try:
        # git alone (FORCED_CONFIG: no hook, helper or auto gc), as run_sync runs it: no
        # subreaper (``pgroups.spawn``), whose start would cost more than the command
        proc = await spawn(
            *cmd.argv,
            contain=False,
            cwd=cmd.cwd,
            env=cmd.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as e:
        raise _not_started(cmd, e) from e
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate()
    except TimeoutError:
        kill_tree(proc.pid)
        await reap(proc)
        raise GitError(cmd.args, cmd.cwd, f"timed out after {timeout_s:.0f}s") from None
    except BaseException:
        kill_tree(proc.pid)  # not proc.kill(): its poll may reap the child
        await reap(proc)
        raise
    return _result(proc.returncode, out, err)
