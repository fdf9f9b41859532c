"""`orch logs`: a run's events as lines a person reads on a terminal.

One line an event: local time, ``run/agent``, the event's kind, and its one-line summary
(``process/events.py``, which also has the :class:`Feed` that gathers them). Every string
from the store is shown, never obeyed (:mod:`.safe`): the model and the sandboxes wrote
most of them.
"""

from __future__ import annotations

import json
from typing import Any

from rich.text import Text

from ..process.events import PLAIN_CHARS, as_text, short, summary, when
from ..run import RunStatus
from .common import STATUS_STYLE
from .safe import shown

LABEL_WIDTH = 20  # the run/agent column, padded to this
KIND_WIDTH = 14  # the event column
KIND_STYLE = {
    "assistant_text": "bold",
    "tool_call": "yellow",
    "tool_refused": "red",
    "child_spawned": "cyan",
    "run_started": "cyan",
    "run_finished": "cyan",
}


def _kind_style(kind: str, data: dict[str, Any]) -> str:
    if kind == "tool_result" and data.get("is_error"):
        return "red"
    if kind == "run_finished":
        try:
            return STATUS_STYLE.get(RunStatus(as_text(data.get("status"))), "")
        except ValueError:
            return ""
    return KIND_STYLE.get(kind, "")


def line(
    event: dict[str, Any],
    agent: str,
    *,
    indent: int = 0,
    width: int | None = None,
    today: str | None = None,
    children: dict[str, str] | None = None,
) -> Text:
    """One event as one line, cut with … at ``width`` cells (None: at PLAIN_CHARS)."""
    kind = as_text(event.get("kind"))
    raw = event.get("data")
    data: dict[str, Any] = raw if isinstance(raw, dict) else {}
    at = event.get("at")
    stamp = when(at, today) if isinstance(at, int | float) else "?"
    label = "  " * indent + f"{short(event.get('run_id'))}/{shown(agent)}"
    said = shown(
        summary(kind, data, children) if isinstance(raw, dict) else json.dumps(raw, default=str)
    )
    if width is None and len(said) > PLAIN_CHARS:
        said = said[: PLAIN_CHARS - 1] + "…"
    text = Text.assemble(
        (stamp, "dim"),
        " ",
        (label.ljust(LABEL_WIDTH), "bold"),
        " ",
        (shown(kind).ljust(KIND_WIDTH), _kind_style(kind, data)),
        " ",
        said,
    )
    if width is not None:
        text.truncate(max(width, 1), overflow="ellipsis")
    return text
