"""The typed run record (``plan``, ``launch``) and its one way to end (``store.end``)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from orchestrator.cli.common import budget_line
from orchestrator.errors import OrchError
from orchestrator.process.listing import ps_row
from orchestrator.run import RunRecord, RunStatus
from orchestrator.spec import Budgets, Launch, RunPlan, RunSpec
from orchestrator.store import SqliteStore
from orchestrator.workspaces.registry import tier_config


def _legacy(run_id: str, workdir: Path) -> dict[str, object]:
    """A record as an older orch stored it: its plan and launch in one ``options`` dict."""
    return {
        "run_id": run_id,
        "chain_id": "c-legacy000000",
        "depth": 0,
        "background": True,
        "prompt": "count the files",
        "options": {
            "spec": {
                "prompt": "count the files",
                "workdir": str(workdir),
                "agent": "general",
                "workspace": {"type": "worktree"},
                "background": True,
            },
            "max_turns": 7,
            "timeout_seconds": 90.0,
            "launch": {
                "model_spec": "scripted:/s.yaml",
                "agents_dirs": ["/a"],
                "overrides": {"max_depth": 2},
                "trust": "abc",
            },
            "budgets": {"running": 3, "runs": 40, "tokens": None},
        },
    }


def _store_raw(store: SqliteStore, run_id: str, data: dict[str, object]) -> None:
    """Put ``data`` as the stored JSON of ``run_id`` (as an older orch wrote it)."""
    with sqlite3.connect(store.path) as db:
        db.execute("UPDATE runs SET data = ? WHERE run_id = ?", (json.dumps(data), run_id))


def test_a_record_stored_by_an_older_orch_loads_typed(tmp_path: Path) -> None:
    store = SqliteStore.for_project(tmp_path)
    store.create_run(RunRecord(run_id="r-legacy000000", chain_id="c-legacy000000"))
    _store_raw(store, "r-legacy000000", _legacy("r-legacy000000", tmp_path))
    record = store.require_run("r-legacy000000")
    assert record.plan is not None
    assert record.plan.spec.prompt == "count the files" and record.plan.spec.workdir == tmp_path
    assert record.plan.spec.workspace == tier_config("worktree")
    assert (record.plan.max_turns, record.plan.timeout_seconds) == (7, 90.0)
    assert record.plan.budgets == Budgets(running=3, runs=40)
    assert record.launch == Launch(
        model_spec="scripted:/s.yaml", agents_dirs=["/a"], overrides={"max_depth": 2}, trust="abc"
    )
    assert budget_line([record]).startswith("chain budgets: runs 1/40")
    (raw,) = store.list_raw()  # `orch ps` reads the stored JSON as it is
    assert ps_row(raw)["budgets"] == {"running": 3, "runs": 40, "tokens": None}
    # written again in the typed shape
    store.update_run("r-legacy000000", summary="x")
    with sqlite3.connect(store.path) as db:
        (data,) = db.execute("SELECT data FROM runs").fetchone()
    assert "options" not in json.loads(data) and json.loads(data)["plan"]["max_turns"] == 7
    typed = {"running": 3, "runs": 40, "tokens": None, "usd": None}  # max_chain_usd: none
    assert ps_row(store.list_raw()[0])["budgets"] == typed
    store.close()


def test_a_legacy_plan_that_no_longer_validates_still_loads(tmp_path: Path) -> None:
    data = _legacy("r-odd000000000", tmp_path)
    data["options"] = {"spec": {"workdir": str(tmp_path)}, "launch": {}}  # no prompt
    record = RunRecord.model_validate_json(json.dumps(data))
    assert record.plan is None and record.launch == Launch()
    with pytest.raises(OrchError, match="keeps no plan to run by"):
        record.planned()


def test_the_plan_is_typed_and_round_trips(tmp_path: Path) -> None:
    spec = RunSpec(prompt="go", workdir=tmp_path, workspace=tier_config("shared"))
    plan = RunPlan(spec=spec, max_turns=3, budgets=Budgets(running=2, runs=5))
    record = RunRecord(run_id="r-1", chain_id="c-1", plan=plan)
    again = RunRecord.model_validate_json(record.model_dump_json())
    assert again.planned() == plan
    with pytest.raises(ValueError, match="max_turns"):
        RunPlan(spec=spec, max_turns=0)


def test_end_writes_the_ending_and_its_one_event_once(tmp_path: Path) -> None:
    store = SqliteStore.for_project(tmp_path)
    store.create_run(RunRecord(run_id="r-a", chain_id="c-a", status=RunStatus.RUNNING))
    done = store.end("r-a", RunStatus.INTERRUPTED, error="gone", output="half")
    assert done is not None and done.status == RunStatus.INTERRUPTED and done.ended_at
    assert (done.error, done.output, store.output("r-a")) == ("gone", "half", "half")
    assert store.end("r-a", RunStatus.CANCELLED) is None  # ended already: nothing written
    events = [e for e in store.events("r-a") if e["kind"] == "run_finished"]
    assert [e["data"] for e in events] == [done.finished_event()]
    assert set(done.finished_event()) == {"status", "error", "usage", "evidence", "artifacts"}
    # the owner's ending is written over another's (a reconcile that took it for gone)
    mine = store.end("r-a", RunStatus.SUCCEEDED, owner=True, output="all")
    assert mine is not None and mine.status == RunStatus.SUCCEEDED and mine.output == "all"
    store.close()


def test_end_writes_the_smallest_ending_when_the_whole_one_fails(tmp_path: Path) -> None:
    store = SqliteStore.for_project(tmp_path)
    store.create_run(RunRecord(run_id="r-b", chain_id="c-b", status=RunStatus.RUNNING))
    unstorable = [{"what": object()}]  # the record cannot be serialized
    done = store.end("r-b", RunStatus.SUCCEEDED, owner=True, output="ok", artifacts=unstorable)
    assert done is not None and done.status == RunStatus.FAILED and done.ended_at
    assert done.error is not None and "\n" not in done.error
    assert done.error.startswith("the run ended succeeded, but its ending could not be stored (")
    (event,) = [e for e in store.events("r-b") if e["kind"] == "run_finished"]
    assert event["data"]["status"] == "failed" and event["data"]["error"] == done.error
    store.close()
