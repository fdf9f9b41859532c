"""Core delegation benchmarks: shared-child spawn overhead and fan-out wall time.

Each measure is compared with the raw primitive measured in the same run:
- spawn: `task` call → the child's first model request, vs a bare
  ``asyncio.create_task`` of a model call (what any delegation costs at least);
- fan-out: 32 children at 0.5 s model latency, vs one child (goal ≤ 1.2×);
- the live view: the same fan-out drawn as `orch task` draws it on a terminal, vs not.
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

from orchestrator.catalog.definitions import load_catalog  # noqa: E402
from orchestrator.config import Settings  # noqa: E402
from orchestrator.engine.runner import Runner  # noqa: E402
from orchestrator.models import ModelProvider, ModelRequest, ModelResponse  # noqa: E402
from orchestrator.spec import RunSpec  # noqa: E402
from orchestrator.store import open_store  # noqa: E402


class BenchModel:
    """Parent: `fan` task calls then a final text. Children: wait `latency`, answer."""

    def __init__(self, fan: int, latency: float) -> None:
        self.fan = fan
        self.latency = latency
        self.call_returned: list[float] = []
        self.child_first: dict[str, float] = {}

    async def complete(self, request: ModelRequest) -> ModelResponse:
        now = time.perf_counter()
        if request.depth == 0:
            if len(request.messages) == 1:
                content: list[dict[str, Any]] = [
                    {
                        "type": "tool_use",
                        "id": f"t{i}",
                        "name": "task",
                        "input": {"description": f"c{i}", "prompt": f"child {i}"},
                    }
                    for i in range(self.fan)
                ]
                self.call_returned.append(time.perf_counter())
                return ModelResponse(content=content, stop_reason="tool_use")
            return ModelResponse(content=[{"type": "text", "text": "done"}])
        self.child_first.setdefault(request.run_id, now)
        if self.latency:
            await asyncio.sleep(self.latency)
        return ModelResponse(content=[{"type": "text", "text": "child done"}])


async def _tree(root: Path, fan: int, latency: float, cap: int) -> tuple[float, BenchModel]:
    model = BenchModel(fan, latency)
    settings = Settings(max_parallel_children=cap, max_chain_running=cap)
    provider = ModelProvider(settings, model=model)
    runner = Runner(
        settings=settings,
        store=open_store(root),
        catalog=load_catalog(root),
        models=provider,
    )
    t0 = time.perf_counter()
    rec = await runner.run(RunSpec(prompt="bench", workdir=root))
    wall = time.perf_counter() - t0
    assert rec.status.value == "succeeded", rec.error
    return wall, model


async def _tree_viewed(root: Path, fan: int, latency: float, view: bool) -> float:
    """``_tree``, with the live view of a foreground `orch task` drawing it (or not) on a
    terminal-like console: what the view costs the run."""
    import contextlib
    import io

    from rich.console import Console

    from orchestrator.cli.live import LiveChain

    model = BenchModel(fan, latency)
    settings = Settings(max_parallel_children=fan, max_chain_running=fan)
    runner = Runner(settings=settings, store=open_store(root), catalog=load_catalog(root),
                    models=ModelProvider(settings, model=model))  # fmt: skip
    console = Console(file=io.StringIO(), force_terminal=True, force_interactive=True,
                      width=120, height=40)  # fmt: skip
    t0 = time.perf_counter()
    handle = await runner.spawn(RunSpec(prompt="bench", workdir=root))
    shown = LiveChain(runner.store, handle.record, console) if view else contextlib.nullcontext()
    with shown:
        rec = await runner.run_handle(handle)
    assert rec.status.value == "succeeded", rec.error
    return time.perf_counter() - t0


def live_view_cost(root: Path, samples: int = 7) -> dict[str, Any]:
    """A fan-out of 32 children at 0.5 s, drawn live at 5 Hz vs not drawn, median wall."""
    plain, drawn = [], []
    for _ in range(samples):
        plain.append(asyncio.run(_tree_viewed(root, 32, 0.5, False)))
        drawn.append(asyncio.run(_tree_viewed(root, 32, 0.5, True)))
    p_med, d_med = statistics.median(plain) * 1000, statistics.median(drawn) * 1000
    return {
        "measure": "fan-out 32 children @0.5 s drawn live (orch task on a tty) vs not, wall",
        "orch_ms": d_med,
        "raw_ms": p_med,
        "ratio": d_med / p_med if p_med else None,
        "goal": "≤ 1.1×",
        "met": d_med / p_med <= 1.1,
    }


async def _raw_spawn() -> float:
    model = BenchModel(1, 0.0)
    req = ModelRequest(
        system="",
        messages=[{"role": "user", "content": "x"}],
        tools=[],
        model="m",
        max_tokens=1,
        run_id="raw",
        depth=1,
    )
    t0 = time.perf_counter()
    await asyncio.create_task(model.complete(req))
    return model.child_first["raw"] - t0


def context_economy(root: Path, files: int = 20) -> dict[str, Any]:
    """Input tokens of the parent's last request: exploring 20 files itself vs via one child."""
    import yaml

    from orchestrator.models import ScriptedModel

    src = root / "economy"
    src.mkdir(exist_ok=True)
    for i in range(files):
        body = "".join(f"def f{i}_{j}(x: int) -> int:\n    return x * {j}\n\n" for j in range(60))
        (src / f"mod{i}.py").write_text(body)
    reads = [{"tool": "read_file", "input": {"path": f"economy/mod{i}.py"}} for i in range(files)]
    answer = "The 20 modules each define 60 small multiplier functions f<i>_<j>."
    alone = {"conversations": [{"turns": [{"tool_calls": reads}, {"text": answer}]}]}
    delegated = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {
                        "tool_calls": [
                            {
                                "tool": "task",
                                "input": {
                                    "subagent_type": "explorer",
                                    "description": "survey modules",
                                    "prompt": "Read every file in economy/ and summarize "
                                    "what they define.",
                                },
                            }
                        ]
                    },
                    {"text": answer},
                ],
            },
            {"depth": 1, "turns": [{"tool_calls": reads}, {"text": answer}]},
        ]
    }

    async def last_input(script: dict[str, Any]) -> int:
        model = ScriptedModel.from_yaml(yaml.safe_dump(script))
        settings = Settings()
        provider = ModelProvider(settings, scripted=model)
        runner = Runner(
            settings=settings, store=open_store(root), catalog=load_catalog(root), models=provider
        )
        rec = await runner.run(RunSpec(prompt="Survey the economy/ modules.", workdir=root))
        assert rec.status.value == "succeeded", rec.error
        parent = [r for r in model.requests if r.run_id == rec.run_id]
        from orchestrator.models.scripted import estimate_tokens

        last = parent[-1]
        return estimate_tokens([last.system, last.messages, last.tools])

    itself = asyncio.run(last_input(alone))
    via_child = asyncio.run(last_input(delegated))
    return {
        "measure": "parent context: last request input tokens, 1 child vs itself (20 files)",
        "orch_ms": float(via_child),
        "raw_ms": float(itself),
        "ratio": via_child / itself,
        "goal": "≤ 0.1×",
        "met": via_child / itself <= 0.1,
    }


