"""Settling a run's worktree: commit its work on its branch, then remove the worktree.

At close (also on cancellation, and when ``orch worktrees prune`` or a reconcile
salvages an interrupted run) every uncommitted change, untracked files included, is
committed on the branch as ``orch <agent> <orch@localhost>`` with ``orch-run`` and
``orch-status`` trailers. A branch with no commits beyond its base is deleted with its
worktree; otherwise the worktree directory is removed and the branch kept. Every git
command runs through :mod:`orchestrator.project.git`, with the worktree's admin dir as
``GIT_DIR``: nothing the run wrote into the tree (a ``.git`` file, nested repositories,
``.gitattributes`` naming drivers) makes host git run anything.

Build artefacts stay out: ``git add`` runs with ``core.excludesFile`` set to a host-owned
temp file holding the run's ``commit_exclude`` patterns (``config.DEFAULT_COMMIT_EXCLUDE``
plus the setting; a salvage after a crash uses the defaults), then the user's global
ignore file, which so keeps the last word. Ignore rules never apply to tracked files: a
tracked ``.pyc`` that changed is committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from ..config import DEFAULT_COMMIT_EXCLUDE
from ..errors import UsageError
from ..project.git import RepoPaths, git, user_excludes_file
from ..project.repo import (
    diff_stats,
    discover,
    is_ancestor,
    orch_dir,
    orch_worktree_root,
    repo_lock,
    rev,
    short_run_id,
    worktree_entries,
    worktree_paths,
)

ORCH_EMAIL = "orch@localhost"
_BASE_IN_REASON = re.compile(r"\(base ([0-9a-f]{7,64})\)")
USER_EXCLUDES_MAX = 1024 * 1024  # of the user's global ignore file, copied after orch's


def agent_of_branch(branch: str) -> str:
    parts = branch.split("/")
    return parts[1] if len(parts) == 3 and parts[0] == "orch" else "agent"


def commit_message(description: str, run_id: str, status: str) -> str:
    return f"{description.strip() or 'orch run'}\n\norch-run: {run_id}\norch-status: {status}\n"


def commit_env(agent: str) -> dict[str, str]:
    name = f"orch {agent}"
    return {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": ORCH_EMAIL,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": ORCH_EMAIL,
    }


def owns_branch(branch: str, run_id: str) -> bool:
    """True for the branch a run makes for itself (``orch/<agent>/<short id>``)."""
    parts = branch.split("/")
    return len(parts) == 3 and parts[0] == "orch" and parts[2] == short_run_id(run_id)


DISCARD = " (discard)"  # in a worktree's lock reason: nothing of it is ever committed


def lock_reason(run_id: str, base: str, discard: bool = False) -> str:
    """The reason git keeps with a run's worktree lock: whose it is, its base, and whether
    its changes are thrown away (a team's gate or reviewer checkout), also after a crash."""
    return f"orch run {run_id} (base {base})" + (DISCARD if discard else "")


def _same_path(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def _discard_dir(path: Path, main_root: Path) -> None:
    if path.parent == orch_dir(main_root) / "worktrees":
        shutil.rmtree(path, ignore_errors=True)


async def remove_worktree(main: RepoPaths, path: Path, branch: str | None) -> None:
    """Unlock and remove a worktree, then delete ``branch`` when given."""
    async with repo_lock(main.main_root):
        await git("worktree", "unlock", str(path), repo=main, check=False)
        result = await git(
            "worktree",
            "remove",
            "--force",
            "--force",
            str(path),
            repo=main,
            check=False,
            retry=True,
        )
        if result.code != 0:
            await asyncio.to_thread(_discard_dir, path, main.main_root)
            await git("worktree", "prune", repo=main, check=False)
        if branch:
            await git("branch", "-D", branch, repo=main, check=False, retry=True)


def _write_excludes(fd: int, patterns: Sequence[str]) -> None:
    """``patterns``, then the user's global ignore file: a later line wins, so a ``!x`` in
    ``commit_exclude`` (a repository's ``orch.toml``) never un-ignores what the user's does."""
    with os.fdopen(fd, "wb") as f:
        f.write("".join(f"{p}\n" for p in patterns).encode())
        with contextlib.suppress(OSError), open(user_excludes_file(), "rb") as user:
            f.write(user.read(USER_EXCLUDES_MAX))


@contextlib.asynccontextmanager
async def excludes(patterns: Sequence[str]) -> AsyncIterator[list[tuple[str, str]]]:
    """The git config that leaves ``patterns`` out of ``git add``/``status``, on top of the
    user's global ignore file (``core.excludesFile``: one file, so both go in one)."""
    if not patterns:
        yield []
        return
    fd, path = await asyncio.to_thread(tempfile.mkstemp, prefix="orch-exclude-")
    try:
        await asyncio.to_thread(_write_excludes, fd, patterns)
        yield [("core.excludesFile", path)]
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


async def commit_all(
    tree: RepoPaths, agent: str, message: str, exclude: Sequence[str] = DEFAULT_COMMIT_EXCLUDE
) -> bool:
    """Commit every change in the worktree ``tree`` but untracked files matching ``exclude``
    (gitignore patterns); False when there was nothing to commit.

    Through :mod:`orchestrator.project.git` (the admin dir as ``GIT_DIR``: a ``.git`` the run wrote
    is not read; no hooks, fsmonitor or drivers). Nested repositories and submodules are
    never looked into (``--ignore-submodules=dirty``: only their HEAD is read).
    """
    async with excludes(exclude) as cfg:
        status = await git(
            "status",
            "--porcelain",
            "-z",
            "--untracked-files=all",
            "--ignore-submodules=dirty",
            repo=tree,
            config=cfg,
        )
        if not status.out:
            return False
        await _add_all(tree, status.out, cfg)
    staged = await git(
        "diff",
        "--cached",
        "--quiet",
        "--no-ext-diff",
        "--no-textconv",
        "--ignore-submodules=dirty",
        repo=tree,
        check=False,
    )
    if staged.code == 0:
        return False
    await git(
        "commit",
        "--no-verify",
        "-q",
        "--cleanup=whitespace",
        "-m",
        message,
        repo=tree,
        identity=commit_env(agent),
        retry=True,
    )
    return True


async def _add_all(tree: RepoPaths, status: str, cfg: list[tuple[str, str]]) -> None:
    # add fails on a file that vanishes mid-walk (try again) or on a nested repository
    # without a commit: then add the rest, and each nested repository with a commit alone
    for _ in range(2):
        added = await git("add", "-A", repo=tree, retry=True, check=False, config=cfg)
        if added.code == 0:
            return
    nested = [e[3:] for e in status.split("\0") if e.startswith("?? ") and e.endswith("/")]
    skip = [f":(exclude,literal){path}" for path in nested]
    await git("add", "-A", "--", ".", *skip, repo=tree, retry=True, config=cfg)
    for path in nested:
        await git("add", "--", f":(literal){path.rstrip('/')}", repo=tree, check=False, config=cfg)


async def settle(
    main: RepoPaths,
    root: Path,
    tree: RepoPaths | None,
    branch: str,
    base: str,
    agent: str,
    message: str,
    keep_branch: bool = False,
    exclude: Sequence[str] = DEFAULT_COMMIT_EXCLUDE,
) -> list[dict[str, Any]]:
    """Commit the work in ``root`` on ``branch`` (but untracked files matching ``exclude``);
    remove the worktree; keep a branch with work (and always with ``keep_branch``: a branch
    the run did not create)."""
    head = None
    if tree is not None and await asyncio.to_thread(root.is_dir):
        await commit_all(tree, agent, message, exclude)
        head = await rev("HEAD", tree)
    tip = await rev(f"refs/heads/{branch}", main)
    extra: list[str] = []
    if head and head != tip:  # the run moved HEAD off its branch: keep what HEAD holds too
        if tip is None or await is_ancestor(main, tip, head):
            await git("update-ref", f"refs/heads/{branch}", head, repo=main)
        elif not await is_ancestor(main, head, tip) and not await is_ancestor(main, head, base):
            extra.append(f"{branch}-head")
            await git("update-ref", f"refs/heads/{branch}-head", head, repo=main)
    artifacts = await branch_artifacts(main, [branch, *extra], {}, base, base)
    keep = keep_branch or any(a["branch"] == branch for a in artifacts)
    await remove_worktree(main, root, None if keep else branch)
    return artifacts


async def salvage_worktree(
    path: Path, run_id: str, status: str, *, proven: bool = False
) -> dict[str, Any] | None:
    """Commit the leftover work of an interrupted run and remove its worktree; keep its branch.

    ``path`` is ``<main root>/.orch/worktrees/<run id>`` (from the run record): the main
    repository is found from it, the worktree through its admin dir (never its ``.git``).
    Returns the branch artifact, or None when there was no worktree or no work (then the
    worktree and its branch are removed). Work is never deleted. ``proven`` (reconcile,
    whose ``path`` comes from a store): only a worktree git has locked for this very run.
    """
    real = await asyncio.to_thread(path.resolve)
    root = orch_worktree_root(real)
    if root is None or not await asyncio.to_thread(root.is_dir):
        return None
    try:
        main = (await discover(root)).main()
    except UsageError:
        return None
    entries = await worktree_entries(main)
    same = [await asyncio.to_thread(_same_path, Path(e["worktree"]), real) for e in entries]
    entry = next((e for e, hit in zip(entries, same, strict=True) if hit), None)
    if entry is None:
        return None  # not a registered worktree: leave it alone
    if proven and not entry.get("locked", "").startswith(f"orch run {run_id} ("):
        return None  # not locked for this run (orch locks each at `worktree add`): not ours
    branch = entry.get("branch")
    if not branch:  # detached: give its commits a branch to live on
        branch = f"orch/salvaged/{short_run_id(run_id)}"
    found = _BASE_IN_REASON.search(entry.get("locked", ""))
    base = found.group(1) if found else None
    if base is None:
        user_head = await rev("HEAD", main)
        tip = await rev(f"refs/heads/{branch}", main) or entry.get("HEAD", "")
        merge_base = await git("merge-base", user_head or "HEAD", tip, repo=main, check=False)
        base = merge_base.out.strip() or tip
    agent = agent_of_branch(branch)
    message = commit_message("", run_id, status)
    keep = not owns_branch(branch, run_id)  # a continued branch is never the run's to delete
    if entry.get("locked", "").endswith(DISCARD):  # a throwaway checkout: nothing to keep
        await remove_worktree(main, real, None if keep else branch)
        return None
    tree = await asyncio.to_thread(worktree_paths, main, real)
    artifacts = await settle(main, real, tree, branch, base, agent, message, keep)
    return artifacts[0] if artifacts else None


async def branch_artifacts(
    main: RepoPaths, branches: list[str], known: dict[str, str], base: str, start: str
) -> list[dict[str, Any]]:
    """Branch artifacts (measured from ``base``) of the ``branches`` with work on them;
    ``known``: tips just landed (work on them when the run started from its base)."""
    out: list[dict[str, Any]] = []
    for name in dict.fromkeys(branches):
        commit = known.get(name) or await rev(f"refs/heads/{name}", main)
        if commit is None:
            continue
        if name not in known or base != start:
            ahead = await git("rev-list", "--count", f"{base}..{commit}", repo=main)
            if int(ahead.out.strip() or 0) == 0:
                continue
        files, ins, dels = await diff_stats(main, base, commit)
        out.append(
            {
                "kind": "branch",
                "branch": name,
                "base": base,
                "commit": commit,
                "files_changed": files,
                "insertions": ins,
                "deletions": dels,
            }
        )
    return out
