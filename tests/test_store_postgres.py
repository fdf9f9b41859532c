"""The Postgres store against a real server (tests/pgserver.py): it answers as SQLite does,
loses nothing under writers in many processes, creates its schema safely when several
processes connect first at once, and keeps a password out of everything it says or stores.

The contract tests shared with SQLite are in tests/test_store.py (``store`` fixture)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from orchestrator.config import load_settings_with_trust
from orchestrator.errors import NotFound
from orchestrator.run import RunRecord, RunStatus, Usage
from orchestrator.store import RunStore, SqliteStore, StoreError, open_store
from orchestrator.store.base import TRANSCRIPT_LIMIT
from orchestrator.store.batch import GATHER_S
from orchestrator.store.postgres import PostgresStore
from orchestrator.storeurl import endpoint, redact, scrub
from tests.pgserver import PASSWORD, PASSWORD_ROLE, PgServer

pytestmark = pytest.mark.postgres

TIMES = {"at", "created_at", "updated_at", "heartbeat_at", "started_at", "ended_at"}


def _plain(value: Any) -> Any:
    """``value`` with every timestamp replaced by whether it is set (backends differ there)."""
    if isinstance(value, RunRecord):
        value = value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: (v is not None if k in TIMES else _plain(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _exercise(store: RunStore) -> list[Any]:
    """Every method of the protocol, in an order that shows its semantics; what each said."""
    said: list[Any] = []
    tree = [("r-root", None), ("r-a", "r-root"), ("r-b", "r-root"), ("r-a1", "r-a")]
    for i, (rid, parent) in enumerate(tree):
        store.create_run(RunRecord(run_id=rid, chain_id="c-1", parent_run_id=parent, depth=i and 1))
        time.sleep(0.002)  # distinct created_at: both order by it
    store.create_run(RunRecord(run_id="r-other", chain_id="c-2", status=RunStatus.RUNNING))
    said.append(store.update_run("r-root", status=RunStatus.RUNNING, summary="s"))
    store.note_activity("r-root", "bash", "x" * 300, usage=Usage(input_tokens=3, output_tokens=4))
    for n in range(7):
        store.note_activity("r-a", "read_file", f"step {n}\x00")
    said.append(store.require_run("r-a"))
    said.append(store.end_if_active("r-b", status=RunStatus.SUCCEEDED))
    said.append(store.end_if_active("r-b", status=RunStatus.FAILED))
    said.append(store.get_run("r-nope"))
    said.append([r.run_id for r in store.find_runs("r-a")])
    said.append([r.run_id for r in store.list_runs()])
    said.append([r.run_id for r in store.list_runs(chain_id="c-1", limit=2)])
    said.append([r.run_id for r in store.list_runs(statuses=[RunStatus.RUNNING])])
    said.append([r.run_id for r in store.list_runs(since=time.time() + 3600)])
    said.append(store.chain_usage("c-1"))
    said.append(store.chain_usage("c-1", tokens=True))
    said.append(store.chain_usage("c-none", tokens=True))
    said.append([r["run_id"] for r in store.list_raw()])
    said.append(sorted(store.list_raw()[0]))
    said.append([r["run_id"] for r in store.list_raw(since=time.time() + 3600)])
    said.append([r.run_id for r in store.descendants("r-root")])
    said.append([r.run_id for r in store.descendants("r-a1")])
    store.heartbeat(["r-root", "r-a"])
    store.heartbeat([])
    said.append([r["heartbeat_at"] is not None for r in store.list_raw()])
    store.request_cancel(["r-a", "r-nope"])
    store.request_cancel([])
    said.append(sorted(store.cancel_requests(["r-root", "r-a", "r-b"])))
    said.append(store.cancel_requests([]))
    store.add_event("r-root", "tool_call", {"tool": "bash", "odd": "\x00é"})
    store.add_event("r-root", "tool_result")
    first, second = (e["id"] for e in store.events("r-root")[-2:])
    said.append(second > first)
    said.append(store.events("r-root"))
    said.append(store.events("r-root", after_id=first))
    said.append(store.events("r-nope"))
    said.append(store.output("r-root"))
    store.save_output("r-root", "first")
    store.save_output("r-root", "whole output \x00 with a NUL and ünïcode")
    said.append(store.output("r-root"))
    said.append(store.transcript("r-root"))
    store.save_transcript("r-root", [{"role": "user", "content": "task"}])
    said.append(store.transcript("r-root"))
    big = [{"role": "user", "content": "task"}] + [
        {"role": "assistant" if i % 2 else "user", "content": "y" * 100_000} for i in range(40)
    ]
    store.save_transcript("r-a", big)
    cut = store.transcript("r-a")
    said.append((len(cut or []), len(str(cut)) < TRANSCRIPT_LIMIT * 1.1))
    said.append(store.prune_transcripts(time.time() - 3600))
    said.append(store.prune_transcripts(time.time() + 1))
    said.append(store.transcript("r-root"))
    store.register_resource("r-root", "pgroup", "1:2")
    store.register_resource("r-a", "worktree", "/w")
    store.register_resource("r-b", "pgroup", "1:2")  # the same resource changes hands
    said.append(sorted((r["run_id"], r["kind"], r["ref"]) for r in store.resources()))
    said.append([r["ref"] for r in store.resources("r-b")])
    store.release_resource("r-b", "pgroup", "1:2")
    store.release_resource("r-b", "pgroup", "never-there")
    said.append([(r["run_id"], r["ref"]) for r in store.resources()])
    with pytest.raises(NotFound):
        store.update_run("r-nope", summary="x")
    return [_plain(x) for x in said]


def test_both_backends_answer_alike(tmp_path: Path, pg_url: str) -> None:
    lite = SqliteStore.for_project(tmp_path)
    pg = PostgresStore(pg_url)
    try:
        assert _exercise(pg) == _exercise(lite)
    finally:
        lite.close()
        pg.close()


# -- many processes -------------------------------------------------------------------
ROLES = ["summary", "error", "usage", "activity"]


def _hammer(url: str, role: str, ids: list[str], seconds: float, out: Any) -> None:
    """Write one field of its own on both runs, plus events, then read it back each time."""
    store = PostgresStore(url)
    n = 0
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            n += 1
            rid = ids[n % len(ids)]
            if role == "summary":
                store.update_run(rid, summary=f"{role}-{n}")
            elif role == "error":
                store.update_run(rid, error=f"{role}-{n}")
            elif role == "usage":
                store.update_run(rid, usage=Usage(tool_uses=n))
            else:
                store.note_activity(rid, "bash", f"{role}-{n}")
            store.add_event(rid, role, {"n": n})
            rec = store.require_run(rid)  # nobody else writes this field: a stale write shows
            seen = {
                "summary": rec.summary,
                "error": rec.error,
                "usage": f"usage-{rec.usage.tool_uses}",
                "activity": rec.last_activity.summary if rec.last_activity else None,
            }[role]
            if seen != f"{role}-{n}":
                raise AssertionError(f"lost update: {role} wrote {n}, then read {seen}")
        out.put((role, n, None))
    except Exception as e:  # reported to the parent, which fails the test
        out.put((role, n, repr(e)))
    finally:
        store.close()


def test_writers_in_many_processes_lose_no_update(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    ids = ["r-h1", "r-h2"]
    for rid in ids:
        store.create_run(RunRecord(run_id=rid, chain_id="c", status=RunStatus.RUNNING))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_hammer, args=(pg_url, r, ids, 3.0, results)) for r in ROLES]
    for p in procs:
        p.start()
    got = {role: (n, e) for role, n, e in (results.get(timeout=90) for _ in procs)}
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert {role: e for role, (_, e) in got.items() if e} == {}
    events = [e for rid in ids for e in store.events(rid)]
    for role, (n, _) in got.items():
        assert n > 20, (role, n)
        assert sorted(e["data"]["n"] for e in events if e["kind"] == role) == list(range(1, n + 1))
    for rid in ids:  # each field holds its writer's last write on that run
        rec = store.require_run(rid)
        last = {
            r: max(i for i in range(1, n + 1) if ids[i % 2] == rid) for r, (n, _) in got.items()
        }
        assert rec.summary == f"summary-{last['summary']}"
        assert rec.error == f"error-{last['error']}"
        assert rec.usage.tool_uses == last["usage"]
        assert rec.last_activity is not None
        assert rec.last_activity.summary == f"activity-{last['activity']}"
        ids_in_order = [e["id"] for e in store.events(rid)]
        assert ids_in_order == sorted(set(ids_in_order))
    store.close()


def _first_connect(url: str, barrier: Any, out: Any) -> None:
    try:
        barrier.wait(30)
        store = PostgresStore(url)
        store.create_run(
            RunRecord(run_id=f"r-{multiprocessing.current_process().name}", chain_id="c")
        )
        store.close()
        out.put(None)
    except Exception as e:
        out.put(repr(e))


def test_first_connects_from_many_processes_at_once_all_succeed(pg_url: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(6), ctx.Queue()
    procs = [
        ctx.Process(target=_first_connect, args=(pg_url, barrier, results), name=f"p{i}")
        for i in range(6)
    ]
    for p in procs:
        p.start()
    errors = [results.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(30)
    assert errors == [None] * 6
    store = PostgresStore(pg_url)
    assert len(store.list_runs()) == 6
    store.close()


# -- the password ---------------------------------------------------------------------
def test_url_helpers_never_keep_a_password() -> None:
    url = "postgresql://me:p%40ss@db1:5433,db2/orch?password=other&sslmode=require"
    assert redact(url) == "postgresql://me@db1:5433,db2/orch?sslmode=require"
    assert endpoint(url) == "db1:5433,db2:5432"
    assert endpoint("postgres:///orch?host=/run/pg&port=6000") == "/run/pg:6000"
    assert endpoint("postgresql://[::1]:7000/x") == "[::1]:7000"
    said = scrub("p@ss and p%40ss and other", url)
    assert "p@ss" not in said and "p%40ss" not in said and "other" not in said


def test_a_password_is_in_nothing_it_says_or_stores(
    pg_server: PgServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pg_server.create_database("t_secret", owner=PASSWORD_ROLE)
    try:
        url = pg_server.url("t_secret", user=PASSWORD_ROLE, password=PASSWORD)
        monkeypatch.setenv("ORCH_STORE", url)
        store = open_store(tmp_path)
        assert isinstance(store, PostgresStore)
        assert (
            store.describe() == f"postgresql://{PASSWORD_ROLE}@127.0.0.1:{pg_server.port}/t_secret"
        )
        _exercise(store)
        said: list[str] = [store.describe()]
        with pytest.raises(NotFound) as missing:
            store.require_run("r-nope")
        said.append(str(missing.value))
        store.close()
        for bad in (  # wrong password, no such database, nothing listening
            pg_server.url("t_secret", user=PASSWORD_ROLE, password=PASSWORD + "x"),
            pg_server.url("t_nope", user=PASSWORD_ROLE, password=PASSWORD),
            url.replace(str(pg_server.port), "1"),
        ):
            with pytest.raises(StoreError) as info:
                PostgresStore(bad)
            said.append(str(info.value))
            assert info.value.__cause__ is None and info.value.__suppress_context__
        assert "password authentication failed" in said[2] and "t_nope" in said[3]
        assert f"127.0.0.1:{pg_server.port}" in said[2] and "127.0.0.1:1 " in said[4]
        dump = pg_server.dump("t_secret")
        assert "whole output" in dump  # the dump does hold what was stored
        for text in [*said, dump, pg_server.log()]:
            assert "s3cret" not in text and quote(PASSWORD, safe="") not in text, text
    finally:
        pg_server.drop_database("t_secret")


def test_a_bad_store_setting_never_echoes_it(tmp_path: Path) -> None:
    (tmp_path / "orch.toml").write_text('store = "mysql://me:hunter2@db/orch"\n')
    with pytest.raises(Exception) as info:
        load_settings_with_trust(tmp_path)
    assert "store" in str(info.value) and "hunter2" not in str(info.value)


def test_only_progress_writes_commit_asynchronously(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    try:
        conn = store.dialect.conn()
        conn.execute("SET synchronous_commit = on")  # the session's (the test server's is off)
        store.create_run(RunRecord(run_id="r-1", chain_id="c"))
        store.note_activity("r-1", "bash", "ls")
        store.add_event("r-1", "tool_call")
        store.heartbeat(["r-1"])
        row = conn.execute("SHOW synchronous_commit").fetchone()
        assert row is not None and row[0] == "on"  # set for those transactions only
        got = store.require_run("r-1")
        assert got.last_activity is not None and got.last_activity.summary == "ls"
        assert [e["kind"] for e in store.events("r-1")] == ["tool_call"]
        assert store.list_raw()[0]["heartbeat_at"] is not None
    finally:
        store.close()


def test_progress_in_a_writes_transaction_commits_as_that_write(pg_url: str) -> None:
    """Queued progress that a strict write takes into its own transaction is written
    there without the asynchronous commit: the write stays as durable as it was."""
    import asyncio

    from orchestrator.store.postgres import ASYNC_COMMIT
    from tests.support import spy_transactions

    store = PostgresStore(pg_url)
    try:
        store.create_run(RunRecord(run_id="r-1", chain_id="c"))
        said = spy_transactions(store)

        async def turn() -> RunRecord:
            store.add_event("r-1", "tool_call")
            store.note_activity("r-1", "bash", "ls")
            return store.update_run("r-1", summary="mine")  # takes the queue in

        record = asyncio.run(turn())
        assert record.summary == "mine" and record.last_activity is not None
        assert len(said) == 1 and not any(ASYNC_COMMIT in s for s in said[0])
        assert any("INSERT INTO events" in s for s in said[0])

        async def progress_only() -> None:
            store.add_event("r-1", "tool_result")
            await asyncio.sleep(GATHER_S * 3)

        asyncio.run(progress_only())
        assert len(said) == 2 and ASYNC_COMMIT in said[1][0]  # its own: asynchronous
        assert [e["kind"] for e in store.events("r-1")] == ["tool_call", "tool_result"]
    finally:
        store.close()
