"""What a real model is told: the agent catalog in the task tool, aliases, allow-lists, cost."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from orchestrator.catalog.definitions import load_catalog, parse_agent
from orchestrator.catalog.guidance import CATALOG_CHARS, TASK_GUIDANCE, agent_catalog
from orchestrator.run import RunStatus
from tests.fakes import FakeRuntime, provisioner
from tests.support import harness, task_call, tool_results


def _agent(where: Path, name: str, description: str, tools: str = "Read, Grep, Glob") -> None:
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{name}.md").write_text(
        f"---\nname: {name}\ndescription: {description}\ntools: {tools}\n---\nYou are {name}.\n"
    )


def _task_schema(request: Any) -> dict[str, Any]:
    (schema,) = [t for t in request.tools if t["name"] == "task"]
    return dict(schema)


def test_the_task_tool_lists_the_agents_the_caller_may_start(tmp_path: Path) -> None:
    _agent(tmp_path / ".orch" / "agents", "db-expert", "Knows the schema and the migrations.")
    _agent(
        tmp_path / ".orch" / "agents",
        "lead",
        "Leads.",
        tools="Read, Task(explorer, db-expert)",
    )
    script = {"conversations": [{"turns": [{"text": "ok"}]}]}
    h = harness(tmp_path, script, provision=provisioner(FakeRuntime()))
    root = h.run()
    desc = _task_schema(h.requests_of(root.run_id)[0])["description"]
    assert desc.startswith(TASK_GUIDANCE)
    assert "- db-expert: Knows the schema and the migrations." in desc
    assert "- general (default): " in desc and "- explorer: " in desc
    names = [ln[2:].split(":")[0].split(" ")[0] for ln in desc.splitlines() if ln.startswith("- ")]
    assert names == sorted(names)
    # an agent with Task(a, b) sees only those two, and may start only those two
    h = harness(tmp_path, {"conversations": [{"agent": "lead", "turns": [
        {"tool_calls": [task_call("x", subagent_type="general")]},
        {"expect_result": "may start only explorer, db-expert", "text": "ok"},
    ]}]}, provision=provisioner(FakeRuntime()))  # fmt: skip
    root = h.run(agent="lead")
    assert root.status == RunStatus.SUCCEEDED, root.error
    desc = _task_schema(h.requests_of(root.run_id)[0])["description"]
    listed = [ln for ln in desc.splitlines() if ln.startswith("- ")]
    assert [ln.split(":")[0] for ln in listed] == ["- db-expert (default)", "- explorer"]
    assert "default: db-expert" in desc


def test_claude_code_names_map_to_bundled_agents(tmp_path: Path) -> None:
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {
                        "tool_calls": [
                            task_call("a", subagent_type="general-purpose"),
                            task_call("b", subagent_type="Explore"),
                            task_call("c", subagent_type="Plan-nope"),
                        ]
                    },
                    {"text": "ok"},
                ],
            },
            {"depth": 1, "runs": 2, "turns": [{"text": "child"}]},
        ]
    }
    h = harness(tmp_path, script, provision=provisioner(FakeRuntime()))
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    kids = sorted(r.agent for r in h.runs(root.chain_id) if r.depth == 1)
    assert kids == ["explorer", "general"]
    bad = tool_results(h.requests_of(root.run_id)[1])[2]
    assert bad["is_error"] and "unknown agent 'Plan-nope'" in bad["content"]
    assert "valid subagent_type values: explorer, general, reviewer, writer" in bad["content"]
    assert "general-purpose → general" in bad["content"]


def test_task_allow_list_parses_with_commas_inside(tmp_path: Path) -> None:
    text = "---\nname: x\ndescription: d\ntools: Read, Task(explorer, writer), Bash\n---\nbody\n"
    d = parse_agent(text, "x.md")
    assert d.agents == ["explorer", "writer"]
    assert d.tools == ["read_file", "task", "bash"]
    assert not any("permission pattern" in w for w in d.warnings)


def test_catalog_is_cut_with_a_note_past_its_size(tmp_path: Path) -> None:
    for i in range(80):
        _agent(tmp_path / "many", f"agent-{i:02d}", "x" * 200)
    cat = load_catalog(tmp_path, agents_dirs=[tmp_path / "many"])
    text = agent_catalog(sorted(cat.agents.values(), key=lambda a: a.name))
    assert len(text) <= CATALOG_CHARS + 200
    assert text.splitlines()[-1].startswith("[") and "orch agents list" in text


def test_a_childs_first_request_stays_small(tmp_path: Path) -> None:
    """Measure the cost of the guidance: the child's first request (system + tools + prompt)."""
    script = {
        "conversations": [
            {"depth": 0, "turns": [{"tool_calls": [task_call("look")]}, {"text": "ok"}]},
            {"depth": 1, "turns": [{"text": "looked"}]},
        ]
    }
    h = harness(tmp_path, script, provision=provisioner(FakeRuntime()))
    root = h.run()
    (child,) = [r for r in h.runs(root.chain_id) if r.depth == 1]
    first = h.requests_of(child.run_id)[0]
    size = len(first.system) + len(json.dumps(first.tools)) + len(json.dumps(first.messages))
    catalog = agent_catalog(load_catalog(tmp_path).agents.values())
    tokens = (size - len(catalog)) / 4  # ~4 characters a token
    print(f"child's first request: {size} chars, ≈{tokens:.0f} tokens without the catalog")
    assert tokens <= 3_000
