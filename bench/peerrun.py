"""The `peer` runs themselves: orch and Claude Code on one scripted delegation.

Started by ``peer.py`` inside a network namespace that has only a loopback
interface (``python peerrun.py --inside ...``), so neither tool can reach any
address but 127.0.0.1. One fake Messages API serves both; every run gets a
fresh git repository; each tool keeps one HOME over all its runs, as a user's
would. orch runs twice over: as installed (``orch``: the first command starts a
warm process that later ones are forked from; it stays between runs, is counted
in the memory figures, and its children's CPU time in the CPU figure) and with
the warm process off (``orch-cold``: ``ORCH_WARM_IDLE=0``, every command in its
own process). Prints one JSON object per run.

The script, identical for both tools except for tool names and path forms:
the root's first request gets a delegation (``Agent``/``Task`` for Claude Code,
``task`` for orch) with the same description, prompt and ``subagent_type``;
the child's first request gets one read of ``notes.txt``; the child's next
request gets the final text; the root's next request gets the answer. Any other
request (Claude Code's side calls) gets a short text.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fakeserver import Exchange, FakeServer, serve  # noqa: E402

ROOT_PROMPT = "PEER-ROOT: ask a subagent to read notes.txt, then tell me its first line."
CHILD_PROMPT = "PEER-CHILD: read notes.txt and return its first line."
NOTES = "peer bench notes, first line\nsecond line\n"
CHILD_ANSWER = "The first line of notes.txt is: peer bench notes, first line"
ROOT_ANSWER = "PEER-DONE: the first line is 'peer bench notes, first line'."
DELEGATION_TOOLS = ("Agent", "Task", "task")
POLL_S = 0.005
PSS_EVERY = 4  # PSS every 20 ms: reading smaps_rollup of a 300 MiB process takes ~5 ms


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(b.get("text", "") for b in content if isinstance(b, dict))
    return ""


def _tool_names(body: dict[str, Any]) -> list[str]:
    return [str(t.get("name")) for t in body.get("tools") or [] if isinstance(t, dict)]


def _has_result(body: dict[str, Any]) -> bool:
    return any(
        isinstance(m.get("content"), list)
        and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in m["content"])
        for m in body.get("messages") or []
    )


def system_chars(body: dict[str, Any]) -> int:
    """Characters of system text: the system field and any system-role messages.

    Claude Code 2.1 also sends part of its system text (the agent list, skills) as
    ``role: system`` messages in ``messages``; orch sends none.
    """
    chars = len(_text(body.get("system")))
    for m in body.get("messages") or []:
        if m.get("role") == "system":
            chars += len(_text(m.get("content")))
    return chars


class Script:
    """The responder: which conversation a request belongs to decides the reply."""

    def __init__(self) -> None:
        self.repo = Path("/nonexistent")

    @staticmethod
    def kind(body: dict[str, Any]) -> str:
        messages = body.get("messages") or []
        first = _text(messages[0].get("content")) if messages else ""
        if not _tool_names(body):
            return "side"
        if ROOT_PROMPT in first:
            return "root"
        if CHILD_PROMPT in first:
            return "child"
        return "side"

    def __call__(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        kind = self.kind(body)
        tools = _tool_names(body)
        if kind == "root" and not _has_result(body):
            name = next((n for n in DELEGATION_TOOLS if n in tools), "task")
            args = {"description": "Read notes", "prompt": CHILD_PROMPT}
            args["subagent_type"] = "general-purpose"
            return kind, _tool_use(name, args, "toolu_peer_root")
        if kind == "child" and not _has_result(body):
            if "Read" in tools:
                args = {"file_path": str(self.repo / "notes.txt")}
                return kind, _tool_use("Read", args, "toolu_peer_read")
            return kind, _tool_use("read_file", {"path": "notes.txt"}, "toolu_peer_read")
        text = {"root": ROOT_ANSWER, "child": CHILD_ANSWER}.get(kind, "OK")
        return kind, {"content": [{"type": "text", "text": text}], "stop_reason": "end_turn"}


def _tool_use(name: str, args: dict[str, Any], tid: str) -> dict[str, Any]:
    block = {"type": "tool_use", "id": tid, "name": name, "input": args}
    return {"content": [block], "stop_reason": "tool_use"}


def loopback_up() -> None:
    """Bring ``lo`` up (a new network namespace starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        iff_up_loopback_running = 0x1 | 0x8 | 0x40
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", iff_up_loopback_running, b""))


def only_loopback() -> list[str]:
    """The interfaces this namespace has that are up (must be just ``lo``)."""
    up = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("16sH14s", name.encode(), 0, b"")
            flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, req))[1]
            if flags & 0x1:
                up.append(name)
    return up


