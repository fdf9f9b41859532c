"""A conversation that never overflows its window (engine/context.py): old tool results
cleared, then the conversation compacted by the model, before a request would pass the
window or after the API refused one; the stored transcript keeps everything."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from orchestrator.catalog.definitions import load_catalog
from orchestrator.config import Settings
from orchestrator.engine.context import SUMMARY_ASK, ContextKeeper, estimate
from orchestrator.engine.runner import Runner
from orchestrator.models import ModelProvider
from orchestrator.models.base import ContextOverflow, ModelRequest, ModelResponse, ModelUsage
from orchestrator.run import RunRecord, RunStatus
from orchestrator.spec import RunSpec
from orchestrator.store import SqliteStore, open_store
from tests.fakeapi import served, text_reply, tool_reply
from tests.fakes import FakeRuntime, provisioner
from tests.loopkit import conversation_problems
from tests.support import RUN_DEADLINE_S, init_repo

FILES = 25
FILE_CHARS = 40_000
WINDOW = 200_000
ANSWER = "Read all 25 files: every one holds its own marker."


def _files() -> dict[str, str]:
    return {
        f"f{i:02d}.txt": (f"MARKER-{i:02d} " + "x" * FILE_CHARS)[:FILE_CHARS] for i in range(FILES)
    }


def _size(request: ModelRequest) -> int:
    return estimate(request.system) + estimate(request.tools) + estimate(request.messages)


def _asks_summary(request: ModelRequest) -> bool:
    return SUMMARY_ASK in json.dumps(request.messages[-1]["content"])


@dataclass
class WindowModel:
    """Reads the files one a turn, then answers; refuses a request over ``window`` tokens
    as the Messages API does; answers a summary request with what it has read."""

    window: int = WINDOW
    read: int = 0
    requests: list[ModelRequest] = field(default_factory=list)
    refused: int = 0

    async def complete(self, request: ModelRequest) -> ModelResponse:
        size = _size(request)
        if size > self.window:
            self.refused += 1
            raise ContextOverflow(
                f"model API error 400: prompt is too long: {size} tokens > {self.window} maximum"
            )
        self.requests.append(request)
        usage = ModelUsage(input_tokens=size, output_tokens=20)
        if _asks_summary(request):
            text = f"Task: read the files. Read f00 to f{self.read - 1:02d}; each had its marker."
            return ModelResponse([{"type": "text", "text": text}], usage=usage)
        if self.read < FILES:
            self.read += 1
            call = {
                "type": "tool_use",
                "id": f"toolu_{self.read:03d}",
                "name": "read_file",
                "input": {"path": f"f{self.read - 1:02d}.txt"},
            }
            return ModelResponse([call], stop_reason="tool_use", usage=usage)
        return ModelResponse([{"type": "text", "text": ANSWER}], usage=usage)


@dataclass
class Ran:
    store: SqliteStore

    def events(self, run_id: str, kind: str) -> list[dict[str, Any]]:
        return [e["data"] for e in self.store.events(run_id) if e["kind"] == kind]


def _run(tmp_path: Path, model: WindowModel, **settings: Any) -> tuple[Ran, RunRecord]:
    root = tmp_path / "p"
    root.mkdir()
    cfg = Settings(**settings)
    store = SqliteStore.for_project(root)
    runner = Runner(
        settings=cfg,
        store=store,
        catalog=load_catalog(root, agents_dirs=[]),
        models=ModelProvider(cfg, model=model),
        provision=provisioner(FakeRuntime(_files())),
    )
    prompt = "Read every file f00.txt .. f24.txt and say what they hold."
    spec = RunSpec(prompt=prompt, workdir=root)
    record = asyncio.run(asyncio.wait_for(runner.run(spec), RUN_DEADLINE_S))
    return Ran(store), record


def _transcript_results(lp: Ran, run_id: str) -> str:
    kept = lp.store.transcript(run_id)
    assert kept is not None
    return json.dumps(kept)


@pytest.mark.parametrize(("keep", "how"), [(4, "cleared"), (20, "compacted")])
def test_a_long_run_is_compacted_before_the_window_and_succeeds(
    tmp_path: Path, keep: int, how: str
) -> None:
    """25 files of 40 KB against a 200k window: clearing old results is enough when few are
    kept whole; when many are, the model compacts the conversation."""
    model = WindowModel()
    context = {"windows": {"model": WINDOW}, "keep_tool_results": keep}
    lp, record = _run(tmp_path, model, context=context)
    assert record.status == RunStatus.SUCCEEDED, record.error
    assert record.output == ANSWER
    assert model.refused == 0  # never sent a request past the window
    assert all(_size(r) <= WINDOW for r in model.requests)
    for request in model.requests:
        assert conversation_problems(request) == [], conversation_problems(request)
    events = lp.events(record.run_id, "context_compacted")
    assert events and all(e["reason"] == "threshold" for e in events)
    assert [e["how"] for e in events][-1] == how
    assert all(e["after_tokens"] < e["before_tokens"] for e in events)
    assert record.usage.compactions == len(events)
    stored = _transcript_results(lp, record.run_id)  # nothing of any tool output was lost
    for i in range(FILES):
        assert f"MARKER-{i:02d} " + "x" * 100 in stored


def test_a_refusal_for_length_is_recovered_from(tmp_path: Path) -> None:
    """The settings think the window is far larger than it is: the API refuses, orch clears
    and compacts, and sends again, once per refusal."""
    model = WindowModel()
    lp, record = _run(tmp_path, model, context={"windows": {"model": 5 * WINDOW}})
    assert record.status == RunStatus.SUCCEEDED, record.error
    assert record.output == ANSWER
    assert model.refused >= 1
    events = lp.events(record.run_id, "context_compacted")
    assert len(events) == model.refused and all(e["reason"] == "refused" for e in events)
    stored = _transcript_results(lp, record.run_id)
    assert all(f"MARKER-{i:02d}" in stored for i in range(FILES))


def test_an_unknown_window_is_only_compacted_when_refused(tmp_path: Path) -> None:
    model = WindowModel()
    lp, record = _run(tmp_path, model)  # "model" has no window in any table
    assert record.status == RunStatus.SUCCEEDED, record.error
    assert model.refused >= 1
    assert lp.events(record.run_id, "context_compacted")


def test_a_refusal_that_nothing_can_fix_fails_the_run_with_the_apis_words(tmp_path: Path) -> None:
    model = WindowModel(window=10)  # not even the first request fits
    lp, record = _run(tmp_path, model)
    assert record.status == RunStatus.FAILED
    assert "prompt is too long" in (record.error or "")


def _conversation(results: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "task"}]
    for i in range(results):
        use = {"type": "tool_use", "id": f"t{i}", "name": "read_file", "input": {"path": "a"}}
        messages.append({"role": "assistant", "content": [use]})
        result = {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"R{i}" * 50}
        messages.append({"role": "user", "content": [result]})
    return messages


def test_clearing_keeps_the_latest_results_and_never_changes_the_conversation() -> None:
    messages = _conversation(6)
    before = json.dumps(messages)
    keeper = ContextKeeper(window=1000, keep_tool_results=2)
    assert keeper.clear(messages) == 4
    view = keeper.view(messages)
    assert json.dumps(messages) == before  # the whole conversation is kept as it was
    shown = json.dumps(view)
    assert "R0R0" not in shown and "R3R3" not in shown and "R4R4" in shown and "R5R5" in shown
    assert shown.count('"type": "tool_use"') == 6  # every call stays, with its input
    assert "cleared to keep the conversation" in shown
    assert keeper.clear(messages) == 0  # already cleared


def test_a_compacted_view_is_the_task_the_summary_and_the_latest_exchange() -> None:
    messages = _conversation(3)
    keeper = ContextKeeper(window=1000)
    point = keeper.compaction_point(messages)
    assert point == 5  # the latest assistant message
    summary = ModelResponse([{"type": "text", "text": "SUMMARY-TEXT"}])
    assert keeper.compacted(messages, point, summary)
    view = keeper.view(messages)
    assert [m["role"] for m in view] == ["user", "assistant", "user"]
    assert "task" in view[0]["content"] and "SUMMARY-TEXT" in view[0]["content"]
    assert view[1:] == messages[5:]


# -- through the real SDK: the long run ----------------------------------------------


def _reads(body: dict[str, Any]) -> int:
    """How many files the conversation sent has read: the latest read_file call's number
    (after a compaction the latest exchange is kept whole, so its call is still there)."""
    text = json.dumps(body["messages"])
    numbers = [int(n) for n in re.findall(r'"path": "big/f(\d\d)\.txt"', text)]
    return max(numbers) + 1 if numbers else 0


def _long_run(body: dict[str, Any]) -> dict[str, Any]:
    if SUMMARY_ASK in json.dumps(body["messages"][-1]):
        return text_reply(
            f"Task: read big/f00.txt to big/f24.txt. Done: up to big/f{_reads(body) - 1:02d}.txt."
        )
    done = _reads(body)
    if done < FILES:
        return tool_reply(("read_file", {"path": f"big/f{done:02d}.txt"}))
    return text_reply(ANSWER)


@pytest.mark.usefixtures("hermetic_git")
def test_twenty_five_files_of_40_kb_against_a_200k_window_succeed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's run through the real `anthropic` SDK against the fake Messages API, whose
    window (200k, claude-sonnet-4-5's) refuses a longer prompt with the real error: without
    orch's clearing and compaction it failed at turn 20 with `prompt is too long`."""
    files = {f"big/f{i:02d}.txt": v for i, (_, v) in enumerate(sorted(_files().items()))}
    root = init_repo(tmp_path / "proj", files)
    cfg = Settings(model="sonnet")
    store = open_store(root)
    provider = ModelProvider(cfg)
    runner = Runner(settings=cfg, store=store, catalog=load_catalog(root), models=provider)
    prompt = "Read big/f00.txt to big/f24.txt, one at a time, and say what they hold."

    async def go() -> RunRecord:
        async with provider:
            return await asyncio.wait_for(runner.run(RunSpec(prompt=prompt, workdir=root)), 300)

    with served(_long_run, monkeypatch) as api:
        record = asyncio.run(go())
        usages = api.answered()
    assert record.status == RunStatus.SUCCEEDED, record.error
    assert record.output == ANSWER
    assert len(api.requests) == len(usages)  # the API refused none
    kinds = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    sizes = [sum(u[k] for k in kinds) for u in usages]
    assert max(sizes) <= WINDOW, sizes
    events = [e["data"] for e in store.events(record.run_id) if e["kind"] == "context_compacted"]
    assert events and events[0]["window"] == WINDOW, sizes
    kept = json.dumps(store.transcript(record.run_id))
    assert all(f"MARKER-{i:02d} " + "x" * 1000 in kept for i in range(FILES))
    assert record.usage.cost_usd > 0 and record.usage.cache_read_input_tokens > 0
