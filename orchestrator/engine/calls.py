"""Tool calls as a model sent them: made into a conversation the API takes back, and cut
down to keep in events and logs.

A model's reply is untrusted input: ids may be missing, repeated or malformed, names
may be anything, inputs may be strings or null. :class:`CallLedger` stores a reply
as an assistant message the Messages API accepts (each tool_use id used once in the
conversation) and lists its calls as sent; :func:`capped` keeps what an event stores
bounded whatever the model sent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..models.base import Block

# What the Messages API takes back in a tool_use block (and the pattern of tool names).
TOOL_USE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
INVALID_NAME = "invalid_tool_name"  # stands in for a name the API would not take back
EMPTY_REPLY = "(empty response)"  # stands in for a reply with no block the API takes back
NAME_SHOWN = 100  # characters of a tool name echoed into a tool_result, an event or a log
EVENT_TEXT = 10_000  # characters of one string of a tool input an event keeps
EVENT_CHARS = 20_000  # characters of all strings of a tool input an event keeps
EVENT_NODES = 500  # values (in lists and objects) of a tool input an event keeps
EVENT_DEPTH = 20  # nesting of a tool input an event keeps
MAX_PROBLEMS = 20  # validation problems listed in one tool error
MISSING: Any = object()  # a field a tool_use block does not have


def json_kind(value: object) -> str:
    """What a JSON value is, in words: "a string", "an array", "null", ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def shown_name(name: object) -> str:
    """A tool name as sent, fit to echo: cut at NAME_SHOWN characters; or what it is."""
    if isinstance(name, str):
        return name if len(name) <= NAME_SHOWN else name[:NAME_SHOWN] + "…"
    return "(no name)" if name is MISSING else f"({json_kind(name)})"


def capped(
    value: object,
    *,
    text: int = EVENT_TEXT,
    chars: int = EVENT_CHARS,
    nodes: int = EVENT_NODES,
) -> Any:
    """``value`` (a tool input as sent) cut down to keep in an event or a log line.

    JSON-able; a string over ``text`` characters is cut with a note, all strings (and
    keys) together keep at most ``chars`` characters and lists and objects at most
    ``nodes`` values, nested at most EVENT_DEPTH deep; what is left out is noted.
    """
    left = [chars, nodes]

    def walk(v: object, depth: int) -> Any:
        left[1] -= 1
        if isinstance(v, str):
            keep = max(0, min(text, left[0]))
            left[0] -= min(len(v), keep)
            if len(v) <= keep:
                return v
            return v[:keep] + f"[cut at {keep:,} of {len(v):,} characters]"
        if v is None or isinstance(v, bool | float):
            return v
        if isinstance(v, int):
            return v if v.bit_length() <= 256 else f"[a {v.bit_length():,}-bit integer]"
        if isinstance(v, dict | list):
            if depth >= EVENT_DEPTH:
                return "[nested too deep]"
            items = v.items() if isinstance(v, dict) else enumerate(v)
            out: dict[str, Any] = {}
            for n, (key, item) in enumerate(items):
                if left[1] <= 0:
                    out["[cut]"] = f"{len(v) - n:,} more left out"
                    break
                out[walk(key if isinstance(key, str) else str(key), EVENT_DEPTH)] = walk(
                    item, depth + 1
                )
            return out if isinstance(v, dict) else list(out.values())
        return f"[{type(v).__name__}]"

    return walk(value, 0)


def summarize_input(tool: str, args: object) -> str:
    """One line of at most 200 characters saying what a call does (activity, logs)."""
    tool = shown_name(tool)
    if isinstance(args, dict):
        for key in ("command", "path", "pattern", "description", "name", "task_id"):
            value = args.get(key)
            if isinstance(value, str):
                return f"{tool}: {value[:200]}"[:200].replace("\n", " ")
    small = json.dumps(capped(args, text=200, chars=400, nodes=50))
    return f"{tool}: {small[:180]}".replace("\n", " ")


@dataclass
class ToolCall:
    """One tool_use block as the model sent it, and the id its tool_result answers."""

    id: str
    sent: Block


@dataclass
class CallLedger:
    """The tool_use ids of one conversation; each stored reply is one the API takes."""

    tool_use_ids: set[str] = field(default_factory=set)
    _fresh_ids: int = 0

    def turn(self, content: object) -> tuple[list[Block], list[ToolCall]]:
        """The assistant message to store for a reply's ``content``, and its tool calls.

        The stored message is sent back with every later request, so it is made one the
        Messages API takes, whatever the model sent; the model's own blocks are not
        changed (a fixed block is a copy). Id policy: each tool_use of the stored message
        carries an id used once in the whole conversation, and its tool_result answers
        exactly that id. An id that is a string of 1-64 letters, digits, ``_`` or ``-``
        not used before is kept; a missing, non-string or malformed id, and a repeat of
        an id already used (in this reply or an earlier one: the first use keeps it),
        is replaced in the stored block by a fresh ``toolu_orch_<n>``.

        Also: a tool_use ``name`` that is not a valid tool name (missing, not a string,
        not 1-64 of those characters) is stored as ``invalid_tool_name`` and an
        ``input`` that is not an object as ``{}`` (the tool_result says what was wrong
        with what was sent; other fields stay as sent); entries that are not objects
        with a string ``type``, ``tool_result`` blocks (only a user sends those) and
        text blocks without text are left out; a reply left with no block is stored
        as the text ``(empty response)``.
        """
        stored: list[Block] = []
        calls: list[ToolCall] = []
        for block in content if isinstance(content, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if not isinstance(block, dict) or not isinstance(kind, str) or kind == "tool_result":
                continue
            if kind == "text":
                text = block.get("text")
                if isinstance(text, str) and text.strip():
                    stored.append(block)
                continue
            if kind != "tool_use":
                stored.append(block)
                continue
            sent_id, name = block.get("id"), block.get("name")
            if (
                isinstance(sent_id, str)
                and TOOL_USE_ID.fullmatch(sent_id)
                and sent_id not in self.tool_use_ids
            ):
                tool_use_id = sent_id
            else:
                tool_use_id = self._fresh_id()
            self.tool_use_ids.add(tool_use_id)
            fixed: Block = {**block, "id": tool_use_id}
            if not (isinstance(name, str) and TOOL_NAME.fullmatch(name)):
                fixed["name"] = INVALID_NAME
            if not isinstance(block.get("input"), dict):
                fixed["input"] = {}
            stored.append(fixed)
            calls.append(ToolCall(tool_use_id, block))
        return stored or [{"type": "text", "text": EMPTY_REPLY}], calls

    def _fresh_id(self) -> str:
        while True:
            self._fresh_ids += 1
            candidate = f"toolu_orch_{self._fresh_ids}"
            if candidate not in self.tool_use_ids:
                return candidate
