"""A tool of an MCP server the run started (``mcpclient.servers``): ``mcp__<server>__<tool>``.

Its schema and description are the server's (cleaned and capped when listed); its input is
whatever object the model sends, which the server checks against its own schema. A call goes
through the policy and hooks like any other (the agent loop's ``_execute``); its time limit
is the server's call timeout plus a margin (the connection gives up first, with one line).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import ConfigDict

from ..config import Settings
from ..mcpclient.servers import Connection, ServerTool
from .base import Tool, ToolContext, ToolInput, ToolOutput


class McpInput(ToolInput):
    model_config = ConfigDict(extra="allow")


class McpTool(Tool):
    input_model: ClassVar[type[ToolInput]] = McpInput

    def __init__(self, tool: ServerTool, connection: Connection) -> None:
        self.name = tool.name
        self.description = tool.description
        self.tool = tool
        self.connection = connection

    def schema(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.tool.schema,
        }

    def time_limit(self, args: Any, settings: Settings) -> float | None:
        return settings.mcp.call_timeout_s + 10

    async def run(self, ctx: ToolContext, args: Any) -> ToolOutput:
        sent = args.model_extra if isinstance(args, McpInput) else None
        text, is_error = await self.connection.call(self.tool.remote, dict(sent or {}))
        return ToolOutput(text, is_error)
