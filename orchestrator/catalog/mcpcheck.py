"""``orch agents validate`` on MCP: the servers an agent names, and their tools.

A server an agent names (in ``tools`` or ``mcpServers``) must be declared: in the agent's
own ``mcpServers``, the project's ``.mcp.json`` or ``~/.orch/mcp.json``. Where it is, and
``start`` is asked, the server is started to list its tools, as a run would start it:
under bubblewrap (no network, the environment whitelist, secrets hidden), with the project
read-only and a short timeout, then stopped; a tool the agent names that it does not list
is reported. A server that cannot be started so is reported as not checked. The user's server
(``~/.orch/mcp.json``, a user's agent's own) named by a repository's agent (``owner.py``) is
reported as never offered to it, and not started; one named by the user's agent starts only
from a program outside the project (``policy/mcpcommand.py``), as in a run.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Collection, Mapping
from pathlib import Path

from ..config import Settings
from ..mcpclient.declared import Declared, ServerDecl
from ..mcpclient.names import parts, servers
from ..policy.mcpcommand import users_server, workspace_roots
from ..workspaces.base import WorkspaceSpec
from ..workspaces.piped import Piped
from ..workspaces.spare import Shell
from .definitions import AgentDefinition

CHECK_TIMEOUT_S = 10.0
WHERE = "(.mcp.json, ~/.orch/mcp.json or the agent's mcpServers)"


def named(d: AgentDefinition) -> tuple[list[str], dict[str, list[str]]]:
    """The servers ``d`` names, and the tools it names one by one, per server."""
    grants = [t for t in d.allowed_tools([]) if t.startswith("mcp__")]
    tools: dict[str, list[str]] = {}
    for grant in grants:
        found = parts(grant)
        if found is not None and found[1] is not None:
            tools.setdefault(found[0], []).append(found[1])
    return servers(grants), tools


class _ReadOnly:
    """Starts a server as a shared-tier run would, but with the project read-only."""

    def __init__(self, root: Path, settings: Settings) -> None:
        spec = WorkspaceSpec(
            run_id=f"validate-{uuid.uuid4().hex[:8]}",
            chain_id="validate",
            agent="validate",
            description="orch agents validate",
            base=root,
            sandbox=settings.sandbox,
        )
        self.shell = Shell(spec, root, read_only_within=(root,), hidden_within=(root / ".orch",))

    async def start(
        self, argv: list[str], *, env: Mapping[str, str], more: Mapping[str, str]
    ) -> Piped:
        return await self.shell.start(argv, env, more)


async def listed_tools(
    name: str, decl: ServerDecl, root: Path, settings: Settings
) -> tuple[list[str] | None, str]:
    """The tools ``decl`` lists (None, and why, when it could not be asked)."""
    from ..mcpclient.servers import open_servers

    cfg = settings.mcp.model_copy(update={"start_timeout_s": CHECK_TIMEOUT_S})
    starter = _ReadOnly(root, settings)
    env = dict(os.environ)
    roots = workspace_roots(root)
    try:
        async with open_servers(
            [name],
            {name: decl},
            grants=[f"mcp__{name}"],
            deny=[],
            runtime=starter,
            env=env,
            cfg=cfg,
            prepare=lambda d: users_server(d, roots, env),
        ) as opened:
            tools = [t.remote for t, _ in opened.tools]
            return (None, opened.notes[0]) if opened.notes and not tools else (tools, "")
    finally:
        await starter.shell.aclose()


async def mcp_warnings(
    agents: list[AgentDefinition],
    declared: Declared,
    root: Path | None,
    settings: Settings,
    *,
    start: bool,
    theirs: Collection[str] = (),
) -> dict[str, list[str]]:
    """Per agent name: what is wrong with the MCP servers and tools it names (``theirs``:
    the names of the repository's agents)."""
    found: dict[str, list[str]] = {}
    asked: dict[str, tuple[list[str] | None, str]] = {}
    for d in agents:
        mine = found.setdefault(d.name, [])
        names, tools = named(d)
        if names:
            mine += [f"MCP declarations: {e}" for e in declared.errors]
        for server in names:
            own = d.mcp_servers.get(server)
            if own is not None:  # its own declaration: the user's unless the agent is not
                own = own.model_copy(update={"user": d.name not in theirs})
            decl = own or declared.servers.get(server)
            if decl is None:
                mine.append(f"MCP server {server!r} is not declared {WHERE}")
                continue
            if decl.user and d.name in theirs:
                mine.append(
                    f"MCP server {server!r} is the user's ({decl.source or '~/.orch/mcp.json'}): "
                    "never offered to a repository's agent, nor to any run below one"
                )
                continue
            if not tools.get(server) or not start or root is None:
                continue
            key = decl.model_dump_json()
            if key not in asked:
                asked[key] = await listed_tools(server, decl, root, settings)
            listed, why = asked[key]
            if listed is None:
                mine.append(f"MCP server {server!r}: tools not checked: {why}")
                continue
            for tool in tools[server]:
                if tool not in listed:
                    have = ", ".join(listed[:20]) or "none"
                    mine.append(
                        f"MCP server {server!r} (started sandboxed to list its tools) has no "
                        f"tool {tool!r}; it lists: {have}"
                    )
    return found
