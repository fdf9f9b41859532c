"""Store benchmarks: progress writes per tool call, `orch ps` over 10,000 runs, idle run memory."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.process import warmhome as warm  # noqa: E402
from orchestrator.run import Activity, RunRecord, RunStatus, Usage  # noqa: E402
from orchestrator.store import SqliteStore  # noqa: E402


def _row(measure: str, orch: float, raw: float, goal: str, met: bool) -> dict[str, Any]:
    return {
        "measure": measure,
        "orch_ms": orch,
        "raw_ms": raw,
        "ratio": orch / raw if raw else None,
        "goal": goal,
        "met": met,
    }


def progress_writes(n: int = 300) -> dict[str, Any]:
    """What the loop writes per tool call vs one bare INSERT+COMMIT in the same kind of DB."""
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteStore(Path(tmp) / "orch.db")
        store.create_run(RunRecord(run_id="r-bench", chain_id="c"))
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            store.add_event("r-bench", "tool_call", {"tool": "bash", "input": {"command": "ls"}})
            store.note_activity("r-bench", "bash", "bash: ls", usage=Usage(tool_uses=i))
            store.add_event("r-bench", "tool_result", {"tool": "bash", "chars": 10})
            times.append(time.perf_counter() - t0)
        raw_db = sqlite3.connect(Path(tmp) / "raw.db", isolation_level=None)
        raw_db.execute("PRAGMA journal_mode=WAL")
        raw_db.execute("PRAGMA synchronous=NORMAL")
        raw_db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, data TEXT)")
        raw = []
        for i in range(n):
            t0 = time.perf_counter()
            raw_db.execute("BEGIN IMMEDIATE")
            raw_db.execute("INSERT INTO t (data) VALUES (?)", (json.dumps({"i": i}),))
            raw_db.execute("COMMIT")
            raw.append(time.perf_counter() - t0)
        raw_db.close()
        store.close()
    o, r = statistics.median(times) * 1000, statistics.median(raw) * 1000
    return _row(
        "progress writes per tool call (3 writes) vs 1 raw INSERT, median", o, r, "≤ 1 ms", o <= 1.0
    )


def _fill(root: Path, n: int) -> None:
    """n ended runs from the past days, in chains of four, and a few running now."""
    old = time.time() - 3 * 86400
    store = SqliteStore.for_project(root)
    db = store.dialect.conn()
    db.execute("BEGIN")
    for i in range(n):
        rec = RunRecord(
            run_id=f"r-{i:012d}",
            chain_id=f"c-{i // 4:012d}",
            parent_run_id=f"r-{i - 1:012d}" if i % 4 else None,
            depth=i % 4,
            status=RunStatus.SUCCEEDED,
            summary="done " * 20,
            last_activity=Activity(tool="bash", summary="bash: pytest -q", at=0.0),
            usage=Usage(turns=3, tool_uses=5, input_tokens=1000, output_tokens=200),
        )
        db.execute(
            "INSERT INTO runs (run_id, chain_id, parent_run_id, depth, status, created_at,"
            " updated_at, pid, data) VALUES (?,?,?,?,?,?,?,?,?)",
            (
                rec.run_id,
                rec.chain_id,
                rec.parent_run_id,
                rec.depth,
                rec.status.value,
                old + i,
                old + i,
                None,
                rec.model_dump_json(),
            ),
        )
    db.execute("COMMIT")
    store.close()


@contextlib.contextmanager
def as_home(home: Path) -> Iterator[None]:
    """This process with ``home`` as its HOME: the user's state key is read from HOME
    (``project/statedir.py``), so the state it writes is the state the commands it starts
    with that HOME accept as theirs."""
    before = os.environ.get("HOME")
    os.environ["HOME"] = str(home)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = before


def stop_warm(home: Path) -> None:
    """End the warm processes of ``home`` (their sockets' peers) and wait for them."""
    for path in (home / ".orch" / "warm").glob("*.sock"):
        pid = warm.owner(path)
        if pid is None:
            continue
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists():
                break
            time.sleep(0.05)


def ps_10k(n: int = 10_000, samples: int = 5) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "home").mkdir()  # a HOME of its own: its warm process is the bench's
        with as_home(root / "home"):
            _fill(root, n)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
        env |= {"HOME": str(root / "home"), "ORCH_WARM_IDLE": "60"}
        cold_env = env | {"ORCH_WARM_IDLE": "0"}
        orch_cmd = [sys.executable, "-m", "orchestrator", "ps", "--json", "-C", tmp]
        all_cmd = [sys.executable, "-m", "orchestrator", "ps", "--all", "--json", "-C", tmp]
        raw_cmd = [
            sys.executable,
            "-c",
            "import sqlite3,json,sys;c=sqlite3.connect(sys.argv[1]);"
            "r=[json.loads(d) for (d,) in c.execute('SELECT data FROM runs')];"
            "sys.stdout.write(json.dumps(r))",
            str(root / ".orch" / "orch.db"),
        ]

        def timed(cmd: list[str], env: dict[str, str] = env) -> float:
            t0 = time.perf_counter()
            subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
            return time.perf_counter() - t0

        timed(orch_cmd)  # the first command starts the warm process the others are forked from
        time.sleep(3)  # (it imports orch and the SDK once, ~1 s)

        recent_code = (
            "import sqlite3, json, sys, time\n"
            "c = sqlite3.connect(sys.argv[1])\n"
            'q = "SELECT data FROM runs WHERE updated_at >= ?"\n'
            "q += \" OR status IN ('queued', 'running')\"\n"
            "r = [json.loads(d) for (d,) in c.execute(q, (time.time() - 3600,))]\n"
            "sys.stdout.write(json.dumps(r))\n"
        )
        recent_cmd = [sys.executable, "-c", recent_code, str(root / ".orch" / "orch.db")]
        o = statistics.median(timed(orch_cmd) for _ in range(samples)) * 1000
        r0 = statistics.median(timed(recent_cmd) for _ in range(samples)) * 1000
        rows.append(
            _row(
                f"`orch ps --json` with {n:,} stored runs (whole command)",
                o,
                r0,
                "≤ 300 ms",
                o <= 300,
            )
        )
        r = statistics.median(timed(raw_cmd) for _ in range(samples)) * 1000
        a = statistics.median(timed(all_cmd) for _ in range(samples)) * 1000
        rows.append(
            _row(
                f"`orch ps --all --json` listing all {n:,} runs (whole command)",
                a,
                r,
                "≤ 300 ms",
                a <= 300,
            )
        )
        for cmd, what, raw_ms in [
            (orch_cmd, "`orch ps --json`", r0),
            (all_cmd, "`orch ps --all --json`", r),
        ]:
            cold = statistics.median(timed(cmd, cold_env) for _ in range(samples)) * 1000
            rows.append(_row(f"{what}, no warm process (ORCH_WARM_IDLE=0)", cold, raw_ms,
                             "report", True))  # fmt: skip
        stop_warm(root / "home")
        with as_home(root / "home"):
            store = SqliteStore.for_project(root)
        t0 = time.perf_counter()
        store.list_raw()
        inner = (time.perf_counter() - t0) * 1000
        db = sqlite3.connect(root / ".orch" / "orch.db")
        t0 = time.perf_counter()
        [json.loads(d) for (d,) in db.execute("SELECT data FROM runs")]
        raw_inner = (time.perf_counter() - t0) * 1000
        db.close()
        store.close()
        rows.append(_row(f"ps listing in-process over {n:,} runs", inner, raw_inner, "-", True))
    return rows


