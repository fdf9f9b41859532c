"""`peer`: orch and Claude Code side by side on one scripted delegation.

Both run the same task against the same scripted Messages API on 127.0.0.1
(``fakeserver.py``): the root delegates once (Claude Code: its ``Agent`` tool;
orch: ``task``), the child reads one file and answers, the root answers. Runs
alternate between the two tools (N pairs, ``BENCH_PEER_RUNS``, default 20) and
every figure is the median over N; the raw column is Claude Code.

Claude Code is installed with npm into ``~/.cache/orch-bench/claude-code``
(``BENCH_PEER_CACHE``) when missing; the suite is skipped with a note when npm
or the registry is not there. Both tools run in a network namespace whose only
interface is loopback (``unshare --net``): they can reach 127.0.0.1 and nothing
else; without such a namespace the suite is skipped rather than run unconfined.

Standalone: ``python bench/peer.py [--runs N]`` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PACKAGE = "@anthropic-ai/claude-code"
LOAD: list[float] = []  # 1-minute load average before and after the runs


class Skipped(Exception):
    """The suite cannot run here (bench/run notes it as skipped, not failed)."""


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "orch-bench" / "claude-code"
    return Path(os.environ.get("BENCH_PEER_CACHE", str(default))).expanduser()


def netns_prefix() -> list[str]:
    """A command prefix that runs its command in a namespace with only loopback."""
    if not shutil.which("unshare"):
        raise Skipped("`unshare` is missing: Claude Code runs only where it can reach no address")
    prefix = ["unshare", "--net"] if os.geteuid() == 0 else ["unshare", "--net", "--map-root-user"]
    probe = subprocess.run([*prefix, sys.executable, "-c", ""], capture_output=True, text=True)
    if probe.returncode != 0:
        raise Skipped(
            f"no network namespace ({probe.stderr.strip()[:120]}): Claude Code "
            "runs only where it can reach no address but 127.0.0.1"
        )
    return prefix


def _native(cache: Path) -> Path | None:
    """Claude Code's native binary: the wrapper's, else the platform package's."""
    mods = cache / "node_modules" / "@anthropic-ai"
    candidates = [mods / "claude-code" / "bin" / "claude.exe"]
    candidates += sorted(mods.glob("claude-code-linux-*/claude"))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK) and c.stat().st_size > 1_000_000:
            return c  # the wrapper's placeholder (postinstall not run) is a few KB
    return None


def ensure_claude(
    prefix: list[str], cache: Path | None = None, version: str | None = None
) -> tuple[Path, str]:
    """The Claude Code binary and its version, installing it with npm into ``cache`` (default
    :func:`cache_dir`) when missing; ``version`` (an npm version range) picks which."""
    cache = cache or cache_dir()
    version = version or os.environ.get("BENCH_PEER_CC_VERSION") or None
    binary = _native(cache)
    if binary is None:
        npm = shutil.which("npm")
        if npm is None:
            raise Skipped("npm is not installed: cannot install Claude Code")
        cache.mkdir(parents=True, exist_ok=True)
        spec = PACKAGE + (f"@{version}" if version else "")
        print(f"peer: installing {spec} into {cache} ...", file=sys.stderr)
        try:
            got = subprocess.run(
                [npm, "install", "--prefix", str(cache), "--no-audit", "--no-fund", spec],
                capture_output=True,
                text=True,
                timeout=900,
            )
        except subprocess.TimeoutExpired as e:
            raise Skipped("npm install of Claude Code timed out (registry unreachable?)") from e
        if got.returncode != 0:
            errs = [x for x in got.stderr.splitlines() if x.startswith("npm error")]
            why = " / ".join(errs[:2]) or got.stderr.strip()[-200:]
            raise Skipped(f"npm install of Claude Code failed (registry unreachable?): {why}")
        binary = _native(cache)
        if binary is None:
            raise Skipped(f"npm installed {PACKAGE} but no native binary for this platform")
    probe = subprocess.run(
        [*prefix, str(binary), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cache)},
    )
    version = probe.stdout.split()[0] if probe.returncode == 0 and probe.stdout else ""
    if not version:
        raise Skipped(f"Claude Code at {binary} does not start: {probe.stderr.strip()[:160]}")
    return binary, version


def orch_binary() -> Path:
    orch = Path(sys.executable).parent / "orch"
    if not orch.exists():
        raise RuntimeError(
            f"no `orch` beside {sys.executable}: run bench/run with the venv's python "
            "(. .venv/bin/activate) after pip install -e ."
        )
    return orch


