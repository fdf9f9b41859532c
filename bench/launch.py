"""`launch`: how soon `orch task --background` gives the shell back (scripted model).

- cold: no warm process (``ORCH_WARM_IDLE=0``) and a fresh project each time (so no worker
  host either): the command imports orch, stores the run, starts a worker host and returns;
  each sample's run ends before the next sample (a host importing orch meanwhile would
  share the 2 cores with it);
- warm: the same command forked from the warm process of its environment, with the
  project's worker host running (the usual case after the first command).

The raw column is the bare interpreter (``python -c pass``), timed in the same run. Both
run with Python's bytecode cache on, as for an installed orch (``PYTHONDONTWRITEBYTECODE``
is dropped from their environment).
Every launched run is checked to have succeeded, so a fast but broken launch is no figure.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from store import _row, as_home, stop_warm  # noqa: E402  (bench/store.py)

from orchestrator.process import warmhome as warm  # noqa: E402
from orchestrator.run import RunStatus  # noqa: E402
from orchestrator.store import SqliteStore  # noqa: E402

COLD_RUNS = 7
WARM_RUNS = 15
COLD_GOAL_S = 1.5
WARM_GOAL_S = 0.3
SCRIPT = "conversations:\n- turns:\n  - text: done\n"
ORCH = [sys.executable, "-m", "orchestrator"]


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "ORCH_"))}
    # as installed: Python keeps orch's compiled modules (pip writes them for a wheel);
    # with PYTHONDONTWRITEBYTECODE every process would compile all of orch again
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env | {"HOME": str(home), "ORCH_HOST_IDLE": "30"} | extra


def _repo(where: Path) -> Path:
    where.mkdir(parents=True)
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.com"]
    subprocess.run([*git, "init", "-q"], cwd=where, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "init"], cwd=where, check=True)
    return where


def _launch(repo: Path, env: dict[str, str], script: Path) -> tuple[float, str]:
    argv = [*ORCH, "task", "say done", "--background", "--json", "--model", f"scripted:{script}"]
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"orch task --background failed: {r.stderr.strip()}")
    return took, str(json.loads(r.stdout)["run_id"])


def _all_succeeded(runs: list[tuple[Path, str]], timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    for repo, run_id in runs:
        store = SqliteStore.for_project(repo)
        try:
            while (record := store.require_run(run_id)).status in (
                RunStatus.QUEUED,
                RunStatus.RUNNING,
            ):
                if time.monotonic() > end:
                    raise RuntimeError(f"run {run_id} did not end within {timeout:g} s")
                time.sleep(0.1)
        finally:
            store.close()
        if record.status != RunStatus.SUCCEEDED:
            raise RuntimeError(f"run {run_id} ended {record.status.value}: {record.error}")


def _stop_hosts(repos: list[Path]) -> None:
    for repo in repos:
        for sock in (repo / ".orch").glob("host-*.sock"):
            pid = warm.owner(sock)
            if pid is not None:
                os.kill(pid, signal.SIGTERM)


def _warm_up(home: Path, env: dict[str, str], repo: Path) -> None:
    """Run one command so that a warm process starts, and wait until it answers."""
    subprocess.run([*ORCH, "ps", "--json"], cwd=repo, env=env, capture_output=True, check=True)
    end = time.monotonic() + 60
    while not any(warm.owner(s) for s in (home / ".orch" / "warm").glob("*.sock")):
        if time.monotonic() > end:
            raise RuntimeError("no warm process answered within 60 s")
        time.sleep(0.1)


def _raw(n: int = 7) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True, env=_env(Path("/")))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        script = base / "script.yaml"
        script.write_text(SCRIPT)
        home = base / "home"
        home.mkdir()
        with as_home(home):  # the runs' state is read in this process too
            launched: list[tuple[Path, str]] = []
            repos: list[Path] = []
            try:
                cold = []
                # each sample alone: its run (and the host that starts for it, importing orch
                # on the same 2 cores) ends before the next sample starts
                cold_env = _env(home, ORCH_WARM_IDLE="0", ORCH_HOST_IDLE="0")
                for i in range(COLD_RUNS):
                    repos.append(_repo(base / f"cold{i}"))
                    took, run_id = _launch(repos[-1], cold_env, script)
                    cold.append(took)
                    _all_succeeded([(repos[-1], run_id)])
                    launched.append((repos[-1], run_id))
                warm_env = _env(home, ORCH_WARM_IDLE="120")
                repos.append(_repo(base / "warm"))
                _warm_up(home, warm_env, repos[-1])
                first, run_id = _launch(repos[-1], warm_env, script)  # starts the worker host
                launched.append((repos[-1], run_id))
                time.sleep(2)  # the host imports the engine once
                hot = []
                for _ in range(WARM_RUNS):
                    took, run_id = _launch(repos[-1], warm_env, script)
                    hot.append(took)
                    launched.append((repos[-1], run_id))
                _all_succeeded(launched)
                raw = _raw()
            finally:
                stop_warm(home)
                _stop_hosts(repos)
    c, w = statistics.median(cold), statistics.median(hot)
    load = os.getloadavg()[0]
    rows = [
        _row(
            f"cold `orch task --background` (no warm process, no host), median of {COLD_RUNS}",
            c * 1000,
            raw * 1000,
            f"≤ {COLD_GOAL_S * 1000:g} ms",
            c <= COLD_GOAL_S,
        ),
        _row(
            f"warm `orch task --background` (warm process and host running), median of {WARM_RUNS}",
            w * 1000,
            raw * 1000,
            f"≤ {WARM_GOAL_S * 1000:g} ms",
            w <= WARM_GOAL_S,
        ),
    ]
    detail = {
        "cold_s": [round(t, 3) for t in cold],
        "warm_s": [round(t, 3) for t in hot],
        "warm_first_with_host_start_s": round(first, 3),
        "load_average_1m": round(load, 2),
    }
    for r in rows:
        r["detail"] = detail
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
