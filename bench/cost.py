"""`cost`: dollars per run, orch and Claude Code on the same scripted work, priced one way.

The twelve-file task: the root delegates once (orch: ``task``; Claude Code: its ``Agent``
tool), the child reads twelve 6 KB files, one a turn, then sums up, the root answers. Both
tools run as users run them (``orch task``, ``claude -p``) against one scripted fake
Messages API on 127.0.0.1 (``fakeserver.py``) in a network namespace whose only interface
is loopback, runs alternating (``BENCH_COST_RUNS`` pairs, default 3). The fake reports
each request's usage by the Messages API's prompt-cache rules
(``orchestrator.testing.messages``: prefixes, breakpoints, the 20-block look-back,
minimum lengths, TTLs), with a cache of its own for every run (a cold start, as a user's
first run of the hour); each request is priced by ``pricing.cost`` (genai-prices' table),
cache writes at their TTL's price, with one price for both tools: a request naming any
Sonnet at Claude Sonnet 4.5's price (both ask for ``sonnet``: orch's alias is Sonnet 4.5,
Claude Code's may be a newer Sonnet priced otherwise; each at its own model's price is
kept in the detail), any other model at its own. Claude Code's side requests (titles,
checks) are counted: a user pays for them.

Cache-read share: of all the input after each run's first request, the part read from
the prompt cache.

The long run (orch alone, in this process, through the SDK against the fake): one agent
reads 25 files of 40 KB, one a turn (≈ 250k tokens in all), against a 200k window; with
orch's context keeper (clearing, then compaction) and with it switched off, where the
fake's "prompt is too long" ends the run.

Standalone: ``python bench/cost.py [--runs N]`` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

ROOT_PROMPT = "COST-ROOT: have a subagent read the twelve files f01.txt to f12.txt and sum up."
CHILD_PROMPT = (
    "COST-CHILD: read f01.txt to f12.txt one at a time, then sum up the value line of each."
)
CHILD_ANSWER = "COST-SUM: the twelve values add up to 78."
ROOT_ANSWER = "COST-DONE: the twelve values add up to 78."
FILES, FILE_BYTES = 12, 6 * 1024
LONG_FILES, LONG_BYTES, WINDOW = 25, 40 * 1024, 200_000
LONG_PROMPT = f"LONG-RUN: read l01.txt to l{LONG_FILES:02d}.txt one at a time, then report."
REFERENCE = "claude-sonnet-4-5"  # prices a model the table does not know
DELEGATION_TOOLS = ("Agent", "Task", "task")
GOAL = 0.4


def file_text(name: str, value: int, size: int) -> str:
    """``size`` bytes of plain lines, the first saying the file's value."""
    lines = [f"{name}: value {value}"]
    i = 0
    while sum(len(x) + 1 for x in lines) < size:
        i += 1
        lines.append(f"{name} line {i:04d}: the quick brown fox jumps over the lazy dog {i * 7}")
    return "\n".join(lines)[:size]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
    return ""


