"""Fan-out at width, per tier: N children against one, in one process, side by side.

One reply of the root asks for N children. Each child has 1 s of model time, then one
``bash true`` (under the tier's sandbox: bubblewrap on the host tiers, the container's
program server in the container tier), then its answer. Caps (parallel children, the
chain's running count, containers per chain) are raised to N. The measure is the wall
time of the whole tree against the same tree with one child, each run in a fresh event
loop of this one process, alternating which goes first.

Also measured at the widest point of each tier: orch's own CPU per child (this process's
user + system time, children's processes not counted: the spawning, the store, the loop)
and the process's peak resident memory over its resident memory before the run.

Where the time goes is printed as phases (median over children): first request → the
bash call's result (spawn and run of one ``true`` while N others do the same), and
that result → the answer.

Beside each tier's in-process figure, the same tree at its widest point through the real
SDK over HTTP against a fake Messages API in a process of its own (``sdkfanout.py``), with
the fake's own CPU time.

Run: ``python bench/fanout.py [shared|worktree|container ...]``.
"""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sdkfanout  # noqa: E402  (bench/ is on sys.path)
from worktree import _raw, make_repo  # noqa: E402

from orchestrator.catalog.definitions import load_catalog  # noqa: E402
from orchestrator.config import SandboxSettings, Settings  # noqa: E402
from orchestrator.engine.runner import Runner  # noqa: E402
from orchestrator.models import ModelProvider, ModelRequest, ModelResponse  # noqa: E402
from orchestrator.spec import RunSpec  # noqa: E402
from orchestrator.store import open_store  # noqa: E402

MODEL_S = 1.0
# tier: (widest N, goal ratio, curve, rounds a point: the median of them; a shared tree
# takes a second, so more of them steady its figure on a machine that is not quiet)
TIERS: dict[str, tuple[int, float, tuple[int, ...], int]] = {
    "shared": (100, 1.3, (25, 50, 100), 5),
    "worktree": (40, 1.5, (10, 20, 40), 2),
    "container": (20, 2.0, (5, 10, 20), 2),
}
IMAGE = "orch-sandbox:latest"


class FanModel:
    """Root: N task calls in one reply, then a final text. Child: 1 s, bash true, answer."""

    def __init__(self, n: int, isolation: str) -> None:
        self.n = n
        self.isolation = isolation
        self.first: dict[str, float] = {}
        self.second: dict[str, float] = {}
        self.failures: list[str] = []

    async def complete(self, request: ModelRequest) -> ModelResponse:
        now = time.perf_counter()
        if request.depth == 0:
            if len(request.messages) == 1:
                calls: list[dict[str, Any]] = [
                    {
                        "type": "tool_use",
                        "id": f"t{i}",
                        "name": "task",
                        "input": {
                            "description": f"c{i}",
                            "prompt": f"child {i}",
                            "isolation": self.isolation,
                        },
                    }
                    for i in range(self.n)
                ]
                return ModelResponse(content=calls, stop_reason="tool_use")
            return ModelResponse(content=[{"type": "text", "text": "done"}])
        if len(request.messages) == 1:
            self.first[request.run_id] = now
            await asyncio.sleep(MODEL_S)
            use = {"type": "tool_use", "id": "b1", "name": "bash", "input": {"command": "true"}}
            return ModelResponse(content=[use], stop_reason="tool_use")
        self.second[request.run_id] = now
        result = request.messages[-1]["content"][0]
        if "exit code 0" not in str(result.get("content")) and result.get("is_error"):
            self.failures.append(str(result.get("content"))[:200])
        return ModelResponse(content=[{"type": "text", "text": "child done"}])


class PeakRss:
    """This process's resident memory, sampled every 10 ms in a thread: before and peak."""

    def __init__(self) -> None:
        self.before = self._rss()
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _settings(n: int, os_sandbox: str = "bwrap") -> Settings:
    return Settings(
        max_parallel_children=max(n, 1),
        max_chain_running=max(n + 1, 2),
        sandbox=SandboxSettings(image=IMAGE, max_per_chain=max(n, 1), os=os_sandbox),
    )


