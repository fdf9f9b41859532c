"""The store: lifecycle, events, cross-process safety, and staying out of git."""

from __future__ import annotations

import multiprocessing
import sqlite3
import subprocess
from pathlib import Path

from orchestrator.run import RunRecord, RunStatus, Usage
from orchestrator.store import Store


def _writer(db: str, run_id: str, n: int) -> None:
    store = Store(Path(db))
    for i in range(n):
        store.note_activity(run_id, "bash", f"step {i}")
        store.add_event(run_id, "tick", {"i": i})
    store.close()


def test_lifecycle_and_events(tmp_path: Path) -> None:
    store = Store.for_project(tmp_path)
    rec = RunRecord(run_id="r-1", chain_id="c-1")
    store.create_run(rec)
    assert store.require_run("r-1").status == RunStatus.QUEUED
    store.update_run("r-1", status=RunStatus.RUNNING)
    store.update_run("r-1", status=RunStatus.SUCCEEDED, usage=Usage(turns=2, tool_uses=3))
    got = store.require_run("r-1")
    assert got.status == RunStatus.SUCCEEDED and got.usage.tool_uses == 3
    store.add_event("r-1", "tool_call", {"tool": "bash"})
    store.add_event("r-1", "tool_result", {"tool": "bash"})
    kinds = [e["kind"] for e in store.events("r-1")]
    assert kinds == ["tool_call", "tool_result"]
    first = store.events("r-1")[0]["id"]
    assert [e["kind"] for e in store.events("r-1", after_id=first)] == ["tool_result"]
    mode = sqlite3.connect(store.path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_state_dir_keeps_itself_out_of_git(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    Store.for_project(tmp_path).create_run(RunRecord(run_id="r-2", chain_id="c"))
    assert (tmp_path / ".orch" / ".gitignore").read_text() == "*\n"
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert status == ""


def test_orch_home_overrides_location(tmp_path: Path, monkeypatch: object) -> None:
    import pytest

    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    monkeypatch.setenv("ORCH_HOME", str(tmp_path / "elsewhere"))
    store = Store.for_project(tmp_path / "proj")
    assert store.path == tmp_path / "elsewhere" / "orch.db"


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    store = Store.for_project(tmp_path)
    ids = [f"r-{i}" for i in range(4)]
    for rid in ids:
        store.create_run(RunRecord(run_id=rid, chain_id="c"))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(store.path), rid, 100)) for rid in ids]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rid in ids:
        assert len(store.events(rid)) == 100
        rec = store.require_run(rid)
        assert rec.last_activity is not None and rec.last_activity.summary == "step 99"
        assert len(rec.recent_activities) == 5


def test_an_ending_is_never_overwritten_by_someone_else(tmp_path: Path) -> None:
    store = Store.for_project(tmp_path)
    store.create_run(RunRecord(run_id="r-done", chain_id="c", status=RunStatus.SUCCEEDED))
    assert store.end_if_active("r-done", status=RunStatus.INTERRUPTED) is None
    assert store.require_run("r-done").status == RunStatus.SUCCEEDED
    store.create_run(RunRecord(run_id="r-live", chain_id="c", status=RunStatus.RUNNING))
    ended = store.end_if_active("r-live", status=RunStatus.INTERRUPTED)
    assert ended is not None and ended.status == RunStatus.INTERRUPTED


def test_reaping_never_kills_a_stranger_that_reuses_a_group_id() -> None:
    from orchestrator.workspaces.base import group_ref, kill_group_ref, process_start

    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        start = process_start(stranger.pid)
        assert start is not None
        stale = f"{stranger.pid}:{start - 100}"  # what a crashed run registered long ago
        assert kill_group_ref(stale) == 0
        assert stranger.poll() is None
        assert kill_group_ref(group_ref(stranger.pid)) == 1  # its own registration kills it
        assert stranger.wait(5) == -9
    finally:
        stranger.kill()
        stranger.wait()
