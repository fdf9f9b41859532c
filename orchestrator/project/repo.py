"""orch's layout in a git repository, and the queries the worktree tier and CLI share.

``<main root>/.orch/worktrees/<run_id>`` holds the worktrees of runs (``.orch`` has a
``.gitignore`` of orch's state); ``.orch/worktrees.lock`` serializes ``worktree add/remove``
and ``branch -D`` per repository (an asyncio lock and an flock). The user's own
repository is discovered from a directory they gave (:func:`discover`); a run's
worktree is found from its path through the admin dirs of the main repository
(:func:`locate`, :func:`worktree_paths`), never through its own ``.git`` file.
Every git command goes through :mod:`orchestrator.project.git`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from ..errors import OrchError, UsageError
from . import statedir
from .git import GitResult, RepoPaths, git, git_sync

NOT_A_REPO = (
    "{path} is not inside a git repository; run orch inside a git repo or use isolation 'shared'"
)
_SHORTSTAT = re.compile(r"(\d+) (file|insertion|deletion)")
FLOCK_TIMEOUT_S = 120.0


def short_run_id(run_id: str) -> str:
    return run_id.removeprefix("r-")[:8]


def parse_shortstat(text: str) -> tuple[int, int, int]:
    """``(files_changed, insertions, deletions)`` from ``git diff --shortstat``."""
    counts = {"file": 0, "insertion": 0, "deletion": 0}
    for number, kind in _SHORTSTAT.findall(text):
        counts[kind] = int(number)
    return counts["file"], counts["insertion"], counts["deletion"]


def parse_worktree_list(text: str) -> list[dict[str, str]]:
    """Entries of ``git worktree list --porcelain -z``: worktree, HEAD, branch, locked, ..."""
    entries: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for field in text.split("\0"):
        if not field:
            if current:
                entries.append(current)
                current = {}
            continue
        key, _, value = field.partition(" ")
        current[key] = value
    if current:
        entries.append(current)
    for entry in entries:
        if entry.get("branch", "").startswith("refs/heads/"):
            entry["branch"] = entry["branch"].removeprefix("refs/heads/")
    return entries


def main_root_from(common_dir: str | Path, toplevel: str | Path) -> Path:
    common = Path(common_dir)
    return common.parent if common.name == ".git" else Path(toplevel)


# -- where a repository is -----------------------------------------------------------------

_DISCOVER = (
    "rev-parse",
    "--path-format=absolute",
    "--absolute-git-dir",
    "--git-common-dir",
    "--show-toplevel",
)


def _located(path: Path, result: GitResult) -> RepoPaths:
    lines = result.out.splitlines()
    if result.code != 0 or len(lines) < 3:
        raise UsageError(NOT_A_REPO.format(path=path))
    git_dir, common, top = (Path(line) for line in lines[:3])
    return RepoPaths(git_dir, top, common, main_root_from(common, top))


def discover_sync(path: Path) -> RepoPaths:
    """The repository of a directory the user gave (never one a sandbox wrote)."""
    if not path.is_dir():
        raise UsageError(NOT_A_REPO.format(path=path))
    return _located(path, git_sync(*_DISCOVER, repo=None, cwd=path, check=False))


async def discover(path: Path) -> RepoPaths:
    if not await asyncio.to_thread(path.is_dir):
        raise UsageError(NOT_A_REPO.format(path=path))
    return _located(path, await git(*_DISCOVER, repo=None, cwd=path, check=False))


# -- the .orch directory and the per-repository lock ---------------------------------------


def orch_dir(main_root: Path) -> Path:
    return main_root / ".orch"


def ensure_orch_dir(main_root: Path) -> None:
    """``<main root>/.orch/worktrees``, with orch's ``.gitignore`` (``orchignore.py``) so git
    status stays clean while ``.orch/agents/`` and the like stay committable. ``.orch`` must
    be ours and ``worktrees`` no symlink (``statedir.py``): else :class:`~.statedir.Refused`."""
    statedir.entry(statedir.checked_dir(orch_dir(main_root)), "worktrees", directory=True)


_async_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


def _flock_acquire(main_root: Path) -> int:
    ensure_orch_dir(main_root)
    path = orch_dir(main_root) / "worktrees.lock"
    fd = statedir.open_file(path.parent, path.name, os.O_RDWR | os.O_CREAT)
    deadline = time.monotonic() + FLOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise OrchError(
                    f"another process holds {path} for over {FLOCK_TIMEOUT_S:.0f}s; "
                    "check for a stuck orch process"
                ) from None
            time.sleep(0.01)


@contextlib.contextmanager
def repo_lock_sync(main_root: Path) -> Iterator[None]:
    """:func:`repo_lock` for synchronous callers (a merge, in a thread of its own): the same
    file lock, so a merge excludes worktree add/remove and every other merge, in this process
    and in others."""
    fd = _flock_acquire(main_root)
    try:
        yield
    finally:
        os.close(fd)


def _close_fd_when_done(task: asyncio.Future[int]) -> None:
    if not task.cancelled() and task.exception() is None:
        os.close(task.result())


@contextlib.asynccontextmanager
async def repo_lock(main_root: Path) -> AsyncIterator[None]:
    """Serialize worktree add/remove and branch deletion for one repository."""
    locks = _async_locks.setdefault(asyncio.get_running_loop(), {})
    lock = locks.setdefault(str(main_root), asyncio.Lock())
    async with lock:
        task = asyncio.ensure_future(asyncio.to_thread(_flock_acquire, main_root))
        try:
            fd = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_close_fd_when_done)  # the thread may still get the lock
            raise
        try:
            yield
        finally:
            os.close(fd)  # releases the flock


# -- where a run's worktree is -------------------------------------------------------------


def orch_worktree_root(path: Path) -> Path | None:
    """``<root>`` when ``path`` is ``<root>/.orch/worktrees/<name>`` (orch's layout)."""
    if path.parent.name == "worktrees" and path.parent.parent.name == ".orch":
        return path.parent.parent.parent
    return None


def admin_dir(common_dir: Path, path: Path) -> Path | None:
    """``<common>/worktrees/<name>``, the admin dir of the linked worktree at ``path``, found
    from the ``gitdir`` files in the (trusted) common dir; the tree's own ``.git`` is never
    read. None when it is not registered. Blocking."""
    real = os.path.realpath(path)
    try:
        admins = sorted((common_dir / "worktrees").iterdir())
    except OSError:
        return None
    for admin in admins:
        try:
            dot = (admin / "gitdir").read_text().strip()
        except OSError:
            continue
        if os.path.realpath(os.path.dirname(dot)) == real:
            return admin
    return None


def worktree_paths(main: RepoPaths, path: Path) -> RepoPaths | None:
    """The linked worktree at ``path`` (see :func:`admin_dir`) as a place git works in."""
    admin = admin_dir(main.common_dir, path)
    if admin is None:
        return None
    return RepoPaths(admin, Path(os.path.realpath(path)), main.common_dir, main.main_root)


async def main_repo(path: Path) -> RepoPaths:
    """The main checkout of the repository at ``path`` (an orch worktree: its main root's)."""
    real = await asyncio.to_thread(path.resolve)
    root = orch_worktree_root(real)
    if root is not None:
        with contextlib.suppress(UsageError):
            return (await discover(root)).main()
    return (await discover(real)).main()


async def locate(path: Path) -> RepoPaths:
    """The repository at ``path``: a run's worktree through the admin dirs of its main
    repository (whatever its ``.git`` says), anything else by discovery (the user's tree)."""
    real = await asyncio.to_thread(path.resolve)
    root = orch_worktree_root(real)
    if root is not None:
        with contextlib.suppress(UsageError):
            main = (await discover(root)).main()
            found = await asyncio.to_thread(worktree_paths, main, real)
            if found is not None:
                return found
    return await discover(real)


# -- common queries ------------------------------------------------------------------------


async def rev(ref: str, repo: RepoPaths) -> str | None:
    result = await git("rev-parse", "-q", "--verify", f"{ref}^{{commit}}", repo=repo, check=False)
    return (result.out.strip() or None) if result.code == 0 else None


async def is_ancestor(repo: RepoPaths, older: str, newer: str) -> bool:
    result = await git("merge-base", "--is-ancestor", older, newer, repo=repo, check=False)
    return result.code == 0


async def worktree_entries(main: RepoPaths) -> list[dict[str, str]]:
    result = await git("worktree", "list", "--porcelain", "-z", repo=main)
    return parse_worktree_list(result.out)


async def diff_stats(repo: RepoPaths, base: str, head: str) -> tuple[int, int, int]:
    result = await git(
        "diff",
        "--shortstat",
        "--no-textconv",
        "--no-ext-diff",
        "--ignore-submodules=dirty",
        base,
        head,
        repo=repo,
    )
    return parse_shortstat(result.out)