def idle_memory(n: int = 50) -> dict[str, Any]:
    """RSS growth per idle background child (a slow model keeps them waiting)."""
    code = f"""
import asyncio, resource, sys, tempfile
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from orchestrator.config import Settings
from orchestrator.catalog.definitions import load_catalog
from orchestrator.engine.runner import Runner
from orchestrator.spec import RunSpec
from orchestrator.models import ModelProvider, ModelResponse

N = {n}
class Slow:
    async def complete(self, request):
        if request.depth == 0:
            if len(request.messages) == 1:
                return ModelResponse(content=[{{"type": "tool_use", "id": f"t{{i}}", "name": "task",
                    "input": {{"prompt": "idle", "run_in_background": True}}}} for i in range(N)],
                    stop_reason="tool_use")
            return ModelResponse(content=[{{"type": "text", "text": "done"}}])
        await asyncio.sleep(3600)

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

async def main():
    tmp = Path(tempfile.mkdtemp())
    settings = Settings(max_parallel_children=N)
    provider = ModelProvider(settings, model=Slow())
    from orchestrator.store import open_store
    d = Runner(settings=settings, store=open_store(tmp), catalog=load_catalog(tmp),
                  models=provider)
    before = rss()
    job = asyncio.create_task(d.run(RunSpec(prompt="go", workdir=tmp)))
    while len(d.jobs) < N + 1:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    after = rss()
    job.cancel()
    try:
        await job
    except asyncio.CancelledError:
        pass
    base = rss()
    tasks = [asyncio.create_task(asyncio.sleep(3600)) for _ in range(N)]
    await asyncio.sleep(0.1)
    raw = rss() - base
    for t in tasks:
        t.cancel()
    print((after - before) / N, max(raw, 1) / N)

asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    per_run, per_task = (float(x) for x in out.stdout.split())
    return {
        "measure": f"memory per idle background run ({n} runs), KiB",
        "orch_ms": per_run / 1024,
        "raw_ms": per_task / 1024,
        "ratio": per_run / per_task,
        "goal": "report",
        "met": True,
    }


def run() -> list[dict[str, Any]]:
    return [progress_writes(), *ps_10k(), idle_memory()]


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'measure':<70} {'orch':>10} {'raw':>10} {'ratio':>7}  goal      met")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        print(
            f"{r['measure']:<70} {r['orch_ms']:>10.3f} {r['raw_ms']:>10.3f} {ratio:>7}  "
            f"{r['goal']:<9} {'yes' if r['met'] else 'NO'}"
        )


if __name__ == "__main__":
    del resource
    print_table(run())
