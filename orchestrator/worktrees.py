"""Git worktree and branch operations for orch: plumbing and ``orch worktrees``.

The first half is the git plumbing the worktree tier
(:mod:`orchestrator.workspaces.worktree`) is built on: running git without
blocking the event loop, retrying on git's own lock files, and serializing
``worktree add/remove`` and ``branch -D`` per repository. The second half is
what ``orch worktrees list|merge|prune`` do with the ``orch/<agent>/<id>``
branches runs leave behind: list them against the user's HEAD, merge one
(refusing on conflicts or a dirty tree), and prune what is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import signal
import subprocess
import time
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from .errors import NotFound, OrchError, UsageError

NOT_A_REPO = (
    "{path} is not inside a git repository; run orch inside a git repo or use isolation 'shared'"
)
_LOCK_MARKERS = ("index.lock", "could not lock", ".lock': file exists", "unable to create")
RETRIES = 8  # attempts of a git command that fails on one of git's lock files
_SHORTSTAT = re.compile(r"(\d+) (file|insertion|deletion)")
# git's own environment variables that would point our commands at another repository
_GIT_LOCATION_ENV = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_PREFIX",
                     "GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES")  # fmt: skip


# -- running git ------------------------------------------------------------------------


class GitError(OrchError):
    """A git command failed; the message is git's first error line."""


@dataclass
class GitResult:
    code: int
    out: str
    err: str


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


def git_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _GIT_LOCATION_ENV}
    env.update(LC_ALL="C", LANGUAGE="C", GIT_TERMINAL_PROMPT="0", GIT_OPTIONAL_LOCKS="0")
    env.update(extra or {})
    return env


def main_root_from(common_dir: str, toplevel: str) -> Path:
    common = Path(common_dir)
    return common.parent if common.name == ".git" else Path(toplevel)


def git_repo_root(path: Path) -> Path:
    """The main repository root of ``path`` (blocking; async code uses :func:`main_repo_root`)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--path-format=absolute", "--git-common-dir", "--show-toplevel"],
            cwd=path, env=git_env(), capture_output=True, text=True, check=False,
        )  # fmt: skip
    except (FileNotFoundError, NotADirectoryError) as e:
        raise UsageError(NOT_A_REPO.format(path=path)) from e
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) < 2:
        raise UsageError(NOT_A_REPO.format(path=path))
    return main_root_from(lines[0], lines[1])


def first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip().removeprefix("fatal: ").removeprefix("error: ")
    return "no output"


async def git(
    *args: str, cwd: Path, check: bool = True, env: Mapping[str, str] | None = None
) -> GitResult:
    """Run one git command; with ``check`` a non-zero exit raises :class:`GitError`."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "git", *args, cwd=cwd, env=git_env(env), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
    except FileNotFoundError as e:
        if not await asyncio.to_thread(cwd.is_dir):
            raise OrchError(f"{cwd} does not exist") from e
        raise OrchError("git is not installed; install git or use isolation 'shared'") from e
    try:
        out, err = await proc.communicate()
    except BaseException:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)  # not proc.kill(): its poll may reap the child
            await asyncio.shield(proc.wait())
        raise
    result = GitResult(
        proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
    )
    if check and result.code != 0:
        raise GitError(f"git {args[0]} failed in {cwd}: {first_line(result.err or result.out)}")
    return result


def lock_contention(result: GitResult) -> bool:
    text = (result.err + result.out).lower()
    return any(marker in text for marker in _LOCK_MARKERS)


async def git_retry(
    *args: str, cwd: Path, check: bool = True, env: Mapping[str, str] | None = None
) -> GitResult:
    """:func:`git`, retried with backoff while git's own lock files are held by someone else."""
    delay = 0.05
    for attempt in range(RETRIES):
        result = await git(*args, cwd=cwd, check=False, env=env)
        if result.code == 0 or not lock_contention(result) or attempt == RETRIES - 1:
            break
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)
    if check and result.code != 0:
        raise GitError(f"git {args[0]} failed in {cwd}: {first_line(result.err or result.out)}")
    return result


