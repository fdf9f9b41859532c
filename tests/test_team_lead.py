"""Lead teams end to end, through the real `anthropic` SDK against a fake Messages API: a
lead's board, teammates claiming concurrently, messages, a gate that sends a task back,
merges onto the integration branch, and a crash resumed from the board."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from orchestrator.catalog.definitions import load_catalog
from orchestrator.cli.main import app
from orchestrator.config import Settings
from orchestrator.models import ModelProvider
from orchestrator.process.rebuild import assemble
from orchestrator.run import RunStatus
from orchestrator.spec import Launch
from orchestrator.store import open_store
from orchestrator.teams.driver import run_team
from orchestrator.teams.plan import make_plan
from orchestrator.teams.progress import TeamResult, read_result
from tests.fakeapi import served
from tests.leadapi import GATE, LeadAPI
from tests.support import init_repo
from tests.teamapi import agent_of, text_of

pytestmark = pytest.mark.usefixtures("hermetic_git")

GOAL = "Give the project add() and sub(), and document them"
PLANNER = """---
name: planner
description: Breaks a goal into tasks for a team; reads, never writes.
tools: read_file, glob, grep
---
You plan work for a team and follow it on the board.
"""
TEAM = f"""description = "A lead, two teammates, a gate and a reviewer"
lead = "planner"
teammates = 2
writer = "writer"
reviewers = ["reviewer"]
gate = "{GATE}"
gate_timeout = 60
rounds = 3
"""


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return init_repo(
        tmp_path / "proj",
        {
            "README.md": "# calc\n",
            ".orch/agents/planner.md": PLANNER,
            ".orch/teams/crew.toml": TEAM,
        },
    )


def lead_team_here(repo: Path, **settings: Any) -> TeamResult:
    cfg = Settings(model="sonnet", **settings)
    provider = ModelProvider(cfg, None)
    runner = assemble(cfg, open_store(repo, None), load_catalog(repo), provider, Launch())
    plan = make_plan(None, "crew", lead="planner", teammates=2, gate=GATE, gate_timeout=60)

    async def go() -> TeamResult:
        async with provider:
            return await run_team(runner, prompt=GOAL, workdir=repo, plan=plan)

    return asyncio.run(asyncio.wait_for(go(), 300))


def board_events(repo: Path, root: str) -> list[dict[str, Any]]:
    store = open_store(repo, None)
    return [e["data"] for e in store.events(root) if e["kind"] == "board_task"]


def test_a_lead_team_claims_messages_gates_and_merges_every_task(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = LeadAPI()
    with served(api, monkeypatch) as fake:
        result = lead_team_here(repo)
    assert result.approved and result.status == RunStatus.SUCCEEDED, result.error
    assert result.board is not None
    tasks = {t.id: t for t in result.board.tasks}
    assert [(t.id, t.title, t.depends_on) for t in tasks.values()] == [
        ("t1", "add", []), ("t2", "sub", []), ("t3", "doc", ["t1"])
    ]  # fmt: skip
    assert all(t.state == "done" and t.commit for t in tasks.values())

    # no task was ever claimed by two runs at once; both teammates worked
    events = board_events(repo, result.root_run_id)
    holders: dict[str, str | None] = {}
    for e in events:
        if e["state"] == "claimed":
            assert holders.get(e["id"]) is None, f"{e['id']} claimed twice"
            holders[e["id"]] = e["run_id"]
        elif e["state"] in ("ready", "done", "failed"):
            holders[e["id"]] = None
    first_claims = [e for e in events if e["state"] == "claimed"][:2]
    assert {e["id"] for e in first_claims} == {"t1", "t2"}
    assert len({e["owner"] for e in first_claims}) == 2

    # t3 waited for t1 to be merged
    t3_ready = next(i for i, e in enumerate(events) if e["id"] == "t3" and e["state"] == "ready")
    t1_done = next(i for i, e in enumerate(events) if e["id"] == "t1" and e["state"] == "done")
    assert t1_done < t3_ready

    # t2 failed the gate once and came back
    assert tasks["t2"].attempts == 1 and "The test gate failed" in tasks["t2"].notes[0]
    assert [g.passed for g in result.gates].count(False) == 1

    # a teammate's message reached the other at a later turn (a notification)
    [sent] = result.board.messages
    assert (sent.sender, sent.to) == tuple(api.sent[0].split("->"))
    later = [
        b for b in fake.requests
        if agent_of(b) == "writer" and f"You are {sent.to}" in text_of(b["messages"][0])
        and any(sent.text in json.dumps(m["content"]) for m in b["messages"][1:])
    ]  # fmt: skip
    assert later, "the message never reached its recipient after its first turn"

    # the integration branch holds all three, merged; the user's tree is untouched
    branch = result.branch
    assert branch is not None and branch.startswith("orch/team/")
    assert git(repo, "show", f"{branch}:sub.py").endswith("return a - b")
    assert git(repo, "show", f"{branch}:add.py").endswith("return a + b")
    assert "add()" in git(repo, "show", f"{branch}:DOC.md")
    merged = git(repo, "log", "--format=%s", branch).splitlines()
    assert {"t1: add", "t2: sub", "t3: doc"} <= set(merged)
    assert not (repo / "add.py").exists()
    assert git(repo, "worktree", "list", "--porcelain").count("worktree ") == 1

    # the runs: a lead and teammates, each teammate run named by its task in ps
    store = open_store(repo, None)
    kids = store.descendants(result.root_run_id)
    mates = [k for k in kids if k.agent == "writer"]
    assert any(k.description.startswith("teammate-") and ": t" in k.description for k in mates)
    assert [k.agent for k in kids].count("planner") == 1
    lead = next(k for k in kids if k.agent == "planner")
    assert {"board_add", "board_wait"} <= set(lead.allowed_tools)
    assert "board_claim" not in lead.allowed_tools and "board_add" not in mates[0].allowed_tools

    # what another terminal sees
    runner = CliRunner()
    shown = runner.invoke(app, ["team", "board", result.root_run_id, "--json", "-C", str(repo)])
    assert shown.exit_code == 0, shown.stderr
    assert [(t["id"], t["state"]) for t in json.loads(shown.stdout)] == [
        ("t1", "done"), ("t2", "done"), ("t3", "done")
    ]  # fmt: skip
    said = runner.invoke(app, ["team", "messages", result.root_run_id, "-C", str(repo)])
    assert said.exit_code == 0 and f"#1 {sent.sender} -> {sent.to}: {sent.text}" in said.stdout
    plain = runner.invoke(app, ["team", "board", result.root_run_id, "--follow", "-C", str(repo)])
    assert plain.exit_code == 0 and "t3 done" in plain.stdout and "(after t1)" in plain.stdout
    other = runner.invoke(app, ["team", "board", lead.run_id, "-C", str(repo)])
    assert other.exit_code == 2 and "not a lead team's run" in other.stderr


def test_cancel_stops_every_member_of_a_lead_team(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = threading.Event()
    api = LeadAPI(hold=hold)
    cfg = Settings(model="sonnet")
    provider = ModelProvider(cfg, None)
    store = open_store(repo, None)
    runner = assemble(cfg, store, load_catalog(repo), provider, Launch())
    plan = make_plan(None, "crew", lead="planner", teammates=2, gate=GATE)

    async def scene() -> TeamResult:
        async with provider:
            job = asyncio.create_task(run_team(runner, prompt=GOAL, workdir=repo, plan=plan))
            assert await asyncio.to_thread(api.doc_started.wait, 180), "doc never started"
            root = next(r for r in store.list_runs() if r.agent == "team")
            store.request_cancel([root.run_id, *(r.run_id for r in store.descendants(root.run_id))])
            return await asyncio.wait_for(job, 60)

    try:
        with served(api, monkeypatch):
            result = asyncio.run(asyncio.wait_for(scene(), 240))
    finally:
        hold.set()
    assert result.status == RunStatus.CANCELLED and not result.approved
    kids = store.descendants(result.root_run_id)
    assert kids and all(k.status.ended for k in kids), [(k.agent, k.status) for k in kids]
    assert {k.status for k in kids if k.agent in ("planner", "writer")} >= {RunStatus.CANCELLED}


def test_a_crashed_lead_team_resumes_from_its_board(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = threading.Event()
    api = LeadAPI(hold=hold)
    env = dict(os.environ)
    try:
        with served(api, monkeypatch):
            env = dict(os.environ)
            proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", "team", "run", "--team", "crew", GOAL],
                cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            assert api.doc_started.wait(180), "the doc task never started"
            store = open_store(repo, None)
            [root] = [r for r in store.list_runs() if r.agent == "team"]
            os.killpg(proc.pid, signal.SIGKILL)  # the whole team dies mid-run
            proc.wait(30)
            hold.set()
            before = read_result(store, store.require_run(root.run_id))
            assert before is not None and before.board is not None
            states = {t.id: t.state for t in before.board.tasks}
            assert states["t1"] == "done" and states["t3"] == "claimed"

            resumed = subprocess.run(
                [sys.executable, "-m", "orchestrator", "resume", root.run_id, "--json"],
                cwd=repo, env=env, capture_output=True, text=True, timeout=300, check=False,
            )  # fmt: skip
    finally:
        hold.set()
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout[-3000:]
    new_root = json.loads(resumed.stdout)["run_id"]
    store = open_store(repo, None)
    after = read_result(store, store.require_run(new_root))
    assert after is not None and after.board is not None and after.approved
    assert after.resumed_from == root.run_id
    tasks = {t.id: t for t in after.board.tasks}
    assert tasks["t1"].commit == next(t.commit for t in before.board.tasks if t.id == "t1")
    assert all(t.state == "done" for t in tasks.values())
    assert any("interrupted" in n for n in tasks["t3"].notes)
    assert "add()" in git(repo, "show", f"{after.branch}:DOC.md")
    deadline = time.monotonic() + 30
    while git(repo, "worktree", "list", "--porcelain").count("worktree ") != 1:
        assert time.monotonic() < deadline, "worktrees left behind"
        time.sleep(0.5)


def test_the_chains_budget_bounds_the_whole_team(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with served(LeadAPI(), monkeypatch):
        result = lead_team_here(repo, max_chain_runs=4)
    assert not result.approved and result.error is not None
    assert "max_chain_runs (4) is used up" in result.error
    store = open_store(repo, None)
    assert len([result.root_run_id, *store.descendants(result.root_run_id)]) <= 4
    assert all(k.status.ended for k in store.descendants(result.root_run_id))
