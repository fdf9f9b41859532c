"""Dashboard benchmarks, with 10,000 runs in the store: the first page (its HTML, script,
style and list, as the browser fetches them) against reading the same rows straight from
SQLite; and how long a store write takes to reach an open page's stream, against the write
and the read that find it."""

from __future__ import annotations

import json
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store import _fill, _row  # noqa: E402

from orchestrator.dashboard.server import Served  # noqa: E402
from orchestrator.run import RunStatus  # noqa: E402
from orchestrator.store import SqliteStore  # noqa: E402


def _get(base: str, path: str, token: str) -> bytes:
    req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as res:
        data: bytes = res.read()
        return data


def _started(served: Served) -> threading.Thread:
    thread = threading.Thread(target=served.run, daemon=True)
    thread.start()
    while not served.server.started:
        time.sleep(0.01)
    return thread


def run(n: int = 10_000, samples: int = 7) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _fill(root, n)
        db_path = root / ".orch" / "orch.db"
        recent = time.time() - 7 * 86400  # every run is in the page's window
        with sqlite3.connect(db_path) as db:
            db.execute("UPDATE runs SET updated_at = ?", (time.time() - 60,))
        store = SqliteStore.for_project(root)
        served = Served(store, root)
        thread = _started(served)
        base = f"http://127.0.0.1:{served.port}"
        try:
            page = ["/", "/static/app.js", "/static/app.css", "/api/runs"]
            for path in page:  # warm: the first request imports and opens what it needs
                _get(base, path, served.token)

            def first_page() -> float:
                t0 = time.perf_counter()
                for path in page:
                    _get(base, path, served.token)
                return time.perf_counter() - t0

            def raw_read() -> float:
                t0 = time.perf_counter()
                with sqlite3.connect(db_path) as db:
                    q = "SELECT data FROM runs WHERE updated_at >= ?"
                    q += " ORDER BY created_at DESC LIMIT 2001"
                    json.dumps([json.loads(d) for (d,) in db.execute(q, (recent,))])
                return time.perf_counter() - t0

            o = statistics.median(first_page() for _ in range(samples)) * 1000
            r = statistics.median(raw_read() for _ in range(samples)) * 1000
            rows.append(
                _row(
                    f"dashboard: first page with {n:,} runs (HTML, JS, CSS, list)",
                    o,
                    r,
                    "<=500 ms",
                    o <= 500,
                )  # fmt: skip
            )
            late, raw = _updates(served, store, base, samples)
            rows.append(
                _row(
                    "dashboard: a store write reaching an open page's stream (median)",
                    late,
                    raw,
                    "<=200 ms",
                    late <= 200,
                )  # fmt: skip
            )
        finally:
            served.stop()
            thread.join(10)
    return rows


def _updates(served: Served, store: SqliteStore, base: str, samples: int) -> tuple[float, float]:
    """(median ms from a write to its event on the stream, median ms of the write + read)."""
    req = urllib.request.Request(
        f"{base}/api/stream?since={time.time()}",
        headers={"Authorization": f"Bearer {served.token}"},
    )
    stream = urllib.request.urlopen(req, timeout=30)
    seen: dict[str, float] = {}
    done = threading.Event()

    def reader() -> None:
        try:
            follow()
        except (OSError, AttributeError, ValueError):  # the stream closed under it: done
            return

    def follow() -> None:
        for line in stream:
            if line.startswith(b"data: "):
                for row in json.loads(line[6:]):
                    if row["summary"].startswith("bench "):
                        seen.setdefault(row["summary"], time.perf_counter())
            if done.is_set():
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    time.sleep(0.3)
    lates, raws = [], []
    for i in range(samples):
        mark = f"bench {i}"
        t0 = time.perf_counter()
        store.update_run("r-000000000003", summary=mark, status=RunStatus.SUCCEEDED)
        store.flush()
        raws.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        store.list_raw(since=time.time() - 1)
        raws[-1] += time.perf_counter() - t1
        deadline = time.monotonic() + 5
        while mark not in seen and time.monotonic() < deadline:
            time.sleep(0.002)
        lates.append(seen.get(mark, t0 + 5) - t0)
        time.sleep(0.1)
    done.set()
    stream.close()
    return statistics.median(lates) * 1000, statistics.median(raws) * 1000


if __name__ == "__main__":
    for row in run():
        print(row)
