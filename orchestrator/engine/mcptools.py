"""A run's MCP tools: its servers opened around its loop (``Execution``), its tool registry
and allow-list with their tools in.

The run's MCP grants (``RunRecord.allowed_tools``: ``mcp__s``, ``mcp__s__t``, ``mcp__*``;
a child's already narrowed to its parent's at admission) name the servers to start; the
agent's own ``mcpServers`` declarations come before the project's. A run with no server
named starts nothing and imports nothing of the SDK. What was not offered, and why, is the
run's ``mcp`` event (``orch logs``).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

from ..catalog.definitions import AgentDefinition, Catalog
from ..config import Settings
from ..mcpclient.names import DENY, denies, is_mcp, servers
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
    if catalog.from_repository(definition):  # the user's servers (their env may hold the
        decls = {n: d for n, d in decls.items() if not d.user}  # user's secrets): not for it
    decls.update({n: d for n, d in definition.mcp_servers.items() if d is not None})
    deny = denies(record.allowed_tools)  # its own disallowedTools and its ancestors' (admission)
    async with open_servers(
        named,
        decls,
        grants=grants,
        deny=deny,
        runtime=runtime,
        env=env,
        cfg=settings.mcp,
        network=network,
    ) as opened:
        mine: list[Tool] = [t for n in tools.names() if (t := tools.get(n)) is not None]
        mine += [McpTool(tool, conn) for tool, conn in opened.tools]
        offered = [tool.name for tool, _ in opened.tools]
        store.add_event(
            record.run_id, "mcp", {"servers": named, "tools": offered, "notes": opened.notes}
        )
        yield RunTools(ToolRegistry(mine), [*builtin, *offered])
