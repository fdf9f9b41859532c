"""Container tier overhead: ContainerWorkspace against the raw Docker commands it replaces.

On a generated 200-file repository, with ``orch-sandbox:latest``, each measure is
compared with the raw primitive measured in the same run, alternating which goes first:
- cold ready: ``async with`` enter (repo probe, worktree + locked-down container started
  concurrently, git wiring) vs ``docker run --rm --network none IMAGE true`` (goal ≤ 1.2×),
  and the p99 of the orch samples against their p50 (goal ≤ 2×);
- warm-pool claim: enter while a :class:`ContainerPool` holds a started container
  (goal ≤ 50 ms); raw is the cold enter of the same run, for scale;
- bash round trip: ``exec("true")`` (through the container's program server: a request,
  ``true`` in a session of its own, its frames, the host's check that nothing of it runs
  on) vs ``docker exec CONTAINER true`` (CLI), goal ≤ 10 ms (the CLI for scale);
- close of a 100-file change: the work committed inside the container, exported as a
  bundle over docker exec, verified and unbundled into the repository and the branch
  moved (``ContainerWorkspace._settle``) vs ``git add -A && git commit`` of the same
  change in a plain worktree, goal ≤ 2×. Both sides wait 1.1 s (a model turn) between
  checkout and change: files written in the second of the checkout are "racily clean"
  to git, and its first ``add`` re-hashes them all (70-130 ms more in the container);
- the whole close (export, container removal overlapped with the host's import, release)
  against the same plain commit, for scale: what a run's end waits for.

Run: ``python bench/container.py`` (needs the engine and the image).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worktree import make_repo  # noqa: E402  (bench/ is on sys.path)

from orchestrator.config import SandboxSettings  # noqa: E402
from orchestrator.run import new_run_id  # noqa: E402
from orchestrator.workspaces.base import RunOutcome, WorkspaceSpec  # noqa: E402
from orchestrator.workspaces.container import ContainerPool, ContainerWorkspace  # noqa: E402

IMAGE = "orch-sandbox:latest"
FILES = 200
COLD_RUNS = 10
CLAIMS = 10
EXECS = 30
CLOSES = 5
THINK_S = 1.1
CHANGE = 'for i in $(seq 100); do echo "change $i" > pkg00/new$i.py; done'


def _spec(repo: Path) -> WorkspaceSpec:
    sandbox = SandboxSettings(image=IMAGE)
    return WorkspaceSpec(new_run_id(), "c-bench", "bench", "bench", repo, sandbox=sandbox)


async def _enter_once(repo: Path) -> tuple[float, ContainerWorkspace]:
    ws = ContainerWorkspace(_spec(repo))
    t0 = time.perf_counter()
    await ws.__aenter__()
    return time.perf_counter() - t0, ws


async def _close(ws: ContainerWorkspace) -> None:
    ws.set_outcome(RunOutcome("succeeded"))
    await ws.__aexit__(None, None, None)


async def _cli(*args: str) -> float:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        "docker", *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    if await proc.wait() != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed")
    return time.perf_counter() - t0


async def _closes(repo: Path) -> tuple[list[float], list[float]]:
    """Commit + export + import of a 100-file change, and the plain commit it replaces."""
    closes: list[float] = []
    raw: list[float] = []
    for i in range(CLOSES):
        _, ws = await _enter_once(repo)
        await asyncio.sleep(THINK_S)  # a model turn: past git's racy-index second (both sides)
        made = await ws.exec(CHANGE, timeout_s=60, env={})
        assert made.exit_code == 0, made.output
        t0 = time.perf_counter()
        await ws._settle(RunOutcome("succeeded", "bench"))  # what the close does before removal
        closes.append(time.perf_counter() - t0)
        ws._ready = False
        await ws.__aexit__(None, None, None)
        await _git(repo, "branch", "-D", ws.branch)
        tree = repo / ".orch" / f"bench-tree-{i}"
        await _git(repo, "worktree", "add", "-q", "-b", f"bench/{i}", str(tree))
        await asyncio.sleep(THINK_S)
        await _cli_sh(CHANGE, tree)
        t0 = time.perf_counter()
        await _git(tree, "add", "-A")
        await _git(tree, "-c", "user.name=b", "-c", "user.email=b@x", "commit", "-q", "-m", "x")
        raw.append(time.perf_counter() - t0)
        await _git(repo, "worktree", "remove", "--force", str(tree))
        await _git(repo, "branch", "-D", f"bench/{i}")
    return closes, raw


async def _whole_closes(repo: Path) -> list[float]:
    """The whole close: export, removal overlapped with the import, release."""
    took: list[float] = []
    for _ in range(CLOSES):
        _, ws = await _enter_once(repo)
        await asyncio.sleep(THINK_S)
        made = await ws.exec(CHANGE, timeout_s=60, env={})
        assert made.exit_code == 0, made.output
        ws.set_outcome(RunOutcome("succeeded", "bench"))
        t0 = time.perf_counter()
        await ws.__aexit__(None, None, None)
        took.append(time.perf_counter() - t0)
        await _git(repo, "branch", "-D", ws.branch)
    return took


async def _git(cwd: Path, *args: str) -> None:
    proc = await asyncio.create_subprocess_exec("git", *args, cwd=cwd,
                                                stdout=asyncio.subprocess.DEVNULL)  # fmt: skip
    if await proc.wait() != 0:
        raise RuntimeError(f"git {' '.join(args)} failed")


async def _cli_sh(command: str, cwd: Path) -> None:
    proc = await asyncio.create_subprocess_exec("bash", "-c", command, cwd=cwd)
    await proc.wait()


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _row(measure: str, orch: float, raw: float | None, goal: str, met: bool) -> dict[str, Any]:
    return {"measure": measure, "orch_ms": orch, "raw_ms": raw if raw is not None else 0.0,
            "ratio": orch / raw if raw else None, "goal": goal, "met": met}  # fmt: skip


async def _bench(repo: Path) -> list[dict[str, Any]]:
    cold: list[float] = []
    raw_run: list[float] = []
    ws: ContainerWorkspace | None = None
    await _close((await _enter_once(repo))[1])  # warm caches (image, git, imports)
    for i in range(COLD_RUNS):
        if i % 2:
            raw_run.append(await _cli("run", "--rm", "--network", "none", IMAGE, "true"))
        took, ws = await _enter_once(repo)
        cold.append(took)
        if not i % 2:
            raw_run.append(await _cli("run", "--rm", "--network", "none", IMAGE, "true"))
        if i < COLD_RUNS - 1:
            await _close(ws)
    assert ws is not None
    execs: list[float] = []
    raw_exec: list[float] = []
    for i in range(EXECS):
        if i % 2:
            raw_exec.append(await _cli("exec", ws.container_id, "true"))
        t0 = time.perf_counter()
        result = await ws.exec("true", timeout_s=30, env={})
        execs.append(time.perf_counter() - t0)
        assert result.exit_code == 0, result.output
        if not i % 2:
            raw_exec.append(await _cli("exec", ws.container_id, "true"))
    await _close(ws)
    closes, raw_closes = await _closes(repo)
    whole = await _whole_closes(repo)
    claims: list[float] = []
    async with ContainerPool(repo, SandboxSettings(image=IMAGE), size=1) as pool:
        for _ in range(CLAIMS):
            async with asyncio.timeout(60):
                await pool.wait_ready()
            took, ws = await _enter_once(repo)
            assert ws.pooled
            claims.append(took)
            await _close(ws)
    ms = 1000.0
    c50, c99 = statistics.median(cold) * ms, _p(cold, 0.99) * ms
    r50 = statistics.median(raw_run) * ms
    e50, re50 = statistics.median(execs) * ms, statistics.median(raw_exec) * ms
    k50 = statistics.median(claims) * ms
    x50, rx50 = statistics.median(closes) * ms, statistics.median(raw_closes) * ms
    w50 = statistics.median(whole) * ms
    return [
        _row(f"cold child ready vs `docker run --rm` (median of {COLD_RUNS})", c50, r50,
             "≤ 1.2×", c50 <= 1.2 * r50),
        _row("cold child ready p99 (raw column: its p50)", c99, c50, "≤ 2× p50", c99 <= 2 * c50),
        _row(f"warm-pool claim (median of {CLAIMS}; raw column: cold)", k50, c50, "≤ 50 ms",
             k50 <= 50),
        _row(f"bash round trip `true` vs `docker exec` CLI (median of {EXECS})", e50, re50,
             "≤ 10 ms", e50 <= 10),
        _row(f"close of a 100-file change vs `git commit` in a worktree (median of {CLOSES})",
             x50, rx50, "≤ 2×", x50 <= 2 * rx50),
        _row(f"whole close incl. container removal (median of {CLOSES}; raw: the commit)",
             w50, rx50, "-", True),
    ]  # fmt: skip


def run() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        make_repo(repo, FILES)
        return asyncio.run(_bench(repo))


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'measure':<62} {'orch ms':>9} {'raw ms':>9} {'ratio':>6}  goal      met")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        print(f"{r['measure']:<62} {r['orch_ms']:>9.1f} {r['raw_ms']:>9.1f} {ratio:>6}  "
              f"{r['goal']:<9} {'yes' if r['met'] else 'NO'}")  # fmt: skip


if __name__ == "__main__":
    print_table(run())
