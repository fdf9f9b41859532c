"""Committed teams end to end, through the real `anthropic` SDK against a fake Messages API:
the gate in the writer's sandbox, several reviewers, best of N, cancel and resume, containers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.catalog.definitions import load_catalog
from orchestrator.config import SandboxSettings, Settings
from orchestrator.models import ModelProvider
from orchestrator.process.rebuild import assemble
from orchestrator.run import RunStatus
from orchestrator.spec import Launch
from orchestrator.store import open_store
from orchestrator.teams.driver import run_team
from orchestrator.teams.plan import TeamPlan, make_plan
from orchestrator.teams.progress import TeamResult
from tests.fakeapi import FakeAPI, served
from tests.support import init_repo, sandbox_image
from tests.teamapi import BUGGY, FIXED, GATE, TeamAPI, agent_of, text_of, verdict

pytestmark = pytest.mark.usefixtures("hermetic_git")

TASK = "Make add(a, b) in calc.py return the sum of a and b"
SECURITY = """---
name: security-reviewer
description: Read-only security review of a branch; answers with a JSON verdict.
tools: read_file, glob, grep
---
You review changes for security problems only. Answer with the JSON verdict asked for.
"""
TEAM = f"""description = "Writer, a test gate and two reviewers"
writer = "writer"
reviewers = ["reviewer", "security-reviewer"]
approve = "all"
rounds = 3
gate = "{GATE}"
gate_timeout = 60
isolation = "worktree"
models = {{ writer = "opus", reviewers = "haiku" }}
"""


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def fixed_after_gate(k: int, attempt: int) -> str:
    return BUGGY if attempt == 1 else FIXED


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return init_repo(
        tmp_path / "origin",
        {
            "calc.py": "def add(a, b):\n    raise NotImplementedError\n",
            ".orch/teams/guarded.toml": TEAM,
            ".orch/agents/security-reviewer.md": SECURITY,
            # a host-side test hook: an untrusted clone's is left out (the gate is not)
            "orch.toml": '[[hooks.SubagentStop]]\ncommand = "exit 0"\n',
        },
    )


def orch(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def team_here(repo: Path, plan: TeamPlan, **settings: Any) -> TeamResult:
    """A team run in this process, its models reached through the real SDK."""
    cfg = Settings(model="sonnet", **settings)
    provider = ModelProvider(cfg, None)
    store = open_store(repo, None)
    runner = assemble(cfg, store, load_catalog(repo), provider, Launch())

    async def go() -> TeamResult:
        async with provider:
            return await run_team(runner, prompt=TASK, workdir=repo, plan=plan)

    return asyncio.run(asyncio.wait_for(go(), 300))


def requests_of(api: FakeAPI, agent: str) -> list[dict[str, Any]]:
    return [b for b in api.requests if agent_of(b) == agent]


def only_main_worktree(repo: Path) -> bool:
    return git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1


# -- a committed team in an untrusted clone ---------------------------------------------------


def test_committed_team_in_an_untrusted_clone_gates_then_both_reviewers_approve(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    base = git(clone, "rev-parse", "HEAD")
    api = TeamAPI(
        fixed_after_gate,
        {
            "reviewer": verdict("approve", "Correct and tested."),
            "security-reviewer": verdict("approve", "Nothing unsafe."),
        },
    )
    with served(api, monkeypatch) as fake_api:
        r = orch(clone, "team", "run", "--team", "guarded", TASK, "--json")
    assert r.returncode == 0, r.stderr
    assert "is not a trusted repository" in r.stderr  # its orch.toml was left out
    data = json.loads(r.stdout)
    assert data["approved"] and data["status"] == "succeeded" and data["rounds"] == 2
    assert data["plan"]["name"] == "guarded" and data["error"] is None

    # round 1: the gate failed in the writer's sandbox; no reviewer was asked
    gates = data["gates"]
    assert [(g["round"], g["passed"], g["exit_code"]) for g in gates] == [
        (1, False, 1),
        (2, True, 0),
    ]
    assert gates[0]["command"] == GATE and not gates[0]["timed_out"]
    roles = [(x["round"], x["role"]) for x in data["runs"]]
    assert roles == [(1, "writer"), (1, "gate"), (2, "writer"), (2, "gate"),
                     (2, "reviewer"), (2, "reviewer")]  # fmt: skip
    # the failing gate's output was the writer's next message, in its own conversation
    writer_bodies = requests_of(fake_api, "writer")
    told = [b for b in writer_bodies if "The test gate failed" in text_of(b["messages"][-1])]
    assert len(told) == 1 and told[0]["messages"][0]["content"] == TASK
    assert GATE in text_of(told[0]["messages"][-1])

    # round 2: both reviewers saw the passing change with the gate's result, and approved
    [review] = data["reviews"]
    assert review["approved"] and review["approvals"] == 2
    assert [n["reviewer"] for n in review["notes"]] == ["reviewer", "security-reviewer"]
    for agent in ("reviewer", "security-reviewer"):
        [prompt] = api.prompts[agent]
        assert "The test gate passed" in prompt and "+    return a + b" in prompt
        assert "return a - b" not in prompt  # never the failing version
    # per-role models
    assert {b["model"] for b in writer_bodies} == {"claude-opus-4-5"}
    reviewers = requests_of(fake_api, "reviewer") + requests_of(fake_api, "security-reviewer")
    assert {b["model"] for b in reviewers} == {"claude-haiku-4-5"}

    # one branch with both writer turns; the gates' and reviewers' checkouts left nothing
    branch = data["branch"]
    assert git(clone, "rev-list", "--count", f"{base}..{branch}") == "2"
    assert git(clone, "show", f"{branch}:calc.py") + "\n" == FIXED
    assert git(clone, "for-each-ref", "--format=%(refname:short)", "refs/heads/orch/") == branch
    assert only_main_worktree(clone) and git(clone, "status", "--porcelain") == ""
    assert data["diffstat"] == {"files_changed": 1, "insertions": 1, "deletions": 1}

    status = orch(clone, "team", "status", data["root_run_id"])
    assert status.returncode == 0, status.stderr
    assert "gate failed (exit 1)" in status.stdout and "gate passed" in status.stdout
    assert "[security-reviewer] approve" in status.stdout and "status  succeeded" in status.stdout


# -- several reviewers ------------------------------------------------------------------------


def on_round(first: str, later: str) -> Any:
    return lambda prompt: later if "Review round 1 " not in prompt else first


def test_majority_approves_with_one_reviewer_against_and_all_sends_tagged_comments(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    against = verdict("changes_requested", "Unsafe.", comment="validate the inputs")
    api = TeamAPI(
        lambda k, attempt: FIXED if attempt == 1 else FIXED + "# checked\n",
        {
            "reviewer": verdict("approve", "Fine."),
            "security-reviewer": on_round(against, verdict("approve", "Now fine.")),
        },
    )
    with served(api, monkeypatch):
        plan = make_plan(None, None, reviewers=["reviewer", "security-reviewer", "reviewer"],
                         approve="majority", gate=GATE)  # fmt: skip
        result = team_here(repo, plan)
    assert result.approved and result.rounds == 1, result.error
    [review] = result.reviews
    assert review.approvals == 2 and review.approved
    assert [n.reviewer for n in review.notes] == ["reviewer", "security-reviewer", "reviewer#2"]
    assert [n.verdict.verdict for n in review.notes] == ["approve", "changes_requested", "approve"]

    api.prompts.clear()
    with served(api, monkeypatch) as fake_api:
        plan = make_plan(None, None, reviewers=["reviewer", "security-reviewer"], approve="all")
        result = team_here(repo, plan)
    assert result.approved and result.rounds == 2, result.error
    first, second = result.reviews
    assert (first.approvals, first.approved, second.approvals) == (1, False, 2)
    # round 2's writer got every reviewer's comments together, each tagged
    told = [b for b in requests_of(fake_api, "writer") if "did not approve" in
            text_of(b["messages"][-1])]  # fmt: skip
    [message] = [text_of(b["messages"][-1]) for b in told]
    assert "[security-reviewer] calc.py:2: validate the inputs" in message
    assert "[reviewer] approve: Fine." in message
    assert "This team has no test gate" in api.prompts["reviewer"][0]


# -- best of N --------------------------------------------------------------------------------


def three_ways(k: int, attempt: int) -> str:
    return {1: BUGGY, 2: FIXED + "# two\n", 3: FIXED + "# three\n"}[k]


def choose_three(prompt: str) -> str:
    blocks = prompt.split("## Candidate ")[1:]
    assert len(blocks) == 2, "only the two candidates that passed the gate are shown"
    pick = next(int(b.split(":")[0]) for b in blocks if "# three" in b)
    return verdict("approve", "Three is clearest.", choice=pick)


def test_best_of_three_with_one_candidate_failing_the_gate(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = TeamAPI(three_ways, {"reviewer": choose_three, "security-reviewer": choose_three})
    with served(api, monkeypatch):
        plan = make_plan(None, None, writers=3, gate=GATE,
                         reviewers=["reviewer", "security-reviewer"])  # fmt: skip
        result = team_here(repo, plan, max_parallel_children=8)
    assert result.approved and result.rounds == 1, result.error
    assert len(result.candidates) == 3 and len(result.gates) == 3
    failed = [g.candidate for g in result.gates if not g.passed]
    assert len(failed) == 1
    chosen = next(c for c in result.candidates if c.number == result.chosen)
    assert chosen.state == "chosen" and result.branch == chosen.branch
    assert git(repo, "show", f"{chosen.branch}:calc.py").endswith("# three")
    states = {c.number: c.state for c in result.candidates}
    assert states[failed[0]] == "gate_failed"
    assert sorted(states.values()) == ["chosen", "gate_failed", "kept"]
    [review] = result.reviews
    assert sorted(review.candidates) == sorted(set(states) - set(failed))
    assert {n.verdict.choice for n in review.notes} == {result.chosen}
    # every candidate's branch is kept and listed
    kept = {c.branch for c in result.kept() if c.branch is not None}
    assert len(kept) == 2 and all(git(repo, "rev-parse", "--verify", b) for b in kept)
    assert only_main_worktree(repo)


# -- cancel, then resume ----------------------------------------------------------------------


def test_a_cancelled_background_team_resumes_from_its_round(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = threading.Event()
    api = TeamAPI(
        fixed_after_gate,
        {"reviewer": verdict("approve", "Good."), "security-reviewer": verdict("approve", "Ok.")},
        hold=hold,
    )
    try:
        with served(api, monkeypatch):
            started = orch(repo, "team", "run", "--team", "guarded", TASK, "--background", "--json")
            assert started.returncode == 0, started.stderr
            root = json.loads(started.stdout)["run_id"]
            for _ in range(300):  # until the first writer is waiting for its model
                if api.writers:
                    break
                time.sleep(0.1)
            assert api.writers == 1
            assert orch(repo, "cancel", root).returncode == 0
            for _ in range(300):
                status = orch(repo, "team", "status", root, "--json")
                if json.loads(status.stdout or "{}").get("status") == "cancelled":
                    break
                time.sleep(0.2)
            before = json.loads(status.stdout)
            assert before["status"] == "cancelled" and before["rounds"] == 1
            assert before["completed"] == 0 and not before["approved"]
            hold.set()

            resumed = orch(repo, "resume", root, "--json")
            assert resumed.returncode == 0, resumed.stderr
            new_root = json.loads(resumed.stdout)["run_id"]
            after = json.loads(orch(repo, "team", "status", new_root, "--json").stdout)
    finally:
        hold.set()
    assert after["approved"] and after["status"] == "succeeded"
    assert after["resumed_from"] == root and after["chain_id"] == before["chain_id"]
    assert [g["passed"] for g in after["gates"]] == [False, True]
    assert after["rounds"] == 2 and only_main_worktree(repo)
    store = open_store(repo, None)
    assert store.require_run(root).status == RunStatus.CANCELLED
    assert store.require_run(new_root).resumed_from == root


# -- in containers ----------------------------------------------------------------------------


def test_a_container_tier_team_gates_in_its_container(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    image = sandbox_image()
    api = TeamAPI(fixed_after_gate, {"reviewer": verdict("approve", "Good.")})
    with served(api, monkeypatch):
        plan = make_plan(None, None, isolation="container", gate=GATE, merge="merge")
        result = team_here(repo, plan, sandbox=SandboxSettings(image=image))
    assert result.approved and result.merged, result.error
    assert [g.passed for g in result.gates] == [False, True]
    store = open_store(repo, None)
    kids = store.descendants(result.root_run_id)
    assert {(k.agent, k.isolation) for k in kids} == {
        ("writer", "container"), ("gate", "container"), ("reviewer", "container")
    }  # fmt: skip
    assert all(k.workspace.get("discard") for k in kids if k.agent in ("gate", "reviewer"))
    assert (repo / "calc.py").read_text() == FIXED
    assert only_main_worktree(repo)