def collect(runs: int) -> tuple[list[dict[str, Any]], str]:
    LOAD.append(os.getloadavg()[0])
    prefix = netns_prefix()
    claude, version = ensure_claude(prefix)
    cmd = [
        *prefix,
        sys.executable,
        str(HERE / "peerrun.py"),
        "--inside",
        "--runs",
        str(runs),
        "--claude",
        str(claude),
        "--orch",
        str(orch_binary()),
    ]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=120 + 90 * runs)
    results = [json.loads(line) for line in got.stdout.splitlines() if line.startswith("{")]
    if got.returncode != 0:
        raise RuntimeError(f"peer runs failed: {got.stderr.strip()[-600:]}")
    LOAD.append(os.getloadavg()[0])
    return results, version


def _row(
    measure: str, orch: list[float], cc: list[float], goal: str, met: bool | None, version: str
) -> dict[str, Any]:
    o, c = statistics.median(orch), statistics.median(cc)
    return {
        "measure": measure,
        "orch_ms": round(o, 1),
        "raw_ms": round(c, 1),
        "ratio": o / c if c else None,
        "goal": goal,
        "met": True if met is None else met,
        "raw_label": f"Claude Code {version}",
        "orch_runs": [round(v, 2) for v in orch],
        "raw_runs": [round(v, 2) for v in cc],
    }


def rows(results: list[dict[str, Any]], version: str) -> list[dict[str, Any]]:
    by = {t: [r for r in results if r["tool"] == t] for t in ("orch", "claude", "orch-cold")}
    n = min(len(by["orch"]), len(by["claude"]))
    if n == 0:
        raise RuntimeError("peer: no completed runs")

    def pair(key: str, tool: str = "orch") -> tuple[list[float], list[float]]:
        return [float(r[key]) for r in by[tool]], [float(r[key]) for r in by["claude"]]

    out = []
    for key, measure, goal in [
        ("wall_ms", f"whole run, wall, median of {n}", "≤ 1.0×"),
        ("start_to_first_request_ms", "process start → first /v1/messages request", "≤ 1.0×"),
        ("last_response_to_exit_ms", "last response sent → process exit", "≤ 60 ms"),
        ("delegation_ms", "delegation: task call sent → child's 1st request received", "report"),
        ("tool_step_ms", "one tool step in the child: tool_use sent → next request", "report"),
        (
            "child_system_tools_tokens",
            "child's 1st request: system + tools, tokens (chars/4)",
            "report",
        ),
        ("child_tools", "child's 1st request: number of tools", "report"),
        ("cpu_ms", "CPU time, user + sys, process and the children it waited for", "report"),
        ("pss_tree_peak_mib", "peak memory, whole process tree (sum of PSS), MiB", "report"),
        ("rss_max_single_mib", "peak RSS of the largest single process, MiB", "report"),
    ]:
        o, c = pair(key)
        mo, mc = statistics.median(o), statistics.median(c)
        met = mo <= 60 if goal == "≤ 60 ms" else mo <= mc if goal == "≤ 1.0×" else None
        out.append(_row(measure, o, c, goal, met, version))
    if by["orch-cold"]:  # the same, every command in its own process (ORCH_WARM_IDLE=0)
        for key, measure in [
            ("wall_ms", "no warm process: whole run, wall"),
            ("start_to_first_request_ms", "no warm process: start → first request"),
            ("last_response_to_exit_ms", "no warm process: last response → exit"),
            ("cpu_ms", "no warm process: CPU time"),
            ("pss_tree_peak_mib", "no warm process: peak memory (sum of PSS), MiB"),
        ]:
            o, c = pair(key, "orch-cold")
            out.append(_row(measure, o, c, "report", None, version))
    extra = {
        t: {
            "side_requests": sorted({r["side_requests"] for r in rs}),
            "streaming": sorted({r["stream"] for r in rs}),
            "leftover_processes": sorted({p for r in rs for p in r["leftover_processes"]}),
            "rss_tree_peak_mib_median": round(
                statistics.median(r["rss_tree_peak_mib"] for r in rs), 1
            ),
            "warm_runs": sum(1 for r in rs if r.get("warm")),
        }
        for t, rs in by.items()
        if rs
    }
    first = [r for r in by["orch"] if not r.get("warm")]
    if first:  # the run that found no warm process and started one
        extra["orch"]["cold_first_run_wall_ms"] = round(first[0]["wall_ms"], 1)
    out[0]["detail"] = extra | {"load_average_1m_before_after": [round(x, 1) for x in LOAD]}
    return out


def run(runs: int | None = None) -> list[dict[str, Any]]:
    n = runs or int(os.environ.get("BENCH_PEER_RUNS", "20"))
    results, version = collect(n)
    return rows(results, version)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=None)
    try:
        print(json.dumps(run(ap.parse_args().runs), indent=1))
    except Skipped as e:
        print(f"peer: skipped: {e}")
