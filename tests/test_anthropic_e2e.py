"""End to end through the real `anthropic` SDK against a fake Messages API on loopback."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from orchestrator.catalog.definitions import load_catalog
from orchestrator.config import Settings
from orchestrator.engine.runner import Runner
from orchestrator.models import ModelProvider
from orchestrator.run import RunRecord, RunStatus
from orchestrator.spec import RunSpec
from orchestrator.store import open_store
from tests.fakeapi import FakeAPI, serve, system_text, text_reply, tool_reply


async def _run(runner: Runner, provider: ModelProvider, prompt: str, root: Path) -> RunRecord:
    async with provider:
        return await asyncio.wait_for(runner.run(RunSpec(prompt=prompt, workdir=root)), 300)


def _agent_of(body: dict[str, Any]) -> tuple[str, int]:
    m = re.search(r"You are agent '([^']+)' at delegation depth (\d+)", system_text(body))
    assert m, "every request names its agent and depth in the system prompt"
    return m.group(1), int(m.group(2))


def _results(body: dict[str, Any]) -> list[dict[str, Any]]:
    last = body["messages"][-1]["content"]
    return [b for b in last if isinstance(b, dict) and b.get("type") == "tool_result"]


def responder(body: dict[str, Any]) -> dict[str, Any]:
    agent, depth = _agent_of(body)
    turn = (len(body["messages"]) + 1) // 2
    if depth == 0:
        if turn == 1:
            return tool_reply(
                (
                    "task",
                    {
                        "description": "inspect",
                        "subagent_type": "general",
                        "prompt": "Inspect the project and report.",
                    },
                )
            )
        return text_reply("parent done")
    if depth == 1:
        if turn == 1:
            return tool_reply(
                ("read_file", {"path": "secret.txt"}),
                ("read_file", {"path": "../outside.txt"}),
                ("task", {"description": "deeper", "prompt": "go deeper"}),
            )
        return text_reply("child saw the secret; summary only")
    if turn == 1:  # depth 2: the limit; write_file is forced although allowed, task forced
        return tool_reply(("task", {"description": "too deep", "prompt": "x"}))
    return text_reply("grandchild done")


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = FakeAPI(responder)
    with serve(fake) as running:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", running.base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-fake")
        yield running


def test_real_sdk_end_to_end(api: FakeAPI, project: Path, tmp_path: Path) -> None:
    (project / "secret.txt").write_text("CHILD-TOOL-OUTPUT-4411\n")
    (project.parent / "outside.txt").write_text("OUTSIDE-DATA\n")
    settings = Settings(max_depth=2, model="sonnet")
    store = open_store(project)
    catalog = load_catalog(project)
    provider = ModelProvider(settings)
    runner = Runner(settings=settings, store=store, catalog=catalog, models=provider)

    root = asyncio.run(_run(runner, provider, "Look at this project.", project))
    assert root.status == RunStatus.SUCCEEDED, root.error
    assert root.output == "parent done"

    by_depth: dict[int, list[dict[str, Any]]] = {}
    for body in api.requests:
        by_depth.setdefault(_agent_of(body)[1], []).append(body)
    assert sorted(by_depth) == [0, 1, 2]
    # aliases resolve to ids; the SDK sent our key
    assert {b["model"] for b in api.requests} == {"claude-sonnet-4-5"}
    assert all(
        "sk-test-fake" in (h.get("x-api-key", "") + h.get("authorization", "")) for h in api.headers
    )

    # the child's first request is fresh: one message, the prompt
    child_first = by_depth[1][0]
    assert child_first["messages"] == [
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "Inspect the project and report.",
                    "cache_control": {"type": "ephemeral"},  # the rolling cache breakpoint
                }
            ],
        }
    ]
    grandchild_first = by_depth[2][0]
    assert len(grandchild_first["messages"]) == 1

    # tool lists per depth: task offered below the limit, withheld at it
    names = [{t["name"] for t in by_depth[d][0]["tools"]} for d in (0, 1, 2)]
    assert "task" in names[0] and "task" in names[1] and "task" not in names[2]

    # inside the child: path escape refused, secret read; forced task at the limit refused
    child_results = _results(by_depth[1][1])
    assert "CHILD-TOOL-OUTPUT-4411" in child_results[0]["content"]
    assert child_results[1]["is_error"] and "outside the workspace" in child_results[1]["content"]
    assert "OUTSIDE-DATA" not in json.dumps(api.requests)
    grand_results = _results(by_depth[2][1])
    assert grand_results[0]["is_error"] and "depth limit" in grand_results[0]["content"]

    # the parent never sees the child's tool outputs, only its final text
    for body in by_depth[0]:
        assert "CHILD-TOOL-OUTPUT-4411" not in json.dumps(body)
    parent_result = _results(by_depth[0][1])[0]["content"]
    assert "child saw the secret; summary only" in parent_result

    # usage comes from the API's usage fields
    assert root.usage.input_tokens > 0 and root.usage.output_tokens > 0


def test_sdk_retries_injected_faults(api: FakeAPI, project: Path) -> None:
    api.responder = lambda body: text_reply("made it")
    api.fail_first = 3  # 429, 500, 529 in a row; the SDK retries with backoff
    settings = Settings()
    store = open_store(project)
    provider = ModelProvider(settings)
    runner = Runner(settings=settings, store=store, catalog=load_catalog(project), models=provider)
    root = asyncio.run(_run(runner, provider, "hi", project))
    assert root.status == RunStatus.SUCCEEDED and root.output == "made it"
    assert api.served == 4


def test_persistent_errors_fail_the_run_clearly(api: FakeAPI, project: Path) -> None:
    api.fail_first = 1000
    api.faults = (500,)
    settings = Settings()
    store = open_store(project)
    provider = ModelProvider(settings)
    runner = Runner(settings=settings, store=store, catalog=load_catalog(project), models=provider)
    root = asyncio.run(_run(runner, provider, "hi", project))
    assert root.status == RunStatus.FAILED
    assert root.error is not None and "model API error 500" in root.error
