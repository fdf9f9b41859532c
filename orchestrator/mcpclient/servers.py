"""A run's MCP servers: started in its sandbox before its first request, stopped at its end.

:func:`open_servers` starts each server a run's grants name (an agent's own ``mcpServers``
entry first, else the project's declaration) through the run's ``Runtime.start`` (its
bubblewrap, or its container: never the host), initializes it, lists its tools and keeps
those the grants cover: ``mcp__<server>__<tool>`` with the server's description and input
schema, both from an untrusted program, so cleaned and capped (``max_tools``,
``max_schema_bytes``; a name the Messages API would refuse is left out). Every way a server
fails (it does not start, times out, crashes, says too much or nonsense) is one line: a note
on the run for a server that never started, the tool error of each call after it broke.
Leaving the ``async with`` closes every session and kills every server's process group.
A remote server (http, sse) is connected to from orch's process, and only for a run whose
tier has the network (:func:`connect_remote`).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import mcp.types as types
from mcp import ClientSession
from mcp.shared.exceptions import MCPError

from ..config import McpSettings
from ..errors import OrchError
from ..untrusted import for_model
from ..workspaces.piped import Piped
from .declared import ServerDecl
from .names import covers, parts, tool_name, tool_name_ok, within
from .transport import Link, piped_streams

DESCRIPTION_CHARS = 2000
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
MAX_PAGES = 10  # tools/list pages read


def clean(text: object, limit: int) -> str:
    """Text a server sent, as safe to show a model: no control characters, and what a
    person would not see (bidi, zero-width, Unicode tags) written out; capped."""
    out = for_model(_CONTROL.sub("", str(text)))
    return out if len(out) <= limit else out[:limit] + " [cut]"


# the user's server, made ready to start (``policy/mcpcommand.py``); OrchError: not started
Prepare = Callable[[ServerDecl], ServerDecl]


class Starter(Protocol):
    """Where a server starts: a run's ``Runtime`` (its sandbox)."""

    async def start(
        self, argv: list[str], *, env: Mapping[str, str], more: Mapping[str, str]
    ) -> Piped: ...


@dataclass
class ServerTool:
    name: str  # mcp__<server>__<tool>
    remote: str  # the server's own name for it
    description: str
    schema: dict[str, Any]


@dataclass
class Connection:
    """One started server: its session, and why it broke once it has."""

    name: str
    link: Link
    session: ClientSession | None
    timeout_s: float
    failed: str | None = None  # why it did not start

    def _broken(self) -> str:
        return f"MCP server {self.name!r} broke: {self.link.why}; it was stopped"

    async def call(self, remote: str, args: dict[str, Any]) -> tuple[str, bool]:
        """The text of a call's result, and whether it is an error (one line when it failed)."""
        if self.failed is not None or self.session is None:
            return f"MCP server {self.name!r} did not start: {self.failed}", True
        if self.link.why is not None:
            return self._broken(), True
        try:
            with anyio.fail_after(self.timeout_s):
                result = await self.session.call_tool(remote, args)
        except TimeoutError:
            if self.link.why is not None:
                return self._broken(), True
            return f"MCP server {self.name!r}: {remote} gave no answer in {self.timeout_s:g}s", True
        except MCPError as e:
            if self.link.why is not None:
                return self._broken(), True
            return f"MCP server {self.name!r}: {remote} failed: {clean(e.error.message, 300)}", True
        except Exception as e:  # the SDK's own word on a bad answer: one line
            if self.link.why is not None:
                return self._broken(), True
            why = clean(f"{type(e).__name__}: {e}".splitlines()[0], 300)
            return f"MCP server {self.name!r}: {remote} failed: {why}", True
        return result_text(result), bool(result.is_error)


