"""A run's MCP tools: its servers opened around its loop (``Execution``), its tool registry
and allow-list with their tools in.

The run's MCP grants (``RunRecord.allowed_tools``: ``mcp__s``, ``mcp__s__t``, ``mcp__*``;
a child's already narrowed to its parent's at admission) name the servers to start; the
agent's own ``mcpServers`` declarations come before the project's. A run with no server
named starts nothing and imports nothing of the SDK. What was not offered, and why, is the
run's ``mcp`` event (``orch logs``).

The user's servers (``~/.orch/mcp.json``, and a user's agent's own ``mcpServers``: their env
may hold the user's secrets) belong to the chain, not to a name: a repository's agent
(``catalog/owner.py``) is never offered one, nor is any run below it, whichever agent that
is (its allowed_tools keep ``names.NO_USERS``, set at admission). Where one is offered, it
starts only from a program outside every workspace (``policy/mcpcommand.py``).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

from ..catalog.definitions import AgentDefinition, Catalog
from ..config import Settings
from ..mcpclient.declared import ServerDecl
from ..mcpclient.names import DENY, NO_USERS, denies, is_mcp, servers
from ..policy.mcpcommand import users_server, workspace_roots
from ..run import RunRecord
from ..store import RunStore
from ..tools.base import Tool, ToolRegistry
from ..workspaces.base import Runtime


@dataclass
class RunTools:
    """What a run may call: its registry (the runner's tools, and its servers') and the
    names it is allowed (the MCP grants replaced by the tools they cover)."""

    registry: ToolRegistry
    allowed: list[str]


@asynccontextmanager
async def run_tools(
    record: RunRecord,
    definition: AgentDefinition,
    catalog: Catalog,
    tools: ToolRegistry,
    *,
    runtime: Runtime,
    env: Mapping[str, str],
    settings: Settings,
    store: RunStore,
    model: bool = True,
    network: bool = False,
) -> AsyncIterator[RunTools]:
    """``model``: the run is a model's loop (a driver's run, a team's, calls no tool: no
    server starts for it); ``network``: its tier reaches the network (a remote server may be
    connected to)."""
    grants = [t for t in record.allowed_tools if is_mcp(t)]
    builtin = [t for t in record.allowed_tools if not is_mcp(t) and not t.startswith(DENY)]
    named = servers(grants) if model else []
    if not named:
        yield RunTools(tools, builtin)
        return
    # the SDK's import takes ≈ 0.7 s: in a thread, not in the loop the other runs share
    await asyncio.to_thread(importlib.import_module, "orchestrator.tools.mcptool")
    from ..mcpclient.servers import open_servers
    from ..tools.mcptool import McpTool

    decls = {**catalog.mcp.servers} if catalog.mcp is not None else {}
    theirs = catalog.from_repository(definition)
    for name, decl in definition.mcp_servers.items():  # its own: the user's, or the repo's
        if isinstance(decl, ServerDecl):
            decls[name] = decl.model_copy(update={"user": not theirs})
    notes: list[str] = []
    if theirs or NO_USERS in record.allowed_tools:  # below a repository's agent
        notes = [f"MCP server {n!r} is the user's: {_NOT_BELOW}" for n in named if _users(decls, n)]
        decls = {n: d for n, d in decls.items() if not d.user}
        named = [n for n in named if n in decls]
    deny = denies(record.allowed_tools)  # its own disallowedTools and its ancestors' (admission)
    roots = workspace_roots(runtime.root, *([catalog.root] if catalog.root else []))
    container = record.isolation == "container"  # its own filesystem and PATH (the image's)

    def prepare(decl: ServerDecl) -> ServerDecl:
        return decl if container else users_server(decl, roots, env)

    async with open_servers(
        named,
        decls,
        grants=grants,
        deny=deny,
        runtime=runtime,
        env=env,
        cfg=settings.mcp,
        network=network,
        prepare=prepare,
    ) as opened:
        mine: list[Tool] = [t for n in tools.names() if (t := tools.get(n)) is not None]
        mine += [McpTool(tool, conn) for tool, conn in opened.tools]
        offered = [tool.name for tool, _ in opened.tools]
        notes += opened.notes
        store.add_event(record.run_id, "mcp", {"servers": named, "tools": offered, "notes": notes})
        yield RunTools(ToolRegistry(mine), [*builtin, *offered])


_NOT_BELOW = "not offered to a repository's agent, nor to any run below one"


def _users(decls: Mapping[str, ServerDecl], name: str) -> bool:
    found = decls.get(name)
    return found is not None and found.user
