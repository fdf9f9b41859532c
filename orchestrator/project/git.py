"""The one way orch runs git on the host, hardened against what a sandbox wrote.

:func:`git` (async), :func:`git_sync` and :func:`spawn_sync` (GitPython's adapter in
:mod:`orchestrator.branches`) run one process as :mod:`orchestrator.project.gitprocess` prepares
it (environment from scratch, config forced, explicit repository, timeout), and add:

- **drivers neutralized**: ``.gitattributes`` in a written tree activates
  ``filter.<x>.clean/smudge/process``, ``diff.<x>.textconv/command`` or
  ``merge.<x>.driver`` from repository config. Before every command but those in
  ``_NO_DRIVERS`` the config keys are listed (``git config --list --show-scope
  --show-origin``, same runner; cached while those files are unchanged) and each driver
  overridden (:func:`driver_overrides`): empty filter commands = no filter (git skips
  it; ``required=false``), an empty textconv/diff command makes git fail instead of
  running anything (orch's diffs pass ``--no-textconv --no-ext-diff``), a merge driver
  ``false`` turns its merge into a conflict.
- retries while another process holds one of git's lock files (``retry=True``).

Callers add ``--no-verify``, ``--ignore-submodules=dirty`` (never look into a submodule
or parse its ``.gitmodules``), ``--no-textconv``...
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from .gitprocess import (
    GIT_TIMEOUT_S,
    IDENTITY_KEYS,
    GitError,
    GitResult,
    RepoPaths,
    checked,
    first_line,
    prepare,
    run_async,
    run_sync,
    user_excludes_file,
)

__all__ = [
    "EMPTY_TREE",
    "GIT_TIMEOUT_S",
    "IDENTITY_KEYS",
    "RETRIES",
    "GitError",
    "GitResult",
    "RepoPaths",
    "driver_overrides",
    "first_line",
    "git",
    "git_sync",
    "lock_contention",
    "neutralizing_config",
    "neutralizing_config_sync",
    "spawn_sync",
    "user_excludes_file",
]

RETRIES = 8  # attempts of a git command that fails on one of git's lock files
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
# commands that never apply attributes-driven drivers (no checkout, no worktree diff)
_NO_DRIVERS = frozenset(
    {
        "rev-parse",
        "rev-list",
        "for-each-ref",
        "update-ref",
        "symbolic-ref",
        "branch",
        "merge-base",
        "config",
        "show-ref",
        "cat-file",
        "var",
        "version",
        "worktree list",
        "worktree lock",
        "worktree unlock",
        "worktree prune",
    }
)
_LOCK_MARKERS = ("index.lock", "could not lock", ".lock': file exists", "unable to create")


def lock_contention(result: GitResult) -> bool:
    text = (result.err + result.out).lower()
    return any(marker in text for marker in _LOCK_MARKERS)


def driver_overrides(listing: str) -> tuple[list[tuple[str, str]], set[str], bool]:
    """Overrides for the drivers in ``git config --list --show-scope --show-origin --null
    --name-only`` output; also the origin files and whether the result may be cached."""
    fields = listing.split("\0")
    found: dict[str, str] = {}
    origins: set[str] = set()
    cacheable = True
    for i in range(0, len(fields) - 2, 3):
        scope, origin, key = fields[i], fields[i + 1], fields[i + 2]
        if scope == "command":
            continue  # ours
        if origin.startswith("file:"):
            origins.add(origin.removeprefix("file:"))
        section, _, rest = key.partition(".")
        sub, _, var = rest.rpartition(".")
        section, var = section.lower(), var.lower()
        if section in ("include", "includeif"):
            cacheable = False  # an included file may appear later
        if not sub:
            continue
        if section == "filter" and var in ("clean", "smudge", "process", "required"):
            for name in ("clean", "smudge", "process"):
                found[f"filter.{sub}.{name}"] = ""
            found[f"filter.{sub}.required"] = "false"
        elif section == "diff" and var in ("textconv", "command", "cachetextconv"):
            found[f"diff.{sub}.textconv"] = ""
            found[f"diff.{sub}.command"] = ""
            found[f"diff.{sub}.cachetextconv"] = "false"
        elif section == "merge" and var in ("driver", "recursive"):
            found[f"merge.{sub}.driver"] = "false"
        elif section == "hook" and var == "command":  # config-defined hooks of newer git
            found[f"hook.{sub}.command"] = ""
    return list(found.items()), origins, cacheable


def _needs_neutralizing(args: Sequence[str]) -> bool:
    return bool(args) and args[0] not in _NO_DRIVERS and " ".join(args[:2]) not in _NO_DRIVERS


_driver_cache: dict[Path, tuple[tuple[tuple[str, int, int, int], ...], list[tuple[str, str]]]] = {}
_LIST_CONFIG = ("config", "--list", "--show-scope", "--show-origin", "--null", "--name-only")


def _config_signature(repo: RepoPaths, origins: set[str]) -> tuple[tuple[str, int, int, int], ...]:
    files = {
        str(repo.common_dir / "config"),
        str(repo.common_dir / "config.worktree"),
        str(repo.git_dir / "config.worktree"),
        *origins,
    }
    sig = []
    for name in sorted(files):
        try:
            st = os.stat(name)
            sig.append((name, st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            sig.append((name, 0, -1, 0))
    return tuple(sig)


def _cached_overrides(repo: RepoPaths) -> list[tuple[str, str]] | None:
    sig, overrides = _driver_cache.get(repo.git_dir, ((), []))
    origins = {name for name, *_ in sig}
    return overrides if sig and _config_signature(repo, origins) == sig else None


def _remember(repo: RepoPaths, listing: GitResult) -> list[tuple[str, str]]:
    if listing.code != 0:
        raise GitError(_LIST_CONFIG, repo.git_dir, first_line(listing.err or listing.out))
    overrides, origins, cacheable = driver_overrides(listing.out)
    if cacheable:
        _driver_cache[repo.git_dir] = (_config_signature(repo, origins), overrides)
    else:
        _driver_cache.pop(repo.git_dir, None)
    return overrides


def neutralizing_config_sync(repo: RepoPaths) -> list[tuple[str, str]]:
    """Overrides that disable every filter/diff/merge driver of ``repo``'s config."""
    if (cached := _cached_overrides(repo)) is not None:
        return cached
    return _remember(repo, run_sync(prepare(_LIST_CONFIG, repo), GIT_TIMEOUT_S))


