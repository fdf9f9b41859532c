"""A store that blinks loses nothing (issue 45): progress written while the store is away
(a real Postgres server stopped with ``pg_ctl stop -m fast`` and started again, a SQLite
file held by another process's ``BEGIN EXCLUSIVE``) waits in order and is written when the
store answers, with the outage once in each run's events."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.catalog.definitions import load_catalog
from orchestrator.config import Settings
from orchestrator.engine.runner import Runner
from orchestrator.models import ModelProvider, ScriptedModel
from orchestrator.run import RunRecord, RunStatus
from orchestrator.spec import RunSpec
from orchestrator.store import SqliteStore, open_url
from orchestrator.store.base import RunStore
from orchestrator.store.journal import JOURNAL
from tests.pgserver import PgServer
from tests.support import RUN_DEADLINE_S, alive, harness, orch, task_call, wait_for, write_script

DOWN_S = 2.0


def pg_down(server: PgServer) -> None:
    """Stop the server as an operator restarting it would (its data kept)."""
    ctl = [*server.prefix, str(server.bindir / "pg_ctl")]
    stop = [*ctl, "stop", "-m", "fast", "-w", "-D", str(server.data)]
    subprocess.run(stop, capture_output=True, timeout=60, check=True)


def pg_up(server: PgServer) -> None:
    """Start it again on the same port and socket directory (tests/pgserver.py's options)."""
    options = " ".join(
        [
            "-c listen_addresses=127.0.0.1",
            f"-c unix_socket_directories={server.root / 'sock'}",
            "-c max_connections=200",
            "-c shared_buffers=32MB",
            "-c fsync=off",
            f"-c port={server.port}",
        ]
    )
    ctl = [*server.prefix, str(server.bindir / "pg_ctl"), "start", "-w", "-t", "60"]
    start = [*ctl, "-D", str(server.data), "-l", str(server.root / "server.log"), "-o", options]
    subprocess.run(start, capture_output=True, timeout=90, check=True)


async def _write_through(
    store: RunStore, ids: list[str], outage: Coroutine[Any, Any, None], n: int
) -> float:
    """Write ``n`` events a run, a few ms apart, while ``outage`` (a coroutine) makes the
    store go away and come back; the longest the loop stood still (seconds)."""
    stall = 0.0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal stall
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.005)
            t = time.monotonic()
            stall = max(stall, t - last - 0.005)
            last = t

    async def writer() -> None:
        for i in range(n):
            for rid in ids:
                store.add_event(rid, "tool_call", {"n": i})
                store.note_activity(rid, "bash", f"step {i}")
            await asyncio.sleep(0.01)

    tick = asyncio.create_task(ticker())
    await asyncio.gather(writer(), outage)
    behind = store._behind  # type: ignore[attr-defined]
    for _ in range(600):  # its retries: up to 30 s
        if behind.outage is None:
            break
        await asyncio.sleep(0.05)
    done.set()
    await tick
    store.flush()
    return stall


def _check(store: RunStore, ids: list[str], n: int) -> None:
    for rid in ids:
        events = store.events(rid)
        kinds = [e["kind"] for e in events]
        assert [e["data"]["n"] for e in events if e["kind"] == "tool_call"] == list(range(n))
        assert kinds.count("store_unreachable") == 1, kinds
        assert kinds.count("store_back") == 1, kinds
        back = next(e for e in events if e["kind"] == "store_back")["data"]
        assert back["until"] > back["since"] and back["kept"] > 0 and back["dropped"] == 0
        record = store.require_run(rid)
        assert record.last_activity is not None
        assert record.last_activity.summary == f"step {n - 1}"


