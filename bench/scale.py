"""Scale-out overhead: worktree children on a Ray cluster against the same children in-process.

A real two-node cluster on loopback (``tests/raycluster.py``), a small repository, and
the real CLI: ``orch task`` whose scripted root starts four worktree children at once,
each writing a file, with ``--executor ray`` and without, alternating. Measured from the
root's events (a ``task`` call → its tool_result: admission, the Ray task, the bundle, the
clone, the run, the export and the import) and as the command's wall time (which adds
``import ray`` and joining the cluster). Reported, no goal: what a remote child costs.

Run: ``python bench/scale.py`` (needs ``pip install 'orch[ray]'``).
"""

from __future__ import annotations

import json
import os
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
CHILDREN = 4
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


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


def _once(repo: Path, script: Path, env: dict[str, str], ray: bool) -> tuple[float, list[float]]:
    args = [sys.executable, "-m", "orchestrator", "task", "--model", f"scripted:{script}", "go"]
    if ray:
        args[4:4] = ["--executor", "ray"]
    t0 = time.perf_counter()
    got = subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    if got.returncode != 0:
        raise RuntimeError(f"orch task failed: {got.stderr[-500:]}")
    rows = json.loads(
        subprocess.run([sys.executable, "-m", "orchestrator", "ps", "--all", "--json"],
                       cwd=repo, env=env, capture_output=True, text=True, check=True).stdout
    )  # fmt: skip
    root = [r for r in rows if r["depth"] == 0][-1]  # oldest first: the newest root
    kids = [r for r in rows if r.get("parent_run_id") == root["run_id"]]
    assert len(kids) == CHILDREN and all(r["status"] == "succeeded" for r in kids)
    assert all(("/ray-" in (r["node"] or "")) == ray for r in kids)
    for r in kids:  # leave no branch behind for the next round
        subprocess.run(["git", "branch", "-qD", f"orch/general/{r['run_id'][2:10]}"], cwd=repo,
                       capture_output=True)  # fmt: skip
    events = json.loads(subprocess.run(
        [sys.executable, "-m", "orchestrator", "logs", root["run_id"], "--json"], cwd=repo,
        env=env, capture_output=True, text=True, check=True).stdout)  # fmt: skip
    # the root's task call → its tool_result: admission, dispatch, the run, its work imported
    called = {e["data"]["id"]: e["at"] for e in events if e["kind"] == "tool_call"}
    spans = [e["at"] - called[e["data"]["id"]] for e in events if e["kind"] == "tool_result"]
    return wall, spans


def run(runs: int = RUNS) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        env = {**os.environ, **LOOPBACK}
        for var in ("RAY_ADDRESS", "ORCH_STORE", "ORCH_HOME"):
            env.pop(var, None)
        cluster = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "raycluster.py"), str(where)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=env, start_new_session=True,
        )  # fmt: skip
        try:
            assert cluster.stdout is not None and cluster.stdout.readline().strip() == "ready"
            info = json.loads((where / "cluster.json").read_text())
            env["RAY_ADDRESS"] = info["address"]
            repo = where / "repo"
            repo.mkdir()
            (repo / "README.md").write_text("bench\n")
            _git(repo, "init", "-q", "-b", "main")
            _git(repo, "add", "-A")
            _git(repo, "commit", "-qm", "init")
            script = where / "script.yaml"
            script.write_text(yaml.safe_dump(_script(CHILDREN)))
            walls: dict[bool, list[float]] = {True: [], False: []}
            spans: dict[bool, list[float]] = {True: [], False: []}
            for i in range(runs + 1):  # the first round warms up and is dropped
                for ray in (i % 2 == 0, i % 2 == 1):
                    wall, got = _once(repo, script, env, ray)
                    if i:
                        walls[ray].append(wall)
                        spans[ray].extend(got)
        finally:
            if cluster.stdin is not None:
                cluster.stdin.write("quit\n")
                cluster.stdin.close()
            try:
                cluster.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(cluster.pid, 9)
            if cluster.stdout is not None:
                cluster.stdout.close()
    child_ray, child_local = statistics.median(spans[True]), statistics.median(spans[False])
    wall_ray, wall_local = statistics.median(walls[True]), statistics.median(walls[False])
    return [
        {"measure": f"worktree child, task call → its result, on a Ray node vs in process "
                    f"(median of {len(spans[True])})",
         "orch_ms": child_ray * 1000, "raw_ms": child_local * 1000,
         "ratio": child_ray / child_local, "goal": "reported", "met": True},
        {"measure": f"`orch task` with {CHILDREN} worktree children, --executor ray vs local "
                    f"(median of {runs})",
         "orch_ms": wall_ray * 1000, "raw_ms": wall_local * 1000,
         "ratio": wall_ray / wall_local, "goal": "reported", "met": True},
    ]  # fmt: skip


def print_table(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(f"{r['measure']:<90} {r['orch_ms']:>9.1f} {r['raw_ms']:>9.1f} {r['ratio']:>6.2f}")


if __name__ == "__main__":
    print_table(run())
