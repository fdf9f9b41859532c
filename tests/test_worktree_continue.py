"""Worktree tier, continuing an existing branch (``spec.branch``, ``spec.branch_base``):
what ``orch team`` uses to send a writer back to its branch and a reviewer to read it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import OrchError, UsageError
from orchestrator.workspaces.base import RunOutcome, WorkspaceSpec
from orchestrator.workspaces.worktree import WorktreeWorkspace, salvage_worktree
from tests.support import init_repo
from tests.test_worktree import make_spec, orch_branches, run_changes, sh, worktree_count

pytestmark = pytest.mark.usefixtures("hermetic_git")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return init_repo(tmp_path / "proj", {"a.txt": "one\n"})


def test_continue_branch_commits_on_it_and_measures_from_base(repo: Path) -> None:
    base = sh(repo, "rev-parse", "HEAD")
    first, _ = run_changes(repo, {"w.txt": "round one\n"})
    branch = first.artifacts()[0]["branch"]
    tip = sh(repo, "rev-parse", branch)
    seen: dict[str, Any] = {}

    async def body() -> WorktreeWorkspace:
        spec = make_spec(repo, agent="writer", branch=branch, branch_base=base)
        async with WorktreeWorkspace(spec) as ws:
            seen["earlier"] = (ws.root / "w.txt").read_text()
            seen["info"] = ws.info()
            seen["head"] = sh(ws.root, "symbolic-ref", "--short", "HEAD")
            (ws.root / "w.txt").write_text("round two\n")
            (ws.root / "v.txt").write_text("more\n")
            ws.set_outcome(RunOutcome("succeeded", "second round"))
        return ws

    second = asyncio.run(body())
    assert seen["earlier"] == "round one\n" and seen["head"] == branch
    assert seen["info"]["branch"] == branch and seen["info"]["base"] == base
    [artifact] = second.artifacts()
    assert artifact["branch"] == branch and artifact["base"] == base
    assert (artifact["files_changed"], artifact["insertions"]) == (2, 2)
    assert sh(repo, "rev-parse", f"{branch}~1") == tip  # a second commit on the same branch
    assert sh(repo, "rev-list", "--count", f"{base}..{branch}") == "2"
    assert "second round" in sh(repo, "log", "-1", "--format=%B", branch)
    assert orch_branches(repo) == [branch]  # no new branch was made
    assert worktree_count(repo) == 1 and sh(repo, "status", "--porcelain") == ""


def test_continue_branch_without_changes_keeps_it(repo: Path) -> None:
    first, _ = run_changes(repo, {"w.txt": "work\n"})
    branch = first.artifacts()[0]["branch"]
    tip = sh(repo, "rev-parse", branch)

    async def body() -> WorktreeWorkspace:
        spec = make_spec(repo, agent="reviewer", branch=branch)
        async with WorktreeWorkspace(spec) as ws:
            assert (ws.root / "w.txt").read_text() == "work\n"
            assert ws.info()["base"] == tip  # default base: the tip, only new work counts
        return ws

    ws = asyncio.run(body())
    assert ws.artifacts() == []
    assert orch_branches(repo) == [branch] and sh(repo, "rev-parse", branch) == tip
    assert worktree_count(repo) == 1
    assert list((repo / ".orch" / "worktrees").iterdir()) == []


def test_continue_branch_refusals_leave_branches_alone(repo: Path) -> None:
    first, _ = run_changes(repo, {"w.txt": "work\n"})
    branch = first.artifacts()[0]["branch"]
    tip, main = sh(repo, "rev-parse", branch), sh(repo, "rev-parse", "main")

    def enter(continued: dict[str, Any]) -> None:
        asyncio.run(WorktreeWorkspace(make_spec(repo, **continued)).__aenter__())

    with pytest.raises(UsageError, match="does not exist"):
        enter({"branch": "orch/writer/nothere"})
    with pytest.raises(UsageError, match=r"only continue an orch/\* branch"):
        enter({"branch": "main"})
    with pytest.raises(UsageError, match="not a commit"):
        enter({"branch": branch, "branch_base": "no-such-ref"})

    async def twice() -> None:
        async with WorktreeWorkspace(make_spec(repo, branch=branch)):
            with pytest.raises(OrchError, match="in use by another worktree"):
                async with WorktreeWorkspace(make_spec(repo, branch=branch)):
                    pass

    asyncio.run(twice())
    assert sh(repo, "rev-parse", branch) == tip and sh(repo, "rev-parse", "main") == main
    assert orch_branches(repo) == [branch] and worktree_count(repo) == 1


def test_salvage_of_a_continued_run_never_deletes_the_branch(repo: Path) -> None:
    first, _ = run_changes(repo, {"w.txt": "work\n"})
    branch = first.artifacts()[0]["branch"]
    tip = sh(repo, "rev-parse", branch)
    idle, busy = (make_spec(repo, branch=branch) for _ in range(2))

    async def crash(spec: WorkspaceSpec, change: bool) -> Path:  # entered, never closed
        ws = await WorktreeWorkspace(spec).__aenter__()
        if change:
            (ws.root / "left.txt").write_text("leftover\n")
        return ws.root

    root = asyncio.run(crash(idle, change=False))
    assert asyncio.run(salvage_worktree(root, idle.run_id, "interrupted")) is None
    assert not root.exists() and sh(repo, "rev-parse", branch) == tip
    root = asyncio.run(crash(busy, change=True))
    artifact = asyncio.run(salvage_worktree(root, busy.run_id, "interrupted"))
    assert artifact is not None and artifact["branch"] == branch
    assert sh(repo, "rev-parse", f"{branch}~1") == tip
    assert sh(repo, "show", f"{branch}:left.txt") == "leftover"
    assert orch_branches(repo) == [branch] and worktree_count(repo) == 1
