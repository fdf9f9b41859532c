"""What the dashboard shows, as JSON, read from the run store (any backend: a Postgres
store shows the runs of every machine that writes to it). Blocking: the app calls these
in a thread. Model-written text is sent as it is; the page only ever sets it as text.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from ..egress import summary as egress
from ..egress.rules import Reach
from ..errors import OrchError
from ..process.listing import ps_row, tree_order
from ..project.repo import discover
from ..run import RunRecord
from ..store import RunStore
from ..teams.progress import read_result
from ..teams.review import branch_diff

MAX_ROWS = 2_000  # runs in the list: the latest chains first
MAX_EVENTS = 500  # of a run's events, its latest
RECENT_S = 24 * 3600.0  # the list: live runs and those that ended in the last day


def runs(store: RunStore, *, show_all: bool = False) -> dict[str, Any]:
    """The list: live runs and recent ones (``show_all``: every run), chains in tree order,
    at most MAX_ROWS rows; ``at``: the store time the list is as of (the stream goes on)."""
    at = time.time()
    since = None if show_all else at - RECENT_S
    raw = store.list_raw(since=since, limit=MAX_ROWS + 1)  # the latest, and one to tell
    cut = len(raw) > MAX_ROWS
    raw = raw[-MAX_ROWS:]
    return {"at": at, "runs": tree_order([ps_row(r) for r in raw]), "cut": cut}


def changes(store: RunStore, since: float) -> list[dict[str, Any]]:
    """The rows changed since ``since`` (and every live one): what the stream sends."""
    return [ps_row(r) for r in store.list_raw(since=since, limit=MAX_ROWS)]


def run(store: RunStore, root: Path, record: RunRecord) -> dict[str, Any]:
    """One run whole: its record, latest events, conversation, output, team, branch diff."""
    every = store.events(record.run_id)
    events = every[-MAX_EVENTS:]
    team = None
    try:
        found = read_result(store, record)
        team = found.model_dump(mode="json") if found is not None else None
    except OrchError as e:
        team = {"error": str(e)}
    return {
        "run": record.model_dump(mode="json", exclude={"progress", "launch"}),
        "children": [ps_row(r.model_dump(mode="json")) for r in store.descendants(record.run_id)],
        "events": events,
        "transcript": store.transcript(record.run_id) or [],
        "output": store.output(record.run_id) or record.output,
        "team": team,
        "diff": diff(root, record),
        "network": network(record, every),
    }


def network(record: RunRecord, events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the run's commands may reach, and what they asked the egress proxy for."""
    asked = egress.egress_events(events)
    reach = Reach.from_info((record.workspace or {}).get("network"))
    return {
        "reach": reach.describe(),
        "summary": egress.text(egress.summarize(e["data"] for e in asked)),
        "requests": [
            {"at": e.get("at"), "allowed": e["data"].get("allowed"), "line": egress.line(e["data"])}
            for e in asked[-MAX_EVENTS:]
        ],
    }


def diff(root: Path, record: RunRecord) -> dict[str, Any] | None:
    """The run's branch and its diff against its base (worktree and container runs)."""
    art = next((a for a in record.artifacts if a.get("kind") == "branch"), None)
    if art is None or not art.get("base") or not art.get("commit"):
        return None

    async def read() -> str:
        repo = (await discover(root)).main()
        return await branch_diff(repo, str(art["base"]), str(art["commit"]))

    try:
        text = asyncio.run(read())
    except OrchError as e:
        text = f"(the diff cannot be shown: {e})"
    keys = ("branch", "base", "commit")
    return {**{k: art.get(k) for k in keys}, "text": text}