def _blocks(body: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [
        b
        for m in body.get("messages") or []
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == kind
    ]


def _reply(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "stop_reason": "end_turn"}


def _use(name: str, args: dict[str, Any], tid: str) -> dict[str, Any]:
    block = {"type": "tool_use", "id": tid, "name": name, "input": args}
    return {"content": [block], "stop_reason": "tool_use"}


class Twelve:
    """The responder of the twelve-file task, for either tool (it answers by tool names)."""

    def __init__(self) -> None:
        self.repo = Path("/nonexistent")

    def __call__(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        messages = body.get("messages") or []
        first = _text(messages[0].get("content")) if messages else ""
        tools = [str(t.get("name")) for t in body.get("tools") or [] if isinstance(t, dict)]
        results = len(_blocks(body, "tool_result"))
        if tools and ROOT_PROMPT in first:
            if results:
                return "root", _reply(ROOT_ANSWER)
            name = next((n for n in DELEGATION_TOOLS if n in tools), "task")
            args = {"description": "Read twelve files", "prompt": CHILD_PROMPT}
            return "root", _use(name, args | {"subagent_type": "general-purpose"}, "toolu_root")
        if tools and CHILD_PROMPT in first:
            if results >= FILES:
                return "child", _reply(CHILD_ANSWER)
            name = f"f{results + 1:02d}.txt"
            if "Read" in tools:
                return "child", _use(
                    "Read", {"file_path": str(self.repo / name)}, f"toolu_r{results}"
                )
            return "child", _use("read_file", {"path": name}, f"toolu_r{results}")
        return "side", _reply("OK")


# -- inside the namespace: both tools, runs alternating ------------------------------------


def make_repo(root: Path) -> Path:
    from peerrun import _base_env

    repo = root / "repo"
    repo.mkdir(parents=True)
    for i in range(1, FILES + 1):
        (repo / f"f{i:02d}.txt").write_text(file_text(f"f{i:02d}", i, FILE_BYTES))
    env = {**_base_env(root / "home"), "GIT_CONFIG_NOSYSTEM": "1"}
    ident = ["-c", "user.name=Bench", "-c", "user.email=bench@example.com"]
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], [*ident, "commit", "-qm", "init"]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True)
    return repo