def result_text(result: types.CallToolResult) -> str:
    parts: list[str] = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            parts.append(block.text)
        else:
            parts.append(f"[{block.type} content not shown]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


@dataclass
class RunServers:
    """What a run's servers offer: tools (with the connection each calls), and notes (why
    a server or tool is not offered)."""

    tools: list[tuple[ServerTool, Connection]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def offered(
    server: str,
    listed: list[types.Tool],
    grants: list[str],
    deny: list[str],
    cfg: McpSettings,
    notes: list[str],
) -> list[ServerTool]:
    """The tools of ``listed`` the grants cover and ``deny`` does not, cleaned and capped."""
    out: list[ServerTool] = []
    seen: set[str] = set()
    for tool in listed:
        name = tool_name(server, tool.name)
        low = name.lower()  # a deny holds for every spelling a server gives the name
        if not covers(grants, server, tool.name) or any(within(low, d.lower()) for d in deny):
            continue
        if not tool_name_ok(name) or name in seen:
            notes.append(f"MCP server {server!r}: tool {clean(tool.name, 80)!r} left out (name)")
            continue
        schema = dict(tool.input_schema)
        size = len(json.dumps(schema))
        if schema.get("type") != "object" or size > cfg.max_schema_bytes:
            why = f"{size:,} bytes" if size > cfg.max_schema_bytes else "not an object"
            notes.append(f"MCP server {server!r}: tool {tool.name!r} left out (schema {why})")
            continue
        if len(out) >= cfg.max_tools:
            notes.append(f"MCP server {server!r}: tools past max_tools ({cfg.max_tools}) left out")
            break
        seen.add(name)
        desc = clean(tool.description or f"{tool.name} (MCP server {server})", DESCRIPTION_CHARS)
        out.append(ServerTool(name, tool.name, desc, schema))
    return out


def named_tools(server: str, grants: list[str]) -> list[str]:
    """The tools of ``server`` that ``grants`` name one by one."""
    found = [parts(g) for g in grants]
    return [p[1] for p in found if p is not None and p[0] == server and p[1] is not None]


async def _listed(session: ClientSession, cfg: McpSettings) -> list[types.Tool]:
    tools: list[types.Tool] = []
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor or len(tools) > cfg.max_tools * 2:
            break
    return tools


async def start_server(
    stack: AsyncExitStack,
    name: str,
    decl: ServerDecl,
    runtime: Starter,
    env: Mapping[str, str],
    cfg: McpSettings,
    prepare: Prepare | None = None,
) -> tuple[Connection, list[types.Tool]]:
    """Start one server in ``runtime`` (its closing pushed on ``stack``), initialize it and
    list its tools; OrchError with the one line that says why it did not. The user's server
    is first made ready by ``prepare`` (none given: it is not started)."""
    if decl.type != "stdio" or decl.command is None:
        raise OrchError(f"a remote ({decl.type}) server; orch starts stdio servers only")
    if decl.user:
        if prepare is None:
            raise OrchError("the user's server has no checked command here; not started")
        decl = prepare(decl)
    link = Link(name)
    argv = [decl.command or "", *decl.args]
    if decl.user:  # the user's server starts in the sandbox's private /tmp, not the workspace:
        # `python -m x` or `npx x` must not load the repository's x with the user's env
        argv = ["/bin/sh", "-c", 'cd /tmp && exec "$@"', "mcp-server", *argv]
    try:
        piped = await runtime.start(argv, env=env, more=decl.env)
    except (ValueError, OSError) as e:  # a name the sandbox refuses, a NUL, no such program
        raise OrchError(f"cannot start it: {clean(e, 300)}") from None
    stack.push_async_callback(piped.stop)
    streams = piped_streams(piped, link, max_line=cfg.max_line_bytes)
    read, write = await stack.enter_async_context(streams)
    return await _initialized(stack, name, link, read, write, cfg)


async def connect_remote(
    stack: AsyncExitStack, name: str, decl: ServerDecl, cfg: McpSettings
) -> tuple[Connection, list[types.Tool]]:
    """Connect to a remote (http: streamable HTTP, sse) server from orch's process: only for
    a run whose tier has the network (``open_servers``); OrchError with the one line."""
    from mcp.client.sse import sse_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    assert decl.url is not None
    # entered without a deadline of ours (a transport's task group may not outlive a cancel
    # scope it was made in): initialize's deadline below bounds a server that never answers
    try:
        if decl.type == "sse":
            got = await stack.enter_async_context(sse_client(decl.url, dict(decl.headers)))
        else:
            client = create_mcp_http_client(headers=dict(decl.headers))
            await stack.enter_async_context(client)
            got = await stack.enter_async_context(
                streamable_http_client(
                    decl.url, http_client=client, max_sse_event_size=cfg.max_line_bytes
                )
            )
    except Exception as e:
        raise OrchError(f"cannot reach {decl.url}: {clean(type(e).__name__, 100)}") from None
    return await _initialized(stack, name, Link(name), got[0], got[1], cfg)


async def _initialized(
    stack: AsyncExitStack, name: str, link: Link, read: Any, write: Any, cfg: McpSettings
) -> tuple[Connection, list[types.Tool]]:
    """The session over ``read``/``write``, initialized, and the server's tools."""
    session = await stack.enter_async_context(ClientSession(read, write))
    try:
        with anyio.fail_after(cfg.start_timeout_s):
            await session.initialize()
            listed = await _listed(session, cfg)
    except TimeoutError:
        why = link.why or f"no answer to initialize/tools/list in {cfg.start_timeout_s:g}s"
        raise OrchError(why) from None
    except Exception as e:
        raise OrchError(
            link.why or clean(f"{type(e).__name__}: {e}".splitlines()[0], 300)
        ) from None
    return Connection(name, link, session, cfg.call_timeout_s), listed


@asynccontextmanager
async def open_servers(
    names: list[str],
    decls: Mapping[str, ServerDecl],
    *,
    grants: list[str],
    deny: list[str],
    runtime: Starter,
    env: Mapping[str, str],
    cfg: McpSettings,
    network: bool = False,
    prepare: Prepare | None = None,
) -> AsyncIterator[RunServers]:
    """The servers ``names`` (declared in ``decls``) started for one run, open while the
    ``async with`` lasts; none outlives it (cancel included). A remote one is connected to
    only when the run's tier has the ``network``; the user's stdio one after ``prepare``."""
    found = RunServers()
    async with AsyncExitStack() as outer:
        for name in names:
            decl = decls.get(name)
            if decl is None:
                where = ".mcp.json, ~/.orch/mcp.json or the agent's mcpServers"
                found.notes.append(f"MCP server {name!r} is not declared ({where}); not offered")
                continue
            if decl.type != "stdio" and not network:
                found.notes.append(
                    f"MCP server {name!r} is remote ({decl.type}); not offered: this run has "
                    'no network (an agent or settings with network = "host" reach it)'
                )
                continue
            inner = AsyncExitStack()
            await outer.enter_async_context(inner)
            try:
                if decl.type == "stdio":
                    conn, listed = await start_server(inner, name, decl, runtime, env, cfg, prepare)
                else:
                    conn, listed = await connect_remote(inner, name, decl, cfg)
            except OrchError as e:
                await inner.aclose()
                found.notes.append(f"MCP server {name!r} did not start: {e}")
                failed = Connection(name, Link(name), None, cfg.call_timeout_s, failed=str(e))
                for remote in named_tools(name, grants):  # named: each call says why
                    schema = {"type": "object", "properties": {}}
                    desc = f"(unavailable: MCP server {name!r} did not start)"
                    found.tools.append(
                        (ServerTool(tool_name(name, remote), remote, desc, schema), failed)
                    )
                continue
            for tool in offered(name, listed, grants, deny, cfg, found.notes):
                found.tools.append((tool, conn))
        yield found
