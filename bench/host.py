"""Worker host benchmarks: what a detached run costs when one process hosts many.

- memory: 100 `orch task --background` runs waiting on their model inside one host,
  host RSS after minus before, per run, vs the RSS of one worker of its own (what each
  run cost before the host); with the scripted model and with the real SDK (against a
  fake Messages API on loopback that holds every request open);
- start: `orch task --background` → the run's first model request (real SDK, fake API),
  with a warm host vs a cold one vs a worker of its own.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from store import _row  # noqa: E402  (bench/store.py: one row of the table)

from orchestrator.run import RunStatus  # noqa: E402
from orchestrator.store import SqliteStore  # noqa: E402
from tests.fakeapi import FakeAPI, serve, text_reply  # noqa: E402

RUNS = 100
MIB = 1024 * 1024


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "ORCH_"))}
    env.update(extra)
    return env


def _launch(project: Path, env: dict[str, str], model: str | None = None) -> str:
    cmd = [sys.executable, "-m", "orchestrator", "task", "wait", "--background", "--json"]
    cmd += ["--model", model] if model else []
    r = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"orch task --background failed: {r.stderr.strip()}")
    return str(json.loads(r.stdout)["run_id"])


def note(what: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} host bench: {what}", file=sys.stderr, flush=True)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RSS for pid {pid}")


def _wait(
    pred: Callable[[], bool], timeout: float, what: str, why: Callable[[], str] = str
) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise RuntimeError(f"timed out waiting for {what} {why()}")
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _ended(pid: int) -> Callable[[], bool]:
    return lambda: _gone(pid)


class Project:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.store = SqliteStore.for_project(root)

    def running(self, ids: list[str]) -> bool:
        return all(self.store.require_run(r).status == RunStatus.RUNNING for r in ids)

    def statuses(self) -> str:
        runs = self.store.list_runs()
        seen = {(r.status.value, r.pid) for r in runs}
        return str({k: sum((r.status.value, r.pid) == k for r in runs) for k in seen})

    def pid(self, run_id: str) -> int:
        pid = self.store.require_run(run_id).pid
        assert pid is not None
        return pid


def _memory(
    label: str, env: dict[str, str], model: str | None, n: int, waiting: Callable[[], int]
) -> list[dict[str, Any]]:
    """``waiting()``: how many runs wait on their model (the fake API's open requests)."""
    with tempfile.TemporaryDirectory() as tmp:
        p = Project(Path(tmp) / "proj")
        first = _launch(p.root, env, model)
        _wait(lambda: p.running([first]) and waiting() >= 1, 60, "the first run")
        host = p.pid(first)
        time.sleep(1.0)
        before = _rss(host)
        note(f"{label}: host {host} at {before / MIB:.1f} MiB with one run; launching {n}")
        with ThreadPoolExecutor(4) as pool:
            ids = list(pool.map(lambda _: _launch(p.root, env, model), range(n)))
        _wait(lambda: p.running(ids) and waiting() >= n + 1, 120, f"{n} runs", p.statuses)
        note(f"{label}: {n} runs launched")
        hosts = {p.pid(r) for r in ids}
        time.sleep(1.0)
        after = _rss(host)
        alone = _launch(p.root, {**env, "ORCH_WORKER_HOST": "0"}, model)
        _wait(lambda: p.running([alone]) and waiting() >= n + 2, 60, "a run's own worker")
        time.sleep(1.0)
        worker = _rss(p.pid(alone))
        os.kill(host, signal.SIGTERM)
        os.kill(p.pid(alone), signal.SIGKILL)
        _wait(lambda: _gone(host), 60, "the host to end")
        p.store.close()
    per_run = (after - before) / n
    one_host = " (one host)" if hosts == {host} else f" ({len(hosts)} hosts!)"
    return [
        _row(
            f"memory per background run, {n} runs in one host, {label}, MiB{one_host}",
            per_run / MIB,
            worker / MIB,
            "≤ 5 MiB",
            per_run <= 5 * MIB and hosts == {host},
        ),
        _row(
            f"host RSS with 1 run → with {n + 1} runs, {label}, MiB",
            after / MIB,
            before / MIB,
            "report",
            True,
        ),  # fmt: skip
    ]


def memory(n: int = RUNS) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "wait.yaml"
        turn = {"text": "x", "latency_s": 3600}
        script.write_text(json.dumps({"conversations": [{"runs": "*", "turns": [turn]}]}))
        env = _env(ORCH_HOST_IDLE="0")
        rows += _memory("scripted model", env, f"scripted:{script}", n, lambda: 1 << 30)
    release = threading.Event()

    def held(body: dict[str, Any]) -> dict[str, Any]:
        release.wait(600)
        return text_reply("done")

    with serve(FakeAPI(held)) as api:
        env = _env(ORCH_HOST_IDLE="0", ANTHROPIC_BASE_URL=api.base_url, ANTHROPIC_API_KEY="sk-x")
        try:
            rows += _memory("real SDK (fake API)", env, None, n, lambda: len(api.requests))
        finally:
            release.set()
    return rows


def first_request(samples: int = 5) -> list[dict[str, Any]]:
    """`orch task --background` → the fake API sees the run's first request, medians."""
    arrived: list[float] = []
    seen = threading.Condition()

    def arrive(body: dict[str, Any]) -> dict[str, Any]:
        with seen:
            arrived.append(time.perf_counter())
            seen.notify_all()
        return text_reply("done")

    def timed(project: Path, env: dict[str, str]) -> tuple[float, str]:
        with seen:
            count = len(arrived)
        t0 = time.perf_counter()
        rid = _launch(project, env)
        with seen:
            if not seen.wait_for(lambda: len(arrived) > count, 60):
                raise RuntimeError("the run's first request never came")
            return (arrived[count] - t0) * 1000, rid

    with serve(FakeAPI(arrive)) as api, tempfile.TemporaryDirectory() as tmp:
        p = Project(Path(tmp) / "proj")
        base = {"ANTHROPIC_BASE_URL": api.base_url, "ANTHROPIC_API_KEY": "sk-x"}
        warm_env = _env(ORCH_HOST_IDLE="600", **base)
        _, rid = timed(p.root, warm_env)  # starts the warm host (and imports the SDK in it)
        host = p.pid(rid)
        times: dict[str, list[float]] = {"cold": [], "warm": [], "own": []}
        for _ in range(samples):  # interleaved: the machine's load weighs on each alike
            ms, rid = timed(p.root, _env(ORCH_HOST_IDLE="0", **base))  # no such host lives
            times["cold"].append(ms)
            _wait(_ended(p.pid(rid)), 30, "the cold host to end")
            times["warm"].append(timed(p.root, warm_env)[0])
            times["own"].append(timed(p.root, _env(ORCH_WORKER_HOST="0", **base))[0])
        os.kill(host, signal.SIGTERM)
        _wait(_ended(host), 30, "the host to end")
        p.store.close()
    out = {k: statistics.median(v) for k, v in times.items()}
    note(f"start → first request, ms: {json.dumps(times)}")
    return [
        _row("`orch task --background` → first model request, warm host vs own worker (SDK)",
             out["warm"], out["own"], "< own", out["warm"] < out["own"]),
        _row("`orch task --background` → first model request, cold host vs own worker (SDK)",
             out["cold"], out["own"], "report", True),
    ]  # fmt: skip


def run() -> list[dict[str, Any]]:
    n = int(os.environ.get("BENCH_HOST_RUNS", RUNS))
    return [*memory(n), *first_request()]


if __name__ == "__main__":
    for r in run():
        print(f"{r['measure']:<90} {r['orch_ms']:>10.2f} {r['raw_ms']:>10.2f}  {r['goal']}")
