"""A store that blinks loses nothing (issue 45): progress written while the store is away
(a real Postgres server stopped with ``pg_ctl stop -m fast`` and started again, a SQLite
file held by another process's ``BEGIN EXCLUSIVE``) waits in order and is written when the
store answers, with the outage once in each run's events."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from orchestrator.run import RunRecord, RunStatus
from orchestrator.store import SqliteStore
from orchestrator.store.base import RunStore
from tests.pgserver import PgServer

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


def test_progress_waits_while_another_process_holds_the_sqlite_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SqliteStore.for_project(tmp_path)
    store.dialect.conn().execute("PRAGMA busy_timeout=50")  # the lock outlasts it
    ids = [f"r-{i}" for i in range(3)]
    for rid in ids:
        store.create_run(RunRecord(run_id=rid, chain_id="c", status=RunStatus.RUNNING))

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
        asyncio.run(_write_through(store, ids, hold(), n))
    said = [r.getMessage() for r in caplog.records]
    assert sum("is unreachable; keeping" in m for m in said) == 1, said
    assert not any("dropped" in m for m in said), said
    _check(store, ids, n)
    store.close()
