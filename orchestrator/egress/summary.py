"""A run's ``egress`` events read back: one line each for ``orch logs``, and what the run
reached in all for ``orch result`` and the dashboard.

The events are the proxy's (:mod:`.proxy`): ``host``, ``port``, ``method``, ``allowed``,
``reason``, ``address``, ``sent``, ``received``, ``ms``; or ``{"more": N}``, the requests
past a run's first ``MAX_EVENTS`` that were only counted. Their hosts are names the
proxy normalized, and reasons its own words, but a reader still shows them as untrusted
text (the store may be shared).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel


class Reached(BaseModel):
    """One host:port a run asked for, and how often it was let through or refused."""

    host: str
    port: int
    allowed: int = 0
    refused: int = 0
    reason: str = ""  # the last refusal's


class EgressSummary(BaseModel):
    requests: int = 0
    allowed: int = 0
    refused: int = 0
    sent: int = 0  # bytes, to the servers
    received: int = 0
    uncounted: int = 0  # requests past the events a run keeps (counted, not itemized)
    hosts: list[Reached] = []


def size(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    if n < 1_000_000:
        return f"{n / 1e3:.1f} KB"
    if n < 1_000_000_000:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e9:.1f} GB"


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def line(data: dict[str, Any]) -> str:
    """One ``egress`` event in a line."""
    if "more" in data:
        return f"{_int(data.get('more')):,} more requests, counted but not kept one by one"
    if not data.get("host"):  # refused before it named one (a bad request, too many)
        return f"refused: {data.get('reason') or '?'}"
    where = f"{data.get('host')}:{data.get('port')}"
    method = str(data.get("method") or "?")
    if not data.get("allowed"):
        return f"{method} {where} refused: {data.get('reason') or '?'}"
    sent, received = size(_int(data.get("sent"))), size(_int(data.get("received")))
    return f"{method} {where} ({data.get('address')}) allowed · {sent} out, {received} in"


def egress_events(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run's ``egress`` events among all its events (as the store gives them)."""
    return [e for e in events if e.get("kind") == "egress" and isinstance(e.get("data"), dict)]


def of_run(events: Iterable[dict[str, Any]]) -> EgressSummary | None:
    """What a run's events say it reached through the egress proxy; None: it asked
    nothing."""
    asked = egress_events(events)
    return summarize(e["data"] for e in asked) if asked else None


def summarize(events: Iterable[dict[str, Any]]) -> EgressSummary:
    """What a run's ``egress`` events (``data`` of each) add up to."""
    out = EgressSummary()
    hosts: dict[tuple[str, int], Reached] = {}
    for data in events:
        if "more" in data:
            out.uncounted += _int(data.get("more"))
            out.requests += _int(data.get("more"))
            continue
        key = (str(data.get("host") or "(no request)"), _int(data.get("port")))
        seen = hosts.setdefault(key, Reached(host=key[0], port=key[1]))
        out.requests += 1
        if data.get("allowed"):
            out.allowed += 1
            seen.allowed += 1
            out.sent += _int(data.get("sent"))
            out.received += _int(data.get("received"))
        else:
            out.refused += 1
            seen.refused += 1
            seen.reason = str(data.get("reason") or "")
    out.hosts = sorted(hosts.values(), key=lambda r: (-r.allowed - r.refused, r.host, r.port))
    return out


def text(s: EgressSummary) -> str:
    """The summary in a line (empty when there was no request)."""
    if not s.requests:
        return ""
    said = f"{s.requests} request(s): {s.allowed} allowed, {s.refused} refused"
    said += f"; {size(s.sent)} out, {size(s.received)} in"
    refused = [f"{h.host}:{h.port}" for h in s.hosts if h.refused]
    if refused:
        more = f" and {len(refused) - 5} more" if len(refused) > 5 else ""
        said += f"; refused: {', '.join(refused[:5])}{more}"
    return said
