"""A run's events as a person reads them, and the feed that gathers them.

One summary an event (:func:`summary`): the model's text, ``bash: <command>``, a tool
result's status and first line, a child started or done, a model request's tokens and cost,
a context compacted, a run's end with its usage (cache reads and writes, cost). Not yet
safe to show: every string in it came from the store, most of it written by the model and
the sandboxes (``orchestrator/untrusted.py`` writes out its controls). ``orch logs``
(``cli/logview.py``) and the MCP server's ``run_logs`` show them.

:class:`Feed` reads the events of a run and, with ``tree``, of its descendants (those
there at the start, and those a ``child_spawned`` event names later), merged in time
order; it knows when every run it follows has ended.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..egress.summary import line as egress_line
from ..run import RunRecord, first_line
from ..store import RunStore
from ..untrusted import one_line, shown
from .listing import cache_text, run_cost, usage_row

PLAIN_CHARS = 1000  # a summary's cap when the output has no width (not a terminal)
ENDED_GRACE_S = 1.0  # a run ended without a run_finished event is done after this
_EXIT = re.compile(r"\[exit code (-?\d+)\]\s*$")
_CHILD = re.compile(r"\[task (\S+) (.*?)(?: · details: .*)?\]$")


def when(ts: float, today: str | None = None) -> str:
    """``HH:MM:SS.mmm`` in local time; with the date in front when not today."""
    t = datetime.fromtimestamp(ts)
    clock = t.strftime("%H:%M:%S.") + f"{t.microsecond // 1000:03d}"
    day = t.strftime("%Y-%m-%d")
    return clock if day == (today or datetime.now().strftime("%Y-%m-%d")) else f"{day} {clock}"


def short(run_id: object) -> str:
    """A run id as a log line shows it: ``r-`` and six hex digits."""
    return shown(run_id)[:8]


def as_text(value: object) -> str:
    """A value of an event as text: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else "" if value is None else json.dumps(value)


def prose(value: object) -> str:
    """Text a model wrote, on one line: whitespace runs (newlines too) made one space."""
    return one_line(as_text(value))


# -- one summary a kind --------------------------------------------------------------------
def _call(data: dict[str, Any]) -> str:
    tool = as_text(data.get("tool")) or "?"
    args = data.get("input")
    if not isinstance(args, dict):
        return f"{tool}: {json.dumps(args)}" if args is not None else tool
    if tool == "task":
        agent = as_text(args.get("subagent_type")) or "general"
        what = prose(args.get("description")) or prose(args.get("prompt"))
        more = " (background)" if args.get("run_in_background") is True else ""
        return f"task → {agent}{more}: {what}"
    if tool == "grep" and isinstance(args.get("pattern"), str):
        where = f" in {args['path']}" if isinstance(args.get("path"), str) else ""
        return f"grep: {args['pattern']}{where}"
    for key in ("command", "path", "pattern", "task_id", "name"):
        if isinstance(args.get(key), str):
            return f"{tool}: {args[key]}"
    return f"{tool}: {json.dumps(args, ensure_ascii=False)}"


def _result(data: dict[str, Any], children: dict[str, str]) -> str:
    tool = as_text(data.get("tool")) or "?"
    preview = as_text(data.get("preview"))
    status = "error" if data.get("is_error") else "ok"
    code = _EXIT.search(preview)
    if code:
        status = f"exit {code.group(1)}"
        preview = preview[: code.start()]
    line = first_line(preview)
    child = _CHILD.match(line) if tool in ("task", "task_output") else None
    if child:  # a child's end: "[task r-… succeeded · agent … · turns … · details: …]"
        said = children.get(child.group(1))
        ended, _, rest = child.group(2).partition(" · ")
        what = f" ({prose(said)})" if said else ""
        return f"{tool} {status}: {short(child.group(1))}{what} {ended} · {rest}"
    chars = data.get("chars")
    size = f" ({chars:,} chars)" if isinstance(chars, int) and chars > len(line) else ""
    return f"{tool} {status}{size}" + (f": {line}" if line else "")


