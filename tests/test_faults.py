"""Faults: a flaky model API, a tool that raises or hangs, a model that never stops.

Every case ends in a defined status, within bounded time, with the store intact.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest

from orchestrator.catalog.definitions import load_catalog
from orchestrator.config import Settings
from orchestrator.engine.runner import Runner
from orchestrator.models import ModelProvider
from orchestrator.run import RunRecord, RunStatus
from orchestrator.spec import RunSpec
from orchestrator.store import open_store
from orchestrator.tools import builtin_tools
from orchestrator.tools.base import Tool, ToolInput, ToolOutput
from orchestrator.tools.delegate import delegation_tools
from tests.fakeapi import FakeAPI, serve, system_text, text_reply, tool_reply
from tests.support import harness, task_call, tool_results


def _depth(body: dict[str, Any]) -> int:
    m = re.search(r"at delegation depth (\d+)", system_text(body))
    assert m
    return int(m.group(1))


def fan_out_responder(body: dict[str, Any]) -> dict[str, Any]:
    """Root: 4 children, each reads a file twice, then answers."""
    turn = (len(body["messages"]) + 1) // 2
    if _depth(body) == 0:
        if turn == 1:
            return tool_reply(
                *[("task", {"description": f"c{i}", "prompt": f"child {i}"}) for i in range(4)]
            )
        return text_reply("root done")
    if turn <= 2:
        return tool_reply(("read_file", {"path": "pyproject.toml"}), text=f"step {turn}")
    return text_reply("child done")


async def _run(settings: Settings, root: Path, prompt: str = "go") -> RunRecord:
    provider = ModelProvider(settings)
    runner = Runner(
        settings=settings, store=open_store(root), catalog=load_catalog(root), models=provider
    )
    async with provider:
        return await asyncio.wait_for(runner.run(RunSpec(prompt=prompt, workdir=root)), 120)


@pytest.mark.slow
def test_thirty_percent_faults_and_slow_answers_never_hang(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = FakeAPI(fan_out_responder, fault_rate=0.3, delay_s=0.05, seed=11)
    with serve(api):
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-fake")
        root = asyncio.run(_run(Settings(), project))
    store = open_store(project)
    runs = store.list_runs()
    assert len(runs) == 5
    for r in runs:
        assert r.status in (RunStatus.SUCCEEDED, RunStatus.FAILED)
        if r.status == RunStatus.FAILED:
            assert r.error and "model API" in r.error or "cannot reach" in (r.error or "")
    assert api.served > len(api.requests)  # faults were injected and retried past
    assert root.status in (RunStatus.SUCCEEDED, RunStatus.FAILED)
    events = store.events(root.run_id)
    assert events[-1]["kind"] == "run_finished"


def test_api_down_for_good_fails_with_partial_output(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}

    def responder(body: dict[str, Any]) -> dict[str, Any]:
        calls["n"] += 1
        return tool_reply(("glob", {"pattern": "*"}), text="PARTIAL-PROGRESS")

    api = FakeAPI(responder)
    with serve(api):
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-fake")
        api.fail_first = 0

        def then_fail(body: dict[str, Any]) -> dict[str, Any]:
            api.fail_first = 10_000  # every later request errors
            api.faults = (529,)
            return responder(body)

        api.responder = then_fail
        root = asyncio.run(_run(Settings(), project))
    assert root.status == RunStatus.FAILED
    assert root.output == "PARTIAL-PROGRESS"
    assert root.error is not None and "529" in root.error


class Explode(Tool):
    name = "explode"
    description = "raises"
    input_model = ToolInput

    async def run(self, ctx: Any, args: Any) -> ToolOutput:
        raise RuntimeError("tool bug")


class Hang(Tool):
    name = "hang"
    description = "never returns"
    input_model = ToolInput
    limit: ClassVar[float] = 0.5

    def time_limit(self, args: Any, settings: Any) -> float | None:
        return self.limit

    async def run(self, ctx: Any, args: Any) -> ToolOutput:
        await asyncio.sleep(3600)
        return ToolOutput("unreachable")


def test_a_tool_that_raises_is_a_tool_error_and_the_loop_goes_on(project: Path) -> None:
    script = {
        "conversations": [
            {
                "turns": [
                    {
                        "tool_calls": [
                            {"tool": "explode"},
                            {"tool": "glob", "input": {"pattern": "*"}},
                        ]
                    },
                    {
                        "expect_result": "explode failed: RuntimeError: tool bug",
                        "text": "recovered",
                    },
                ]
            }
        ]
    }
    h = harness(project, script)
    h.runner.tools.add(Explode())
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED and root.output == "recovered"
    bad, glob = tool_results(h.requests_of(root.run_id)[1])
    assert bad["is_error"] and "pyproject.toml" in glob["content"]


def test_a_child_that_raises_fails_alone(project: Path) -> None:
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [task_call("bad"), task_call("good")]},
                    {"text": "parent carries on"},
                ],
            },
            {
                "prompt": "bad",
                "turns": [{"text": "PARTIAL", "tool_calls": [{"tool": "glob"}]}, {"text": "never"}],
            },
            {"prompt": "good", "turns": [{"text": "fine"}]},
        ]
    }
    h = harness(project, script)
    original = h.model.complete

    async def flaky(request: Any) -> Any:
        if request.depth == 1 and len(request.messages) > 1 and "bad" in str(request.messages[0]):
            raise RuntimeError("model layer bug")
        return await original(request)

    h.model.complete = flaky  # type: ignore[method-assign]
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED
    bad, good = tool_results(h.requests_of(root.run_id)[-1])
    assert bad["is_error"] and "RuntimeError: model layer bug" in bad["content"]
    assert "PARTIAL" in bad["content"]
    assert "fine" in good["content"] and not good.get("is_error")


def test_a_tool_that_hangs_is_cut_off_and_the_loop_goes_on(project: Path) -> None:
    script = {
        "conversations": [
            {
                "turns": [
                    {"tool_calls": [{"tool": "hang"}]},
                    {"expect_result": "did not finish within 0.5s", "text": "moved on"},
                ]
            }
        ]
    }
    h = harness(project, script)
    h.runner.tools.add(Hang())
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED and root.output == "moved on"


def test_tool_registry_defaults_are_bounded() -> None:
    settings = Settings()
    limits = {
        t.name: t.time_limit(t.input_model.model_construct(), settings)
        for t in [*builtin_tools(), *delegation_tools()]
    }
    assert limits["task"] is None and limits["task_output"] is None
    assert limits["read_file"] == settings.tool_timeout_s
    assert limits["bash"] == settings.bash_timeout_s + 15.0  # its own timeout, then a margin
    unbounded = {n for n, v in limits.items() if v is None}
    assert unbounded == {"task", "task_output", "task_stop"}  # bounded by the child's limits
    assert all(v > 0 for v in limits.values() if v is not None)
