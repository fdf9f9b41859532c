"""ScriptedModel: a model that plays a YAML script, for tests and the offline demo.

Conversations are keyed per agent, not one global queue, so parallel
children stay deterministic::

    conversations:
      - agent: general          # match on the agent name (optional)
        depth: 0                # match on the delegation depth (optional)
        prompt: "test framework" # regex searched in the first user message (optional)
        runs: 1                 # how many runs it serves (default 1; "*" for any)
        latency_s: 0.0          # wait before each reply
        turns:
          - text: "Let me look."
            tool_calls:
              - tool: glob
                input: {pattern: "*.toml"}
          - expect_result: "pyproject"   # regex the previous tool results must match
            text: "It uses pytest."
            usage: {input_tokens: 5000, output_tokens: 20}  # reported (default: estimated)

A tool call's ``input`` may be any JSON value (a string, a list, null: what a
misbehaving model sends), and ``blocks`` adds content blocks exactly as written
(a ``tool_use`` without ``id`` or ``name``, a repeated id), for hostile-model tests.

Strict: a request no conversation matches, a run asking for more turns than
its conversation has, an ``expect_result`` that does not match, or turns and
runs left unconsumed at the end (``verify``) raise :class:`ScriptError`
naming the conversation, the turn and the run.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import OrchError, UsageError
from .base import Block, ModelRequest, ModelResponse, ModelUsage

if TYPE_CHECKING:
    from .registry import Provider, Session


class ScriptError(OrchError):
    """The script and the run disagree; the message says where."""

    exit_code = 2


class ScriptToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tool: str
    input: Any = Field(default_factory=dict)  # any JSON value, sent as written
    id: str | None = None


class ScriptUsage(BaseModel):
    """What a turn reports as used (default: an estimate from the request's size)."""

    model_config = ConfigDict(extra="forbid")

    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(default=0, ge=0)


class ScriptTurn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = ""
    tool_calls: list[ScriptToolCall] = Field(default_factory=list)
    blocks: list[dict[str, Any]] = Field(default_factory=list)  # sent as written, after those
    expect_result: str | None = None
    latency_s: float | None = None
    stop_reason: Literal["end_turn", "max_tokens", "tool_use"] | None = None
    usage: ScriptUsage | None = None


class Conversation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    agent: str | None = None
    depth: int | None = None
    prompt: str | None = None
    runs: int | Literal["*"] = 1
    latency_s: float = 0.0
    turns: list[ScriptTurn] = Field(min_length=1)

    def label(self, index: int) -> str:
        keys = [f"agent={self.agent}"] if self.agent else []
        if self.depth is not None:
            keys.append(f"depth={self.depth}")
        if self.prompt:
            keys.append(f"prompt=/{self.prompt}/")
        return f"#{index + 1} ({', '.join(keys) or 'matches anything'})"


class Script(BaseModel):
    model_config = ConfigDict(extra="forbid")

    conversations: list[Conversation] = Field(min_length=1)


def _first_user_text(request: ModelRequest) -> str:
    if not request.messages:
        return ""
    content = request.messages[0].get("content")
    if isinstance(content, str):
        return content
    blocks = content if isinstance(content, list) else []
    return "\n".join(str(b.get("text", "")) for b in blocks if isinstance(b, dict))


def _last_results_text(request: ModelRequest) -> str:
    last = request.messages[-1] if request.messages else {}
    content = last.get("content", "")
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for b in content:
        c = b.get("content", b.get("text", ""))
        parts.append(c if isinstance(c, str) else json.dumps(c))
    return "\n".join(parts)


def estimate_tokens(obj: object) -> int:
    """About four characters a token: the usual rule of thumb for English and code."""
    return max(1, len(json.dumps(obj, default=str)) // 4)


class ScriptedModel:
    def __init__(self, script: Script, source: str = "<script>") -> None:
        self.script = script
        self.source = source
        self.served = [0] * len(script.conversations)
        self.bound: dict[str, int] = {}  # run_id -> conversation index
        self.position: dict[str, int] = {}  # run_id -> turns served
        self.requests: list[ModelRequest] = []  # every request, for tests

    @classmethod
    def load(cls, path: Path) -> ScriptedModel:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ScriptError(f"cannot read model script {path}: {e.strerror}") from e
        return cls.from_yaml(text, str(path))

    @classmethod
    def from_yaml(cls, text: str, source: str = "<script>") -> ScriptedModel:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            raise ScriptError(f"{source}{where}: not valid YAML ({e})") from e
        return cls.from_data(data, source)

    @classmethod
    def from_data(cls, data: object, source: str = "<script>") -> ScriptedModel:
        try:
            script = Script.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise ScriptError(f"{source}: malformed script at {loc}: {err['msg']}") from e
        for i, conv in enumerate(script.conversations):
            if conv.prompt:
                try:
                    re.compile(conv.prompt)
                except re.error as e:
                    raise ScriptError(
                        f"{source}: conversation #{i + 1}: bad prompt regex: {e}"
                    ) from e
        return cls(script, source)

    def _bind(self, request: ModelRequest) -> int:
        first = _first_user_text(request)
        for i, conv in enumerate(self.script.conversations):
            if conv.runs != "*" and self.served[i] >= conv.runs:
                continue
            if conv.agent is not None and conv.agent != request.agent:
                continue
            if conv.depth is not None and conv.depth != request.depth:
                continue
            if conv.prompt is not None and not re.search(conv.prompt, first):
                continue
            self.served[i] += 1
            return i
        labels = "; ".join(c.label(i) for i, c in enumerate(self.script.conversations))
        raise ScriptError(
            f"{self.source}: unexpected model call: no conversation left that matches agent "
            f"{request.agent!r} at depth {request.depth} with first message "
            f"{first[:120]!r} (run {request.run_id}); conversations: {labels}"
        )

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(request)
        key = request.run_id or "<anonymous>"
        if key not in self.bound:
            self.bound[key] = self._bind(request)
            self.position[key] = 0
        index = self.bound[key]
        conv = self.script.conversations[index]
        step = self.position[key]
        if step >= len(conv.turns):
            raise ScriptError(
                f"{self.source}: conversation {conv.label(index)} has {len(conv.turns)} turns, "
                f"but run {request.run_id} asked for turn {step + 1} (its last scripted turn "
                "called a tool, so the run went on; add a final turn with text only)"
            )
        turn = conv.turns[step]
        self.position[key] = step + 1
        if turn.expect_result is not None:
            seen = _last_results_text(request)
            if not re.search(turn.expect_result, seen):
                raise ScriptError(
                    f"{self.source}: conversation {conv.label(index)} turn {step + 1} expected "
                    f"the previous results to match /{turn.expect_result}/, got {seen[:300]!r}"
                )
        latency = turn.latency_s if turn.latency_s is not None else conv.latency_s
        if latency > 0:
            await asyncio.sleep(latency)
        content: list[Block] = []
        if turn.text:
            content.append({"type": "text", "text": turn.text})
        for n, call in enumerate(turn.tool_calls):
            call_id = call.id or f"toolu_{request.run_id}_{step + 1}_{n + 1}"
            content.append(
                {"type": "tool_use", "id": call_id, "name": call.tool, "input": call.input}
            )
        content.extend(dict(b) for b in turn.blocks)
        if not content:
            content.append({"type": "text", "text": ""})
        usage = (
            ModelUsage(turn.usage.input_tokens, turn.usage.output_tokens)
            if turn.usage is not None
            else ModelUsage(
                input_tokens=estimate_tokens([request.system, request.messages, request.tools]),
                output_tokens=estimate_tokens(content),
            )
        )
        calls = turn.tool_calls or any(b.get("type") == "tool_use" for b in turn.blocks)
        stop = turn.stop_reason or ("tool_use" if calls else "end_turn")
        return ModelResponse(content=content, stop_reason=stop, usage=usage)

    def problems(self) -> list[str]:
        """What the run left unconsumed: runs not served and runs that stopped early."""
        out: list[str] = []
        for i, conv in enumerate(self.script.conversations):
            if conv.runs != "*" and self.served[i] < conv.runs:
                out.append(
                    f"conversation {conv.label(i)} expected {conv.runs} run(s), served "
                    f"{self.served[i]}"
                )
        for run_id, i in self.bound.items():
            conv = self.script.conversations[i]
            if self.position[run_id] < len(conv.turns):
                out.append(
                    f"run {run_id} stopped after turn {self.position[run_id]} of "
                    f"{len(conv.turns)} in conversation {conv.label(i)}"
                )
        return out

    def report(self) -> dict[str, Any]:
        """What this copy of the script served (a run on a cluster node), for ``absorb``."""
        runs = {rid: [i, self.position[rid]] for rid, i in self.bound.items()}
        return {"served": list(self.served), "runs": runs}

    def absorb(self, report: dict[str, Any]) -> None:
        """Count what another copy of this script served as served here, so ``verify``
        holds the whole tree to the script, wherever its runs executed."""
        for i, n in enumerate(list(report.get("served", []))[: len(self.served)]):
            self.served[i] += int(n)
        for rid, (i, position) in dict(report.get("runs", {})).items():
            self.bound[str(rid)] = int(i)
            self.position[str(rid)] = int(position)

    def verify(self) -> None:
        problems = self.problems()
        if problems:
            raise ScriptError(f"{self.source}: script not fully used: " + "; ".join(problems))


class ScriptedProvider:
    """``scripted:FILE``: the script at FILE answers every agent of the run."""

    name = "scripted"
    env_prefix = None
    env_names: tuple[str, ...] = ()
    preload: tuple[str, ...] = ()
    api = None
    whole_run = True  # the script keeps its place in the run

    def portable(self, model_id: str) -> str:
        return str(Path(model_id).resolve())

    def fixed(self, model_id: str) -> ScriptedModel:
        return ScriptedModel.load(Path(model_id))

    def missing(self) -> str | None:
        return None

    def open(self) -> Session:
        raise UsageError(
            "a scripted model plays for the whole run (--model scripted:FILE), not for one agent"
        )


PROVIDER: Provider = ScriptedProvider()