async def main_repo_root(path: Path) -> Path:
    result = await git(
        "rev-parse", "--path-format=absolute", "--git-common-dir", "--show-toplevel",
        cwd=path, check=False,
    )  # fmt: skip
    lines = result.out.splitlines()
    if result.code != 0 or len(lines) < 2:
        raise UsageError(NOT_A_REPO.format(path=path))
    return main_root_from(lines[0], lines[1])


async def rev(ref: str, cwd: Path) -> str | None:
    result = await git("rev-parse", "-q", "--verify", f"{ref}^{{commit}}", cwd=cwd, check=False)
    return (result.out.strip() or None) if result.code == 0 else None


async def worktree_entries(main_root: Path) -> list[dict[str, str]]:
    result = await git("worktree", "list", "--porcelain", "-z", cwd=main_root)
    return parse_worktree_list(result.out)


async def diff_stats(cwd: Path, base: str, head: str) -> tuple[int, int, int]:
    result = await git("diff", "--shortstat", base, head, cwd=cwd)
    return parse_shortstat(result.out)


# -- per-repository serialization -------------------------------------------------------

_async_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)
FLOCK_TIMEOUT_S = 120.0


def _flock_acquire(main_root: Path) -> int:
    ensure_orch_dir(main_root)
    path = orch_dir(main_root) / "worktrees.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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


def orch_dir(main_root: Path) -> Path:
    return main_root / ".orch"


def ensure_orch_dir(main_root: Path) -> None:
    """``<main root>/.orch/worktrees`` with a ``.gitignore`` of ``*`` so git status stays clean."""
    (orch_dir(main_root) / "worktrees").mkdir(parents=True, exist_ok=True)
    ignore = orch_dir(main_root) / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n")


async def is_ancestor(cwd: Path, older: str, newer: str) -> bool:
    result = await git("merge-base", "--is-ancestor", older, newer, cwd=cwd, check=False)
    return result.code == 0



# -- orch worktrees list | merge | prune -------------------------------------------------


class WorktreeInfo(BaseModel):
    """One ``orch/*`` branch, compared with the user's current HEAD."""

    branch: str
    run_id: str | None = None  # from the worktree dir name or the commits' orch-run trailer
    path: str | None = None  # the worktree, while one still exists
    head: str  # the branch tip
    base: str | None = None  # merge base with the user's HEAD
    ahead: int = 0
    behind: int = 0
    files_changed: int = 0
    insertions: int = 0
    deletions: int = 0
    merged: bool = False  # merging it would change nothing (merged, also by squash)


class MergeReport(BaseModel):
    branch: str
    run_id: str | None
    into: str  # the user's branch, or "HEAD" when detached
    commit: str  # the user's HEAD after the merge
    squash: bool
    stashed: bool
    already_merged: bool = False
    files_changed: int = 0
    insertions: int = 0
    deletions: int = 0
    warning: str | None = None


class PruneReport(BaseModel):
    salvaged: list[dict[str, Any]] = Field(default_factory=list)  # work committed from leftovers
    removed_worktrees: list[str] = Field(default_factory=list)
    running: list[str] = Field(default_factory=list)  # run ids whose worktrees were left alone
    deleted_branches: list[str] = Field(default_factory=list)
    kept_branches: list[str] = Field(default_factory=list)  # unmerged: pass force to delete


async def _run_id_in_commits(cwd: Path, base: str | None, tip: str, ahead: int) -> str | None:
    span = [f"{base}..{tip}"] if base and ahead else ["-1", tip]
    log = await git("log", "--format=%(trailers:key=orch-run,valueonly)", *span, cwd=cwd)
    return next((line.strip() for line in log.out.splitlines() if line.strip()), None)


