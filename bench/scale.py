"""Scale-out overhead: worktree children on a Ray cluster against the same children in-process.

A real cluster on loopback (``tests/raycluster.py``: a head and a worker, later a third
node), a small repository, and the real CLI: ``orch task`` whose scripted root starts N
worktree children at once, each writing a file, with ``--executor ray`` and without,
alternating. Measured from the root's events (a ``task`` call → its tool_result:
admission, the Ray call, the bundle, the clone, the run, the export and the import) and
as the command's wall time (which adds ``import ray`` and joining the cluster).

Rows and goals:

- one child, on a node's warm orch actor vs in process: at most 300 ms more;
- four children at once (2 nodes): reported;
- 32 children at once on 3 nodes vs one child on the same cluster (the root's first
  ``task`` call → its last result): at most 1.5x; and the same 32 in process, reported.
  The nodes share this machine's cores, so the CPU all 32 children cost (measured: every
  process with the bench's HOME, i.e. the cluster, orch's warm process and what they
  reaped, and the ``orch`` commands) divided by the cores is a floor no scheduling beats;
  the last row shows it, with the same CPU for the 32 in process.

The commands run with a HOME of their own whose config lets one root start 32 children at
once (``max_parallel_children``) and asks no CPU of Ray per run (``[ray] num_cpus = 0``: the
nodes' ``orch_slots``, 12 each, bound the runs).

Run: ``python bench/scale.py`` (needs ``pip install 'orch[ray]'``).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RUNS = 5
FAN_RUNS = 3
CHILDREN = 4
FAN = 32
SLOTS = 12  # orch_slots per node: 32 children fit at once on 3 nodes
GOAL_EXTRA_MS = 300.0
GOAL_FAN = 1.5
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
CONFIG = f"max_parallel_children = {FAN}\nmax_chain_running = {FAN + 8}\n[ray]\nnum_cpus = 0\n"
TICK = os.sysconf("SC_CLK_TCK")


def _script(children: int) -> dict[str, Any]:
    calls = [
        {"tool": "task", "input": {"description": f"w{i}", "prompt": f"write file {i}",
                                   "isolation": "worktree"}}
        for i in range(children)
    ]  # fmt: skip
    convs: list[dict[str, Any]] = [{"depth": 0, "turns": [{"tool_calls": calls}, {"text": "ok"}]}]
    for i in range(children):
        convs.append({"depth": 1, "prompt": f"file {i}$", "turns": [
            {"tool_calls": [{"tool": "write_file", "input": {"path": f"f{i}.txt",
                                                             "content": f"{i}\n"}}]},
            {"text": "done"},
        ]})  # fmt: skip
    return {"conversations": convs}


def _git(repo: Path, *args: str) -> None:
    ident = ["-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run(["git", *ident, *args], cwd=repo, check=True, capture_output=True)


def _orch(repo: Path, env: dict[str, str], *args: str) -> Any:
    got = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=repo, env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(got.stdout)


def _home_cpu(home: Path) -> float:
    """CPU seconds of every live process whose HOME is ``home`` (the cluster's, orch's warm
    process and what it started), with the children they reaped (git, bwrap, workers)."""
    mark = b"HOME=" + bytes(home) + b"\0"
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (b"\0" + (entry / "environ").read_bytes()).count(b"\0" + mark):
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / TICK


def _cpu(home: Path) -> float:
    """This process's reaped children (the ``orch`` commands) and the live processes of
    ``home`` (:func:`_home_cpu`), in CPU seconds."""
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + _home_cpu(home)


def _once(
    repo: Path, scripts: dict[int, Path], env: dict[str, str], ray: bool, children: int
) -> tuple[float, list[float], float]:
    """One ``orch task``: its wall time, each child's span, the fan-out's span."""
    args = [sys.executable, "-m", "orchestrator", "task", "--model",
            f"scripted:{scripts[children]}", "go"]  # fmt: skip
    if ray:
        args[4:4] = ["--executor", "ray"]
    t0 = time.perf_counter()
    got = subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if got.returncode != 0:
        raise RuntimeError(f"orch task failed: {got.stderr[-500:]}")
    rows = _orch(repo, env, "ps", "--all", "--json")
    root = [r for r in rows if r["depth"] == 0][-1]  # oldest first: the newest root
    kids = [r for r in rows if r.get("parent_run_id") == root["run_id"]]
    assert len(kids) == children and all(r["status"] == "succeeded" for r in kids)
    assert all(("/ray-" in (r["node"] or "")) == ray for r in kids)
    for r in kids:  # leave no branch behind for the next round
        subprocess.run(["git", "branch", "-qD", f"orch/general/{r['run_id'][2:10]}"], cwd=repo,
                       capture_output=True)  # fmt: skip
    events = _orch(repo, env, "logs", root["run_id"], "--json")
    # the root's task call → its tool_result: admission, dispatch, the run, its work imported
    called = {e["data"]["id"]: e["at"] for e in events if e["kind"] == "tool_call"}
    results = {e["data"]["id"]: e["at"] for e in events if e["kind"] == "tool_result"}
    spans = [at - called[i] for i, at in results.items()]
    return wall, spans, max(results.values()) - min(called.values())


class Cluster:
    """``tests/raycluster.py`` in a session of its own."""

    def __init__(self, where: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "raycluster.py"), str(where), str(SLOTS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=env, start_new_session=True,
        )  # fmt: skip
        assert self.ask(None) == "ready"
        self.info = json.loads((where / "cluster.json").read_text())

    def ask(self, line: str | None) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _repo(where: Path) -> Path:
    repo = where / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("bench\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "init")
    return repo


def run(runs: int = RUNS, fan_runs: int = FAN_RUNS) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        home = where / "home"
        (home / ".orch").mkdir(parents=True)
        (home / ".orch" / "config.toml").write_text(CONFIG)
        env = {**os.environ, **LOOPBACK, "HOME": str(home)}
        for var in ("RAY_ADDRESS", "ORCH_STORE", "ORCH_HOME"):
            env.pop(var, None)
        cluster = Cluster(where, env)
        try:
            env["RAY_ADDRESS"] = cluster.info["address"]
            repo = _repo(where)
            scripts = {}
            for n in (1, CHILDREN, FAN):
                scripts[n] = where / f"script{n}.yaml"
                scripts[n].write_text(yaml.safe_dump(_script(n)))
            walls: dict[tuple[int, bool], list[float]] = {}
            spans: dict[tuple[int, bool], list[float]] = {}
            for i in range(runs + 1):  # the first round warms up and is dropped
                for n in (1, CHILDREN):
                    for ray in (i % 2 == 0, i % 2 == 1):
                        wall, got, _ = _once(repo, scripts, env, ray, n)
                        if i:
                            walls.setdefault((n, ray), []).append(wall)
                            spans.setdefault((n, ray), []).extend(got)
            cluster.ask(f"add {SLOTS}")  # a third node
            fans: dict[int, list[float]] = {1: [], FAN: []}
            cpus: list[float] = []
            local_cpus: list[float] = []
            for i in range(fan_runs + 1):
                cpu0 = _cpu(home)
                _, _, fan = _once(repo, scripts, env, False, FAN)  # the same 32 in process
                cpu1 = _cpu(home)
                if i:
                    fans.setdefault(0, []).append(fan)
                    local_cpus.append(cpu1 - cpu0)
                for n in (1, FAN) if i % 2 else (FAN, 1):
                    cpu0 = _cpu(home)
                    _, _, fan = _once(repo, scripts, env, True, n)
                    cpu1 = _cpu(home)
                    if i:
                        fans[n].append(fan)
                        if n == FAN:
                            cpus.append(cpu1 - cpu0)
        finally:
            cluster.close()
    one, local = statistics.median(spans[1, True]), statistics.median(spans[1, False])
    child_ray, child_local = statistics.median(spans[4, True]), statistics.median(spans[4, False])
    wall_ray, wall_local = statistics.median(walls[4, True]), statistics.median(walls[4, False])
    fan1, fan32 = statistics.median(fans[1]), statistics.median(fans[FAN])
    fan_local = statistics.median(fans[0])
    cores = os.cpu_count() or 1
    cpu = statistics.median(cpus)
    floor = cpu / cores
    return [
        {"measure": f"one worktree child, task call → its result, on a node's warm orch actor "
                    f"vs in process (median of {len(spans[1, True])}; goal: ≤ +300 ms)",
         "orch_ms": one * 1000, "raw_ms": local * 1000, "ratio": one / local,
         "goal": f"≤ +{GOAL_EXTRA_MS:.0f} ms", "met": (one - local) * 1000 <= GOAL_EXTRA_MS},
        {"measure": f"{CHILDREN} worktree children at once, each: task call → its result, on "
                    f"2 Ray nodes vs in process (median of {len(spans[4, True])})",
         "orch_ms": child_ray * 1000, "raw_ms": child_local * 1000,
         "ratio": child_ray / child_local, "goal": "reported", "met": True},
        {"measure": f"`orch task` with {CHILDREN} worktree children, --executor ray vs local "
                    f"(median of {runs})",
         "orch_ms": wall_ray * 1000, "raw_ms": wall_local * 1000,
         "ratio": wall_ray / wall_local, "goal": "reported", "met": True},
        {"measure": f"{FAN} worktree children at once on 3 Ray nodes vs one child, first task "
                    f"call → last result (median of {fan_runs}; goal: ≤ {GOAL_FAN}x)",
         "orch_ms": fan32 * 1000, "raw_ms": fan1 * 1000, "ratio": fan32 / fan1,
         "goal": f"≤ {GOAL_FAN}x", "met": fan32 / fan1 <= GOAL_FAN},
        {"measure": f"{FAN} worktree children at once: on 3 Ray nodes vs in process "
                    f"(median of {fan_runs})",
         "orch_ms": fan32 * 1000, "raw_ms": fan_local * 1000, "ratio": fan32 / fan_local,
         "goal": "reported", "met": True},
        {"measure": f"… its floor on {cores} cores: the CPU of all {FAN} (nodes + orch's, "
                    f"{cpu / FAN * 1000:.0f} ms a child; in process "
                    f"{statistics.median(local_cpus) / FAN * 1000:.0f} ms) / {cores} vs one child",
         "orch_ms": floor * 1000, "raw_ms": fan1 * 1000, "ratio": floor / fan1,
         "goal": "reported", "met": True},
    ]  # fmt: skip


def print_table(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(f"{r['measure']:<90} {r['orch_ms']:>9.1f} {r['raw_ms']:>9.1f} {r['ratio']:>6.2f}")


if __name__ == "__main__":
    print_table(run(*(int(a) for a in sys.argv[1:3])))
