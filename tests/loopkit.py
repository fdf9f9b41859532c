"""A listed-responses Model, a Runner over it on the in-memory workspace, and the
Messages API conversation invariants every request of the agent loop must keep.

Used by the malformed-tool-call tests and the loop fuzzer.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.catalog.definitions import load_catalog
from orchestrator.config import Settings
from orchestrator.engine.runner import Runner
from orchestrator.models import ModelProvider
from orchestrator.models.base import Block, ModelRequest, ModelResponse
from orchestrator.run import RunRecord
from orchestrator.spec import Limits, RunSpec
from orchestrator.store import SqliteStore
from orchestrator.workspaces.base import ProcessResult
from tests.fakes import FakeRuntime, provisioner
from tests.support import RUN_DEADLINE_S

# What the Messages API accepts for a tool_use id and (for a tool definition) a name.
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")

FINAL = "all done"


@dataclass
class ListModel:
    """Plays ``responses`` (raw content lists, or ModelResponses) to the root run in order,
    then answers with the final text; a child run (depth > 0) gets the final text at once.
    Every request is kept.
    """

    responses: list[Any] = field(default_factory=list)
    requests: list[ModelRequest] = field(default_factory=list)

    def load(self, responses: list[Any]) -> None:
        self.responses = list(responses)
        self.requests = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        if request.depth == 0 and self.responses:
            item = self.responses.pop(0)
            if isinstance(item, ModelResponse):
                return item
            return ModelResponse(content=item, stop_reason="tool_use")
        return ModelResponse(content=[{"type": "text", "text": FINAL}])


@dataclass
class Loop:
    root: Path
    model: ListModel
    runtime: FakeRuntime
    store: SqliteStore
    runner: Runner

    def run(self, responses: list[Any], prompt: str = "go", **limits: Any) -> RunRecord:
        self.model.load(responses)
        spec = RunSpec(prompt=prompt, workdir=self.root, limits=Limits(**limits))
        return asyncio.run(asyncio.wait_for(self.runner.run(spec), RUN_DEADLINE_S))

    def root_requests(self) -> list[ModelRequest]:
        return [r for r in self.model.requests if r.depth == 0]

    def results(self, turn: int) -> list[Block]:
        """The tool_result blocks the root run sent with its request number ``turn``."""
        content = self.root_requests()[turn].messages[-1]["content"]
        return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]

    def events(self, run_id: str, kind: str) -> list[dict[str, Any]]:
        return [e["data"] for e in self.store.events(run_id) if e["kind"] == kind]


def loop(
    root: Path,
    files: dict[str, str] | None = None,
    commands: dict[str, ProcessResult] | None = None,
    **settings: Any,
) -> Loop:
    """A Runner over a ListModel and one in-memory workspace, its store under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    model = ListModel()
    runtime = FakeRuntime(files or {}, commands)
    cfg = Settings(**settings)
    store = SqliteStore.for_project(root)
    runner = Runner(
        settings=cfg,
        store=store,
        catalog=load_catalog(root, agents_dirs=[]),
        models=ModelProvider(cfg, model=model),
        provision=provisioner(runtime),
    )
    return Loop(root, model, runtime, store, runner)


def conversation_problems(request: ModelRequest) -> list[str]:
    """What would make the Messages API refuse this request (empty: a valid conversation).

    The first message is the prompt alone; roles alternate, user first and last; an
    assistant message is a non-empty list of blocks; tool_use ids are valid, unique over
    the conversation, names are valid names and inputs objects; the next user message
    opens with exactly one tool_result per tool_use of the assistant message before it,
    in the same order, and has no others; no tool_result holds a traceback.
    """
    problems: list[str] = []
    messages = request.messages
    if not messages or not isinstance(messages[0].get("content"), str):
        return ["the first message is not the prompt"]
    if messages[0]["role"] != "user":
        problems.append("the first message is not from the user")
    if messages[-1]["role"] != "user":
        problems.append("the last message is not from the user")
    seen_ids: set[str] = set()
    expected: list[str] = []  # tool_use ids the next user message must answer
    for i, m in enumerate(messages):
        want = "user" if i % 2 == 0 else "assistant"
        if m.get("role") != want:
            problems.append(f"message {i}: role {m.get('role')!r}, expected {want}")
            continue
        content = m.get("content")
        if isinstance(content, str):
            blocks: list[Any] = [{"type": "text", "text": content}] if content else []
        elif isinstance(content, list):
            blocks = content
        else:
            problems.append(f"message {i}: content is {type(content).__name__}")
            continue
        if not blocks:
            problems.append(f"message {i}: empty content")
        for b in blocks:
            if not isinstance(b, dict) or not isinstance(b.get("type"), str):
                problems.append(f"message {i}: a block that is not a typed object: {b!r:.80}")
            elif b["type"] == "text" and (
                not isinstance(b.get("text"), str) or not b["text"].strip()
            ):
                problems.append(f"message {i}: a text block without text")
        if want == "assistant":
            uses = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_use"]
            if any(isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks):
                problems.append(f"message {i}: tool_result in an assistant message")
            expected = []
            for b in uses:
                tid, name = b.get("id"), b.get("name")
                if not isinstance(tid, str) or not ID_PATTERN.fullmatch(tid):
                    problems.append(f"message {i}: tool_use id {tid!r:.80}")
                elif tid in seen_ids:
                    problems.append(f"message {i}: tool_use id {tid!r} used twice")
                else:
                    seen_ids.add(tid)
                    expected.append(tid)
                if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
                    problems.append(f"message {i}: tool_use name {name!r:.80}")
                if not isinstance(b.get("input"), dict):
                    problems.append(f"message {i}: tool_use input {b.get('input')!r:.80}")
            continue
        results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
        leading = blocks[: len(results)]
        if leading != results:
            problems.append(f"message {i}: tool_result blocks do not come first")
        ids = [r.get("tool_use_id") for r in results]
        if ids != expected:
            problems.append(f"message {i}: tool_result ids {ids!r:.200} for {expected!r:.200}")
        for r in results:
            text = r.get("content")
            if not isinstance(text, str):
                problems.append(f"message {i}: tool_result content {type(text).__name__}")
            elif "Traceback (most recent call last)" in text:
                problems.append(f"message {i}: a traceback in a tool_result")
        expected = []
    return problems
