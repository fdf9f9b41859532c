"""A tool: a name, a description, a pydantic input model and an async ``run``.

Tools never check permissions themselves: the agent loop sends every call
through the policy first (see ``agent.py``). Tools do record evidence (files
read and written, commands and their exit codes) on the run context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from ..agent import RunContext
    from ..config import Settings


class ToolInput(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class ToolOutput:
    content: str
    is_error: bool = False


class ToolFailure(Exception):
    """Raised inside a tool: becomes an ``is_error`` tool_result with this message."""


_SCHEMAS: dict[type[Tool], dict[str, Any]] = {}


class Tool:
    name: ClassVar[str]
    description: ClassVar[str]
    input_model: ClassVar[type[ToolInput]]
    read_only: ClassVar[bool] = False

    def schema(self) -> dict[str, Any]:
        """The schema sent to the model; built once per tool class (pydantic is slow at it)."""
        cached = _SCHEMAS.get(type(self))
        if cached is None:
            schema = self.input_model.model_json_schema()
            schema.pop("title", None)
            for prop in schema.get("properties", {}).values():
                prop.pop("title", None)
            cached = {"name": self.name, "description": self.description, "input_schema": schema}
            _SCHEMAS[type(self)] = cached
        return dict(cached)  # shallow: the nested schema is shared and never mutated

    def time_limit(self, args: Any, settings: Settings) -> float | None:
        """Seconds a call may take before it is cancelled (None: the tool bounds itself)."""
        return settings.tool_timeout_s

    async def run(self, ctx: RunContext, args: Any) -> ToolOutput:
        raise NotImplementedError


class ToolRegistry:
    """Name → tool. Order is kept: it is the order of the schema the model sees."""

    def __init__(self, tools: list[Tool] | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools or []:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self, allowed: set[str] | frozenset[str]) -> list[dict[str, Any]]:
        return [t.schema() for n, t in self._tools.items() if n in allowed]
