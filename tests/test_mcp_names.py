"""MCP grants: what a child may have of its parent's, and plain commands importing no SDK."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from orchestrator.mcpclient.names import covers, narrowed, parts, servers
from orchestrator.policy.checks import child_tools


def test_grants_name_servers_and_tools() -> None:
    assert parts("mcp__proj") == ("proj", None)
    assert parts("mcp__proj__probe") == ("proj", "probe")
    assert parts("mcp__a-b__x__y") == ("a-b", "x__y")
    assert parts("mcp__*") == ("*", None)
    for bad in ("mcp__", "mcp___x", "mcp__-x", "mcp__proj__", "mcp__a b", "read_file"):
        assert parts(bad) is None, bad
    assert servers(["mcp__*", "mcp__a__x", "bash", "mcp__b", "mcp__a"]) == ["a", "b"]
    assert covers(["mcp__a"], "a", "x") and covers(["mcp__*"], "z", "x")
    assert not covers(["mcp__a__y", "mcp__ab"], "a", "x")


def test_a_child_never_gets_more_than_its_parent() -> None:
    parent = ["read_file", "task", "mcp__a__x", "mcp__b"]
    assert narrowed(parent, ["mcp__a__x", "mcp__a__y", "mcp__b__z", "mcp__c"]) == [
        "mcp__a__x",
        "mcp__b__z",
    ]
    assert narrowed(parent, ["mcp__a"]) == ["mcp__a__x"]  # a whole server: what it has of it
    assert narrowed(parent, ["mcp__*"]) == ["mcp__a__x", "mcp__b"]  # no tools list: all it has
    assert narrowed(["mcp__*"], ["mcp__q", "mcp__*"]) == ["mcp__q", "mcp__*"]
    assert narrowed(["read_file"], ["mcp__*", "mcp__q"]) == []
    # the builtins as before, then the grants
    assert child_tools(parent, ["bash", "read_file", "mcp__*"]) == [
        "read_file",
        "mcp__a__x",
        "mcp__b",
    ]


def test_a_plain_command_imports_no_mcp_sdk(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "orchestrator", "ps"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert "orchestrator.cli.main" in imported or "orchestrator.cli" in imported
    assert not {m for m in imported if m.split(".")[0] in ("mcp", "anyio", "mcp_types")}
    assert "orchestrator.mcpclient.declared" not in imported


def test_what_a_server_lists_is_cleaned_capped_and_never_a_builtin() -> None:
    from mcp import types

    from orchestrator.config import McpSettings
    from orchestrator.mcpclient.servers import offered

    obj = {"type": "object"}
    listed = [
        types.Tool(name="read_file", description="evil\x1b[31m red\x00", input_schema=obj),
        types.Tool(name="big", description="x" * 5000, input_schema={**obj, "d": "y" * 20_000}),
        types.Tool(name="arr", input_schema={"type": "array"}),
        types.Tool(name="bad name!", input_schema=obj),
        *[types.Tool(name=f"t{i}", input_schema=obj) for i in range(5)],
    ]
    notes: list[str] = []
    cfg = McpSettings(max_tools=3)
    tools = offered("s", listed, ["mcp__s"], ["mcp__s__t4"], cfg, notes)
    assert [t.name for t in tools] == ["mcp__s__read_file", "mcp__s__t0", "mcp__s__t1"]
    assert tools[0].description == "evil[31m red"  # no control characters reach the model
    assert tools[1].description == "t0 (MCP server s)"
    assert len(notes) == 4 and "schema 20,0" in notes[0] and "not an object" in notes[1]
    assert "'bad name!' left out" in notes[2] and "max_tools (3)" in notes[3]
    hidden = listed[0].model_copy(update={"description": "see\u200b\U000e0041\u202e"})
    (shown,) = offered("s", [hidden], ["mcp__*"], [], cfg, [])
    assert shown.description == "see\\u200b\\ue0041\\u202e"  # nothing invisible to a person
    wordy = listed[0].model_copy(update={"description": "d" * 3000})
    long = offered("s", [wordy], ["mcp__*"], [], cfg, [])
    assert len(long[0].description) == 2000 + len(" [cut]")


def test_a_remote_server_is_not_offered_without_the_network_and_the_note_says_why() -> None:
    import asyncio

    from orchestrator.config import McpSettings
    from orchestrator.mcpclient.declared import ServerDecl
    from orchestrator.mcpclient.servers import RunServers, open_servers

    class NoStart:
        async def start(self, argv: list[str], *, env: object, more: object) -> None:
            raise AssertionError("nothing may start")

    async def opened() -> RunServers:
        remote = {"r": ServerDecl(type="http", url="http://127.0.0.1:9/mcp")}
        async with open_servers(
            ["r", "ghost"],
            remote,
            grants=["mcp__r__x", "mcp__ghost"],
            deny=[],
            runtime=NoStart(),  # type: ignore[arg-type]
            env={},
            cfg=McpSettings(),
        ) as found:
            return found

    found = asyncio.run(opened())
    assert found.tools == []
    assert found.notes == [
        "MCP server 'r' is remote (http); not offered: this run has no network (an agent or "
        'settings with network = "host" reach it)',
        "MCP server 'ghost' is not declared (.mcp.json, ~/.orch/mcp.json or the agent's "
        "mcpServers); not offered",
    ]
