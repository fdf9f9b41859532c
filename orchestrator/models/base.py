"""The one async seam between the agent loop and any language model.

Messages and content blocks use the Anthropic Messages API shapes as plain
dicts (``{"type": "text", ...}``, ``{"type": "tool_use", ...}``,
``{"type": "tool_result", ...}``), so every model speaks the same language.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

Block = dict[str, Any]
Message = dict[str, Any]


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


@dataclass
class ModelUsage:
    input_tokens: int = 0
    output_tokens: int = 0


@dataclass
class ModelResponse:
    content: list[Block]
    stop_reason: str = "end_turn"
    usage: ModelUsage = field(default_factory=ModelUsage)

    @property
    def tool_uses(self) -> list[Block]:
        return [b for b in self.content if b.get("type") == "tool_use"]

    @property
    def raw_text(self) -> str:
        """The text blocks as sent, unstripped (for joining the pieces of a cut answer)."""
        return "".join(b["text"] for b in self.content if b.get("type") == "text")

    @property
    def text(self) -> str:
        return "\n".join(b["text"] for b in self.content if b.get("type") == "text").strip()


class Model(Protocol):
    async def complete(self, request: ModelRequest) -> ModelResponse: ...


class ModelError(Exception):
    """A model call failed for good (after the client's own retries)."""
