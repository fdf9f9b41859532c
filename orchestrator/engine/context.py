"""A conversation that never overflows its model's window.

The agent loop keeps a run's whole conversation (``messages``: what the store keeps, for
resume and for reading); what it sends is a *view* of it made here. Before a request whose
input would pass ``[context] compact_at`` of the model's window (``pricing.window``, or the
settings' ``[context] windows``), and after the API refused one as too long:

1. **Clear**: the results of old tool calls are replaced by a one-line note (the call stays,
   with its input; the latest ``keep_tool_results`` results stay whole). This is the
   Messages API's own "clear tool uses" edit, done on our side.
2. **Compact**, if clearing was not enough: the model is asked, with the same tools and
   system prompt (so the request reads the prompt cache), to summarise the conversation so
   far: the task, decisions, files touched, open questions and next steps, the way Claude
   Code's auto-compact does. The view becomes the task with that summary, then the latest
   exchange as it was.

Each time is a ``context_compacted`` event. Token counts come from what the API reported
for the previous request plus an estimate (JSON characters / 4, scaled by how the API's
figures compared with the estimate so far) of what was added since.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..models.base import Block, Message, Model, ModelRequest, ModelResponse, ModelUsage

CLEARED = (
    "[orch: this tool result ({chars:,} characters) was cleared to keep the conversation "
    "inside the model's context window; run the call again if you need it]"
)
SUMMARY_ASK = (
    "[orch] The conversation is about to be compacted to fit the model's context window. "
    "Write a summary that lets you carry on the task without it: the task and its "
    "requirements; what you did and decided, and why; every file you read, changed or "
    "created (paths, and what matters in them); commands run and their outcome; errors met "
    "and how they were solved; open questions; the exact next steps. Be complete and "
    "specific (names, paths, numbers). Answer with the summary only, no tool call."
)
SUMMARY_HEAD = (
    "{task}\n\n<summary>\nThe conversation so far was compacted to fit the context window. "
    "A summary of it:\n{summary}\n</summary>\n\nContinue the task from where it stopped."
)
TASK_CHARS = 20_000  # of the first message, repeated above the summary
_MIN_SCALE, _MAX_SCALE = 0.25, 4.0


def estimate(value: object) -> int:
    """Tokens of a JSON-like value, about four characters a token."""
    return len(json.dumps(value, default=str)) // 4


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text"
        )
    return ""


def _result_chars(block: Block) -> int:
    content = block.get("content")
    return len(content) if isinstance(content, str) else len(json.dumps(content, default=str))


@dataclass
class Fit:
    """What one clearing or compaction did (the ``context_compacted`` event's data)."""

    how: str  # "cleared" | "compacted"
    reason: str  # "threshold" | "refused"
    before_tokens: int
    after_tokens: int
    cleared_results: int
    window: int | None

    def event(self, turn: int) -> dict[str, Any]:
        return {"turn": turn, **self.__dict__}


@dataclass
class ContextKeeper:
    """The view of one run's conversation that fits its window (see the module's doc)."""

    window: int | None  # tokens; None: unknown (only a refusal makes it act)
    compact_at: float = 0.8
    keep_tool_results: int = 4
    cleared: set[str] = field(default_factory=set)  # tool_use ids whose results are cleared
    start: int = 0  # the whole conversation's index the view goes on from after a summary
    summary: str | None = None
    scale: float = 1.0  # the API's token count / our estimate, from the latest request
    last_tokens: int = 0  # the latest request's whole input as the API counted it
    # id -> (the object, its content's id, its estimate): a message, the system prompt or
    # the tools, estimated once (the object is held, so its id is not reused while it is
    # here; a message whose content was replaced is estimated again)
    _seen: dict[int, tuple[object, int, int]] = field(default_factory=dict)

    def _raw(self, request: ModelRequest) -> int:
        """``estimate`` of the request's input, each message and part estimated once."""
        total = 0
        for part in (request.system, request.tools, *request.messages):
            inner = id(part.get("content")) if isinstance(part, dict) else 0
            seen = self._seen.get(id(part))
            if seen is None or seen[0] is not part or seen[1] != inner:
                seen = self._seen[id(part)] = (part, inner, estimate(part))
            total += seen[2]
        return total

    @property
    def limit(self) -> int | None:
        return int(self.window * self.compact_at) if self.window else None

    def view(self, messages: list[Message]) -> list[Message]:
        """What is sent of ``messages``: the summary and what follows it, old results cleared.
        New lists and dicts where anything differs: ``messages`` is never changed."""
        out = list(messages[self.start :])
        if self.summary is not None:
            task = _text(messages[0].get("content"))[:TASK_CHARS]
            head = SUMMARY_HEAD.format(task=task, summary=self.summary)
            out.insert(0, {"role": "user", "content": head})
        if not self.cleared:
            return out
        for i, message in enumerate(out):
            content = message.get("content")
            if message.get("role") != "user" or not isinstance(content, list):
                continue
            if any(self._clears(b) for b in content):
                blocks = [self._cleared(b) if self._clears(b) else b for b in content]
                out[i] = {**message, "content": blocks}
        return out

    def _clears(self, block: object) -> bool:
        return (
            isinstance(block, dict)
            and block.get("type") == "tool_result"
            and block.get("tool_use_id") in self.cleared
        )

    @staticmethod
    def _cleared(block: Block) -> Block:
        kept = {k: v for k, v in block.items() if k in ("type", "tool_use_id", "is_error")}
        return {**kept, "content": CLEARED.format(chars=_result_chars(block))}

    def size(self, request: ModelRequest) -> int:
        """The request's input in tokens, as the API would count it (estimated)."""
        return int(self._raw(request) * self.scale)

    def note(self, request: ModelRequest, usage: ModelUsage) -> None:
        """What the API counted for ``request``: calibrates the estimate."""
        counted = usage.prompt_tokens
        if counted <= 0:
            return
        self.last_tokens = counted
        raw = self._raw(request)
        if raw > 0:
            self.scale = min(_MAX_SCALE, max(_MIN_SCALE, counted / raw))

    def over(self, request: ModelRequest) -> bool:
        limit = self.limit
        return limit is not None and self.size(request) > limit

    def clear(self, messages: list[Message]) -> int:
        """Clear every tool result of the view but the latest ``keep_tool_results``; how
        many were newly cleared."""
        ids = [
            str(b.get("tool_use_id"))
            for m in messages[self.start :]
            if m.get("role") == "user" and isinstance(m.get("content"), list)
            for b in m["content"]
            if isinstance(b, dict) and b.get("type") == "tool_result"
        ]
        keep = set(ids[max(0, len(ids) - self.keep_tool_results) :])
        new = {i for i in ids if i not in keep and i not in self.cleared}
        self.cleared |= new
        return len(new)

    def compaction_point(self, messages: list[Message]) -> int | None:
        """Where the view goes on after a summary: the latest assistant message (its calls and
        their results stay whole), or None when there is nothing before it to summarise."""
        for i in range(len(messages) - 1, self.start, -1):
            if messages[i].get("role") == "assistant":
                return i if i > self.start else None
        return None

    def summary_request(self, request: ModelRequest, messages: list[Message]) -> ModelRequest:
        """``request`` (its system prompt and tools: the cached prefix) asking for the summary
        of the view, every tool result in it but the latest cleared."""
        kept, keep = set(self.cleared), self.keep_tool_results
        self.keep_tool_results = 0
        self.clear(messages)  # for this request only: the view goes on with the latest whole
        view = self.view(messages)
        self.cleared, self.keep_tool_results = kept, keep
        last = view[-1]
        content = last.get("content")
        if isinstance(content, str):
            blocks: list[Block] = [{"type": "text", "text": content}]
        else:
            blocks = list(content) if isinstance(content, list) else []
        ask: Block = {"type": "text", "text": SUMMARY_ASK}
        view[-1] = {**last, "content": [*blocks, ask]}
        return ModelRequest(
            system=request.system,
            messages=view,
            tools=request.tools,
            model=request.model,
            max_tokens=request.max_tokens,
            agent=request.agent,
            run_id=request.run_id,
            depth=request.depth,
            stable_chars=request.stable_chars,
            cache_ttl=request.cache_ttl,
        )

    def compacted(self, messages: list[Message], point: int, response: ModelResponse) -> bool:
        """Take the summary of ``response``; False when it gave none (no text)."""
        summary = response.text.strip()
        if not summary:
            return False
        self.summary = summary
        self.start = point
        self.cleared = {i for i in self.cleared if self._later(messages, i)}
        return True

    def _later(self, messages: list[Message], tool_use_id: str) -> bool:
        return any(
            isinstance(b, dict) and b.get("tool_use_id") == tool_use_id
            for m in messages[self.start :]
            if isinstance(m.get("content"), list)
            for b in m["content"]
        )


Build = Callable[[list[Message]], ModelRequest]  # a view -> the request that sends it


async def fit(
    keeper: ContextKeeper,
    model: Model,
    messages: list[Message],
    build: Build,
    *,
    refused: bool,
    on_usage: Callable[[ModelUsage], None],
) -> Fit | None:
    """Make the view of ``messages`` fit: clear old tool results, then (when that is not
    enough, or the API refused the request) have the model summarise. None: nothing could
    be cleared or compacted. A refusal of the summary's own request raises."""
    request = build(keeper.view(messages))
    before = keeper.size(request)
    cleared = keeper.clear(messages)
    request = build(keeper.view(messages))
    reason = "refused" if refused else "threshold"
    done = Fit("cleared", reason, before, keeper.size(request), cleared, keeper.window)
    if not refused and cleared and not keeper.over(request):
        return done
    point = keeper.compaction_point(messages)
    if point is None:
        return done if cleared else None
    response = await model.complete(keeper.summary_request(request, messages))
    on_usage(response.usage)
    if not keeper.compacted(messages, point, response):
        return done if cleared else None
    after = keeper.size(build(keeper.view(messages)))
    return Fit("compacted", reason, before, after, cleared, keeper.window)
