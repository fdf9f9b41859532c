"""A lead team's integration branch: where each checked task's work is merged, on the host.

``orch/team/<id>`` starts at the user's HEAD. A task's branch starts at the integration
branch's tip; once its work passed the gate and the reviewers, it is merged onto the
integration branch without a checkout: ``git merge-tree --write-tree`` makes the merged tree
(or names the conflicting files), ``git commit-tree`` the merge commit, and ``update-ref``
moves the branch only if nobody moved it meanwhile, all under the repository's lock. Every
git process comes from ``project/git.py`` (no hooks, no drivers, an explicit ``GIT_DIR``).
"""

from __future__ import annotations

from ..errors import OrchError
from ..project.git import RepoPaths, first_line, git
from ..project.repo import is_ancestor, repo_lock, rev
from ..workspaces.settle import commit_env


class Conflict(OrchError):
    """The task's branch does not merge cleanly onto the integration branch."""


async def ensure_branch(repo: RepoPaths, branch: str, at: str) -> str:
    """``branch`` (made at ``at`` when missing); its tip."""
    async with repo_lock(repo.main_root):
        tip = await rev(f"refs/heads/{branch}", repo)
        if tip is None:
            await git("branch", "--no-track", branch, at, repo=repo)
            tip = at
    return tip


async def delete_if_unused(repo: RepoPaths, branch: str, start: str) -> None:
    """Delete a task branch that holds no commit beyond where it started."""
    async with repo_lock(repo.main_root):
        if await rev(f"refs/heads/{branch}", repo) == start:
            await git("branch", "-D", branch, repo=repo, check=False)


async def merge_onto(repo: RepoPaths, target: str, branch: str, message: str) -> str:
    """Merge ``branch`` onto ``target`` (neither checked out); the new tip of ``target``."""
    async with repo_lock(repo.main_root):
        tip = await rev(f"refs/heads/{target}", repo)
        head = await rev(f"refs/heads/{branch}", repo)
        if tip is None or head is None:
            raise OrchError(f"branch {target if tip is None else branch} is gone")
        if await is_ancestor(repo, head, tip):
            return tip  # nothing new
        merged = await git(
            "merge-tree",
            "--write-tree",
            "--name-only",
            "--no-messages",
            tip,
            head,
            repo=repo,
            check=False,
        )
        lines = merged.out.strip().splitlines()
        if merged.code == 1:
            files = ", ".join(line for line in lines[1:] if line.strip()) or "(unnamed)"
            raise Conflict(f"merging onto {target} conflicts in: {files}")
        if merged.code != 0 or not lines:
            raise OrchError(f"git merge-tree failed: {first_line(merged.err or merged.out)}")
        made = await git(
            "commit-tree",
            lines[0],
            "-p",
            tip,
            "-p",
            head,
            "-m",
            message,
            repo=repo,
            identity=commit_env("team"),
        )
        commit = made.out.strip()
        await git("update-ref", f"refs/heads/{target}", commit, tip, repo=repo)
        return commit