async def _tree(root: Path, n: int, isolation: str, os_sandbox: str = "bwrap") -> dict[str, Any]:
    model = FanModel(n, isolation)
    settings = _settings(n, os_sandbox)
    runner = Runner(
        settings=settings,
        store=open_store(root),
        catalog=load_catalog(root),
        models=ModelProvider(settings, model=model),
    )
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    with PeakRss() as rss:
        t0 = time.perf_counter()
        rec = await runner.run(RunSpec(prompt="fan", workdir=root))
        wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    if rec.status.value != "succeeded" or model.failures:
        raise RuntimeError(f"{isolation} x{n}: {rec.status.value} {rec.error} {model.failures[:1]}")
    if len(model.second) != n:
        raise RuntimeError(f"{isolation} x{n}: {len(model.second)} of {n} children answered")
    tool = [model.second[r] - model.first[r] - MODEL_S for r in model.first]
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {
        "wall": wall,
        "cpu": cpu,
        "rss_peak": rss.peak - rss.before,
        "first_spread": max(model.first.values()) - min(model.first.values()),
        "tool_p50": statistics.median(tool),
        "tool_max": max(tool),
    }


def _once(root: Path, n: int, isolation: str, os_sandbox: str = "bwrap") -> dict[str, Any]:
    return asyncio.run(_tree(root, n, isolation, os_sandbox))


def unsandboxed(root: Path, n: int = 100, rounds: int = 2) -> dict[str, Any]:
    """The shared fan-out with ``sandbox.os = "off"``: what is left without bubblewrap."""
    walls, ones = [], []
    for _ in range(rounds):
        ones.append(_once(root, 1, "shared", "off")["wall"])
        walls.append(_once(root, n, "shared", "off")["wall"])
    wall, one = statistics.median(walls), statistics.median(ones)
    print(f"  shared x{n}, os sandbox off: {wall * 1000:.0f} ms vs one {one * 1000:.0f} ms")
    return {
        "measure": f"shared fan-out {n}, sandbox.os = off (no bwrap) vs 1 child, wall",
        "orch_ms": wall * 1000,
        "raw_ms": one * 1000,
        "ratio": wall / one,
        "goal": "-",
        "met": True,
    }


def measure(tier: str, root: Path) -> list[dict[str, Any]]:
    widest, goal, curve, rounds = TIERS[tier]
    _once(root, 1, tier)  # warm: imports, caches, the image
    rows: list[dict[str, Any]] = []
    ones: list[float] = []
    for n in curve:
        walls: list[float] = []
        last: dict[str, Any] = {}
        for i in range(rounds):
            if i % 2:
                walls.append(_once(root, n, tier)["wall"])
                ones.append(_once(root, 1, tier)["wall"])
            else:
                ones.append(_once(root, 1, tier)["wall"])
                last = _once(root, n, tier)
                walls.append(last["wall"])
        one = statistics.median(ones)
        wall = statistics.median(walls)
        print(
            f"  {tier} x{n}: wall {wall * 1000:.0f} ms vs one {one * 1000:.0f} ms "
            f"({wall / one:.2f}x); first requests within {last['first_spread'] * 1000:.0f} ms;"
            f" bash phase p50 {last['tool_p50'] * 1000:.0f} ms, max "
            f"{last['tool_max'] * 1000:.0f} ms; orch CPU {last['cpu'] * 1000 / n:.1f} ms/child;"
            f" peak RSS +{last['rss_peak'] / 2**20:.0f} MiB",
            flush=True,
        )
        met = wall / one <= goal if n == widest else True
        rows.append(
            {
                "measure": f"{tier} fan-out {n} children (1 s model, bash true) vs 1 child, wall",
                "orch_ms": wall * 1000,
                "raw_ms": one * 1000,
                "ratio": wall / one,
                "goal": f"≤ {goal}×" if n == widest else "-",
                "met": met,
            }
        )
        if n == widest:
            rows.append(
                {
                    "measure": f"{tier} fan-out {n}: orch's own CPU per child (ms)",
                    "orch_ms": last["cpu"] * 1000 / n,
                    "raw_ms": None,
                    "ratio": None,
                    "goal": "-",
                    "met": True,
                }
            )
            rows.append(
                {
                    "measure": f"{tier} fan-out {n}: peak RSS over before, MiB (orch_ms column)",
                    "orch_ms": last["rss_peak"] / 2**20,
                    "raw_ms": None,
                    "ratio": None,
                    "goal": "-",
                    "met": True,
                }
            )
    return rows


