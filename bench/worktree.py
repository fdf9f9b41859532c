"""Worktree tier overhead: WorktreeWorkspace against the raw git commands it wraps.

On a generated 5,000-file repository, each measure is compared with the raw
primitive measured in the same run, alternating which goes first:
- ready: ``async with`` enter (repo probe, lock, ``git worktree add --lock``) vs
  a bare ``git worktree add -b <branch> <path> HEAD`` (goal ≤ 1.2×);
- teardown with no changes: exit (status, unlock, remove, delete the branch) vs
  ``git worktree remove`` + ``git branch -D``.

Run: ``python bench/worktree.py``
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.run import new_run_id  # noqa: E402
from orchestrator.workspaces.base import WorkspaceSpec  # noqa: E402
from orchestrator.workspaces.worktree import WorktreeWorkspace  # noqa: E402

FILES = 5000
RUNS = 15
READY_GOAL = 1.2
TEARDOWN_GOAL = 1.5


def make_repo(root: Path, files: int = FILES) -> None:
    """A repository of ``files`` small Python files in 50 packages, one commit (also used by
    bench/container.py)."""
    for i in range(files):
        pkg = root / f"pkg{i % 50:02d}"
        pkg.mkdir(exist_ok=True)
        (pkg / f"mod{i:05d}.py").write_text(f"VALUE = {i}\n\n\ndef f() -> int:\n    return VALUE\n")
    ident = ["-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], [*ident, "commit", "-q", "-m", "x"]):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


async def _raw(repo: Path, *args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "git", *args, cwd=repo, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    if await proc.wait() != 0:
        raise RuntimeError(f"git {' '.join(args)} failed")


async def _orch_once(repo: Path) -> tuple[float, float]:
    ws = WorktreeWorkspace(WorkspaceSpec(new_run_id(), "c-bench", "bench", "bench", repo))
    t0 = time.perf_counter()
    await ws.__aenter__()
    t1 = time.perf_counter()
    await ws.__aexit__(None, None, None)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


async def _raw_once(repo: Path, i: int) -> tuple[float, float]:
    branch, path = f"raw/{i}", str(repo / ".orch" / "raw" / str(i))
    t0 = time.perf_counter()
    await _raw(repo, "worktree", "add", "-q", "-b", branch, path, "HEAD")
    t1 = time.perf_counter()
    await _raw(repo, "worktree", "remove", path)
    await _raw(repo, "branch", "-D", branch)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


async def _measure(repo: Path, runs: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"orch_ready": [], "orch_down": [], "raw_ready": [],
                                     "raw_down": []}  # fmt: skip
    for i in range(runs + 1):  # the first round warms caches and is dropped
        if i % 2:
            raw = await _raw_once(repo, i)
            orch = await _orch_once(repo)
        else:
            orch = await _orch_once(repo)
            raw = await _raw_once(repo, i)
        if i == 0:
            continue
        times["orch_ready"].append(orch[0])
        times["orch_down"].append(orch[1])
        times["raw_ready"].append(raw[0])
        times["raw_down"].append(raw[1])
    return times


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def run(runs: int = RUNS, files: int = FILES) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        make_repo(repo, files)
        times = asyncio.run(_measure(repo, runs))
    rows: list[dict[str, Any]] = []
    for key, label, goal in (("ready", "worktree ready (enter)", READY_GOAL),
                             ("down", "teardown, no changes (exit)", TEARDOWN_GOAL)):  # fmt: skip
        for stat, fn in (("median", statistics.median), ("p90", _p90)):
            orch_ms = fn(times[f"orch_{key}"]) * 1000
            raw_ms = fn(times[f"raw_{key}"]) * 1000
            ratio = orch_ms / raw_ms if raw_ms else None
            rows.append({
                "measure": f"{label}, {files} files, {stat} of {runs}",
                "orch_ms": orch_ms, "raw_ms": raw_ms, "ratio": ratio,
                "goal": f"≤ {goal}×", "met": ratio is not None and ratio <= goal,
            })  # fmt: skip
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'measure':<52} {'orch ms':>9} {'raw ms':>9} {'ratio':>6}  goal     met")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        print(f"{r['measure']:<52} {r['orch_ms']:>9.1f} {r['raw_ms']:>9.1f} {ratio:>6}  "
              f"{r['goal']:<8} {'yes' if r['met'] else 'NO'}")  # fmt: skip


if __name__ == "__main__":
    print_table(run())
