"""Cancelling a run and every descendant, from any process: the one way `orch cancel` and
the MCP server's ``task_stop`` stop runs.

The request goes through the store (``cancel_requested``), which each owner's
``Supervisor`` polls; a run whose owner is gone is cancelled here, after what it left is
reaped. A live owner's resources are never taken from under it.
"""

from __future__ import annotations

import time

from ..engine.owner import owner_alive
from ..errors import OrchError
from ..run import RunRecord, RunStatus
from ..store import RunStore
from .reconcile import reap


def cancel_tree(store: RunStore, rec: RunRecord, wait: float) -> list[RunRecord]:
    """Ask ``rec`` and its descendants to stop; wait up to ``wait`` seconds for them to end.
    Returns their records as they are then (blocking: call it off the event loop)."""
    tree = [rec, *store.descendants(rec.run_id)]
    live = [r for r in tree if not r.status.ended]
    store.request_cancel([r.run_id for r in live])
    deadline = time.monotonic() + wait
    while live and time.monotonic() < deadline:
        live = [r for r in (store.require_run(x.run_id) for x in live) if not r.status.ended]
        for r in list(live):
            if not owner_alive(r):  # nobody left to obey the request: do it here
                force_cancel(store, r, "owner gone")
        live = [r for r in (store.require_run(x.run_id) for x in live) if not r.status.ended]
        if live:
            time.sleep(0.1)
    return [store.require_run(r.run_id) for r in tree]


def raise_if_stuck(final: list[RunRecord], wait: float) -> None:
    stuck = [r for r in final if not r.status.ended]
    if stuck:  # a live owner's resources are never taken from under it
        pids = ", ".join(sorted({str(r.pid) for r in stuck}))
        raise OrchError(
            f"{len(stuck)} run(s) still running: their owner (pid {pids}) did not stop them "
            f"within {wait:g}s; run `orch cancel` again or stop that process"
        )


def force_cancel(store: RunStore, record: RunRecord, why: str) -> None:
    """Cancel a run whose owner is gone: reap what it left, unless it ended meanwhile."""
    current = store.get_run(record.run_id)
    if current is None or current.status.ended or owner_alive(current):
        return
    actions = reap(store, record.run_id)
    error = f"cancelled ({why})" + (": " + "; ".join(actions) if actions else "")
    store.end(record.run_id, RunStatus.CANCELLED, error=error)