def run(samples: int = 60) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spawn: list[float] = []
        raw: list[float] = []
        for _ in range(samples):
            _, model = asyncio.run(_tree(root, 1, 0.0, 20))
            first = next(iter(model.child_first.values()))
            spawn.append(first - model.call_returned[0])
            raw.append(asyncio.run(_raw_spawn()))
        s_med, r_med = statistics.median(spawn) * 1000, statistics.median(raw) * 1000
        rows.append(
            {
                "measure": "shared child spawn (task call → child's 1st request), median",
                "orch_ms": s_med,
                "raw_ms": r_med,
                "ratio": s_med / r_med if r_med else None,
                "goal": "≤ 2 ms",
                "met": s_med <= 2.0,
            }
        )
        one, _ = asyncio.run(_tree(root, 1, 0.5, 32))
        for cap in (32, 20):
            fan, _ = asyncio.run(_tree(root, 32, 0.5, cap))
            rows.append(
                {
                    "measure": f"fan-out 32 children @0.5 s (cap {cap}) vs 1 child, wall",
                    "orch_ms": fan * 1000,
                    "raw_ms": one * 1000,
                    "ratio": fan / one,
                    "goal": "≤ 1.2×",
                    "met": fan / one <= 1.2,
                }
            )
        rows.append(context_economy(root))
        rows.append(live_view_cost(root))
        sandboxed = bash_overhead(root)
        if sandboxed is not None:
            rows.append(sandboxed)
    return rows


def bash_overhead(root: Path, samples: int = 30) -> dict[str, Any] | None:
    """A host-tier bash call under bubblewrap vs plain ``bash -c true`` (None: no bwrap)."""
    from orchestrator.bwrap.profile import OsSandbox, available
    from orchestrator.workspaces.base import NullSink, run_process

    if available() is not None:
        return None
    box = OsSandbox(
        workspace=root, read_only_within=(root / ".git",), env={"PATH": "/usr/bin:/bin"}
    )
    argv = ["bash", "-c", "true"]

    async def once(wrapped: bool) -> float:
        cmd = box.wrap(argv, root) if wrapped else argv
        t0 = time.perf_counter()
        result = await run_process(cmd, cwd=root, env=dict(box.env), timeout_s=30,
                                   sink=NullSink(), run_id="bench")  # fmt: skip
        assert result.exit_code == 0, result.output
        return time.perf_counter() - t0

    plain = [asyncio.run(once(False)) for _ in range(samples)]
    boxed = [asyncio.run(once(True)) for _ in range(samples)]
    p_med, b_med = statistics.median(plain) * 1000, statistics.median(boxed) * 1000
    return {
        "measure": "host-tier bash call under bubblewrap vs plain bash -c true (added ms)",
        "orch_ms": b_med,
        "raw_ms": p_med,
        "ratio": b_med / p_med if p_med else None,
        "goal": "≤ +15 ms",
        "met": b_med - p_med <= 15.0,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'measure':<66} {'orch ms':>10} {'raw ms':>10} {'ratio':>7}  goal      met")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        print(
            f"{r['measure']:<66} {r['orch_ms']:>10.3f} {r['raw_ms']:>10.3f} {ratio:>7}  "
            f"{r['goal']:<9} {'yes' if r['met'] else 'NO'}"
        )


if __name__ == "__main__":
    print_table(run())
