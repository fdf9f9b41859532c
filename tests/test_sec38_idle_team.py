"""Issue 38, class 12: a team that makes no progress stops. A lead team whose teammates
never claim a task spawned runs until the chain budget was gone (500 runs in under two
minutes); a lead that waits on a board nobody can move waited up to ten minutes a call. Both
now end the team after ``idle_runs`` (a team-file setting, default 3) with one line."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.teams.driver import run_team
from orchestrator.teams.plan import TeamFile, make_plan, parse_team
from orchestrator.teams.progress import TeamResult
from tests.support import Harness, harness, init_repo

pytestmark = pytest.mark.usefixtures("hermetic_git")

APPROVE = json.dumps({"verdict": "approve", "summary": "Fine.", "comments": []})


def call(tool: str, **args: Any) -> dict[str, Any]:
    return {"tool": tool, "input": args}


def play(tmp_path: Path, lead: dict[str, Any], mate: dict[str, Any], **plan: Any) -> tuple[
    TeamResult, Harness, float
]:  # fmt: skip
    root = init_repo(tmp_path / "proj", {"README.md": "# p\n"})
    script = {
        "conversations": [
            lead,
            mate,
            {"agent": "reviewer", "runs": "*", "turns": [{"text": APPROVE}]},
        ]
    }
    h = harness(root, script)
    flags = {"lead": "explorer", "teammates": 2, "reviewers": ["reviewer"], **plan}
    go = run_team(h.runner, prompt="a goal", workdir=root, plan=make_plan(None, None, **flags))
    started = time.monotonic()
    result = asyncio.run(asyncio.wait_for(go, 90))
    return result, h, time.monotonic() - started


def test_teammates_that_never_claim_end_the_team_after_idle_runs(tmp_path: Path) -> None:
    """The robustness fault: each teammate run ends without claiming; orch started another,
    until the chain budget was gone. Now the team stops after 3 such runs, in one line."""
    lead = {
        "agent": "explorer",
        "turns": [
            {"tool_calls": [call("board_add", title="a", detail="write a.py")]},
            *[{"tool_calls": [call("board_wait", timeout_s=30)]} for _ in range(20)],
        ],
    }
    idle = {"agent": "writer", "runs": "*", "turns": [{"text": "I will not claim anything."}]}
    result, h, seconds = play(tmp_path, lead, idle)
    mates = [k for k in h.store.descendants(result.root_run_id) if k.agent == "writer"]
    assert not result.approved and result.error is not None
    assert "teammate runs in a row ended without claiming a ready task" in result.error
    assert "(idle_runs = 3)" in result.error and "\n" not in result.error
    assert len(mates) <= 4, f"{len(mates)} teammate runs"  # 3, and one racing the last
    assert seconds < 60


def test_the_bound_is_a_team_file_setting(tmp_path: Path) -> None:
    file = parse_team('lead = "explorer"\nidle_runs = 5\n', "t.toml")
    assert isinstance(file, TeamFile) and file.idle_runs == 5
    lead = {
        "agent": "explorer",
        "turns": [
            {"tool_calls": [call("board_add", title="a")]},
            *[{"tool_calls": [call("board_wait", timeout_s=30)]} for _ in range(20)],
        ],
    }
    idle = {"agent": "writer", "runs": "*", "turns": [{"text": "no"}]}
    result, h, _ = play(tmp_path, lead, idle, idle_runs=1, teammates=1)
    mates = [k for k in h.store.descendants(result.root_run_id) if k.agent == "writer"]
    assert result.error is not None and "(idle_runs = 1)" in result.error and len(mates) == 1


def test_a_lead_waiting_on_a_board_nobody_can_move_ends_the_team(tmp_path: Path) -> None:
    """The variant: the lead adds nothing and waits (600 s a call) on an empty board that
    no teammate can change. Each wait now answers at once, saying so; after 3 the team
    ends in one line."""
    lead = {
        "agent": "explorer",
        "turns": [{"tool_calls": [call("board_wait", timeout_s=600)]} for _ in range(20)],
    }
    mate = {"agent": "writer", "runs": "*", "turns": [{"text": "unused"}]}
    result, h, seconds = play(tmp_path, lead, mate)
    assert not result.approved and result.error is not None
    assert "the lead waited 3 times in a row on a board nobody else can move" in result.error
    assert "\n" not in result.error and seconds < 60
    [lead_run] = [k for k in h.store.descendants(result.root_run_id) if k.agent == "explorer"]
    said = json.dumps([r.messages[-1]["content"] for r in h.requests_of(lead_run.run_id)[1:]])
    assert "Nothing can change the board but you" in said