async def _adds_nothing(cwd: Path, head: str, tip: str) -> bool:
    """True when merging ``tip`` into ``head`` would leave ``head``'s tree as it is."""
    merged = await git("merge-tree", "--write-tree", head, tip, cwd=cwd, check=False)
    tree = await git("rev-parse", f"{head}^{{tree}}", cwd=cwd)
    return merged.code == 0 and merged.out.split("\n", 1)[0].strip() == tree.out.strip()


async def _branch_info(
    cwd: Path, branch: str, tip: str, head: str | None, path: str | None
) -> WorktreeInfo:
    info = WorktreeInfo(branch=branch, head=tip, path=path)
    if head:
        counts = await git("rev-list", "--left-right", "--count", f"{head}...{tip}", cwd=cwd)
        behind, ahead = (int(n) for n in counts.out.split())
        merge_base = await git("merge-base", head, tip, cwd=cwd, check=False)
        info.base = merge_base.out.strip() or None
        info.ahead, info.behind = ahead, behind
        if info.base:
            stats = await diff_stats(cwd, info.base, tip)
            info.files_changed, info.insertions, info.deletions = stats
        info.merged = ahead == 0 or await _adds_nothing(cwd, head, tip)
    if path:
        info.run_id = Path(path).name
    else:
        info.run_id = await _run_id_in_commits(cwd, info.base, tip, info.ahead)
    return info


async def list_worktrees(repo_root: Path) -> list[WorktreeInfo]:
    """Every ``orch/*`` branch with its worktree (if any) and where it stands against HEAD."""
    main_root = await main_repo_root(repo_root)
    head = await rev("HEAD", repo_root)
    refs = await git(
        "for-each-ref", "--sort=committerdate", "--format=%(refname)%00%(objectname)",
        "refs/heads/orch/", cwd=main_root,
    )  # fmt: skip
    paths = {e["branch"]: e["worktree"] for e in await worktree_entries(main_root) if "branch" in e}
    infos = []
    for line in refs.out.splitlines():
        ref, _, tip = line.partition("\0")
        branch = ref.removeprefix("refs/heads/")
        infos.append(await _branch_info(repo_root, branch, tip, head, paths.get(branch)))
    return infos


def _pick(infos: list[WorktreeInfo], target: str) -> WorktreeInfo:
    target = target.strip()
    hits = [i for i in infos if target in (i.branch, i.run_id)]
    if not hits:
        short = short_run_id(target) if target.startswith("r-") else target
        hits = [i for i in infos if i.branch.endswith("/" + short)]
    if not hits:
        raise NotFound(f"no orch branch matches {target!r}; see `orch worktrees list`")
    if len(hits) > 1:
        names = ", ".join(i.branch for i in hits)
        raise UsageError(f"{target!r} matches several branches ({names}); give the full branch")
    return hits[0]


