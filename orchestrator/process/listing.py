"""Runs as rows: what ``orch ps --json`` prints and the MCP server's ``list_runs`` returns,
from the stored records (the same keys in both); and what runs used, summed.

:func:`totals` is the one sum of runs' usage (tokens of every kind, cost): a chain's, or a
run's with the runs under it; every view (ps, tree, result, logs, the dashboard, MCP) shows
its figures, none adds them up itself; ``models.pricing.money`` is how each writes a cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from ..models.pricing import money
from ..run import RunStatus, first_line, now
from ..store import RunStore

PS_KEYS = [
    "run_id",
    "parent_run_id",
    "chain_id",
    "depth",
    "agent",
    "status",
    "isolation",
    "last_activity",
    "recent_activities",
    "summary",
    "error",
    "pid",
    "started_at",
    "updated_at",
    "ended_at",
]
# a run's usage (``run.Usage``) as a row has it; ``tokens``: all four kinds of tokens
USAGE_KEYS = (
    "turns",
    "tool_uses",
    "input_tokens",  # input neither read from nor written to the prompt cache
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "cost_usd",
    "context_tokens",
    "compactions",
)
TOKEN_KEYS = (
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
)
RECENT_S = 3600.0
ABOUT_CHARS = 200  # a description taken from a prompt's first line


def about(description: object, prompt: object) -> str:
    """What a run is for: its description (the ``task`` call's, or ``--description``), else
    its prompt's first line (cut at ABOUT_CHARS)."""
    if isinstance(description, str) and description.strip():
        return description.strip()
    first = first_line(prompt if isinstance(prompt, str) else "")
    return first if len(first) <= ABOUT_CHARS else first[: ABOUT_CHARS - 1] + "…"


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _usd(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return max(0.0, float(value)) if math.isfinite(value) else 0.0


def usage_row(usage: object) -> dict[str, Any]:
    """A stored usage (``Usage`` as JSON; or a stored run's, or a row's) as flat row fields,
    ``tokens`` added; what is missing or malformed counts 0."""
    u = usage if isinstance(usage, Mapping) else {}
    if isinstance(u.get("usage"), Mapping):  # a run record as JSON
        u = u["usage"]
    row: dict[str, Any] = {k: _count(u.get(k)) for k in USAGE_KEYS if k != "cost_usd"}
    row["cost_usd"] = _usd(u.get("cost_usd"))
    row["tokens"] = sum(row[k] for k in TOKEN_KEYS)
    return row


def totals(usages: Iterable[object]) -> dict[str, Any]:
    """What runs used, together: ``runs``, tokens of each kind and in all, ``total_cost_usd``
    (Claude Code's name), and ``unpriced``: the runs with tokens but no price (their cost
    is unknown, not 0). Each item: what :func:`usage_row` reads."""
    rows = [usage_row(u) for u in usages]
    sums: dict[str, Any] = {"runs": len(rows)}
    for k in (*TOKEN_KEYS, "tokens"):
        sums[k] = sum(r[k] for r in rows)
    # to 1e-10 dollars: a sum of floats, without its last binary digits (0.0398, not 0.03979…)
    sums["total_cost_usd"] = round(math.fsum(r["cost_usd"] for r in rows), 10)
    sums["unpriced"] = sum(1 for r in rows if r["tokens"] and not r["cost_usd"])
    return sums


def run_cost(u: Mapping[str, Any]) -> str:
    """The cost of one run (a row, or :func:`usage_row`'s fields)."""
    return money(u["cost_usd"], unpriced=bool(u["tokens"]) and not u["cost_usd"])


def total_cost(t: Mapping[str, Any]) -> str:
    """The cost of runs together (:func:`totals`)."""
    return money(t["total_cost_usd"], unpriced=bool(t["unpriced"]))


def cache_text(u: Mapping[str, Any]) -> str:
    """``cache 50,000 read / 3,000 written (93% of input read)``, or "" without cache use."""
    read, wrote = u.get("cache_read_input_tokens", 0), u.get("cache_creation_input_tokens", 0)
    if not read and not wrote:
        return ""
    share = read / (read + wrote + u.get("input_tokens", 0))
    return f"cache {read:,} read / {wrote:,} written ({share:.0%} of input read)"


def usage_text(u: Mapping[str, Any]) -> str:
    """One run's use (:func:`usage_row`'s fields) in words: ``12,345 in · 678 out · cache
    … · $0.0123``; ``in``: the input the cache had no part in."""
    parts = [f"{u['input_tokens']:,} in", f"{u['output_tokens']:,} out", cache_text(u)]
    if u.get("compactions"):
        parts.append(f"context compacted {u['compactions']}×")
    return " · ".join([p for p in parts if p] + [run_cost(u)])


def totals_text(t: Mapping[str, Any]) -> str:
    """Runs' use (:func:`totals`) in words: ``3 runs · 250,000 tokens · cache … · $0.0456``."""
    runs = f"{t['runs']} run{'s' if t['runs'] != 1 else ''}"
    parts = [runs, f"{t['tokens']:,} tokens", cache_text(t), total_cost(t)]
    return " · ".join(p for p in parts if p)


def subtree_totals(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each row (by ``run_id``): :func:`totals` of it and the rows below it."""
    kids: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        kids.setdefault(str(r.get("parent_run_id")), []).append(r)
    below: dict[str, list[dict[str, Any]]] = {}

    def gather(r: dict[str, Any]) -> list[dict[str, Any]]:
        if r["run_id"] not in below:
            below[r["run_id"]] = [r]  # (a cycle, were there one, ends here)
            for k in kids.get(r["run_id"], []):
                below[r["run_id"]] += gather(k)
        return below[r["run_id"]]

    return {r["run_id"]: totals(gather(r)) for r in rows}


def ps_row(raw: dict[str, Any]) -> dict[str, Any]:
    act = raw.get("last_activity") if isinstance(raw.get("last_activity"), dict) else {}
    # the run's last sign of life: a tool call, a model turn, a change of state
    times = [
        t for t in (raw.get("updated_at"), (act or {}).get("at")) if isinstance(t, float | int)
    ]
    return {
        **{k: raw.get(k) for k in PS_KEYS if k in raw},
        "description": about(raw.get("description"), raw.get("prompt")),
        "node": raw.get("node"),  # where it executes: a host name, or host/ray-<node id>
        **usage_row(raw.get("usage")),
        "last_activity": raw.get("last_activity"),
        "last_activity_at": max(times) if times else None,
        "recent_activities": raw.get("recent_activities") or [],
        "summary": (raw.get("summary") or "")[:500],
        "os_sandbox": (raw.get("workspace") or {}).get("os_sandbox"),
        "network": (raw.get("workspace") or {}).get("network"),
        "budgets": (raw.get("plan") or raw.get("options") or {}).get("budgets")
        if raw.get("depth") == 0
        else None,
    }


def with_chain_use(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row gains ``total_cost_usd``: its cost with the rows below it; each root row
    ``chain``: its chain's :func:`totals` and live runs (of the rows listed) next to the
    chain's budgets."""
    chains: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        chains.setdefault(str(r.get("chain_id")), []).append(r)
    below = subtree_totals(rows)
    for r in rows:
        budgets = r.pop("budgets", None)
        r["total_cost_usd"] = below[r["run_id"]]["total_cost_usd"]
        if r.get("depth") == 0:
            mates = chains[str(r.get("chain_id"))]
            live = sum(0 if RunStatus(m["status"]).ended else 1 for m in mates)
            r["chain"] = {**totals(mates), "live": live, "budgets": budgets}
    return rows


def tree_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows grouped by chain, each child right under its parent (depth-first)."""
    ids = {r["run_id"] for r in rows}
    kids: dict[str | None, list[dict[str, Any]]] = {}
    for r in rows:
        parent = r.get("parent_run_id")
        kids.setdefault(parent if parent in ids else None, []).append(r)
    ordered: list[dict[str, Any]] = []

    def walk(parent: str | None) -> None:
        for r in kids.get(parent, []):
            ordered.append(r)
            walk(r["run_id"])

    walk(None)
    return ordered


def ps_rows(store: RunStore, *, show_all: bool = False) -> list[dict[str, Any]]:
    """The runs ``orch ps`` lists (running ones and those that ended in the last hour;
    every run with ``show_all``), in tree order, each root with its chain's use."""
    raw = store.list_raw(since=None if show_all else now() - RECENT_S)
    return with_chain_use(tree_order([ps_row(r) for r in raw]))
