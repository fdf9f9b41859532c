"""What a tier saves about a run: one model per tier (its parts in ``workspaces/saved.py``),
read back through ``registry.saved_state`` by everything that uses a record's ``workspace``."""

from __future__ import annotations

from orchestrator.workspaces.container.export import ContainerState
from orchestrator.workspaces.registry import saved_state
from orchestrator.workspaces.shared import SharedState
from orchestrator.workspaces.worktree import WorktreeState


def test_each_tier_reads_back_as_its_own_model() -> None:
    shared = SharedState(root="/w", os_sandbox="off", network="host").dump()
    worktree = WorktreeState(root="/w/.orch/worktrees/r-1", branch="orch/a/1", base="b" * 40)
    container = ContainerState(root="/workspace", start="c" * 40, user="1000:1000")
    assert saved_state(shared) == SharedState(root="/w", os_sandbox="off", network="host")
    assert saved_state(worktree.dump()) == worktree
    read = saved_state(container.dump())
    assert isinstance(read, ContainerState) and read.start == "c" * 40 and read.continued is False


def test_a_record_of_no_tier_reads_as_none_and_an_older_one_keeps_its_keys() -> None:
    assert saved_state({}) is None  # the run never opened its workspace
    assert saved_state({"isolation": "nowhere"}) is None
    assert saved_state({"os_sandbox": "off"}) is None  # no tier wrote it
    older = {"isolation": "container", "branch": "orch/a/1", "gone_key": 1}
    read = saved_state(older)
    assert isinstance(read, ContainerState) and read.branch == "orch/a/1" and read.user == ""