@pytest.mark.postgres
def test_progress_waits_through_a_postgres_restart(
    pg_server: PgServer, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from orchestrator.store.postgres import PostgresStore

    store = PostgresStore(pg_url)
    ids = [f"r-{i}" for i in range(3)]
    for rid in ids:
        store.create_run(RunRecord(run_id=rid, chain_id="c", status=RunStatus.RUNNING))

    async def restart() -> None:
        await asyncio.sleep(0.2)
        await asyncio.to_thread(pg_down, pg_server)
        await asyncio.sleep(DOWN_S)
        await asyncio.to_thread(pg_up, pg_server)

    n = 300  # ~3 s of writes a run: before, during and after the outage
    with caplog.at_level(logging.WARNING, logger="orchestrator.store.batch"):
        try:
            stall = asyncio.run(_write_through(store, ids, restart(), n))
        finally:
            if subprocess.run(
                [
                    *pg_server.prefix,
                    str(pg_server.bindir / "pg_ctl"),
                    "status",
                    "-D",
                    str(pg_server.data),
                ],
                capture_output=True,
            ).returncode:
                pg_up(pg_server)  # never leave the session's server down
    said = [r.getMessage() for r in caplog.records]
    assert sum("is unreachable; keeping" in m for m in said) == 1, said
    assert sum("answers again" in m for m in said) == 1, said
    assert not any("dropped" in m for m in said), said
    _check(store, ids, n)
    assert stall < 0.1, f"the loop stood still {stall * 1000:.0f} ms"
    store.close()


HOLD = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("held", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("ROLLBACK")
"""


@pytest.mark.parametrize("busy_s", [30.0, 0.05])
def test_progress_waits_off_the_loop_while_another_process_holds_the_sqlite_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, busy_s: float
) -> None:
    """Whatever the busy timeout, a thread that must not stand still (the loop's, the
    writer thread) waits ``LOOP_BUSY_S`` for another process's lock: past it the store is
    away and what waits is written once the file is free. Nothing is dropped and the loop
    never stands still; a thread without a loop (a command's own code) keeps the busy
    timeout."""
    store = SqliteStore.for_project(tmp_path)
    store.dialect.busy_timeout_s = busy_s
    ids = [f"r-{i}" for i in range(3)]
    for rid in ids:
        store.create_run(RunRecord(run_id=rid, chain_id="c", status=RunStatus.RUNNING))
    busy_ms = store.dialect.conn().execute("PRAGMA busy_timeout").fetchone()[0]
    assert busy_ms == int(busy_s * 1000)

    async def hold() -> None:
        await asyncio.sleep(0.2)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", HOLD, str(store.path), str(DOWN_S), stdout=subprocess.PIPE
        )
        assert proc.stdout is not None
        assert await proc.stdout.readline() == b"held\n"
        await proc.wait()

    n = 300
    with caplog.at_level(logging.WARNING, logger="orchestrator.store.batch"):
        stall = asyncio.run(_write_through(store, ids, hold(), n))
    said = [r.getMessage() for r in caplog.records]
    assert not any("dropped" in m for m in said), said
    assert stall < 0.1, f"the loop stood still {stall * 1000:.0f} ms"
    assert sum("is unreachable; keeping" in m for m in said) == 1, said
    _check(store, ids, n)
    store.close()


def _slow_ending(answer: str) -> dict[str, Any]:
    """A run that calls a tool, then thinks ``ENDING_S`` before it answers."""
    turns = [
        {"tool_calls": [{"tool": "glob", "input": {"pattern": "src/*.py"}}]},
        {"expect_result": "app.py", "latency_s": ENDING_S, "text": answer},
    ]
    return {"conversations": [{"depth": 0, "turns": turns}]}


ENDING_S = 1.5  # the run's last turn: the store goes away in it


def _runner(root: Path, url: str, script: dict[str, Any], **settings: Any) -> Runner:
    from orchestrator.store.postgres import PostgresStore

    model = ScriptedModel.from_yaml(yaml.safe_dump(script), "test-script")
    cfg = Settings(**settings)
    store = PostgresStore(url)
    return Runner(
        settings=cfg,
        store=store,
        catalog=load_catalog(root, agents_dirs=[]),
        models=ModelProvider(cfg, scripted=model),
    )


def _ran_through(
    server: PgServer, runner: Runner, root: Path, down_s: float
) -> tuple[RunRecord, float]:
    """Run to its end while the server goes away in its last turn for ``down_s``; the
    record the run answered and how long the server was down."""
    spec = RunSpec(prompt="look", workdir=root)
    down = [0.0]

    async def play() -> RunRecord:
        job = asyncio.create_task(runner.run(spec))
        await asyncio.sleep(0.5)  # in its last turn
        t0 = time.monotonic()
        await asyncio.to_thread(pg_down, server)
        try:
            done, _ = await asyncio.wait({job}, timeout=down_s)
        finally:
            await asyncio.to_thread(pg_up, server)
            down[0] = time.monotonic() - t0
        return await job

    try:
        record = asyncio.run(asyncio.wait_for(play(), RUN_DEADLINE_S))
    finally:
        _ensure_up(server)
    return record, down[0]


def _ensure_up(server: PgServer) -> None:
    ctl = [*server.prefix, str(server.bindir / "pg_ctl"), "status", "-D", str(server.data)]
    if subprocess.run(ctl, capture_output=True).returncode:
        pg_up(server)  # never leave the session's server down


@pytest.mark.postgres
def test_a_run_that_ends_while_postgres_restarts_ends_succeeded(
    pg_server: PgServer, pg_url: str, project: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = _runner(project, pg_url, _slow_ending("ENDED-THROUGH-OUTAGE"))
    with caplog.at_level(logging.WARNING):
        record, down = _ran_through(pg_server, runner, project, DOWN_S)
    assert down >= DOWN_S
    assert record.status == RunStatus.SUCCEEDED, record.error
    store = runner.store
    stored = store.require_run(record.run_id)
    assert stored.status == RunStatus.SUCCEEDED, stored.error
    assert store.output(record.run_id) == "ENDED-THROUGH-OUTAGE"
    kinds = [e["kind"] for e in store.events(record.run_id)]
    assert kinds.count("run_finished") == 1, kinds
    assert kinds.count("store_unreachable") == 1 and kinds.count("store_back") == 1, kinds
    assert "tool_call" in kinds and "tool_result" in kinds, kinds
    said = [r.getMessage() for r in caplog.records]
    assert sum("is unreachable; keeping" in m for m in said) == 1, said
    assert not any("dropped" in m or "could not be recorded" in m for m in said), said
    store.close()


@pytest.mark.postgres
def test_an_ending_past_store_outage_s_is_journaled_and_written_by_the_next_command(
    pg_server: PgServer, pg_url: str, project: Path
) -> None:
    runner = _runner(project, pg_url, _slow_ending("ENDED-INTO-JOURNAL"), store_outage_s=0.5)
    record, _ = _ran_through(pg_server, runner, project, DOWN_S + 1)
    assert record.status == RunStatus.SUCCEEDED  # as the process knew it
    journal = project / ".orch" / JOURNAL
    assert journal.exists() and journal.stat().st_mode & 0o777 == 0o600
    assert record.run_id in journal.read_text()
    runner.store.close()
    r = orch("ps", "--all", cwd=project, env={"ORCH_STORE": pg_url})
    assert r.returncode == 0, r.stderr
    check = open_url(pg_url)
    stored = check.require_run(record.run_id)
    assert stored.status == RunStatus.SUCCEEDED, stored.error  # not reconcile's interrupted
    assert check.output(record.run_id) == "ENDED-INTO-JOURNAL"
    assert [e["kind"] for e in check.events(record.run_id)].count("run_finished") == 1
    assert journal.read_text() == ""
    check.close()


@pytest.mark.postgres
def test_a_background_run_ending_while_postgres_restarts_is_recorded_by_its_host(
    pg_server: PgServer, pg_url: str, project: Path
) -> None:
    env = {"ORCH_STORE": pg_url}
    script = _slow_ending("BACKGROUND-THROUGH-OUTAGE")
    script["conversations"][0]["turns"][1]["latency_s"] = 2.5
    path = write_script(project, script)
    r = orch(
        "task", "x", "--background", "--json", "--model", f"scripted:{path}", cwd=project, env=env
    )
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    store = open_url(pg_url)
    wait_for(lambda: any(e["kind"] == "tool_result" for e in store.events(run_id)))
    store.close()
    try:
        pg_down(pg_server)
        time.sleep(DOWN_S + 1)  # the run ends while the server is down
    finally:
        pg_up(pg_server)
    store = open_url(pg_url)
    wait_for(lambda: store.require_run(run_id).status.ended, timeout=30)
    record = store.require_run(run_id)
    assert record.status == RunStatus.SUCCEEDED, record.error
    assert store.output(run_id) == "BACKGROUND-THROUGH-OUTAGE"
    kinds = [e["kind"] for e in store.events(run_id)]
    assert kinds.count("run_finished") == 1, kinds
    assert kinds.count("store_unreachable") == 1 and kinds.count("store_back") == 1, kinds
    assert record.pid is not None
    wait_for(lambda: not alive(record.pid or 0))
    logs = "".join(p.read_text() for p in (project / ".orch" / "logs").glob("*"))
    assert "could not be recorded" not in logs and "dropped" not in logs, logs
    assert "StoreUnreachable" not in logs and logs.count("is unreachable; keeping") == 1, logs
    assert not (project / ".orch" / JOURNAL).exists()
    store.close()


def test_past_the_bound_the_oldest_progress_goes_said_once_and_an_ending_never(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import sqlite3

    store = SqliteStore.for_project(tmp_path)
    store.create_run(RunRecord(run_id="r-1", chain_id="c", status=RunStatus.RUNNING))
    store.keep_at_most(5)
    behind = store._behind
    works = behind._transaction
    away = [True]

    def transaction() -> Any:
        if away[0]:
            raise sqlite3.OperationalError("database is locked")
        return works()

    behind._transaction = transaction

    async def play() -> RunRecord | None:
        for i in range(10):
            store.add_event("r-1", "tool_call", {"n": i})
            await asyncio.sleep(0.005)
        ended = store.keep_ending(
            "r-1",
            {"status": RunStatus.SUCCEEDED, "ended_at": time.time()},
            output="OUT",
            owner=True,
        )
        for i in range(10, 13):
            store.add_event("r-1", "tool_call", {"n": i})
        assert [k.run_id for k in store.unwritten()] == ["r-1"]
        away[0] = False
        for _ in range(100):
            if behind.outage is None and not store.unwritten():
                break
            await asyncio.sleep(0.05)
        return ended

    with caplog.at_level(logging.WARNING, logger="orchestrator.store.batch"):
        ended = asyncio.run(play())
    assert ended is not None and ended.status == RunStatus.SUCCEEDED
    said = [r.getMessage() for r in caplog.records]
    assert sum("the oldest progress is dropped" in m for m in said) == 1, said
    store.flush()
    record = store.require_run("r-1")
    assert record.status == RunStatus.SUCCEEDED and store.output("r-1") == "OUT"
    events = store.events("r-1")
    kept = [e["data"]["n"] for e in events if e["kind"] == "tool_call"]
    assert kept == list(range(13 - len(kept), 13)) and len(kept) < 13  # the newest, in order
    kinds = [e["kind"] for e in events]
    assert kinds.count("run_finished") == 1 and kinds.count("store_back") == 1, kinds
    back = next(e for e in events if e["kind"] == "store_back")["data"]
    assert back["dropped"] == 13 - len(kept)
    store.close()


HOLD_S = 10.0  # the Done when's lock: another process holds the SQLite file this long


def test_eight_children_ride_out_a_sqlite_file_held_ten_seconds(
    project: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A root with eight children (``task``), the file held by another process's ``BEGIN
    EXCLUSIVE`` for 10 s while they call tools and end: every run ends ``succeeded`` in the
    store, and the loop never stands still 100 ms (its statements wait ``LOOP_BUSY_S`` at
    most; past it, the outage path carries them)."""
    child = [
        {"tool_calls": [{"tool": "glob", "input": {"pattern": "*"}}], "latency_s": 1.5},
        {"text": "CHILD-DONE", "latency_s": 1.5},
    ]
    calls = [task_call(f"part {i}", description=f"part {i}") for i in range(8)]
    script = {
        "conversations": [
            {"depth": 0, "turns": [{"tool_calls": calls}, {"text": "ROOT-DONE"}]},
            *[{"depth": 1, "turns": child} for _ in range(8)],
        ]
    }
    h = harness(project, script)
    stall = [0.0]

    async def play() -> RunRecord:
        done = asyncio.Event()

        async def probe() -> None:
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.005)
                t = time.monotonic()
                stall[0] = max(stall[0], t - last - 0.005)
                last = t

        tick = asyncio.create_task(probe())
        job = asyncio.create_task(h.runner.run(h.spec("split it")))
        await asyncio.sleep(1.0)  # the children are in their first turn
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", HOLD, str(h.store.path), str(HOLD_S), stdout=subprocess.PIPE
        )
        assert proc.stdout is not None
        assert await proc.stdout.readline() == b"held\n"
        try:
            record = await job
        finally:
            await proc.wait()
            done.set()
            await tick
        return record

    with caplog.at_level(logging.WARNING):
        t0 = time.monotonic()
        record = asyncio.run(asyncio.wait_for(play(), RUN_DEADLINE_S))
        took = time.monotonic() - t0
    assert took >= HOLD_S  # the root's ending waited for the file
    stored = h.store.require_run(record.run_id)
    assert stored.status == RunStatus.SUCCEEDED, stored.error
    children = [r for r in h.runs(record.chain_id) if r.run_id != record.run_id]
    assert len(children) == 8
    assert all(c.status == RunStatus.SUCCEEDED for c in children), [c.error for c in children]
    assert all(h.store.output(c.run_id) == "CHILD-DONE" for c in children)
    for c in children:
        kinds = [e["kind"] for e in h.store.events(c.run_id)]
        assert kinds.count("run_finished") == 1, kinds
        assert kinds.count("store_unreachable") == 1 and kinds.count("store_back") == 1, kinds
    said = [r.getMessage() for r in caplog.records]
    assert sum("is unreachable; keeping" in m for m in said) == 1, said
    assert not any("dropped" in m or "could not be recorded" in m for m in said), said
    print(f"longest loop stall {stall[0] * 1000:.1f} ms")
    assert stall[0] < 0.1, f"the loop stood still {stall[0] * 1000:.0f} ms"


@pytest.mark.postgres
def test_a_run_whose_store_stays_away_past_store_outage_s_ends_interrupted(
    pg_server: PgServer, pg_url: str, project: Path
) -> None:
    """The server stopped under a run for longer than ``store_outage_s`` (3 s): the run
    works on (its tools and model need no store), then stops ``interrupted`` with its
    output so far; its ending, journaled, is written by the next command once the server
    is back, and nothing stays ``running``."""
    look = {"tool": "glob", "input": {"pattern": "*"}}
    turns = [
        {"text": "PARTIAL-SO-FAR", "tool_calls": [look]},
        *[{"tool_calls": [look], "latency_s": 0.5} for _ in range(40)],
        {"text": "NEVER-REACHED"},
    ]
    script = {"conversations": [{"depth": 0, "turns": turns}]}
    runner = _runner(project, pg_url, script, store_outage_s=3)
    spec = RunSpec(prompt="look", workdir=project)
    took = [0.0]

    async def play() -> RunRecord:
        job = asyncio.create_task(runner.run(spec))
        await asyncio.sleep(1.0)  # at work
        assert not job.done()
        t0 = time.monotonic()
        await asyncio.to_thread(pg_down, pg_server)
        try:
            return await asyncio.wait_for(job, 60)
        finally:
            took[0] = time.monotonic() - t0
            await asyncio.to_thread(pg_up, pg_server)

    try:
        record = asyncio.run(asyncio.wait_for(play(), RUN_DEADLINE_S))
    finally:
        _ensure_up(pg_server)
    assert record.status == RunStatus.INTERRUPTED, record.error
    assert record.error is not None and "store_outage_s" in record.error
    assert took[0] >= 3.0
    assert record.run_id in (project / ".orch" / JOURNAL).read_text()
    runner.store.close()
    r = orch("ps", "--all", cwd=project, env={"ORCH_STORE": pg_url})
    assert r.returncode == 0, r.stderr
    check = open_url(pg_url)
    stored = check.require_run(record.run_id)
    assert stored.status == RunStatus.INTERRUPTED, stored.error
    assert check.output(record.run_id) == "PARTIAL-SO-FAR"
    assert not check.list_runs(chain_id=record.chain_id, statuses=[RunStatus.RUNNING])
    kinds = [e["kind"] for e in check.events(record.run_id)]
    assert kinds.count("run_finished") == 1, kinds
    check.close()