async def neutralizing_config(repo: RepoPaths) -> list[tuple[str, str]]:
    if (cached := _cached_overrides(repo)) is not None:
        return cached
    return _remember(repo, await run_async(prepare(_LIST_CONFIG, repo), GIT_TIMEOUT_S))


async def git(
    *args: str,
    repo: RepoPaths | None,
    cwd: Path | None = None,
    check: bool = True,
    identity: Mapping[str, str] | None = None,
    retry: bool = False,
    timeout_s: float = GIT_TIMEOUT_S,
    config: Sequence[tuple[str, str]] = (),
) -> GitResult:
    """Run one hardened git command; ``retry`` retries while git's lock files are held by
    someone else; with ``check`` a non-zero exit raises :class:`GitError`. ``config``: more
    command-scope settings of orch's own (never values a sandbox wrote)."""
    drivers = await neutralizing_config(repo) if repo and _needs_neutralizing(args) else []
    cmd = prepare(args, repo, cwd=cwd, identity=identity, config=[*drivers, *config])
    delay = 0.05
    for attempt in range(RETRIES if retry else 1):
        result = await run_async(cmd, timeout_s)
        if result.code == 0 or not lock_contention(result) or attempt == RETRIES - 1:
            break
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)
    return checked(cmd, result, check)


def git_sync(
    *args: str,
    repo: RepoPaths | None,
    cwd: Path | None = None,
    check: bool = True,
    identity: Mapping[str, str] | None = None,
    timeout_s: float = GIT_TIMEOUT_S,
) -> GitResult:
    """:func:`git` for synchronous code (the CLI, GitPython)."""
    config = neutralizing_config_sync(repo) if repo and _needs_neutralizing(args) else []
    cmd = prepare(args, repo, cwd=cwd, identity=identity, config=config)
    return checked(cmd, run_sync(cmd, timeout_s), check)


def spawn_sync(args: Sequence[str], repo: RepoPaths, stdin: int | None) -> subprocess.Popen[bytes]:
    """A long-lived hardened git process (GitPython's ``cat-file --batch``)."""
    config = neutralizing_config_sync(repo) if _needs_neutralizing(args) else []
    cmd = prepare(args, repo, config=config)
    return subprocess.Popen(
        cmd.argv,
        cwd=cmd.cwd,
        env=cmd.env,
        stdin=subprocess.DEVNULL if stdin is None else stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
