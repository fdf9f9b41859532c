"""Run inside a network namespace with only loopback (tests/test_mcp_claude_code.py):
Claude Code in print mode against a fake Messages API on 127.0.0.1, with ``orch mcp`` as
its MCP server. One fake API answers both: Claude Code's turns (call ``mcp__orch__task``
with isolation worktree, then a final text) and orch's run (write ``hello.txt``, then its
answer). Writes a JSON report of what happened.

    python tests/claude_inside.py CLAUDE REPO REPORT
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from fakeserver import serve  # noqa: E402
from peerrun import loopback_up, only_loopback  # noqa: E402

PROMPT = "ORCH-MCP-E2E: have orch write hello.txt on a branch of its own, then report."
CHILD_PROMPT = "Write hello.txt containing 'hello from orch' and say what you did."
CHILD_ANSWER = "ORCH-CHILD: wrote hello.txt"
FINAL = "ORCH-MCP-DONE: orch's agent wrote hello.txt on its own branch."
TOOL = "mcp__orch__task"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(b.get("text", "") for b in content or [] if isinstance(b, dict))


def tool_results(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        b
        for m in body.get("messages") or []
        if isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") == "tool_result"
    ]


def _use(name: str, args: dict[str, Any], tid: str) -> dict[str, Any]:
    block = {"type": "tool_use", "id": tid, "name": name, "input": args}
    return {"content": [block], "stop_reason": "tool_use"}


def _say(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "stop_reason": "end_turn"}


def responder(body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    names = [t.get("name") for t in body.get("tools") or []]
    msgs = body.get("messages") or []
    first = next((_text(m.get("content")) for m in msgs if m.get("role") == "user"), "")
    done = tool_results(body)
    if TOOL in names and PROMPT in first:  # Claude Code's conversation
        if not done:
            args = {"description": "write hello", "prompt": CHILD_PROMPT, "isolation": "worktree"}
            return "claude:tool_use", _use(TOOL, args, "toolu_cc_1")
        return "claude:final", _say(FINAL)
    if "write_file" in names and CHILD_PROMPT in first:  # orch's run
        if not done:
            args = {"path": "hello.txt", "content": "hello from orch\n"}
            return "orch:write", _use("write_file", args, "toolu_orch_1")
        return "orch:answer", _say(CHILD_ANSWER)
    return "side", _say("OK")


def main(claude: str, repo: str, report: str) -> int:
    loopback_up()
    if only_loopback() != ["lo"]:
        raise SystemExit(f"refusing: interfaces up besides lo: {only_loopback()}")
    tmp = Path(tempfile.mkdtemp(prefix="orch-cc-"))
    home, tmpdir = tmp / "home", tmp / "tmp"
    home.mkdir()
    tmpdir.mkdir()
    server = [sys.executable, "-m", "orchestrator", "mcp", "-C", repo]
    # Claude Code does not always wait for a slow server before its first request: the
    # server's modules are imported (and compiled) once here, so it starts in well under 1 s
    warm = "import orchestrator.cli.main, orchestrator.mcpserver.server"
    subprocess.run([sys.executable, "-c", warm], check=True, timeout=120)
    config = {"mcpServers": {"orch": {"command": server[0], "args": server[1:]}}}
    (tmp / "mcp.json").write_text(json.dumps(config))
    with serve(responder) as fake:
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "TMPDIR": str(tmpdir),
            "LANG": "C.UTF-8",
            "ANTHROPIC_BASE_URL": fake.base_url,
            "ANTHROPIC_API_KEY": "sk-ant-fake",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "ENABLE_TOOL_SEARCH": "false",  # the MCP tool in tools[] from the first request
            "MCP_TIMEOUT": "60000",
            "MCP_TOOL_TIMEOUT": "120000",
            # orch's own, as the suite runs it: which bwrap, no lingering helper processes
            **{k: v for k, v in os.environ.items() if k.startswith("ORCH_")},
        }
        argv = [claude, "-p", PROMPT, "--mcp-config", str(tmp / "mcp.json")]
        argv += ["--strict-mcp-config", "--allowedTools", TOOL, "--output-format", "json"]
        argv += ["--model", "sonnet", "--max-turns", "4"]
        got = subprocess.run(
            argv,
            cwd=repo,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )
        exchanges = [
            {"label": e.label, "path": e.path, "body": e.body, "stream": e.stream}
            for e in fake.exchanges
        ]
    out = {"rc": got.returncode, "stdout": got.stdout, "stderr": got.stderr[-4000:]}
    logs = sorted(home.glob(".cache/claude-cli-nodejs/*/mcp-logs-orch/*.jsonl"))
    out["mcp_log"] = logs[0].read_text()[-4000:] if logs else ""
    Path(report).write_text(json.dumps({**out, "exchanges": exchanges}))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:4]))
