"""A tool: a name, a description, a pydantic input model and an async ``run``.

Tools never check permissions themselves: the agent loop sends every call
through the policy first (see ``agent.py``). A tool gets a narrow
:class:`ToolContext`: the run's workspace :class:`Runtime` (the only way to
its files and commands), a :class:`Spawner` for delegation, the skills, and
where to note evidence (files read and written, commands and exit codes).
No tool module imports the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict

from ..catalog.definitions import SkillDefinition
from ..config import Settings
from ..run import Evidence
from ..workspaces.base import Runtime


class ToolInput(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class ToolOutput:
    content: str
    is_error: bool = False


class ToolFailure(Exception):
    """Raised inside a tool: becomes an ``is_error`` tool_result with this message."""


class TaskArgs(Protocol):
    """What a ``task`` call asks for (``tools.delegate.TaskInput``)."""

    @property
    def description(self) -> str: ...
    @property
    def prompt(self) -> str: ...
    @property
    def subagent_type(self) -> str | None: ...
    @property
    def model(self) -> str | None: ...
    @property
    def isolation(self) -> str | None: ...
    @property
    def run_in_background(self) -> bool: ...
    @property
    def resume(self) -> str | None: ...


class Spawner(Protocol):
    """Delegation as the tools see it: start a child, collect it, stop it."""

    async def spawn(self, args: TaskArgs) -> ToolOutput: ...

    async def output(self, task_id: str, *, block: bool, timeout_s: float | None) -> ToolOutput: ...

    async def stop(self, task_id: str) -> ToolOutput: ...


class TaskView(Protocol):
    """A task on a lead team's board, as its tools show it (``teams.board.BoardTask``)."""

    @property
    def id(self) -> str: ...
    @property
    def title(self) -> str: ...
    @property
    def detail(self) -> str: ...
    @property
    def notes(self) -> list[str]: ...


class BoardSeat(Protocol):
    """A run's place on a lead team's board (``teams.board.Seat``): the board tools act
    through it, as its member, with its role's rights."""

    @property
    def name(self) -> str: ...
    @property
    def role(self) -> str: ...

    def add(self, title: str, detail: str, depends_on: list[str]) -> TaskView: ...

    def update(self, task_id: str, **changes: object) -> TaskView: ...

    def claim(self) -> TaskView | None: ...

    def done(self, task_id: str, summary: str) -> TaskView: ...

    def message(self, to: str, text: str) -> object: ...

    def listing(self) -> str: ...

    async def wait(self, timeout_s: float) -> str: ...


@dataclass
class ToolContext:
    """What one run's tools may use, and nothing more."""

    run_id: str
    runtime: Runtime
    settings: Settings
    env: Mapping[str, str]  # for commands: the run's scrubbed environment
    evidence: Evidence
    spawner: Spawner
    skills: Mapping[str, SkillDefinition]
    board: BoardSeat | None = None  # a lead team's member: its seat at the board


_SCHEMAS: dict[type[Tool], dict[str, Any]] = {}


class Tool:
    name: str  # a class's own, or (an MCP server's tool: ``mcptool.py``) an instance's
    description: str
    input_model: ClassVar[type[ToolInput]]
    writes: ClassVar[bool] = False  # changes files (a read-only agent may not have it)
    granted: ClassVar[bool] = False  # only a driver grants it (``RunSpec.grants``), never a file

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

    async def run(self, ctx: ToolContext, args: Any) -> ToolOutput:
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

    def granted(self) -> frozenset[str]:
        """The tools no agent definition gives: a driver grants them (a team's board)."""
        return frozenset(n for n, t in self._tools.items() if t.granted)

    def writers(self) -> frozenset[str]:
        """The tools that change files."""
        return frozenset(n for n, t in self._tools.items() if t.writes)

    def schemas(self, allowed: set[str] | frozenset[str]) -> list[dict[str, Any]]:
        return [t.schema() for n, t in self._tools.items() if n in allowed]