def command(
    tool: str, paths: dict[str, str], url: str, home: Path
) -> tuple[list[str], dict[str, str]]:
    from peerrun import _base_env

    env = {**_base_env(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "fake"}
    if tool == "claude":
        env |= {
            "IS_SANDBOX": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
        }
        argv = [paths["claude"], "-p", ROOT_PROMPT, "--output-format", "json"]
        argv += ["--dangerously-skip-permissions", "--model", "sonnet", "--max-turns", "40"]
        return argv, env
    env["ORCH_WARM_IDLE"] = "0"  # no warm process outlives the suite (dollars do not change)
    env["PYTHONPATH"] = str(HERE.parent)  # the checkout this bench runs from
    env["PATH"] = f"{Path(paths['orch']).parent}:{env['PATH']}"
    return [paths["orch"], "task", "--model", "sonnet", ROOT_PROMPT], env


def run_one(
    tool: str, fake: Any, script: Twelve, paths: dict[str, str], home: Path
) -> dict[str, Any]:
    from orchestrator.testing.messages import Messages

    with tempfile.TemporaryDirectory(prefix=f"cost-{tool}-") as tmp:
        script.repo = make_repo(Path(tmp))
        argv, env = command(tool, paths, fake.base_url, home)
        fake.reset()
        fake.rules = Messages()  # a cold prompt cache for every run
        t0 = time.perf_counter()
        got = subprocess.run(
            argv, cwd=script.repo, env=env, stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=600,
        )  # fmt: skip
        wall = time.perf_counter() - t0
    requests = [
        {"label": e.label, "model": (e.body or {}).get("model", ""), "usage": e.usage}
        for e in fake.messages()
        if e.usage is not None
    ]
    ok = got.returncode == 0 and ROOT_ANSWER in got.stdout
    reads = sum(1 for e in fake.messages() if e.label == "child") - 1
    return {
        "tool": tool,
        "ok": ok,
        "reads": reads,
        "wall_s": round(wall, 2),
        "requests": requests,
        "error": "" if ok else (got.stdout + got.stderr)[-600:],
    }


def inside(runs: int, paths: dict[str, str]) -> None:
    from fakeserver import serve
    from peerrun import loopback_up, only_loopback, reap

    loopback_up()
    if only_loopback() != ["lo"]:
        raise SystemExit(f"refusing to run: interfaces up besides lo: {only_loopback()}")
    tools = [t for t in ("claude", "orch") if paths.get(t)]
    script = Twelve()
    homes = Path(tempfile.mkdtemp(prefix="cost-homes-"))
    with serve(script) as fake:
        for i in range(runs):
            for tool in tools if i % 2 == 0 else tools[::-1]:
                print(json.dumps(run_one(tool, fake, script, paths, homes / tool)), flush=True)
                reap()


# -- pricing: the same for both tools -------------------------------------------------------


def dollars(model: str, usage: dict[str, Any], same: bool = True) -> float:
    """One request's USD by ``pricing.cost``, its cache writes at their TTL's price: at the
    model it names, or (``same``) at the reference model's price if it names a Sonnet; a
    model the table does not know at the reference price."""
    from orchestrator.models import pricing
    from orchestrator.models.base import ModelUsage

    sonnet = same and "sonnet" in model
    spec = model if pricing.known(model) and not sonnet else REFERENCE
    split = usage.get("cache_creation") or {}
    w1h = int(split.get("ephemeral_1h_input_tokens", 0))
    w5m = int(usage.get("cache_creation_input_tokens", 0)) - w1h
    base = ModelUsage(
        input_tokens=int(usage.get("input_tokens", 0)),
        output_tokens=int(usage.get("output_tokens", 0)),
        cache_creation_input_tokens=w5m,
        cache_read_input_tokens=int(usage.get("cache_read_input_tokens", 0)),
    )
    total = pricing.cost(spec, base, ttl="5m")
    if w1h:
        total += pricing.cost(spec, ModelUsage(cache_creation_input_tokens=w1h), ttl="1h")
    return total


def _prompt(u: dict[str, Any]) -> int:
    keys = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    return sum(int(u.get(k, 0)) for k in keys)


def summary(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's dollars, requests, tokens and cache-read share, from its logged usage."""
    usages = [r["usage"] for r in requests]
    later = usages[1:]
    prompt_later = sum(_prompt(u) for u in later)
    read_later = sum(int(u.get("cache_read_input_tokens", 0)) for u in later)
    return {
        "usd": sum(dollars(r["model"], r["usage"]) for r in requests),
        "usd_own_model_price": sum(dollars(r["model"], r["usage"], False) for r in requests),
        "requests": len(requests),
        "side_requests": sum(1 for r in requests if r["label"] == "side"),
        "input_tokens_all_kinds": sum(_prompt(u) for u in usages),
        "cache_read_tokens": sum(int(u.get("cache_read_input_tokens", 0)) for u in usages),
        "cache_write_tokens": sum(int(u.get("cache_creation_input_tokens", 0)) for u in usages),
        "uncached_input_tokens": sum(int(u.get("input_tokens", 0)) for u in usages),
        "output_tokens": sum(int(u.get("output_tokens", 0)) for u in usages),
        "cache_read_share": read_later / prompt_later if prompt_later else 0.0,
        "models": sorted({r["model"] for r in requests}),
    }


# -- the long run: orch alone, in this process -----------------------------------------------


class Long:
    """Read l01..l25, one a turn; answer a compaction's summary request with where it is."""

    def __call__(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        last = (body.get("messages") or [{}])[-1]
        if "about to be compacted" in _text(last.get("content")):
            return "summary", _reply(f"LONG-SUMMARY read={self.done(body)}")
        done = self.done(body)
        if done >= LONG_FILES:
            return "final", _reply(f"LONG-DONE read={done}")
        return "read", _use("read_file", {"path": f"l{done + 1:02d}.txt"}, f"toolu_l{done}")

    @staticmethod
    def done(body: dict[str, Any]) -> int:
        """Files read so far: the last one asked for whose result is in, or a summary's."""
        seen = [0]
        text = json.dumps(body.get("messages"))
        seen += [int(m) for m in re.findall(r"LONG-SUMMARY read=(\d+)", text)]
        answered = {b.get("tool_use_id") for b in _blocks(body, "tool_result")}
        for b in _blocks(body, "tool_use"):
            if b.get("id") in answered and (
                m := re.match(r"l(\d+)\.txt", str(b["input"].get("path")))
            ):
                seen.append(int(m.group(1)))
        return max(seen)


async def _long_tree(root: Path, url: str) -> Any:
    from orchestrator.catalog.definitions import load_catalog
    from orchestrator.config import Settings
    from orchestrator.engine.runner import Runner
    from orchestrator.models import ModelProvider
    from orchestrator.spec import RunSpec
    from orchestrator.store import open_store

    os.environ["ANTHROPIC_BASE_URL"], os.environ["ANTHROPIC_API_KEY"] = url, "bench-fake"
    settings = Settings(max_turns=60)
    settings.context.windows = {REFERENCE: WINDOW}
    async with ModelProvider(settings, REFERENCE) as models:
        runner = Runner(
            settings=settings, store=open_store(root), catalog=load_catalog(root), models=models
        )
        return await runner.run(RunSpec(prompt=LONG_PROMPT, workdir=root))


def long_run(compaction: bool) -> dict[str, Any]:
    """The 25-file run; ``compaction`` False switches orch's context keeper off."""
    from fakeserver import serve
    from worktree import make_repo as git_repo

    from orchestrator.engine import agent
    from orchestrator.engine.context import ContextKeeper
    from orchestrator.testing.messages import Messages

    async def nothing(*_: Any, **__: Any) -> None:
        return None

    with contextlib.ExitStack() as off:
        if not compaction:  # the loop's only ways to clear or compact
            off.enter_context(mock.patch.object(agent, "fit", nothing))
            off.enter_context(mock.patch.object(ContextKeeper, "over", lambda *_: False))
        with tempfile.TemporaryDirectory() as tmp, serve(Long(), Messages()) as fake:
            root = Path(tmp)
            git_repo(root, 1)
            for i in range(1, LONG_FILES + 1):
                (root / f"l{i:02d}.txt").write_text(file_text(f"l{i:02d}", i, LONG_BYTES))
            rec = asyncio.run(_long_tree(root, fake.base_url))
            exchanges = fake.messages()
    requests = [
        {"label": e.label, "model": (e.body or {}).get("model", ""), "usage": e.usage}
        for e in exchanges
        if e.usage is not None
    ]
    refused = [e for e in exchanges if e.status == 400]
    done = max((Long.done(e.body or {}) for e in exchanges), default=0)
    return summary(requests) | {
        "status": rec.status.value,
        "error": (rec.error or "")[:160],
        "files_read": done,
        "refused": len(refused),
        "summaries": sum(1 for r in requests if r["label"] == "summary"),
        "peak_prompt_tokens": max((_prompt(r["usage"]) for r in requests), default=0),
    }


# -- outside: the suite ----------------------------------------------------------------------


def collect(runs: int) -> tuple[list[dict[str, Any]], str, str]:
    """Run the twelve-file task in a loopback-only namespace: per-run results, Claude Code's
    version ("" if it is not here) and why not."""
    from peer import Skipped, ensure_claude, netns_prefix, orch_binary

    prefix = netns_prefix()
    paths = {"orch": str(orch_binary()), "claude": ""}
    version, why = "", ""
    try:
        claude, version = ensure_claude(prefix)
        paths["claude"] = str(claude)
    except Skipped as e:
        why = str(e)
    cmd = [*prefix, sys.executable, __file__, "--inside", "--runs", str(runs)]
    cmd += ["--orch", paths["orch"], "--claude", paths["claude"]]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=300 + 300 * runs)
    results = [json.loads(x) for x in got.stdout.splitlines() if x.startswith("{")]
    if got.returncode != 0:
        raise RuntimeError(f"cost runs failed: {got.stderr.strip()[-600:]}")
    bad = [r for r in results if not r["ok"]]
    if bad:
        raise RuntimeError(f"{bad[0]['tool']} run failed: {bad[0]['error']}")
    return results, version, why


def _med(rs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in rs))


def rows(results: list[dict[str, Any]], version: str, why: str) -> list[dict[str, Any]]:
    by = {
        t: [r | summary(r["requests"]) for r in results if r["tool"] == t]
        for t in ("orch", "claude")
    }
    orch, cc = by["orch"], by["claude"]
    label = f"Claude Code {version}" if cc else "Claude Code (not run)"
    out: list[dict[str, Any]] = []
    for key, measure, scale, goal in [
        ("usd", "twelve-file delegation: US cents per run", 100.0, f"≤ {GOAL}×"),
        (
            "cache_read_share",
            "twelve-file: cache-read share of the input after the 1st request, %",
            100.0,
            "report",
        ),
        ("requests", "twelve-file: requests per run (side requests included)", 1.0, "report"),
        ("input_tokens_all_kinds", "twelve-file: input tokens per run, all kinds", 1.0, "report"),
        ("cache_write_tokens", "twelve-file: tokens written to the cache per run", 1.0, "report"),
        ("output_tokens", "twelve-file: output tokens per run", 1.0, "report"),
    ]:
        o = _med(orch, key) * scale
        c = _med(cc, key) * scale if cc else None
        ratio = o / c if c else None
        met = ratio is not None and ratio <= GOAL if goal.startswith("≤") else True
        out.append(
            {
                "measure": measure,
                "orch_ms": round(o, 3),
                "raw_ms": None if c is None else round(c, 3),
                "ratio": ratio,
                "goal": goal,
                "met": met,
                "raw_label": label,
                "orch_runs": [round(r[key] * scale, 3) for r in orch],
                "raw_runs": [round(r[key] * scale, 3) for r in cc],
            }
        )
    out[0]["detail"] = {
        t: {
            "models": sorted({m for r in rs for m in r["models"]}),
            "side_requests": sorted({r["side_requests"] for r in rs}),
            "uncached_input_tokens": _med(rs, "uncached_input_tokens"),
            "cache_read_tokens": _med(rs, "cache_read_tokens"),
            "child_reads": sorted({r["reads"] for r in rs}),
            "usd_own_model_price": _med(rs, "usd_own_model_price"),
            "wall_s": _med(rs, "wall_s"),
        }
        for t, rs in by.items()
        if rs
    } | ({"claude_code_not_run": why} if why else {})
    return out


def long_rows() -> list[dict[str, Any]]:
    out = []
    for compaction in (True, False):
        r = long_run(compaction)
        how = "with orch's compaction" if compaction else "compaction off"
        print(f"  long run, {how}: {json.dumps(r)}", flush=True)
        ok = r["status"] == "succeeded" and r["files_read"] == LONG_FILES
        out.append(
            {
                "measure": f"long run (25 × 40 KB reads, 200k window), {how}: US cents; "
                f"{r['requests']} requests, {r['files_read']} files read, "
                f"{'succeeded' if ok else 'FAILED: ' + r['error'][:60]}",
                "orch_ms": round(r["usd"] * 100, 2),
                "raw_ms": None,
                "ratio": None,
                "goal": "succeeds" if compaction else "report",
                "met": ok if compaction else True,
                "detail": r,
            }
        )
    return out


def run(runs: int | None = None) -> list[dict[str, Any]]:
    n = runs or int(os.environ.get("BENCH_COST_RUNS", "3"))
    results, version, why = collect(n)
    if why:
        print(f"  cost: Claude Code not run: {why}", flush=True)
    return rows(results, version, why) + long_rows()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--inside", action="store_true")
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--orch", default="")
    ap.add_argument("--claude", default="")
    ap.add_argument("--long", action="store_true", help="only the long run")
    a = ap.parse_args()
    if a.inside:
        inside(a.runs or 3, {"orch": a.orch, "claude": a.claude})
    elif a.long:
        print(json.dumps(long_rows(), indent=1))
    else:
        print(json.dumps(run(a.runs), indent=1))


if __name__ == "__main__":
    main()
