"""The engine through its seams, on an in-memory workspace: no bash, git or Docker involved.

Covers the Runner's admission rules (chain position, tools, tier order), the one
ending per run, the narrow tool context and the RunSpec contract.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from orchestrator.catalog.definitions import load_catalog
from orchestrator.config import Settings
from orchestrator.engine.runner import Runner
from orchestrator.models import ModelProvider
from orchestrator.run import RunStatus
from orchestrator.spec import RunSpec
from orchestrator.store import open_store
from orchestrator.workspaces.base import ProcessResult
from orchestrator.workspaces.registry import TIER_NAMES, parse_config, rank
from orchestrator.workspaces.worktree import WorktreeConfig
from tests.fakes import FakeRuntime, FakeWorkspace, provisioner
from tests.support import harness, orch, task_call, tool_results, write_script


def test_child_and_parent_share_files_through_the_runtime(tmp_path: Path) -> None:
    runtime = FakeRuntime({"notes.txt": "from the user\n"})
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [task_call("write the answer")]},
                    {"tool_calls": [{"tool": "read_file", "input": {"path": "out/answer.txt"}}]},
                    {"expect_result": "42", "text": "the child wrote 42"},
                ],
            },
            {
                "depth": 1,
                "turns": [
                    {"tool_calls": [{"tool": "read_file", "input": {"path": "notes.txt"}}]},
                    {
                        "expect_result": "from the user",
                        "tool_calls": [
                            {
                                "tool": "write_file",
                                "input": {"path": "out/answer.txt", "content": "42"},
                            }
                        ],
                    },
                    {"text": "wrote it"},
                ],
            },
        ]
    }
    h = harness(tmp_path, script, provision=provisioner(runtime))
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    assert runtime.files["out/answer.txt"] == b"42"
    (child,) = [r for r in h.runs(root.chain_id) if r.depth == 1]
    assert child.evidence.files_read == ["notes.txt"]
    assert child.evidence.files_written == ["out/answer.txt"]
    assert root.evidence.children == [child.run_id]
    assert child.workspace == {"isolation": "shared", "root": "/fake/workspace", "fake": True}


def test_bash_runs_in_the_runtime_with_the_scrubbed_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-secret")
    monkeypatch.setenv("HARMLESS_SETTING", "yes")
    runtime = FakeRuntime(commands={"make test": ProcessResult(0, "all good\n")})
    script = {
        "conversations": [
            {
                "turns": [
                    {"tool_calls": [{"tool": "bash", "input": {"command": "make test"}}]},
                    {"expect_result": "all good", "text": "done"},
                ]
            }
        ]
    }
    h = harness(tmp_path, script, provision=provisioner(runtime))
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    ((command, env),) = runtime.ran
    assert command == "make test"
    assert "ANTHROPIC_API_KEY" not in env and env.get("HARMLESS_SETTING") == "yes"
    assert [c.exit_code for c in root.evidence.commands] == [0]
    assert runtime.expected == [env, env]  # told at each request: a sandbox made meanwhile


def test_a_run_without_bash_has_no_sandbox_made_ahead(tmp_path: Path) -> None:
    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "reader.md").write_text(
        "---\nname: reader\ndescription: Reads.\ntools: Read, Grep\n---\nRead.\n"
    )
    runtime = FakeRuntime({"a.txt": "x"})
    script = {"conversations": [{"turns": [{"text": "read nothing"}]}]}
    h = harness(tmp_path, script, agents_dirs=[agents], provision=provisioner(runtime))
    root = h.run(agent="reader")
    assert root.status == RunStatus.SUCCEEDED, root.error
    assert runtime.expected == []


def _tier_script(isolation: str | None) -> dict[str, object]:
    extra = {"isolation": isolation} if isolation else {}
    return {
        "conversations": [
            {"depth": 0, "turns": [{"tool_calls": [task_call("sub", **extra)]}, {"text": "ok"}]},
            {"depth": 1, "turns": [{"text": "child done"}]},
        ]
    }


@pytest.mark.parametrize("weaker", ["shared"])
def test_a_child_never_runs_in_a_weaker_tier(tmp_path: Path, weaker: str) -> None:
    h = harness(tmp_path, _tier_script(weaker), provision=provisioner(FakeRuntime()))
    root = h.run(isolation="worktree")
    assert root.status == RunStatus.SUCCEEDED, root.error
    assert [r.depth for r in h.runs(root.chain_id)] == [0]  # nothing was spawned
    (result,) = tool_results(h.requests_of(root.run_id)[1])
    assert result["is_error"]
    assert f"isolation '{weaker}' is weaker than this agent's own 'worktree'" in result["content"]
    assert "worktree, container" in result["content"]


def test_a_childs_default_tier_is_its_parents(tmp_path: Path) -> None:
    opened: list[FakeWorkspace] = []
    h = harness(tmp_path, _tier_script(None), provision=provisioner(FakeRuntime(), opened))
    root = h.run(isolation="container")
    assert root.status == RunStatus.SUCCEEDED, root.error
    assert [r.isolation for r in h.runs(root.chain_id)] == ["container", "container"]
    assert [ws.isolation for ws in opened] == ["container", "container"]


def test_an_agents_weaker_default_tier_is_raised_to_the_parents(tmp_path: Path) -> None:
    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "looker.md").write_text(
        "---\nname: looker\ndescription: Looks.\nisolation: shared\n---\nLook around.\n"
    )
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [task_call("look", subagent_type="looker")]},
                    {"text": "ok"},
                ],
            },
            {"depth": 1, "turns": [{"text": "looked"}]},
        ]
    }
    h = harness(tmp_path, script, agents_dirs=[agents], provision=provisioner(FakeRuntime()))
    root = h.run(isolation="worktree")
    assert root.status == RunStatus.SUCCEEDED, root.error
    assert [r.isolation for r in h.runs(root.chain_id)] == ["worktree", "worktree"]


def test_the_tier_order_is_the_registrys() -> None:
    assert TIER_NAMES == ("shared", "worktree", "container")
    assert [rank(n) for n in TIER_NAMES] == [0, 1, 2]
    cfg = parse_config({"type": "worktree", "branch": "orch/w/1"})
    assert isinstance(cfg, WorktreeConfig) and cfg.branch == "orch/w/1"
    with pytest.raises(ValidationError):
        parse_config({"type": "vm"})
    with pytest.raises(ValidationError):
        parse_config({"type": "shared", "branch": "x"})  # extra="forbid" per tier


def test_runspec_is_strict(tmp_path: Path) -> None:
    with pytest.raises(ValidationError):
        RunSpec.model_validate({"prompt": "x", "workdir": str(tmp_path), "isolation": "shared"})
    with pytest.raises(ValidationError):
        RunSpec(prompt="   ", workdir=tmp_path)
    spec = RunSpec.model_validate(
        {"prompt": "x", "workdir": str(tmp_path), "workspace": {"type": "container"}}
    )
    assert spec.workspace is not None and spec.workspace.type == "container"
    assert RunSpec.model_validate_json(spec.model_dump_json()) == spec


def test_a_run_has_exactly_one_ending(tmp_path: Path) -> None:
    script = {
        "conversations": [
            {"depth": 0, "turns": [{"tool_calls": [task_call("sub")]}, {"text": "ok"}]},
            {"depth": 1, "turns": [{"text": "done"}]},
        ]
    }
    h = harness(tmp_path, script, provision=provisioner(FakeRuntime()))
    root = h.run()
    for rec in h.runs(root.chain_id):
        kinds = [e["kind"] for e in h.store.events(rec.run_id)]
        assert kinds.count("run_started") == 1 and kinds.count("run_finished") == 1
        assert kinds[-1] == "run_finished"


def test_unknown_agent_is_a_tool_error_listing_the_agents(tmp_path: Path) -> None:
    script = {
        "conversations": [
            {
                "turns": [
                    {"tool_calls": [task_call("x", subagent_type="nobody")]},
                    {"expect_result": "unknown agent 'nobody'", "text": "ok"},
                ]
            }
        ]
    }
    h = harness(tmp_path, script, provision=provisioner(FakeRuntime()))
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    (result,) = tool_results(h.requests_of(root.run_id)[1])
    assert "explorer" in result["content"] and "general" in result["content"]


def test_foreground_and_background_runs_of_one_command_are_the_same(project: Path) -> None:
    """An agent found through orch.toml's agents_dirs runs the same in both paths."""
    (project / "orch.toml").write_text('agents_dirs = ["team-agents"]\nmax_depth = 2\n')
    (project / "team-agents").mkdir()
    (project / "team-agents" / "lister.md").write_text(
        "---\nname: lister\ndescription: Lists files.\ntools: Glob\n---\nList files.\n"
    )
    turns = [
        {"tool_calls": [{"tool": "glob", "input": {"pattern": "src/*.py"}}]},
        {"expect_result": "src/app.py", "text": "LISTED src/app.py"},
    ]
    script = write_script(project, {"conversations": [{"agent": "lister", "turns": turns}]})
    model = f"scripted:{script}"
    fg = orch("task", "list", "--agent", "lister", "--json", "--model", model, cwd=project)
    assert fg.returncode == 0, fg.stderr
    started = orch(
        "task", "list", "--agent", "lister", "--background", "--json", "--model", model,
        cwd=project,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    run_id = json.loads(started.stdout)["run_id"]
    bg = orch("result", run_id, "--wait", "--json", cwd=project)
    assert bg.returncode == 0, bg.stdout + bg.stderr
    a, b = json.loads(fg.stdout), json.loads(bg.stdout)
    for key in ("status", "agent", "summary", "isolation", "depth"):
        assert a[key] == b[key], key
    assert b["summary"] == "LISTED src/app.py"
    assert a["usage"]["tool_uses"] == b["usage"]["tool_uses"] == 1


def test_run_setting_flags_override_orch_toml(project: Path) -> None:
    (project / "orch.toml").write_text("auto_background_after = 600\nmax_parallel_children = 7\n")
    script = write_script(
        project,
        {
            "conversations": [
                {
                    "depth": 0,
                    "turns": [
                        {"tool_calls": [task_call("slow one")]},
                        {"expect_result": '"backgrounded": true', "text": "moved on"},
                        {"text": "collected"},
                    ],
                },
                {"depth": 1, "latency_s": 1.5, "turns": [{"text": "slow done"}]},
            ]
        },
    )
    for background in (False, True):
        args = ["task", "go", "--json", "--model", f"scripted:{script}"]
        args += ["--auto-background-after", "0.3", "--max-parallel", "1"]
        r = orch(*args, *(["--background"] if background else []), cwd=project)
        assert r.returncode == 0, r.stderr
        run_id = json.loads(r.stdout)["run_id"]
        if background:
            done = orch("result", run_id, "--wait", "--json", cwd=project)
            assert done.returncode == 0, done.stdout + done.stderr
        from orchestrator.store import open_store

        store = open_store(project)
        (child,) = [c for c in store.list_runs() if c.parent_run_id == run_id]
        kinds = [e["kind"] for e in store.events(child.run_id)]
        assert "auto_backgrounded" in kinds, kinds
        auto = [e for e in store.events(child.run_id) if e["kind"] == "auto_backgrounded"]
        assert auto[0]["data"]["after_s"] == 0.3


class _Fan:
    """Depth 0 and 1 fan out ``width`` task calls; depth 2 answers after a short wait.
    Counts model calls in flight: only runs that hold a place in the chain call the model."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.inflight = 0
        self.peak = 0

    async def complete(self, request: Any) -> Any:
        from orchestrator.models.base import ModelResponse

        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            await asyncio.sleep(0.01)
            if request.depth < 2 and len(request.messages) == 1:
                calls = [
                    {"type": "tool_use", "id": f"t{i}", "name": "task",
                     "input": {"description": f"c{i}", "prompt": f"part {i}"}}
                    for i in range(self.width)
                ]  # fmt: skip
                return ModelResponse(content=calls, stop_reason="tool_use")
            return ModelResponse(content=[{"type": "text", "text": f"done at {request.depth}"}])
        finally:
            self.inflight -= 1


def _fan_runner(tmp_path: Path, width: int, **settings: Any) -> tuple[Runner, _Fan]:
    model = _Fan(width)
    cfg = Settings(max_depth=2, **settings)
    runner = Runner(
        settings=cfg,
        store=open_store(tmp_path),
        catalog=load_catalog(tmp_path),
        models=ModelProvider(cfg, model=model),
        provision=provisioner(FakeRuntime()),
    )
    return runner, model


def test_a_deep_fan_out_never_has_more_runs_working_than_the_chain_allows(
    tmp_path: Path,
) -> None:
    runner, model = _fan_runner(tmp_path, 25, max_chain_running=20, max_chain_runs=1000)
    root = asyncio.run(
        asyncio.wait_for(runner.run(RunSpec(prompt="fan out", workdir=tmp_path)), 300)
    )
    assert root.status == RunStatus.SUCCEEDED, root.error
    runs = runner.store.list_runs(chain_id=root.chain_id)
    assert len(runs) == 1 + 25 + 25 * 25
    assert {r.status for r in runs} == {RunStatus.SUCCEEDED}
    assert model.peak <= 20
    assert model.peak >= 15  # the budget is used, not just respected
    assert all(r.plan and r.plan.budgets and r.plan.budgets.running == 20 for r in runs)


def test_chain_budgets_refuse_with_the_budgets_name(tmp_path: Path) -> None:
    runner, _ = _fan_runner(tmp_path, 5, max_chain_runs=8)
    root = asyncio.run(
        asyncio.wait_for(runner.run(RunSpec(prompt="fan out", workdir=tmp_path)), 300)
    )
    assert root.status == RunStatus.SUCCEEDED, root.error
    runs = runner.store.list_runs(chain_id=root.chain_id)
    assert len(runs) == 8
    refused = [
        e
        for r in runs
        for e in runner.store.events(r.run_id)
        if e["kind"] == "tool_result" and e["data"]["is_error"]
    ]
    assert refused and all("max_chain_runs (8) is used up" in e["data"]["preview"] for e in refused)


def test_tree_shows_the_chains_use_of_its_budgets(project: Path) -> None:
    script = write_script(
        project,
        {
            "conversations": [
                {"depth": 0, "turns": [{"tool_calls": [task_call("sub")]}, {"text": "ok"}]},
                {"depth": 1, "turns": [{"text": "child"}]},
            ]
        },
    )
    (project / "orch.toml").write_text("max_chain_runs = 50\nmax_chain_tokens = 99999\n")
    r = orch("task", "go", "--json", "--model", f"scripted:{script}", cwd=project)
    assert r.returncode == 0, r.stderr
    t = orch("tree", json.loads(r.stdout)["run_id"], cwd=project)
    assert t.returncode == 0, t.stderr
    assert "chain budgets: runs 2/50 · live 0 (working at once ≤ 20) · tokens " in t.stdout
    assert "/99,999" in t.stdout
    rows = json.loads(orch("ps", "--json", cwd=project).stdout)
    (root,) = [x for x in rows if x["depth"] == 0]
    assert root["chain"]["runs"] == 2 and root["chain"]["live"] == 0
    assert root["chain"]["budgets"] == {"running": 20, "runs": 50, "tokens": 99999, "usd": None}
    assert "chain" not in [x for x in rows if x["depth"] == 1][0]


class _Idle:
    """The root starts ``n`` background children that never answer; it then waits for them."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def complete(self, request: Any) -> Any:
        from orchestrator.models.base import ModelResponse

        if request.depth == 0:
            if len(request.messages) == 1:
                calls = [
                    {"type": "tool_use", "id": f"t{i}", "name": "task",
                     "input": {"prompt": "idle", "run_in_background": True}}
                    for i in range(self.n)
                ]  # fmt: skip
                return ModelResponse(content=calls, stop_reason="tool_use")
            return ModelResponse(content=[{"type": "text", "text": "done"}])
        await asyncio.sleep(3600)
        raise AssertionError("never answers")


def test_cancelling_a_chain_that_fills_its_gate_ends_promptly(tmp_path: Path) -> None:
    """The root waits for children holding every place: cancelling it must not wait for one."""
    cfg = Settings(max_parallel_children=50, max_chain_running=5)
    runner = Runner(
        settings=cfg,
        store=open_store(tmp_path),
        catalog=load_catalog(tmp_path),
        models=ModelProvider(cfg, model=_Idle(12)),
        provision=provisioner(FakeRuntime()),
    )

    async def main() -> None:
        job = asyncio.create_task(runner.run(RunSpec(prompt="go", workdir=tmp_path)))
        while len(runner.jobs) < 13:  # noqa: ASYNC110 - polls the runner from outside
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        job.cancel()
        done, _ = await asyncio.wait({job}, timeout=5)
        assert done, "cancelling the chain hung: the root waited for a place its children held"

    asyncio.run(main())
    statuses = {r.status for r in runner.store.list_runs()}
    assert statuses == {RunStatus.CANCELLED}


def _burner(project: Path, second: dict[str, Any]) -> Path:
    """A root that starts a child using ten million tokens in one turn, then another."""
    return write_script(
        project,
        {
            "conversations": [
                {
                    "depth": 0,
                    "turns": [
                        {"tool_calls": [task_call("burn")]},
                        {"tool_calls": [task_call("again")]},
                        {**second, "text": "stopped"},
                    ],
                },
                {
                    "depth": 1,
                    "runs": "*",
                    "turns": [{"text": "burned", "usage": {"input_tokens": 10_000_000}}],
                },
            ]
        },
    )


def test_max_chain_tokens_has_a_default_and_says_how_to_raise_it(project: Path) -> None:
    assert Settings().max_chain_tokens == 10_000_000
    refused = (
        "max_chain_tokens .10,000,000. is used up.*higher max_chain_tokens in "
        "~/.orch/config.toml, or in orch.toml and then `orch trust`"
    )
    script = _burner(project, {"expect_result": refused})
    r = orch("task", "go", "--json", "--model", f"scripted:{script}", cwd=project)
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    t = orch("tree", run_id, cwd=project)
    assert "runs 2/500" in t.stdout, t.stdout  # the second child never started
    assert re.search(r"tokens10,0\d\d,\d\d\d/10,000,000", "".join(t.stdout.split())), t.stdout
    # raised as the message says (a repository raises a limit only once trusted), the
    # second child runs
    (project / "orch.toml").write_text("max_chain_tokens = 30_000_000\n")
    assert orch("trust", cwd=project).returncode == 0
    script = _burner(project, {"expect_result": "burned"})
    r = orch("task", "go", "--json", "--model", f"scripted:{script}", cwd=project)
    assert r.returncode == 0, r.stderr
    t = orch("tree", json.loads(r.stdout)["run_id"], cwd=project)
    assert "runs 3/500" in t.stdout and "/30,000,000" in t.stdout, t.stdout