def make_repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir(parents=True)
    (repo / "notes.txt").write_text(NOTES)
    env = {**_base_env(root / "home"), "GIT_CONFIG_NOSYSTEM": "1"}
    for args in (
        ["init", "-q", "-b", "main"],
        ["add", "-A"],
        ["-c", "user.name=Bench", "-c", "user.email=bench@example.com", "commit", "-qm", "init"],
    ):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True)
    return repo


def _base_env(home: Path) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}


def command(
    tool: str, paths: dict[str, str], base_url: str, home: Path
) -> tuple[list[str], dict[str, str]]:
    env = {**_base_env(home), "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "fake"}
    if tool == "orch-cold":
        env["ORCH_WARM_IDLE"] = "0"
    if tool == "claude":
        env |= {
            "IS_SANDBOX": "1",  # we are root
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
        }
        argv = [
            paths["claude"],
            "-p",
            ROOT_PROMPT,
            "--output-format",
            "json",
            "--dangerously-skip-permissions",
            "--model",
            "sonnet",
            "--max-turns",
            "6",
        ]
        return argv, env
    env["PATH"] = f"{Path(paths['orch']).parent}:{env['PATH']}"
    return [paths["orch"], "task", "--model", "sonnet", ROOT_PROMPT], env


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return f"{pid} (gone)"


def is_warm(pid: int) -> bool:
    """orch's warm process (it outlives a run by design; see orchestrator/warm/)."""
    return "orchestrator.warm.server" in _cmdline(pid)


def children_cpu_ms(pids: list[int]) -> float:
    """CPU time of the reaped children of ``pids`` (``cutime + cstime``), in ms."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[13]) + int(fields[14])
        except (OSError, ValueError, IndexError):
            pass
    return total * 1000 / os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss_poller(parent: int, with_warm: bool) -> None:
    """Peak memory of everything under ``parent`` but this process, until stdin says stop.

    Two sums over the tree: RSS every POLL_S (counts pages shared between processes,
    e.g. a forked child, once per process) and PSS every PSS_EVERY samples (shared
    pages split between their sharers: what the tree costs the machine). orch's warm
    process is in the tree (we are its subreaper) and counts only ``with_warm`` (orch's
    runs, not Claude Code's or orch-cold's).
    """
    page = os.sysconf("SC_PAGE_SIZE")
    me = os.getpid()
    peak_rss = peak_pss = peak_single = samples = 0
    os.set_blocking(sys.stdin.fileno(), False)
    print("ready", flush=True)
    while True:
        pids = [p for p in tree(parent) if p not in (parent, me)]
        if not with_warm:  # orch's warm process (and its commands) counts for orch's runs only
            pids = [p for p in pids if not is_warm(p)]
        total = 0
        for p in pids:
            try:
                with open(f"/proc/{p}/statm") as f:
                    one = int(f.read().split()[1]) * page
            except (OSError, IndexError, ValueError):
                continue
            total += one
            peak_single = max(peak_single, one)
        peak_rss = max(peak_rss, total)
        if samples % PSS_EVERY == 0:
            peak_pss = max(peak_pss, sum(_pss_kib(p) for p in pids) * 1024)
        samples += 1
        try:
            if sys.stdin.read():
                break
        except (BlockingIOError, TypeError):
            pass
        time.sleep(POLL_S)
    result = {"rss": peak_rss, "pss": peak_pss, "single": peak_single, "samples": samples}
    print(json.dumps(result), flush=True)


def reap() -> None:
    """Collect the orphans a run left to us (we are their subreaper) once they exit."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def run_one(
    tool: str, fake: FakeServer, script: Script, paths: dict[str, str], home: Path
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"peer-{tool}-") as tmp:
        repo = make_repo(Path(tmp))
        script.repo = repo
        argv, env = command(tool, paths, fake.base_url, home)
        mine = tool == "orch"  # the warm process is orch's (orch-cold runs without one)
        warm_before = [p for p in tree(os.getpid()) if mine and is_warm(p)]
        cpu_before = children_cpu_ms(warm_before)
        poller = subprocess.Popen(
            [sys.executable, __file__, "--rss", str(os.getpid()), "--with-warm", str(int(mine))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert poller.stdout is not None and poller.stdin is not None
        poller.stdout.readline()
        fake.reset()
        with open(Path(tmp) / "out", "w+") as out, open(Path(tmp) / "err", "w+") as err:
            t_start = time.perf_counter()
            proc = subprocess.Popen(
                argv, cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err
            )
            _, status, usage = os.wait4(proc.pid, 0)
            t_exit = time.perf_counter()
            proc.returncode = os.waitstatus_to_exitcode(status)
            rss = json.loads(poller.communicate("stop\n", timeout=30)[0])
            warm_cpu = children_cpu_ms(warm_before) - cpu_before  # the forked command's
            reap()
            left = [p for p in tree(os.getpid()) if p != os.getpid() and not is_warm(p)]
            leftovers = [_cmdline(p) for p in left]
            for p in left:  # a run must not outlive its measure
                os.kill(p, signal.SIGKILL)
            time.sleep(0.05 if left else 0)
            reap()
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        exchanges = list(fake.exchanges)
        if proc.returncode != 0 or ROOT_ANSWER not in stdout:
            raise RuntimeError(
                f"{tool} run failed (exit {proc.returncode}): {(stdout + stderr)[-800:]}"
            )
    return measure(tool, exchanges, t_start, t_exit) | {
        "pss_tree_peak_mib": rss["pss"] / 2**20,
        "rss_tree_peak_mib": rss["rss"] / 2**20,
        "rss_samples": rss["samples"],
        "rss_max_single_mib": max(usage.ru_maxrss * 1024, rss["single"]) / 2**20,
        "cpu_ms": (usage.ru_utime + usage.ru_stime) * 1000 + warm_cpu,
        "warm": bool(warm_before),
        "leftover_processes": leftovers,
    }


def measure(tool: str, ex: list[Exchange], t_start: float, t_exit: float) -> dict[str, Any]:
    msgs = [e for e in ex if e.path.split("?")[0] == "/v1/messages"]
    root = [e for e in msgs if e.label == "root"]
    child = [e for e in msgs if e.label == "child"]
    if len(root) != 2 or len(child) != 2:
        raise RuntimeError(
            f"{tool}: expected 2 root and 2 child requests, got "
            f"{[(e.method, e.path, e.label) for e in ex]}"
        )
    body = child[0].body or {}
    return {
        "tool": tool,
        "delegation_ms": (child[0].t_recv - root[0].t_sent) * 1000,
        "tool_step_ms": (child[1].t_recv - child[0].t_sent) * 1000,
        "child_system_tools_tokens": (system_chars(body) + len(json.dumps(body.get("tools") or [])))
        // 4,
        "child_tools": len(body.get("tools") or []),
        "start_to_first_request_ms": (min(e.t_recv for e in msgs) - t_start) * 1000,
        "start_to_root_request_ms": (root[0].t_recv - t_start) * 1000,
        "last_response_to_exit_ms": (t_exit - max(e.t_sent for e in ex)) * 1000,
        "wall_ms": (t_exit - t_start) * 1000,
        "requests": {
            k: sum(1 for e in ex if (e.label or e.method) == k)
            for k in {e.label or e.method for e in ex}
        },
        "side_requests": len(msgs) - 4,
        "stream": child[0].stream,
    }


def inside(runs: int, paths: dict[str, str], tools: list[str]) -> None:
    loopback_up()
    up = only_loopback()
    if up != ["lo"]:
        raise SystemExit(f"refusing to run: interfaces up besides lo: {up}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans stay in our tree
    script = Script()
    homes = Path(tempfile.mkdtemp(prefix="peer-homes-"))
    try:
        with serve(script) as fake:
            for i in range(runs):
                order = tools if i % 2 == 0 else tools[::-1]
                for tool in order:
                    got = run_one(tool, fake, script, paths, homes / tool)
                    print(json.dumps(got | {"i": i}), flush=True)
    finally:
        for p in tree(os.getpid()):
            if is_warm(p):
                os.kill(p, signal.SIGTERM)  # nothing outlives the suite
        time.sleep(0.5)
        reap()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rss", type=int)
    ap.add_argument("--with-warm", type=int, default=0)
    ap.add_argument("--inside", action="store_true")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--claude", default="")
    ap.add_argument("--orch", default="")
    a = ap.parse_args()
    if a.rss:
        rss_poller(a.rss, bool(a.with_warm))
        return
    tools = [t for t in ("claude", "orch") if getattr(a, t)]
    if a.orch:
        tools.append("orch-cold")
    inside(a.runs, {"claude": a.claude, "orch": a.orch}, tools)


if __name__ == "__main__":
    main()