def _usage(data: dict[str, Any]) -> str:
    if not isinstance(data.get("usage"), dict):
        return ""
    u = usage_row(data["usage"])
    cache = cache_text(u)
    return (
        f" · turns {u['turns']} · tools {u['tool_uses']}"
        f" · tokens {u['input_tokens']:,} in / {u['output_tokens']:,} out"
        + (f" · {cache}" if cache else "")
        + (f" · context compacted {u['compactions']}×" if u["compactions"] else "")
        + f" · {run_cost(u)}"
    )


def _request(data: dict[str, Any]) -> str:
    """One model request's use: ``turn 3: 1,200 in / 80 out · cache … · $0.0012 · 850 ms``"""
    u = usage_row(data)
    cache = cache_text(u)
    ms = data.get("ms")
    took = f" · {ms:,.0f} ms" if isinstance(ms, int | float) and ms > 0 else ""
    return (
        f"turn {_number(data.get('turn'))}: {u['input_tokens']:,} in / {u['output_tokens']:,} out"
        + (f" · {cache}" if cache else "")
        + f" · {run_cost(u)}{took}"
    )


def _number(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else "?"


def _compacted(data: dict[str, Any]) -> str:
    """``context compacted (threshold) at turn 12: 162,000 → 21,000 tokens of 200,000,
    9 tool results cleared``"""
    how = as_text(data.get("how")) or "compacted"
    reason = f" ({as_text(data.get('reason'))})" if data.get("reason") else ""
    turn = f" at turn {_number(data['turn'])}" if "turn" in data else ""
    before, after = _number(data.get("before_tokens")), _number(data.get("after_tokens"))
    window = f" of {_number(data['window'])}" if data.get("window") else ""
    n = data.get("cleared_results")
    cleared = f", {_number(n)} tool result{'s' if n != 1 else ''} cleared" if n else ""
    return f"context {how}{reason}{turn}: {before} → {after} tokens{window}{cleared}"


def summary(kind: str, data: dict[str, Any], children: dict[str, str] | None = None) -> str:
    """What an event says, on one line (not yet shown-safe: see :func:`line`);
    ``children``: the description of each child run by id (for a child's end)."""
    if kind == "assistant_text":
        text = prose(data.get("text"))
        chars = data.get("chars")
        cut = f" [stored cut at {len(text):,} of {chars:,} chars]" if data.get("cut") else ""
        return text + cut if isinstance(chars, int) else text
    if kind == "tool_call":
        return _call(data)
    if kind == "tool_result":
        return _result(data, children or {})
    if kind == "tool_refused":
        return f"{as_text(data.get('tool'))} refused: {prose(data.get('reason'))}"
    if kind == "child_spawned":
        agent, child = as_text(data.get("agent")), short(data.get("child_run_id"))
        bg = ", background" if data.get("background") else ""
        tier = as_text(data.get("isolation"))
        return f"{child}/{agent} ({tier}{bg}): {prose(data.get('description'))}"
    if kind == "run_started":
        depth = f"depth {data.get('depth', 0)}/{data.get('max_depth', '?')}"
        resumed = (
            f" · resumed {as_text(data.get('resumed_from'))}" if data.get("resumed_from") else ""
        )
        return (
            f"{as_text(data.get('agent'))} · {as_text(data.get('model'))} · {depth}"
            f" · {as_text(data.get('isolation'))}{resumed}"
        )
    if kind == "run_finished":
        error = f" · {prose(data.get('error'))}" if data.get("error") else ""
        return f"{as_text(data.get('status'))}{_usage(data)}{error}"
    if kind == "model_usage":
        return _request(data)
    if kind == "context_compacted":
        return _compacted(data)
    if kind == "auto_backgrounded":
        return f"still running after {data.get('after_s')} s: moved to the background"
    if kind == "subagent_stop_block":
        return f"SubagentStop hook: {prose(data.get('message'))}"
    if kind.startswith("team_") or kind == "gate_result":
        return _team(kind, data)
    if kind == "egress":
        return egress_line(data)
    return json.dumps(data, ensure_ascii=False, default=str)


def _team(kind: str, data: dict[str, Any]) -> str:
    """A team's events (``teams/driver.py``, ``teams/gate.py``) in a line each."""
    n = f"round {data.get('round')}"
    if kind in ("team_gate", "gate_result"):
        state = "passed" if data.get("passed") else "failed"
        why = " (timed out)" if data.get("timed_out") else f" (exit {data.get('exit_code')})"
        where = f"{n} candidate {data.get('candidate')}: " if kind == "team_gate" else ""
        return f"{where}gate {state}{why}: {prose(data.get('command'))}"
    if kind == "team_verdict":
        return f"{n}: [{as_text(data.get('reviewer'))}] {as_text(data.get('verdict'))}: " + prose(
            data.get("summary")
        )
    if kind == "team_bad_verdict":
        return f"{n}: [{as_text(data.get('reviewer'))}] malformed verdict: " + prose(
            data.get("problem")
        )
    if kind == "team_decision":
        state = "approved" if data.get("approved") else "not approved"
        return f"{n}: {state}, candidate {data.get('chosen')}, {data.get('approvals')} approval(s)"
    return json.dumps(data, ensure_ascii=False, default=str)


# -- the events of a run (and its tree) ----------------------------------------------------
@dataclass
class Followed:
    record: RunRecord
    after: int = 0  # the last event id read
    finished: bool = False  # its run_finished event was read (or it ended without one)
    ended_seen: float | None = None  # monotonic time its record was first seen ended


class Feed:
    """The events of ``root`` (and with ``tree`` its descendants) as they are written."""

    def __init__(self, store: RunStore, root: RunRecord, *, tree: bool = False) -> None:
        self.store = store
        self.root = root
        self.tree = tree
        self.runs: dict[str, Followed] = {root.run_id: Followed(root)}
        self.children: dict[str, str] = {}  # child run id -> its description
        for r in store.descendants(root.run_id) if tree else []:
            self.runs[r.run_id] = Followed(r)
        self.check()

    def agent(self, run_id: str) -> str:
        f = self.runs.get(run_id)
        return f.record.agent if f else "?"

    def depth(self, run_id: str) -> int:
        f = self.runs.get(run_id)
        return max(0, f.record.depth - self.root.depth) if f else 0

    def poll(self) -> list[dict[str, Any]]:
        """The events written since the last poll, in time order."""
        got: list[dict[str, Any]] = []
        todo = [rid for rid, f in self.runs.items() if not f.finished]
        while todo:
            f = self.runs[todo.pop(0)]
            events = self.store.events(f.record.run_id, after_id=f.after)
            for e in events:
                f.after = max(f.after, int(e["id"]))
                if e["kind"] == "run_finished":
                    f.finished = True
                elif e["kind"] == "child_spawned":
                    todo.extend(self._adopt(e.get("data")))
            got.extend(events)
            if f.ended_seen is not None and time.monotonic() - f.ended_seen >= ENDED_GRACE_S:
                f.finished = True  # ended without a run_finished event (an old or odd run)
        got.sort(key=lambda e: (e["at"], e["id"]))
        return got

    def _adopt(self, data: object) -> list[str]:
        if not isinstance(data, dict) or not isinstance(data.get("child_run_id"), str):
            return []
        child: str = data["child_run_id"]
        self.children[child] = as_text(data.get("description"))
        if not self.tree or child in self.runs:
            return []
        record = self.store.get_run(child)
        if record is None:
            return []
        self.runs[child] = Followed(record)
        return [child]

    def check(self) -> None:
        """Read the records of the runs not yet done: note those that ended, and (with
        ``tree``) adopt descendants no ``child_spawned`` event named."""
        if self.tree:
            for r in self.store.descendants(self.root.run_id):
                self.runs.setdefault(r.run_id, Followed(r))
        for f in self.runs.values():
            if f.finished or f.ended_seen is not None:
                continue
            record = self.store.get_run(f.record.run_id)
            if record is not None and record.status.ended:
                f.record = record
                ended = record.ended_at or time.time()
                # ended a while ago: its events are all written; just now: wait a moment
                f.ended_seen = time.monotonic() - max(0.0, time.time() - ended)

    @property
    def done(self) -> bool:
        return all(f.finished for f in self.runs.values())

    def exit_code(self) -> int:
        """The root run's exit code (0 while it runs)."""
        record = self.store.require_run(self.root.run_id)
        return record.result().exit_code if record.status.ended else 0
