"""Profile orch's edges on the `peer` task: start → first request, last response → exit.

    python bench/peerprofile.py [--out DIR] [--top N]

Runs ``orch task`` once per probe, in a loopback-only network namespace against
the same scripted API as the `peer` suite:
- ``-X importtime``: the imports before the first request, by cumulative time;
- ``cProfile``: the whole command, by cumulative time (written to DIR/orch.prof);
- ``strace -f -tt``: every syscall after the last API response was read, until
  the process exits, with the gaps between them (Python work shows as gaps).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fakeserver import FakeServer, serve  # noqa: E402
from peer import netns_prefix, orch_binary  # noqa: E402
from peerrun import Script, command, loopback_up, make_repo  # noqa: E402


def _run(
    fake: FakeServer, script: Script, wrap: list[str], stamps: Path | None = None
) -> dict[str, float]:
    """One `orch task` under ``wrap``: its edges, in seconds from its start."""
    with tempfile.TemporaryDirectory(prefix="peerprof-") as tmp:
        script.repo = make_repo(Path(tmp))
        # orch-cold: the command in its own process (the imports are what is profiled)
        paths = {"orch": str(orch_binary())}
        argv, env = command("orch-cold", paths, fake.base_url, Path(tmp) / "h")
        if stamps:  # the wrapper stands in for the console script
            argv = [str(HERE / "peerwrap.py"), str(stamps), *wrap[1:], "--", *argv[1:]]
            wrap = wrap[:1]
        fake.reset()
        t0 = time.perf_counter()
        got = subprocess.run(
            [*wrap, *argv],
            cwd=script.repo,
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        t1 = time.perf_counter()
        if got.returncode != 0:
            raise SystemExit(f"orch failed under {wrap}: {got.stderr[-800:]}")
        msgs = fake.messages()
        edges = {
            "first_request": msgs[0].t_recv - t0,
            "last_response": max(e.t_sent for e in fake.exchanges) - t0,
            "reaped": t1 - t0,
        }
        if stamps:
            edges |= {k: v - t0 for k, v in json.loads(stamps.read_text()).items()}
        _STDERR[0] = got.stderr
        return edges


_STDERR = [""]


def timeline(fake: FakeServer, script: Script, out: Path, runs: int) -> None:
    got = [_run(fake, script, [sys.executable], out / "stamps.json") for _ in range(runs)]
    med = {k: statistics.median(g[k] for g in got) * 1000 for k in got[0]}
    print(f"## timeline of `orch task`, medians of {runs} (ms from process start)")
    steps = [
        ("main", "interpreter up, wrapper running (Python start-up, site)"),
        ("imported", "orchestrator.cli.main imported (typer, rich, CLI modules)"),
        ("first_request", "first /v1/messages request received (engine + SDK import, setup)"),
        ("last_response", "last response sent (the run itself)"),
        ("exit_called", "os._exit called (CLI done after the last response)"),
        ("reaped", "process reaped (kernel tear-down)"),
    ]
    prev = 0.0
    for key, what in steps:
        print(f"  {med[key]:8.1f}  (+{med[key] - prev:7.1f})  {what}")
        prev = med[key]


def importtime(fake: FakeServer, script: Script, top: int) -> None:
    first = _run(fake, script, [sys.executable, "-X", "importtime"])["first_request"]
    err = _STDERR[0]
    rows = []
    for line in err.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((int(m[2]), int(m[1]), len(m[3]) // 2, m[4]))
    total = sum(r[0] for r in rows if r[2] == 0)
    print(f"## -X importtime (start → first request {first * 1000:.0f} ms under importtime)")
    print(f"top-level imports, cumulative: {total / 1000:.0f} ms over {len(rows)} modules")
    for cum, _self, _depth, name in sorted((r for r in rows if r[2] == 0), reverse=True)[:top]:
        print(f"  {cum / 1000:8.1f} ms  {name}")
    print("largest packages (sum of self time of their modules):")
    pkgs: dict[str, int] = {}
    for _cum, self_us, _depth, name in rows:
        pkgs[name.split(".")[0]] = pkgs.get(name.split(".")[0], 0) + self_us
    for name, us in sorted(pkgs.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us / 1000:8.1f} ms  {name}")


def cprofile(fake: FakeServer, script: Script, top: int, out: Path) -> None:
    prof = out / "orch.prof"
    e = _run(fake, script, [sys.executable, str(prof)], out / "stamps.json")
    print(
        f"\n## cProfile of orch's main (start → first request {e['first_request'] * 1000:.0f} ms"
        f" under the profiler)"
    )
    buf = io.StringIO()
    stats = pstats.Stats(str(prof), stream=buf)
    stats.sort_stats("cumulative").print_stats(top)
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:12000])


def trace_exit(fake: FakeServer, script: Script, top: int, out: Path) -> None:
    if not shutil.which("strace"):
        print("\n## strace: not installed")
        return
    log = out / "orch.strace"
    wrap = ["strace", "-f", "-tt", "-s", "48", "-o", str(log)]
    e = _run(fake, script, wrap)
    last = e["reaped"] - e["last_response"]
    lines = log.read_text().splitlines()
    stamp = re.compile(r"^(\d+)\s+(\d+):(\d+):(\d+\.\d+) (.*)$")
    events = []
    for line in lines:
        m = stamp.match(line)
        if m:
            t = int(m[2]) * 3600 + int(m[3]) * 60 + float(m[4])
            events.append((t, int(m[1]), m[5]))
    last_read = max(i for i, e in enumerate(events) if "HTTP/1.1 200" in e[2])
    tail = events[last_read:]
    span = tail[-1][0] - tail[0][0]
    print(
        f"\n## strace after the last response was read ({len(tail)} syscalls, {span * 1000:.0f} ms "
        f"under strace; {last * 1000:.0f} ms response → exit as the server saw it)"
    )
    gaps = sorted(((tail[i + 1][0] - tail[i][0], i) for i in range(len(tail) - 1)), reverse=True)[
        :top
    ]
    for gap, i in sorted(gaps, key=lambda g: g[1]):
        print(
            f"  +{(tail[i][0] - tail[0][0]) * 1000:7.1f} ms  gap {gap * 1000:6.1f} ms after "
            f"[{tail[i][1]}] {tail[i][2][:110]}"
        )
    kinds: dict[str, int] = {}
    for _t, _pid, call in tail:
        name = call.split("(")[0]
        kinds[name] = kinds.get(name, 0) + 1
    print(
        "  syscalls: "
        + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:15])
    )


def inside(out: Path, top: int, runs: int) -> None:
    loopback_up()
    script = Script()
    with serve(script) as fake:
        _run(fake, script, [])  # warm the page cache once
        timeline(fake, script, out, runs)
        importtime(fake, script, top)
        cprofile(fake, script, top, out)
        trace_exit(fake, script, top, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--runs", type=int, default=5, help="runs for the timeline")
    ap.add_argument("--inside", action="store_true")
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="orch-peerprofile-"))
    out.mkdir(parents=True, exist_ok=True)
    if a.inside:
        inside(out, a.top, a.runs)
        return
    cmd = [
        *netns_prefix(),
        sys.executable,
        __file__,
        "--inside",
        "--out",
        str(out),
        "--top",
        str(a.top),
        "--runs",
        str(a.runs),
    ]
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