async def _raw_worktrees(root: Path, n: int) -> float:
    """The primitive under a worktree fan-out: ``n`` plain ``git worktree add --no-checkout``
    (git serialises them: run one after another) then their checkouts at once."""

    base = root / ".raw-wt"
    t0 = time.perf_counter()
    for i in range(n):
        await _raw(
            root, "worktree", "add", "-q", "--no-checkout", "-b", f"raw{i}", str(base / str(i))
        )
    await asyncio.gather(*(_raw(base / str(i), "reset", "-q", "--hard") for i in range(n)))
    took = time.perf_counter() - t0
    for i in range(n):
        await _raw(root, "worktree", "remove", "--force", str(base / str(i)))
        await _raw(root, "branch", "-D", f"raw{i}")
    return took


def worktree_floor(root: Path, n: int = 40) -> dict[str, Any]:
    took = statistics.median(asyncio.run(_raw_worktrees(root, n)) for _ in range(3))
    print(f"  raw: {n} plain git worktrees made and checked out in {took * 1000:.0f} ms")
    return {
        "measure": f"raw floor: {n} plain `git worktree add` + checkouts (200 files), wall",
        "orch_ms": took * 1000,
        "raw_ms": None,
        "ratio": None,
        "goal": "-",
        "met": True,
    }


def container_floor(n: int = 20) -> dict[str, Any]:
    """The primitive under a container fan-out: ``n`` containers of the sandbox image
    (no network, a process that waits) started at once, one ``exec`` each, removed; the
    same for one container. With the children's 1 s of model time added to each, their
    ratio is the least a container fan-out of ``n`` can cost against one child here."""
    from concurrent.futures import ThreadPoolExecutor

    import docker

    client = docker.from_env(max_pool_size=n + 2)  # a connection for each thread

    def start(_: int) -> Any:
        return client.containers.run(
            IMAGE, ["sleep", "60"], detach=True, network_mode="none", init=True
        )

    def lifecycle(width: int) -> float:
        with ThreadPoolExecutor(width) as pool:
            t0 = time.perf_counter()
            started = list(pool.map(start, range(width)))
            list(pool.map(lambda c: c.exec_run(["true"]), started))
            list(pool.map(lambda c: c.remove(force=True), started))
            return time.perf_counter() - t0

    wide = statistics.median(lifecycle(n) for _ in range(2))
    one = statistics.median(lifecycle(1) for _ in range(3))
    floor, alone = MODEL_S + wide, MODEL_S + one
    print(
        f"  raw: {n} containers started, exec'd once and removed at once in {wide * 1000:.0f} ms"
        f" (one: {one * 1000:.0f} ms): with the model's 1 s, {floor / alone:.2f}x"
    )
    return {
        "measure": f"raw floor: {n} containers' lifecycle at once + 1 s vs one's + 1 s, wall",
        "orch_ms": floor * 1000,
        "raw_ms": alone * 1000,
        "ratio": floor / alone,
        "goal": "-",
        "met": True,
    }


def _docker_ok() -> bool:
    try:
        import docker

        client = docker.from_env()
        client.images.get(IMAGE)
        return True
    except Exception:
        return False


def run(tiers: tuple[str, ...] = ("shared", "worktree", "container")) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for tier in tiers:
        if tier == "container" and not _docker_ok():
            print(f"  container: skipped (no Docker engine or no {IMAGE})")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            make_repo(root, 200)
            rows.extend(measure(tier, root))
            rows.extend(sdkfanout.tier_rows(tier, root))  # the same through the SDK over HTTP
            if tier == "shared":
                rows.append(unsandboxed(root))
            if tier == "worktree":
                rows.append(worktree_floor(root))
            if tier == "container":
                rows.append(container_floor())
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'measure':<72} {'orch':>9} {'raw':>9} {'ratio':>6}  goal      met")
    for r in rows:
        raw = f"{r['raw_ms']:9.0f}" if r["raw_ms"] is not None else f"{'':>9}"
        ratio = f"{r['ratio']:5.2f}x" if r["ratio"] is not None else f"{'':>6}"
        print(f"{r['measure']:<72} {r['orch_ms']:9.1f} {raw} {ratio}  {r['goal']:<9} {r['met']}")


if __name__ == "__main__":
    chosen = tuple(sys.argv[1:]) or ("shared", "worktree", "container")
    print_table(run(chosen))