async def merge(
    repo_root: Path, run_id_or_branch: str, squash: bool = False, stash: bool = False
) -> MergeReport:
    """Merge a run's branch into the user's HEAD (a ``--no-ff`` merge commit, or a squash)."""
    info = _pick(await list_worktrees(repo_root), run_id_or_branch)
    branch, run_id = info.branch, info.run_id
    if info.path:
        raise UsageError(
            f"{branch} still has its worktree at {info.path} (run in progress or interrupted); "
            "wait for the run to end, or run `orch worktrees prune` to salvage it"
        )
    head = await rev("HEAD", repo_root)
    if head is None:
        raise UsageError("your repository has no commits yet; make a first commit, then merge")
    symbolic = await git("symbolic-ref", "-q", "--short", "HEAD", cwd=repo_root, check=False)
    into = symbolic.out.strip() or "HEAD"
    report = MergeReport(branch=branch, run_id=run_id, into=into, commit=head, squash=squash,
                         stashed=False)  # fmt: skip
    if info.merged:
        report.already_merged = True
        return report
    probe = await git(
        "merge-tree", "--write-tree", "--name-only", "--no-messages", head, info.head,
        cwd=repo_root, check=False,
    )  # fmt: skip
    if probe.code == 1:
        files = list(dict.fromkeys(f for f in probe.out.splitlines()[1:] if f.strip()))
        raise UsageError(
            f"merging {branch} into {into} would conflict in {', '.join(files) or 'some files'}; "
            f"merge it by hand (git merge {branch}) and resolve the conflicts"
        )
    if probe.code != 0:
        raise GitError(f"git merge-tree failed: {first_line(probe.err or probe.out)}")
    status = await git("status", "--porcelain", "--untracked-files=no", cwd=repo_root)
    dirty = [line[3:] for line in status.out.splitlines() if line.strip()]
    if dirty and not stash:
        shown = ", ".join(dirty[:3]) + (", ..." if len(dirty) > 3 else "")
        raise UsageError(
            f"your working tree has uncommitted changes ({shown}); "
            "commit or stash them, or pass --stash"
        )
    if dirty:
        await git("stash", "push", "-q", "-m", f"orch: before merging {branch}", cwd=repo_root)
        report.stashed = True
    env = {"GIT_MERGE_AUTOEDIT": "no"}
    trailer = f"\n\norch-run: {run_id}" if run_id else ""
    try:
        if squash:
            subjects = await git("log", "--format=- %s", f"{head}..{info.head}", cwd=repo_root)
            message = f"Squash orch branch {branch}\n\n{subjects.out.strip()}{trailer}"
            await git("merge", "--squash", "-q", f"refs/heads/{branch}", cwd=repo_root, env=env)
            await git("commit", "-q", "-m", message, cwd=repo_root, env=env)
        else:
            message = f"Merge orch branch {branch}{trailer}"
            await git("merge", "--no-ff", "--no-edit", "-q", "-m", message,
                      f"refs/heads/{branch}", cwd=repo_root, env=env)  # fmt: skip
    except OrchError:
        await git("merge", "--abort", cwd=repo_root, check=False)
        await git("reset", "--merge", cwd=repo_root, check=False)
        if report.stashed:
            await git("stash", "pop", "-q", cwd=repo_root, check=False)
        raise
    if report.stashed:
        popped = await git("stash", "pop", "-q", cwd=repo_root, check=False)
        if popped.code != 0:
            report.warning = (
                "your stashed changes did not re-apply cleanly; they are kept in `git stash list`"
            )
    report.commit = await rev("HEAD", repo_root) or head
    stats = await diff_stats(repo_root, head, report.commit)
    report.files_changed, report.insertions, report.deletions = stats
    return report


async def prune(
    repo_root: Path, force: bool = False, is_running: Callable[[str], bool] | None = None
) -> PruneReport:
    """Salvage and remove worktrees of ended runs; delete merged ``orch/*`` branches.

    ``is_running(run_id)`` says whether a run still uses its worktree (None: none does).
    Branches with unmerged commits are kept unless ``force``.
    """
    from .workspaces.worktree import salvage_worktree  # the tier imports this module

    main_root = await main_repo_root(repo_root)
    report = PruneReport()
    parent = await asyncio.to_thread((orch_dir(main_root) / "worktrees").resolve)
    for entry in await worktree_entries(main_root):
        path = Path(entry["worktree"])
        if (await asyncio.to_thread(path.resolve)).parent != parent:
            continue
        if is_running is not None and is_running(path.name):
            report.running.append(path.name)
            continue
        artifact = await salvage_worktree(path, path.name, "interrupted")
        report.removed_worktrees.append(str(path))
        if artifact:
            report.salvaged.append(artifact)
    async with repo_lock(main_root):
        await git("worktree", "prune", cwd=main_root, check=False)
    busy = {e["branch"] for e in await worktree_entries(main_root) if "branch" in e}
    for info in await list_worktrees(repo_root):
        if info.branch in busy:
            continue
        if not (info.merged or force):
            report.kept_branches.append(info.branch)
            continue
        async with repo_lock(main_root):
            await git_retry("branch", "-D", info.branch, cwd=main_root)
        report.deleted_branches.append(info.branch)
    return report
