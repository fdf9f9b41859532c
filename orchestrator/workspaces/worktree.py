"""Worktree tier: each run gets its own git checkout and branch; work comes back as a branch.

The worktree is made under ``<main repo root>/.orch/worktrees/<run_id>`` (the
main root is the directory holding the common ``.git``, even when the base is
itself a worktree of a parent run) on a new branch ``orch/<agent>/<short id>``
based on the current HEAD of ``spec.base``: the user's HEAD for a root run, the
parent's worktree HEAD for a nested child. Only committed state is carried:
uncommitted changes of the user (or of a parent run) are NOT in the new
worktree. Git-ignored or untracked files named by ``spec.include`` and
``.worktreeinclude`` (glob patterns) are copied in; copies left unchanged are
not committed back.

The worktree is locked while the run lives. At close (also on cancellation:
the close is shielded) every uncommitted change, untracked files included, is
committed on the branch as ``orch <agent> <orch@localhost>`` with ``orch-run``
and ``orch-status`` trailers. A branch with no commits beyond its base is
deleted with its worktree; otherwise the worktree directory is removed and the
branch kept (:mod:`.settle`). ``git worktree add/remove`` and ``git branch -D``
are serialized per repository (an asyncio lock and an flock on
``.orch/worktrees.lock``). Every git command runs through :mod:`orchestrator.project.git`
with an explicit ``GIT_DIR`` (the worktree's admin dir, found from the main
repository, never from a ``.git`` file in a tree a run wrote).

Continuing a branch: ``spec.branch`` names an existing ``orch/*`` branch
(left by an earlier run, e.g. a writer going on after a review) to check out in
the new worktree instead of making a new one. New work is committed on it; it
is never deleted, even when the run changed nothing (nor by a salvage: only a
run's own ``orch/<agent>/<short id>`` branch is). ``spec.branch_base`` is the
commit its artifact is measured from (default: the branch tip, i.e. only what
this run adds). ``discard`` (a team's test gate, its reviewers) commits nothing: the
worktree goes at the end with whatever the run changed, also after a crash (its lock says so).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from pathlib import Path
from stat import S_ISREG
from typing import Any, ClassVar, Literal

from ..errors import OrchError, UsageError
from ..fs.safefs import Beneath, UnsafePath
from ..project.git import RETRIES, GitError, RepoPaths, first_line, git, lock_contention
from ..project.repo import ensure_orch_dir, locate, orch_dir, repo_lock, rev, worktree_paths
from .base import ProcessResult, RunOutcome, Runtime, TierConfig, WorkspaceSpec
from .branch import branch_name, continued_start, ref_component, with_branch
from .hiding import absolute_hidden, hidden_reason, hidden_rels
from .host import HostRuntime, confinement, os_sandbox_mode
from .includes import excluded_paths, include_files, untracked, write_includes
from .lifetime import Shielded
from .saved import BranchState, Confined
from .settle import commit_message, lock_reason, remove_worktree, salvage_worktree, settle
from .spare import Shell

__all__ = ["WorktreeConfig", "WorktreeWorkspace", "salvage_worktree"]

# -- filesystem helpers (blocking: run them in a thread) ---------------------------------


def _drop_unchanged_copies(root: Path, copied: Mapping[str, tuple[int, int]]) -> None:
    """Included copies the run did not touch go away so they are not committed back.

    Only regular files still beneath ``root``, through safefs: a run that swapped a
    directory for a symlink never gets orch to delete a file elsewhere.
    """
    with Beneath(root) as fs:
        for rel, (size, mtime) in copied.items():
            with contextlib.suppress(OSError, UnsafePath):
                st = fs.stat(rel)
                if S_ISREG(st.st_mode) and (st.st_size, st.st_mtime_ns) == (size, mtime):
                    fs.remove(rel)


# -- the workspace ----------------------------------------------------------------------


class WorktreeWorkspace(Shielded):
    isolation = "worktree"
    _main: RepoPaths | None = None  # the main checkout, once found
    _tree: RepoPaths | None = None  # the worktree (its admin dir as GIT_DIR), once made

    def __init__(self, spec: WorkspaceSpec) -> None:
        self.spec = spec
        self.base_path = spec.base.resolve()
        self.root: Path = self.base_path  # the worktree once entered
        # an existing branch to go on with: checked out, committed on, never deleted
        self.continued: str | None = spec.branch or None
        self.branch = self.continued or branch_name(spec.agent, spec.run_id)
        self.base_commit = ""
        self.main_root: Path | None = None
        self.hidden: tuple[str, ...] = (".orch",)  # set once made: ``hiding.hidden_rels``
        self._outcome: RunOutcome | None = None
        self._created = False
        self._owns_branch = False
        self._copied: dict[str, tuple[int, int]] = {}
        self._shell: Shell | None = None  # its commands' sandboxes, once made
        self._artifacts: list[dict[str, Any]] = []
        self._tip = ""  # a continued branch's tip when the run started

    async def _open(self) -> None:
        await self._create()

    async def _undo(self) -> None:
        if self._shell is not None:
            await self._shell.aclose()
        await self._discard()

    async def _shut(self, exc_type: type[BaseException] | None) -> None:
        if self._shell is not None:
            await self._shell.aclose()  # no sandbox made ahead outlives the run
        await self._close(RunOutcome.at_exit(self._outcome, exc_type, self.spec.description))

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str]
    ) -> ProcessResult:
        if not self._created or self._shell is None:  # never run in the user's tree
            raise OrchError("the worktree workspace is not open; use it inside `async with`")
        return await self._shell.exec(command, timeout_s=timeout_s, env=env)

    def set_outcome(self, outcome: RunOutcome) -> None:
        self._outcome = outcome

    def info(self) -> dict[str, Any]:
        repo = str(self.main_root) if self.main_root else None
        saved = WorktreeState(
            root=str(self.root),
            branch=self.branch,
            base=self.base_commit,
            repo=repo,
            **confinement(self.spec),
        )
        return saved.dump()

    def artifacts(self) -> list[dict[str, Any]]:
        return [dict(a) for a in self._artifacts]

    def runtime(self) -> Runtime:
        shell = self._shell
        expect, start = (shell.expect, shell.start) if shell is not None else (None, None)
        return HostRuntime(self.root, self.exec, self.hidden, expect, start)

    # -- internals ----------------------------------------------------------------------

    async def _create(self) -> None:
        spec = self.spec
        located = await locate(self.base_path)  # a parent's worktree: through its admin dir
        base_top = located.work_tree or self.base_path
        head = await rev("HEAD", located)
        if head is None:
            raise UsageError(
                f"the git repository at {base_top} has no commits yet; "
                "make a first commit or use isolation 'shared'"
            )
        main = located.main()
        self.base_commit = head
        if self.continued is not None:
            tip, self.base_commit = await continued_start(main, self.branch, spec.branch_base)
            self._tip = tip
        self.main_root, self._main = main.main_root, main
        await asyncio.to_thread(ensure_orch_dir, main.main_root)
        patterns = list(spec.include)
        path = orch_dir(main.main_root) / "worktrees" / spec.run_id
        # a worktree is a checkout of the base: what is hidden there is hidden here too
        self.hidden = hidden_rels(spec, [path, base_top, main.main_root])
        reason = lock_reason(spec.run_id, self.base_commit, spec.discard)
        # git's worktree registration is serialised (concurrent adds fail on the common
        # dir); the checkout is this worktree's own: made outside the lock, so forty
        # children do not check out one after another
        async with repo_lock(main.main_root):
            await self._add(main, path, reason)
        self.root = path
        self._created = True
        self._shell = Shell(
            spec,
            path,
            read_only_within=(path / ".git", main.main_root / ".git"),
            hidden_within=absolute_hidden(path, self.hidden),
        )
        spec.sink.register_resource(spec.run_id, "worktree", str(path))
        self._tree = await asyncio.to_thread(worktree_paths, main, path)
        if self._tree is None:
            raise OrchError(f"git worktree add left no admin dir for {path}; run again")
        filled = await git("reset", "--hard", "-q", repo=self._tree, cwd=path, check=False)
        if filled.code != 0:
            raise OrchError(f"checking out {self.branch} failed: {first_line(filled.err)}")
        await self._copy_includes(located, base_top, patterns)

    async def _add(self, main: RepoPaths, path: Path, reason: str) -> None:
        delay = 0.05
        for attempt in range(RETRIES):
            args = ["worktree", "add", "--no-checkout", "--lock", "--reason", reason]
            # an existing branch (continued, or made by an earlier attempt that failed) is
            # checked out as it is; otherwise the branch is made here from the base. A
            # throwaway checkout of a branch holds its tip detached: several at once (a
            # team's reviewers) may look at one branch, and none can move it.
            if self.continued is not None and self.spec.discard:
                args += ["--detach", str(path), self._tip]
            elif self.continued is not None or self._owns_branch:
                args += [str(path), self.branch]
            else:
                args += ["-b", self.branch, str(path), self.base_commit]
            result = await git(*args, repo=main, check=False)
            if result.code == 0:
                self._owns_branch = self.continued is None
                return
            if self.continued is not None:
                if "already" in result.err:  # checked out (or used) by another worktree
                    raise OrchError(
                        f"branch {self.branch} is in use by another worktree "
                        f"({first_line(result.err)}); wait for that run to end"
                    )
            elif "a branch named" in result.err and not self._owns_branch:
                raise OrchError(
                    f"branch {self.branch} already exists; merge or delete it "
                    "(orch worktrees prune) and run again"
                )
            elif not self._owns_branch and await rev(f"refs/heads/{self.branch}", main):
                self._owns_branch = True
            if not lock_contention(result) or attempt == RETRIES - 1:
                raise GitError(args, main.main_root, first_line(result.err or result.out))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _copy_includes(self, base: RepoPaths, base_top: Path, patterns: list[str]) -> None:
        """The untracked files ``.worktreeinclude`` and ``patterns`` name, copied from the
        base's tree through safefs (:mod:`.includes`): no link followed, no store, nothing
        hidden."""
        never = excluded_paths(self.spec)
        files = await asyncio.to_thread(include_files, base_top, patterns, never)
        wanted = await untracked(base, sorted(files)) if files else []
        chosen = {rel: files[rel] for rel in wanted if hidden_reason(rel, self.hidden) is None}
        self._copied = await asyncio.to_thread(write_includes, self.root, chosen)

    async def _discard(self) -> None:
        """Undo a creation that failed or was cancelled half way (there is no work yet)."""
        main = self._main
        if main is None:
            return
        if self._created:
            await remove_worktree(main, self.root, None if self.continued else self.branch)
            self.spec.sink.release_resource(self.spec.run_id, "worktree", str(self.root))
        elif self._owns_branch:
            path = orch_dir(main.main_root) / "worktrees" / self.spec.run_id
            await remove_worktree(main, path, self.branch)
        self._created = False
        self.root = self.base_path

    async def _close(self, outcome: RunOutcome) -> None:
        if not self._created or self._main is None:
            return
        if self.spec.discard:  # a throwaway checkout (a gate, a reviewer): nothing is kept
            await remove_worktree(self._main, self.root, None if self.continued else self.branch)
            self._created = False
            self.spec.sink.release_resource(self.spec.run_id, "worktree", str(self.root))
            return
        if self._copied:
            await asyncio.to_thread(_drop_unchanged_copies, self.root, self._copied)
        message = commit_message(
            outcome.description or self.spec.description, self.spec.run_id, outcome.status
        )
        self._artifacts = await settle(
            self._main,
            self.root,
            self._tree,
            self.branch,
            self.base_commit,
            ref_component(self.spec.agent),
            message,
            self.continued is not None,
            list(self.spec.commit_exclude),
        )
        self._created = False
        self.spec.sink.release_resource(self.spec.run_id, "worktree", str(self.root))


class WorktreeState(BranchState, Confined):
    isolation: Literal["worktree"] = "worktree"


class WorktreeConfig(TierConfig):
    """``isolation: worktree``: an own checkout on an own branch ``orch/<agent>/<id>``.

    ``branch`` continues an existing ``orch/*`` branch instead (a writer going on after
    a review); ``base`` is the commit its artifact is measured from.
    """

    type: Literal["worktree"] = "worktree"
    branch: str | None = None
    base: str | None = None
    discard: bool = False  # nothing is committed: the checkout is thrown away at the end
    needs_git: ClassVar[bool] = True

    def provision(self, spec: WorkspaceSpec) -> WorktreeWorkspace:
        os_sandbox_mode(spec)  # fails closed here when bwrap cannot run
        return WorktreeWorkspace(with_branch(spec, self.branch, self.base, self.discard))
