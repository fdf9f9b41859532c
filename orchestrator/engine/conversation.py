"""A run's conversation as the agent loop keeps it: a resumed one continued, a long answer
cut, a turn's text as an event."""

from __future__ import annotations

from typing import Any

from ..models.base import Block, Message

TEXT_EVENT_CHARS = 4096  # characters of a turn's text its ``assistant_text`` event keeps

CONTINUE = (
    "Your reply was cut off at the output token limit. Continue exactly where it stopped, "
    "without repeating anything."
)


def cut(text: str, limit: int, where: str = "") -> str:
    if len(text) <= limit:
        return text
    more = f"; {where}" if where else ""
    return text[:limit] + f"\n[output cut at {limit:,} of {len(text):,} characters{more}]"


def text_event(turn: int, text: str) -> dict[str, Any]:
    """The ``assistant_text`` event of a turn: its text, cut at TEXT_EVENT_CHARS (``cut``
    says so; ``chars`` is the whole length; the whole answer is the run's output)."""
    return {
        "turn": turn,
        "text": text[:TEXT_EVENT_CHARS],
        "chars": len(text),
        "cut": len(text) > TEXT_EVENT_CHARS,
    }


def continued(history: list[Message], prompt: str) -> list[Message]:
    """A stored conversation with ``prompt`` as its next user message (added to the last
    message when that is the user's already, e.g. the tool results of an interrupted run)."""
    messages = [dict(m) for m in history]
    last = messages[-1]
    if last.get("role") != "user":
        return [*messages, {"role": "user", "content": prompt}]
    content = last["content"]
    blocks: list[Block] = (
        [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    )
    messages[-1] = {"role": "user", "content": [*blocks, {"type": "text", "text": prompt}]}
    return messages


def tool_use_ids(messages: list[Message]) -> set[str]:
    """The tool_use ids a conversation used already (a resumed one must not reuse them)."""
    return {
        str(b.get("id"))
        for m in messages
        if m["role"] == "assistant" and isinstance(m["content"], list)
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_use"
    }
