"""The ``orch/<agent>/<id>`` branches worktree runs leave behind: list, merge, prune.

``list_branches`` compares each branch with the user's HEAD; ``merge`` merges one
into the user's current branch (a ``--no-ff`` merge commit or a squash), refusing on
conflicts, on a dirty tree, and on changes to control files (:func:`control_changes`:
orch's and git's own configuration, CI, hooks) unless ``allow_control_files``;
``prune`` salvages and removes worktrees of ended runs and deletes merged branches.

Listing and merging are synchronous and use GitPython (refs, commits and config read in
Python); every git process GitPython starts goes through :mod:`orchestrator.project.git`
(:class:`_HardenedGit`): scrubbed environment, forced config, drivers neutralized,
explicit ``GIT_DIR``/``GIT_WORK_TREE``. Merge commits carry the user's identity (from
their config, parsed by GitPython, or ``GIT_AUTHOR_*``/``GIT_COMMITTER_*``), unsigned.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from .errors import NotFound, OrchError, UsageError
from .policy.controlscan import control_paths
from .project.git import (
    EMPTY_TREE,
    IDENTITY_KEYS,
    GitError,
    RepoPaths,
    first_line,
    git,
    git_sync,
    spawn_sync,
)
from .project.gitpy import GitCommandError, gitpython
from .project.repo import (
    discover,
    discover_sync,
    orch_dir,
    parse_shortstat,
    parse_worktree_list,
    repo_lock,
    repo_lock_sync,
    short_run_id,
    worktree_entries,
)

CONTROL_FLAG = "--allow-control-files"
# every diff: no external diff or textconv, and never into a submodule (nor its .gitmodules)
_DIFF_SAFE = ("--no-textconv", "--no-ext-diff", "--ignore-submodules=dirty")


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
    control_files: list[str] = Field(default_factory=list)  # merged with allow_control_files
    warning: str | None = None


class PruneReport(BaseModel):
    salvaged: list[dict[str, Any]] = Field(default_factory=list)  # work committed from leftovers
    removed_worktrees: list[str] = Field(default_factory=list)
    running: list[str] = Field(default_factory=list)  # run ids whose worktrees were left alone
    deleted_branches: list[str] = Field(default_factory=list)
    kept_branches: list[str] = Field(default_factory=list)  # unmerged: pass force to delete


# -- GitPython, through orchestrator.project.git ---------------------------------------


class GitFailed(GitCommandError):
    """A git command GitPython ran failed (with git's first error line kept)."""

    def __init__(self, args: Sequence[str], code: int, out: str, err: str) -> None:
        super().__init__(["git", *args], code, err, out)
        self.detail, self.code = first_line(err or out), code


class _HardenedGit(gitpython.cmd.Git):
    """GitPython's command runner with every process started by :mod:`orchestrator.project.git`.

    GitPython's own ``execute`` copies ``os.environ`` (API keys included) into git's
    environment; this one never does. ``env`` given to a command may only carry the
    author/committer identity.
    """

    where: RepoPaths  # set by the subclass open_repo makes

    def execute(  # type: ignore[override]
        self,
        command: Sequence[Any],
        *,
        istream: Any = None,
        with_extended_output: bool = False,
        with_exceptions: bool = True,
        as_process: bool = False,
        strip_newline_in_stdout: bool = True,
        env: Mapping[str, str] | None = None,
        **unsupported: Any,
    ) -> Any:
        args = [os.fspath(a) for a in command[1:]]  # command[0]: GitPython's git executable
        if as_process:  # the persistent cat-file of GitPython's object database
            return self.AutoInterrupt(spawn_sync(args, self.where, istream), args)
        if istream is not None or any(v not in (None, True) for v in unsupported.values()):
            raise NotImplementedError(f"orch's GitPython adapter: {sorted(unsupported)}")
        result = git_sync(*args, repo=self.where, check=False, identity=env)
        if with_exceptions and result.code != 0:
            raise GitFailed(args, result.code, result.out, result.err)
        out = result.out
        if strip_newline_in_stdout and out.endswith("\n"):
            out = out[:-1]
        return (result.code, out, result.err) if with_extended_output else out


@contextmanager
def open_repo(where: RepoPaths) -> Iterator[gitpython.Repo]:
    """A GitPython repository at ``where`` whose git processes are all hardened."""

    class Git(_HardenedGit):
        pass

    Git.where = where

    class Repo(gitpython.Repo):
        GitCommandWrapperType = Git

    repo = Repo(os.fspath(where.git_dir))
    try:
        yield repo
    finally:
        repo.close()


def user_identity(repo: gitpython.Repo) -> dict[str, str]:
    """The user's name and email (system, global and repository config, parsed in Python,
    never run), overridden by ``GIT_AUTHOR_*``/``GIT_COMMITTER_*`` of the environment."""
    ident: dict[str, str] = {}
    with repo.config_reader() as cfg:
        for what in ("name", "email"):
            value = str(cfg.get_value("user", what, default=""))
            if value:
                ident[f"GIT_AUTHOR_{what.upper()}"] = ident[f"GIT_COMMITTER_{what.upper()}"] = value
    ident.update({k: v for k, v in os.environ.items() if k in IDENTITY_KEYS})
    return ident


# -- control files --------------------------------------------------------------------------


def _hooks_dirs(repo: gitpython.Repo, work_tree: Path | None) -> list[str]:
    """``core.hooksPath`` when it points inside the work tree, relative to it."""
    with repo.config_reader() as cfg:
        value = str(cfg.get_value("core", "hooksPath", default="")).strip()
    if not value or work_tree is None:
        return []
    path = Path(os.path.expanduser(value))
    if not path.is_absolute():
        return [path.as_posix().strip("/")]
    try:
        return [Path(os.path.realpath(path)).relative_to(os.path.realpath(work_tree)).as_posix()]
    except ValueError:
        return []


def _control_changes(
    repo: gitpython.Repo, work_tree: Path | None, base: str, tip: str
) -> list[str]:
    return control_paths(repo, _hooks_dirs(repo, work_tree), base, tip)


def control_changes(repo: Path | RepoPaths, base: str | None, tip: str) -> list[str]:
    """Control paths (any dot-path, CI, agent-client, editor and package-manager
    configuration, hooks, manifests' install scripts, what control links point at:
    ``policy/controlscan.py``) that ``tip`` changes against ``base`` (None: the empty tree),
    deletions, mode changes and both sides of renames included. ``repo``: a directory of the
    user's repository, or its :class:`RepoPaths`."""
    where = repo if isinstance(repo, RepoPaths) else discover_sync(repo)
    with open_repo(where) as r:
        return _control_changes(r, where.work_tree, base or EMPTY_TREE, tip)


# -- list -----------------------------------------------------------------------------------


def _adds_nothing(repo: gitpython.Repo, head: str, tip: str) -> bool:
    """True when merging ``tip`` into ``head`` would leave ``head``'s tree as it is."""
    code, out, _ = repo.git.merge_tree(
        "--write-tree", head, tip, with_extended_output=True, with_exceptions=False
    )
    return bool(code == 0 and out.split("\n", 1)[0].strip() == repo.commit(head).tree.hexsha)


def _run_id_in_commits(repo: gitpython.Repo, base: str | None, tip: str, ahead: int) -> str | None:
    span = [f"{base}..{tip}"] if base and ahead else ["-1", tip]
    log = repo.git.log("--format=%(trailers:key=orch-run,valueonly)", *span)
    return next((line.strip() for line in log.splitlines() if line.strip()), None)


def _branch_info(
    repo: gitpython.Repo, branch: str, tip: str, head: str | None, path: str | None
) -> WorktreeInfo:
    info = WorktreeInfo(branch=branch, head=tip, path=path)
    if head:
        behind, ahead = (
            int(n) for n in repo.git.rev_list("--left-right", "--count", f"{head}...{tip}").split()
        )
        bases = repo.merge_base(head, tip)
        info.base = bases[0].hexsha if bases else None
        info.ahead, info.behind = ahead, behind
        if info.base:
            stats = repo.git.diff("--shortstat", *_DIFF_SAFE, info.base, tip)
            info.files_changed, info.insertions, info.deletions = parse_shortstat(stats)
        info.merged = ahead == 0 or _adds_nothing(repo, head, tip)
    if path:
        info.run_id = Path(path).name
    else:
        info.run_id = _run_id_in_commits(repo, info.base, tip, info.ahead)
    return info


def _head(repo: gitpython.Repo) -> str | None:
    return repo.head.commit.hexsha if repo.head.is_valid() else None


def _infos(repo: gitpython.Repo) -> list[WorktreeInfo]:
    head = _head(repo)
    listed = parse_worktree_list(repo.git.worktree("list", "--porcelain", "-z"))
    paths = {e["branch"]: e["worktree"] for e in listed if "branch" in e}
    heads = [h for h in repo.heads if h.path.startswith("refs/heads/orch/")]
    heads.sort(key=lambda h: (h.commit.committed_date, h.path))
    infos = []
    for h in heads:
        branch = h.path.removeprefix("refs/heads/")
        infos.append(_branch_info(repo, branch, h.commit.hexsha, head, paths.get(branch)))
    return infos


def list_branches(repo_root: Path) -> list[WorktreeInfo]:
    """Every ``orch/*`` branch with its worktree (if any) and where it stands against HEAD."""
    with open_repo(discover_sync(repo_root)) as repo:
        return _infos(repo)


def find_branch(repo_root: Path, target: str) -> WorktreeInfo:
    """The ``orch/*`` branch ``target`` names: a branch, a run id, or a run's short id."""
    with open_repo(discover_sync(repo_root)) as repo:
        return _pick(_infos(repo), target)


# -- merge ----------------------------------------------------------------------------------


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


def _check_mergeable(repo: gitpython.Repo, info: WorktreeInfo, head: str, into: str) -> None:
    code, out, err = repo.git.merge_tree(
        "--write-tree",
        "--name-only",
        "--no-messages",
        head,
        info.head,
        with_extended_output=True,
        with_exceptions=False,
    )
    if code == 1:
        files = list(dict.fromkeys(f for f in out.splitlines()[1:] if f.strip()))
        raise UsageError(
            f"merging {info.branch} into {into} would conflict in "
            f"{', '.join(files) or 'some files'}; merge it by hand (git merge {info.branch}) "
            "and resolve the conflicts"
        )
    if code != 0:
        raise GitError(["merge-tree"], repo.working_dir, first_line(err or out), code)


def _merge_commit(
    repo: gitpython.Repo, info: WorktreeInfo, head: str, squash: bool, ident: dict[str, str]
) -> None:
    trailer = f"\n\norch-run: {info.run_id}" if info.run_id else ""
    ref = f"refs/heads/{info.branch}"
    if squash:
        subjects = repo.git.log("--format=- %s", f"{head}..{info.head}")
        message = f"Squash orch branch {info.branch}\n\n{subjects.strip()}{trailer}"
        repo.git.merge("--squash", "-q", ref, env=ident)
        repo.git.commit("-q", "--no-verify", "-m", message, env=ident)
    else:
        message = f"Merge orch branch {info.branch}{trailer}"
        repo.git.merge("--no-ff", "--no-edit", "--no-verify", "-q", "-m", message, ref, env=ident)


def merge(
    repo_root: Path,
    run_id_or_branch: str,
    squash: bool = False,
    stash: bool = False,
    allow_control_files: bool = False,
) -> MergeReport:
    """Merge a run's branch into the user's HEAD (a ``--no-ff`` merge commit, or a squash).

    Refuses when the branch still has its worktree, changes control files (unless
    ``allow_control_files``), would conflict, or the tree is dirty (unless ``stash``).
    """
    where = discover_sync(repo_root)
    with repo_lock_sync(where.main_root), open_repo(where) as repo:  # one merge at a time
        info = _pick(_infos(repo), run_id_or_branch)
        if info.path:
            raise UsageError(
                f"{info.branch} still has its worktree at {info.path} (run in progress or "
                "interrupted); wait for the run to end, or run `orch worktrees prune` to salvage it"
            )
        head = _head(repo)
        if head is None:
            raise UsageError("your repository has no commits yet; make a first commit, then merge")
        into = "HEAD" if repo.head.is_detached else repo.active_branch.name
        report = MergeReport(
            branch=info.branch,
            run_id=info.run_id,
            into=into,
            commit=head,
            squash=squash,
            stashed=False,
        )
        if info.merged:
            report.already_merged = True
            return report
        control = _control_changes(repo, where.work_tree, info.base or EMPTY_TREE, info.head)
        if control and not allow_control_files:
            shown = ", ".join(control[:5]) + (", ..." if len(control) > 5 else "")
            raise UsageError(
                f"{info.branch} changes control files ({shown}); review them "
                f"(git diff {head[:10]}...{info.branch}) and pass {CONTROL_FLAG} to merge anyway"
            )
        report.control_files = control
        _check_mergeable(repo, info, head, into)
        _merge_into(repo, info, head, report, stash)
        return report


def _merge_into(
    repo: gitpython.Repo, info: WorktreeInfo, head: str, report: MergeReport, stash: bool
) -> None:
    status = repo.git.status("--porcelain", "--untracked-files=no", "--ignore-submodules=dirty")
    dirty = [line[3:] for line in status.splitlines() if line.strip()]
    if dirty and not stash:
        shown = ", ".join(dirty[:3]) + (", ..." if len(dirty) > 3 else "")
        raise UsageError(
            f"your working tree has uncommitted changes ({shown}); "
            "commit or stash them, or pass --stash"
        )
    ident = user_identity(repo)
    if dirty:
        repo.git.stash("push", "-q", "-m", f"orch: before merging {info.branch}", env=ident)
        report.stashed = True
    try:
        _merge_commit(repo, info, head, report.squash, ident)
    except (GitFailed, OrchError) as e:
        repo.git.merge("--abort", with_exceptions=False)
        repo.git.reset("--merge", with_exceptions=False)
        if report.stashed:
            repo.git.stash("pop", "-q", with_exceptions=False)
        if isinstance(e, GitFailed):
            raise GitError(["merge"], repo.working_dir, e.detail, e.code) from e
        raise
    if report.stashed:
        code, _, _ = repo.git.stash("pop", "-q", with_extended_output=True, with_exceptions=False)
        if code != 0:
            report.warning = (
                "your stashed changes did not re-apply cleanly; they are kept in `git stash list`"
            )
    report.commit = _head(repo) or head
    stats = repo.git.diff("--shortstat", *_DIFF_SAFE, head, report.commit)
    report.files_changed, report.insertions, report.deletions = parse_shortstat(stats)


# -- prune ----------------------------------------------------------------------------------


async def prune(
    repo_root: Path, force: bool = False, is_running: Callable[[str], bool] | None = None
) -> PruneReport:
    """Salvage and remove worktrees of ended runs; delete merged ``orch/*`` branches.

    ``is_running(run_id)`` says whether a run still uses its worktree (None: none does).
    Branches with unmerged commits are kept unless ``force``.
    """
    from .workspaces.worktree import salvage_worktree

    main = (await discover(repo_root)).main()
    report = PruneReport()
    parent = await asyncio.to_thread((orch_dir(main.main_root) / "worktrees").resolve)
    for entry in await worktree_entries(main):
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
    async with repo_lock(main.main_root):
        await git("worktree", "prune", repo=main, check=False)
    busy = {e["branch"] for e in await worktree_entries(main) if "branch" in e}
    for info in await asyncio.to_thread(list_branches, repo_root):
        if info.branch in busy:
            continue
        if not (info.merged or force):
            report.kept_branches.append(info.branch)
            continue
        async with repo_lock(main.main_root):
            await git("branch", "-D", info.branch, repo=main, retry=True)
        report.deleted_branches.append(info.branch)
    return report
