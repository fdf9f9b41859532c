"""Runs as rows: what ``orch ps --json`` prints and the MCP server's ``list_runs`` returns,
from the stored records (the same keys in both)."""

from __future__ import annotations

from typing import Any

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
    "tool_uses",
    "input_tokens",
    "output_tokens",
    "last_activity",
    "recent_activities",
    "summary",
    "error",
    "pid",
    "started_at",
    "updated_at",
    "ended_at",
]
RECENT_S = 3600.0
ABOUT_CHARS = 200  # a description taken from a prompt's first line


def about(description: object, prompt: object) -> str:
    """What a run is for: its description (the ``task`` call's, or ``--description``), else
    its prompt's first line (cut at ABOUT_CHARS)."""
    if isinstance(description, str) and description.strip():
        return description.strip()
    first = first_line(prompt if isinstance(prompt, str) else "")
    return first if len(first) <= ABOUT_CHARS else first[: ABOUT_CHARS - 1] + "…"


def ps_row(raw: dict[str, Any]) -> dict[str, Any]:
    usage = raw.get("usage") or {}
    act = raw.get("last_activity") if isinstance(raw.get("last_activity"), dict) else {}
    # the run's last sign of life: a tool call, a model turn, a change of state
    times = [
        t for t in (raw.get("updated_at"), (act or {}).get("at")) if isinstance(t, float | int)
    ]
    return {
        **{k: raw.get(k) for k in PS_KEYS if k in raw},
        "description": about(raw.get("description"), raw.get("prompt")),
        "node": raw.get("node"),  # where it executes: a host name, or host/ray-<node id>
        "tool_uses": usage.get("tool_uses", 0),
        "input_tokens": usage.get("input_tokens", 0),
        "output_tokens": usage.get("output_tokens", 0),
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
    """Each root row gains ``chain``: its chain's runs, live runs and tokens (of the rows
    listed) next to the chain's budgets."""
    use: dict[str, dict[str, int]] = {}
    for r in rows:
        u = use.setdefault(str(r.get("chain_id")), {"runs": 0, "live": 0, "tokens": 0})
        u["runs"] += 1
        u["live"] += 0 if RunStatus(r["status"]).ended else 1
        u["tokens"] += r["input_tokens"] + r["output_tokens"]
    for r in rows:
        budgets = r.pop("budgets", None)
        if r.get("depth") == 0:
            r["chain"] = {**use[str(r.get("chain_id"))], "budgets": budgets}
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
