"""Runs whose owner is gone: reconcile marks them ``interrupted`` and reaps what they left.

Any ``orch`` command first calls :func:`reconcile`: a queued or running run whose owner
(``owner.py``) is gone becomes ``interrupted`` (its partial output kept), and what it owned
is reaped: process groups killed, worktrees salvaged (work committed to the branch, never
deleted), containers salvaged the same way (work exported to the branch) and removed. A
remote owner's resources are its node's: nothing of them is reaped here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ..engine.owner import foreign, owner_alive
from ..pgroups import kill_group_ref, kill_marked
from ..project.statedir import verified
from ..run import RunRecord, RunStatus, now
from ..store import RunStore

SIGNED = ("pgroup", "container")  # refs signed at registration (statedir.sign)


def reap(store: RunStore, run_id: str) -> list[str]:
    """Reap what a run whose owner is gone left behind; returns what was done."""
    done: list[str] = []
    for res in store.resources(run_id):
        kind, signed = res["kind"], res["ref"]
        ref = verified(run_id, kind, signed) if kind in SIGNED else signed
        if ref is None:  # a row this user's orch did not write: nothing of it is touched
            done.append(
                f"left {kind} {signed.split(' ')[0][:24]} alone: not registered by this user's orch"
            )
        elif kind == "pgroup":
            # the group, and what of the run left it (bwrap makes the sandbox a session)
            if kill_group_ref(ref) + kill_marked(run_id, ref):
                done.append(f"killed process group {ref.partition(':')[0]}")
        elif kind == "worktree":
            from ..workspaces.worktree import salvage_worktree

            art = asyncio.run(salvage_worktree(Path(ref), run_id, "interrupted", proven=True))
            if art:
                done.append(f"kept work on branch {art.get('branch')} at {art.get('commit')}")
        elif kind in ("container", "checkpoint"):  # work salvaged, then the container removed
            from ..workspaces.container.export import reap_resource

            done.extend(reap_resource(store.get_run(run_id), kind, ref))
        store.release_resource(run_id, kind, signed)
    return done


def owner_of(record: RunRecord) -> tuple[str | None, int | None, int | None]:
    return (record.node, record.pid, record.pid_start)


def reconcile(store: RunStore) -> list[RunRecord]:
    """Mark runs whose owner is gone as interrupted and reap their resources."""
    fixed: list[RunRecord] = []
    live = store.list_runs(statuses=[RunStatus.QUEUED, RunStatus.RUNNING])
    beats: dict[str, float | None] = {}
    if any(foreign(rec) for rec in live):  # their heartbeats say whether they are alive
        beats = {r["run_id"]: r.get("heartbeat_at") for r in store.list_raw(since=now())}
    for rec in live:
        if owner_alive(rec, beats.get(rec.run_id)):
            continue
        # The listing is a snapshot: since then the owner may have ended the run, or handed
        # it to a new owner (a launcher hands a background run to the worker host, which
        # writes its pid before the launcher exits). Judge the record as it is now.
        current = store.get_run(rec.run_id)
        if current is None or current.status.ended:
            continue
        if owner_of(current) != owner_of(rec) and owner_alive(current, beats.get(rec.run_id)):
            continue
        # a remote owner's resources are on its node: nothing of them is here to reap
        actions = [] if foreign(rec) else reap(store, rec.run_id)
        where = f" on {rec.node}" if foreign(rec) else ""
        error = f"interrupted: owner process {rec.pid}{where} is gone"
        if actions:
            error += " (" + "; ".join(actions) + ")"
        output = current.output or current.summary
        updated = store.end(rec.run_id, RunStatus.INTERRUPTED, error=error, output=output)
        if updated is not None:
            fixed.append(updated)
    return fixed
