"""The one async seam between the agent loop and any language model.

Messages and content blocks use the Anthropic Messages API shapes as plain
dicts (``{"type": "text", ...}``, ``{"type": "tool_use", ...}``,
``{"type": "tool_result", ...}``), so every model speaks the same language.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

Block = dict[str, Any]
Message = dict[str, Any]
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """``text`` with every lone UTF-16 surrogate (which no UTF-8 encoder, JSON serializer
    or database accepts) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


def clean(value: Any) -> Any:
    """A copy of the JSON-like ``value`` with :func:`clean_text` applied to every string in
    it, dict keys too, however deep (no recursion: a server picks the depth)."""
    out = [value]
    done: dict[int, Any] = {}  # id of a container seen -> its copy (shared or cyclic ones)
    todo: list[tuple[Any, Any]] = [(out, 0)]
    while todo:
        parent, key = todo.pop()
        item = parent[key]
        if isinstance(item, str):
            parent[key] = clean_text(item)
        elif isinstance(item, (list, dict)):
            if id(item) in done:
                parent[key] = done[id(item)]
                continue
            copy: Any
            if isinstance(item, list):
                copy = list(item)
                todo.extend((copy, i) for i in range(len(copy)))
            else:
                copy = {clean_text(k) if isinstance(k, str) else k: v for k, v in item.items()}
                todo.extend((copy, k) for k in copy)
            done[id(item)] = parent[key] = copy
    return out[0]


@dataclass(frozen=True)
class ModelRequest:
    system: str
    messages: list[Message]
    tools: list[dict[str, Any]]
    model: str
    max_tokens: int
    # Who asks: lets a scripted model key conversations per agent.
    agent: str = "general"
    run_id: str = ""
    depth: int = 0
    # The first ``stable_chars`` characters of ``system`` are the same for every run of
    # this agent in this project (nothing per run: no id, path, depth or budget): the
    # prompt cache's stable prefix ends there, after the tools.
    stable_chars: int = 0
    cache_ttl: str = "5m"  # "5m" or "1h": how long its prompt-cache entries live


@dataclass
class ModelUsage:
    """One request's usage, as the Messages API counts it: ``input_tokens`` is the input
    neither read from nor written to the prompt cache."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        """The whole input of the request (what the model's window holds)."""
        return self.input_tokens + self.cache_creation_input_tokens + self.cache_read_input_tokens


@dataclass
class ModelResponse:
    content: list[Block]
    stop_reason: str = "end_turn"
    usage: ModelUsage = field(default_factory=ModelUsage)

    def __post_init__(self) -> None:
        """The seam every model answers through: its strings (text, tool ids, names and
        input, stop reason) are cleaned of lone surrogates here, once, so no later
        serialization of them (store, transcript, events, the next request) can fail."""
        self.content = clean(self.content)
        self.stop_reason = (
            clean_text(self.stop_reason) if isinstance(self.stop_reason, str) else "end_turn"
        )

    # What a model sends is not trusted to be well formed: a tool_use block keeps its
    # ``input`` as sent (a string, a list, a number, null or absent: the agent loop answers
    # those with a tool error), ids may repeat and ``id``/``name`` may be missing. Nothing
    # here raises on such blocks.
    @property
    def tool_uses(self) -> list[Block]:
        return [b for b in self.content if isinstance(b, dict) and b.get("type") == "tool_use"]

    @property
    def raw_text(self) -> str:
        """The text blocks as sent, unstripped (for joining the pieces of a cut answer)."""
        return "".join(_text_of(b) for b in self.content)

    @property
    def text(self) -> str:
        return "\n".join(_text_of(b) for b in self.content if _is_text(b)).strip()


def _is_text(block: object) -> TypeGuard[Block]:
    return isinstance(block, dict) and block.get("type") == "text"


def _text_of(block: object) -> str:
    """The text of a text block; "" for any other block or a text that is not a string."""
    if not _is_text(block):
        return ""
    text = block.get("text")
    return text if isinstance(text, str) else ""


class Model(Protocol):
    async def complete(self, request: ModelRequest) -> ModelResponse: ...


class ModelError(Exception):
    """A model call failed for good (after the client's own retries)."""


class ContextOverflow(ModelError):
    """The request was longer than the model's context window (the API refused it: the
    Messages API's ``prompt is too long``, Chat Completions' ``context_length_exceeded``).
    The agent loop clears and compacts the conversation and asks once more."""
