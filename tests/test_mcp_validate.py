"""``orch agents validate`` on MCP: an unknown server, and (the server started in the OS
sandbox to list its tools) a tool it does not have; declarations' own errors; no traceback."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from orchestrator.mcpclient.declared import load_declared
from tests.support import init_repo, orch
from tests.test_mcp_client import agent, bwrap, processes_with, project

__all__ = ["bwrap"]  # its autouse fixture, for this module too


@pytest.mark.bwrap
def test_validate_reports_unknown_servers_and_tools(tmp_path: Path) -> None:
    mark = f"mark-{uuid.uuid4().hex}"
    text = agent("prober", "Read, mcp__proj__probe, mcp__proj__nope, mcp__ghost__x")
    repo = project(tmp_path, mark, prober=text)
    path = repo / ".claude" / "agents" / "prober.md"
    done = orch("agents", "validate", str(path), cwd=repo, env={"COLUMNS": "500"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any("MCP server 'ghost' is not declared" in ln for ln in lines), done.stdout
    nope = [ln for ln in lines if "has no tool 'nope'" in ln]
    assert len(nope) == 1 and "started sandboxed" in nope[0] and "probe" in nope[0]
    assert not any("'probe'" in ln and "has no tool" in ln for ln in lines)
    assert processes_with(mark) == []
    # without starting anything: the unknown server only
    quiet = orch("agents", "validate", "--no-start", str(path), cwd=repo)
    assert "ghost" in quiet.stdout and "nope" not in quiet.stdout


def test_validate_names_a_broken_declaration_in_one_line(tmp_path: Path) -> None:
    servers = {"proj": {"command": "x", "timeout": 5}, "bad": {"args": []}, "a__b": {}}
    repo = init_repo(
        tmp_path / "proj",
        {
            ".mcp.json": json.dumps({"mcpServers": servers}),
            ".claude/agents/a.md": agent("a", "mcp__proj, mcp__bad"),
        },
    )
    where = str(repo / ".claude/agents/a.md")
    done = orch("agents", "validate", "--no-start", where, cwd=repo, env={"COLUMNS": "500"})
    assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr
    mcp_json = repo / ".mcp.json"
    assert f"{mcp_json}: server 'bad': a stdio server needs 'command'" in done.stdout
    assert "server name 'a__b'" in done.stdout
    assert "MCP server 'bad' is not declared" in done.stdout
    found = load_declared(repo, tmp_path / "nohome")
    assert list(found.servers) == ["proj"]
    assert found.warnings == [f"{mcp_json}: server 'proj': timeout ignored"]


def test_declarations_project_wins_links_are_not_followed_and_size_is_capped(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    (home / ".orch").mkdir(parents=True)
    mine = {"mcpServers": {"proj": {"command": "mine"}, "only": {"command": "u"}}}
    (home / ".orch" / "mcp.json").write_text(json.dumps(mine))
    repo = init_repo(tmp_path / "proj", {".mcp.json": '{"mcpServers": {"proj": {"command": "p"}}}'})
    found = load_declared(repo, home)
    assert {n: d.command for n, d in found.servers.items()} == {"proj": "p", "only": "u"}
    (repo / ".mcp.json").unlink()
    (repo / ".mcp.json").symlink_to(home / ".orch" / "mcp.json")  # out of the repository
    linked = load_declared(repo, tmp_path / "nohome")
    assert linked.servers == {} and len(linked.errors) == 1 and "cannot read" in linked.errors[0]
    (repo / ".mcp.json").unlink()
    (repo / ".mcp.json").write_text(" " * (300 * 1024))
    big = load_declared(repo, tmp_path / "nohome")
    assert big.servers == {} and "over the 262,144 read" in big.errors[0]


def test_an_agents_mcp_servers_parse_or_fail_in_one_line(tmp_path: Path) -> None:
    from orchestrator.catalog.definitions import DefinitionError, parse_agent

    head = "---\nname: a\ndescription: d\n"
    a = parse_agent(head + "mcpServers:\n  - docs\n  - own: {command: x, extra: 1}\n---\n", "a.md")
    assert a.mcp_servers["docs"] is None and a.mcp_servers["own"].command == "x"
    assert any("server 'own': extra ignored" in w for w in a.warnings)
    assert a.allowed_tools(["read_file"]) == ["read_file", "mcp__*", "mcp__docs", "mcp__own"]
    mapping = parse_agent(head + "mcpServers: {docs: null}\ntools: Read\n---\n", "a.md")
    assert mapping.allowed_tools(["read_file"]) == ["read_file", "mcp__docs"]
    denied = parse_agent(
        head + "tools: mcp__docs, mcp__x__y\ndisallowedTools: mcp__x__y\n---\nHi", "a"
    )
    assert denied.warnings == [] and denied.allowed_tools([]) == ["mcp__docs"]
    for bad, why in [
        ("mcpServers: 3", "must be a list of server names"),
        ("mcpServers: [{own: {args: []}}]", "server 'own': a stdio server needs 'command'"),
        ("mcpServers: [a__b]", "'a__b' is not a server name"),
        ("mcpServers: [{own: {type: ftp, command: x}}]", "server 'own': type: Input should be"),
    ]:
        with pytest.raises(DefinitionError) as e:
            parse_agent(head + bad + "\n---\n", "a.md")
        assert why in str(e.value) and "\n" not in str(e.value), str(e.value)
