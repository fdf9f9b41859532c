"""What the dashboard shows, as JSON, read from the run store (any backend: a Postgres
store shows the runs of every machine that writes to it). Blocking: the app calls these
in a thread. Model-written text is sent as it is; the page only ever sets it as text.

Costs and usage come with their words (``cost_text``, ``text``) written here by the CLI's
own functions (``process/listing.py``): the page formats no money and adds up nothing.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from ..egress import summary as egress
from ..egress.rules import Reach
from ..errors import OrchError
from ..process.listing import (
    ps_row,
    run_cost,
    totals,
    totals_text,
    tree_order,
    usage_row,
    usage_text,
    with_chain_use,
)
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
    rows = with_chain_use(tree_order([ps_row(r) for r in raw]))
    return {"at": at, "runs": worded(rows), "cut": cut}


def worded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with their cost in words, and each root's chain totals in words."""
    for r in rows:
        r["cost_text"] = run_cost(r)
        if isinstance(r.get("chain"), dict):
            r["chain"]["text"] = totals_text(r["chain"])
    return rows


def changes(store: RunStore, since: float) -> list[dict[str, Any]]:
    """The rows changed since ``since`` (and every live one): what the stream looks at."""
    return [ps_row(r) for r in store.list_raw(since=since, limit=MAX_ROWS)]


def chains(store: RunStore, chain_ids: list[str]) -> list[dict[str, Any]]:
    """Every row of these chains, worded: a change in one run changes its ancestors' cost
    with the runs under them and its root's chain totals (what the stream sends)."""
    rows: list[dict[str, Any]] = []
    for chain_id in chain_ids:
        records = store.list_runs(chain_id=chain_id)[-MAX_ROWS:]
        rows += with_chain_use([ps_row(r.model_dump(mode="json")) for r in records])
    return worded(rows)


def usage(store: RunStore, record: RunRecord, below: list[RunRecord]) -> dict[str, Any]:
    """What a run used, with the runs under it, and its chain: figures and words."""
    u = usage_row(record.usage.model_dump())
    mine = totals(r.usage.model_dump() for r in [record, *below])
    chain = totals(r.usage.model_dump() for r in store.list_runs(chain_id=record.chain_id))
    context = f"context: {u['context_tokens']:,} tokens in the latest request" + (
        f" · compacted {u['compactions']}×" if u["compactions"] else ""
    )
    return {
        **u,
        "text": usage_text(u),
        "context_text": context,
        "with_below": {**mine, "text": totals_text(mine)},
        "chain": {**chain, "text": totals_text(chain)},
    }


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
    below = store.descendants(record.run_id)
    return {
        "run": record.model_dump(mode="json", exclude={"progress", "launch"}),
        "usage": usage(store, record, below),
        "children": worded([ps_row(r.model_dump(mode="json")) for r in below]),
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
