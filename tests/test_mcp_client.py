"""orch as an MCP client, end to end through the engine (scripted model, real bubblewrap).

A project declares a server in ``.mcp.json`` (``tests/mcp_probe_server.py``, committed into
the project); an agent lists its tools; the child calls them. The server runs inside the
child's sandbox: it cannot read a hidden ``~/.ssh`` and has no API key; each way it can fail
is one line of tool error; none of its processes outlives the run; a child never gets an
MCP tool its parent lacks.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import SandboxSettings
from orchestrator.mcpclient.names import NO_USERS
from orchestrator.run import RunRecord, RunStatus
from tests.support import Harness, harness, init_repo, need_bwrap, task_call, tool_results

pytestmark = pytest.mark.bwrap

SERVER = Path(__file__).with_name("mcp_probe_server.py")
MARKER = "sk-ant-MCP-MARKER-51c2"
KEY = "MCP-PRIVATE-KEY-MARKER"


@pytest.fixture(autouse=True)
def bwrap() -> None:
    need_bwrap()


def agent(name: str, tools: str) -> str:
    return f"---\nname: {name}\ndescription: {name} agent\ntools: {tools}\n---\nYou {name}.\n"


def project(tmp_path: Path, mark: str, *, args: list[str] | None = None, **agents: str) -> Path:
    """A repository with the probe server, its ``.mcp.json`` (the server's command line holds
    ``mark``, to find its processes by) and ``agents`` (name -> file text)."""
    decl = {"command": "python3", "args": ["tools/probe_server.py", mark, *(args or [])]}
    files = {
        "tools/probe_server.py": SERVER.read_text(),
        ".mcp.json": json.dumps({"mcpServers": {"proj": decl}}),
        **{f".claude/agents/{n}.md": text for n, text in agents.items()},
    }
    return init_repo(tmp_path / "proj", files)


def processes_with(mark: str) -> list[int]:
    """The pids whose command line holds ``mark`` (this test's server, wherever it runs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if mark.encode() in cmdline:
                found.append(int(entry.name))
    return found


def call(tool: str, **args: Any) -> dict[str, Any]:
    return {"tool": tool, "input": args}


def plays(agent: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The conversation of ``agent``: ``calls``, then a final answer."""
    return {"agent": agent, "turns": [{"tool_calls": calls}, {"text": "done"}]}


def child_script(calls: list[dict[str, Any]], **task: Any) -> dict[str, Any]:
    return {
        "conversations": [
            {"depth": 0, "turns": [{"tool_calls": [task_call("go", **task)]}, {"text": "ok"}]},
            {"depth": 1, "turns": [{"tool_calls": calls}, {"text": "done"}]},
        ]
    }


def lead_then_prober() -> dict[str, Any]:
    """``lead`` starts ``prober``, which calls ``mcp__proj__probe``."""
    return {
        "conversations": [
            plays("lead", [task_call("go", subagent_type="prober")]),
            plays("prober", [call("mcp__proj__probe")]),
        ]
    }


def child_of(h: Harness, root: RunRecord) -> RunRecord:
    (child,) = [r for r in h.runs(root.chain_id) if r.depth == 1]
    return child


def results(h: Harness, run: RunRecord) -> list[dict[str, Any]]:
    return tool_results(h.requests_of(run.run_id)[1])


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", MARKER)
    ssh = Path(os.environ["HOME"]) / ".ssh"
    ssh.mkdir(exist_ok=True)
    (ssh / "id_rsa").write_text(KEY + "\n")


@pytest.mark.usefixtures("secrets")
@pytest.mark.parametrize("isolation", ["shared", "worktree"])
def test_a_child_calls_a_project_server_that_runs_inside_its_sandbox(
    tmp_path: Path, isolation: str
) -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    repo = project(tmp_path, mark, prober=agent("prober", "Read, mcp__proj__probe"))
    script = child_script([call("mcp__proj__probe")], subagent_type="prober", isolation=isolation)
    h = harness(repo, script)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    child = child_of(h, root)
    assert child.allowed_tools == ["read_file", "mcp__proj__probe", NO_USERS]  # a repo agent
    # the child was offered the server's tool, with its schema and description
    offered = {t["name"]: t for t in h.requests_of(child.run_id)[0].tools}
    assert set(offered) == {"read_file", "mcp__proj__probe"}
    assert offered["mcp__proj__probe"]["description"] == "Probe the sandbox"
    assert offered["mcp__proj__probe"]["input_schema"] == {"type": "object", "properties": {}}
    # its answer reached the model's next request: the server saw no key and no ssh key
    (result,) = results(h, child)
    assert "ssh=unreadable" in result["content"] and "api_key=<none>" in result["content"]
    assert KEY not in result["content"] and MARKER not in result["content"]
    assert not result.get("is_error")
    assert processes_with(mark) == []  # none of it outlives the run


@pytest.mark.usefixtures("secrets")
def test_a_child_never_gets_an_mcp_tool_its_parent_lacks(tmp_path: Path) -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    repo = project(
        tmp_path,
        mark,
        lead=agent("lead", "Task, Read"),
        prober=agent("prober", "Read, mcp__proj__probe"),
        wide=agent("wide", "Task, mcp__proj__echo"),
    )
    h = harness(repo, lead_then_prober())
    root = h.run(agent="lead")
    assert root.status == RunStatus.SUCCEEDED, root.error
    child = child_of(h, root)
    assert child.allowed_tools == ["read_file", NO_USERS]
    assert [t["name"] for t in h.requests_of(child.run_id)[0].tools] == ["read_file"]
    (refused,) = results(h, child)
    assert refused.get("is_error") and "unknown tool 'mcp__proj__probe'" in refused["content"]
    assert not [e for e in h.store.events(child.run_id) if e["kind"] == "mcp"]  # never started
    # a parent with one tool of the server: a child asking for the whole server gets that one
    script2 = {
        "conversations": [
            plays("wide", [task_call("go", subagent_type="whole")]),
            plays("whole", [call("mcp__proj__probe")]),
        ]
    }
    whole = tmp_path / "more"
    whole.mkdir()
    (whole / "whole.md").write_text(agent("whole", "mcp__proj"))
    h2 = harness(repo, script2, agents_dirs=[whole])
    root2 = h2.run(agent="wide")
    assert root2.status == RunStatus.SUCCEEDED, root2.error
    child2 = child_of(h2, root2)
    assert child2.allowed_tools == ["mcp__proj__echo", NO_USERS]  # below a repo agent
    assert [t["name"] for t in h2.requests_of(child2.run_id)[0].tools] == ["mcp__proj__echo"]
    assert "unknown tool" in results(h2, child2)[0]["content"]
    assert processes_with(mark) == []


FAILURES = {
    "crash": "MCP server 'proj' broke: it exited; it was stopped",
    "big": "MCP server 'proj' broke: it sent a message over 65,536 bytes; it was stopped",
    "junk": "MCP server 'proj' broke: it sent a line that is not a JSON-RPC message; "
    "it was stopped",
    "sleep": "MCP server 'proj': sleep gave no answer in 2s",
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_each_way_a_server_fails_is_one_line_of_tool_error(tmp_path: Path, failure: str) -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    repo = project(tmp_path, mark, prober=agent("prober", "mcp__proj"))
    calls = [call(f"mcp__proj__{failure}")]
    h = harness(
        repo,
        child_script(calls, subagent_type="prober"),
        mcp={"call_timeout_s": 2, "max_line_bytes": 65536},
    )
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    (result,) = results(h, child_of(h, root))
    assert result.get("is_error") and result["content"] == FAILURES[failure]
    assert processes_with(mark) == []


def test_a_server_that_does_not_start_is_a_tool_error_and_a_note(tmp_path: Path) -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    repo = project(
        tmp_path, mark, args=["--exit-at-start"], prober=agent("prober", "mcp__proj__probe")
    )
    h = harness(repo, child_script([call("mcp__proj__probe")], subagent_type="prober"))
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    child = child_of(h, root)
    why = "MCP server 'proj' did not start: it exited (its stderr: probe server: refusing to start)"
    (result,) = results(h, child)
    assert result.get("is_error") and result["content"] == why
    (event,) = [e for e in h.store.events(child.run_id) if e["kind"] == "mcp"]
    assert event["data"]["notes"] == [why]
    assert processes_with(mark) == []


def test_a_run_that_times_out_mid_call_leaves_no_server(tmp_path: Path) -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    repo = project(tmp_path, mark, prober=agent("prober", "mcp__proj"))
    script = {"conversations": [plays("prober", [call("mcp__proj__sleep")])]}
    h = harness(repo, script)
    root = h.run(agent="prober", timeout_seconds=3)
    assert root.status == RunStatus.TIMED_OUT, root.error
    (event,) = [e for e in h.store.events(root.run_id) if e["kind"] == "mcp"]
    assert "mcp__proj__sleep" in event["data"]["tools"]  # it was there, mid-call, when cut
    assert processes_with(mark) == []


def test_without_the_os_sandbox_no_server_starts(tmp_path: Path) -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    repo = project(tmp_path, mark, prober=agent("prober", "mcp__proj__probe"))
    script = child_script([call("mcp__proj__probe")], subagent_type="prober")
    h = harness(repo, script, sandbox=SandboxSettings(os="off"))
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    (result,) = results(h, child_of(h, root))
    assert result.get("is_error") and result["content"] == (
        "MCP server 'proj' did not start: an MCP server runs only in the OS sandbox "
        '(sandbox.os = "bwrap")'
    )
    assert processes_with(mark) == []


def test_an_agents_own_mcp_servers_entry_gives_it_that_servers_tools(tmp_path: Path) -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    own = (
        "---\nname: owner\ndescription: d\ntools: Read\nmcpServers:\n"
        f"  - own: {{command: python3, args: [tools/probe_server.py, {mark}-own]}}\n"
        "---\nYou own.\n"
    )
    repo = project(tmp_path, mark, owner=own)
    calls = [call("mcp__own__echo", x="mine")]
    h = harness(repo, child_script(calls, subagent_type="owner"))
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    child = child_of(h, root)
    assert child.allowed_tools == ["read_file", "mcp__own", NO_USERS]
    names = [t["name"] for t in h.requests_of(child.run_id)[0].tools]
    assert names[0] == "read_file" and "mcp__own__echo" in names and len(names) == 7
    assert results(h, child)[0]["content"] == "echo:mine"
    assert processes_with(mark) == []


def test_the_users_own_servers_serve_the_users_agents_only_and_away_from_the_checkout(
    tmp_path: Path,
) -> None:
    """A server of ``~/.orch/mcp.json`` (its env may hold the user's secrets) is not offered
    to a repository's agent, and starts in the sandbox's private /tmp, so `python -m x` or
    `npx x` cannot load the repository's x with the user's environment."""
    mark = f"mark-{uuid.uuid4().hex}"
    home = Path(os.environ["HOME"])
    decl = {"command": "python3", "args": [str(SERVER), mark], "env": {"DB_URL": "USER-SECRET"}}
    (home / ".orch").mkdir(exist_ok=True)
    (home / ".orch" / "mcp.json").write_text(json.dumps({"mcpServers": {"mine": decl}}))
    (home / ".orch" / "agents").mkdir(exist_ok=True)
    (home / ".orch" / "agents" / "own.md").write_text(agent("own", "mcp__mine__probe"))
    repo = init_repo(tmp_path / "proj", {".claude/agents/theirs.md": agent("theirs", "mcp__mine")})
    for who, offered in (("own", True), ("theirs", False)):
        script = child_script([call("mcp__mine__probe")], subagent_type=who)
        h = harness(repo, script)
        root = h.run()
        child = child_of(h, root)
        tools = {t["name"] for t in h.requests_of(child.run_id)[0].tools}
        assert ("mcp__mine__probe" in tools) is offered, (who, tools)
        (result,) = results(h, child)
        if offered:
            assert "cwd=/tmp" in result["content"], result["content"]
        else:  # a tool it was never offered: refused as unknown
            assert result.get("is_error"), result
    assert processes_with(mark) == []


@pytest.mark.usefixtures("secrets")
@pytest.mark.parametrize(
    ("lead_tools", "lead_denies"),
    [("Task, mcp__proj", "mcp__proj__probe"), (None, "mcp__proj")],
    ids=["a-tool-of-a-granted-server", "a-server-of-every-tool"],
)
def test_an_mcp_tool_denied_to_a_parent_is_denied_to_its_children(
    tmp_path: Path, lead_tools: str | None, lead_denies: str
) -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    tools = f"tools: {lead_tools}\n" if lead_tools else ""
    lead = (
        f"---\nname: lead\ndescription: lead\n{tools}disallowedTools: {lead_denies}\n---\nLead.\n"
    )
    repo = project(tmp_path, mark, lead=lead, prober=agent("prober", "Read, mcp__proj__probe"))
    h = harness(repo, lead_then_prober())
    root = h.run(agent="lead")
    assert root.status == RunStatus.SUCCEEDED, root.error
    child = child_of(h, root)
    assert f"!{lead_denies}" in child.allowed_tools  # kept for its own children too
    offered = [t["name"] for t in h.requests_of(child.run_id)[0].tools]
    assert "mcp__proj__probe" not in offered, offered
    (refused,) = results(h, child)
    assert refused.get("is_error") and "unknown tool 'mcp__proj__probe'" in refused["content"]
    assert processes_with(mark) == []


def test_a_declared_env_the_sandbox_refuses_is_one_line_not_a_failed_run(tmp_path: Path) -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    repo = project(tmp_path, mark, prober=agent("prober", "mcp__proj__probe"))
    decl = {"command": "python3", "args": ["tools/probe_server.py", mark], "env": {}}
    decl["env"] = {"GITHUB_TOKEN": "x"}  # a secret-looking name: refused into the sandbox
    (repo / ".mcp.json").write_text(json.dumps({"mcpServers": {"proj": decl}}))
    h = harness(repo, child_script([call("mcp__proj__probe")], subagent_type="prober"))
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    child = child_of(h, root)
    assert child.status == RunStatus.SUCCEEDED, child.error
    (result,) = results(h, child)
    said = result["content"]
    assert result.get("is_error") and said.startswith("MCP server 'proj' did not start:"), said
    assert "GITHUB_TOKEN" in said and "\n" not in said


class RemoteServer:
    """A streamable-HTTP MCP server on 127.0.0.1 (standard library: JSON answers)."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        seen = self.seen = []  # type: list[str]

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(405)
                self.end_headers()

            def do_DELETE(self) -> None:
                self.send_response(200)
                self.end_headers()

            def do_POST(self) -> None:
                msg = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen.append(str(msg.get("method")))
                if "id" not in msg:
                    self.send_response(202)
                    self.end_headers()
                    return
                params = msg.get("params") or {}
                result: dict[str, Any] = {}
                if msg["method"] == "initialize":
                    result = {
                        "protocolVersion": params.get("protocolVersion", "2025-06-18"),
                        "capabilities": {"tools": {}},
                        "serverInfo": {"name": "remote", "version": "1"},
                    }
                elif msg["method"] == "tools/list":
                    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
                    result = {"tools": [{"name": "echo", "inputSchema": schema}]}
                elif msg["method"] == "tools/call":
                    x = (params.get("arguments") or {}).get("x")
                    result = {"content": [{"type": "text", "text": f"remote echo: {x}"}]}
                body = json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/mcp"
        import threading

        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_remote_server_is_reached_only_by_a_run_with_the_network(tmp_path: Path) -> None:
    remote = RemoteServer()
    try:
        decl = {"type": "http", "url": remote.url}
        files = {".mcp.json": json.dumps({"mcpServers": {"far": decl}})}
        repo = init_repo(tmp_path / "proj", files)
        mine = tmp_path / "mine"  # the user's agents: one of them on the host's network
        mine.mkdir()
        (mine / "near.md").write_text(agent("near", "mcp__far__echo"))
        (mine / "wide.md").write_text(
            "---\nname: wide\ndescription: wide\ntools: mcp__far__echo\nnetwork: host\n---\nW.\n"
        )
        for who, reached in (("near", False), ("wide", True)):
            remote.seen.clear()
            script = {"conversations": [plays(who, [call("mcp__far__echo", x="hi")])]}
            h = harness(repo, script, agents_dirs=[mine])
            root = h.run(agent=who)
            assert root.status == RunStatus.SUCCEEDED, root.error
            (event,) = [e for e in h.store.events(root.run_id) if e["kind"] == "mcp"]
            (result,) = results(h, root)
            if reached:
                assert result["content"] == "remote echo: hi" and not result.get("is_error")
                assert "initialize" in remote.seen and "tools/call" in remote.seen
            else:
                assert remote.seen == []  # not one request: the run has no network
                assert "no network" in event["data"]["notes"][0], event
                assert result.get("is_error")
    finally:
        remote.close()
