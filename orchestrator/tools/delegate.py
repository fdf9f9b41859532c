"""The delegation tools: task, task_output, task_stop.

Thin: they call the run's :class:`~.base.Spawner` (``delegation.py`` implements
it); no tool imports the engine.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..catalog.guidance import TASK_GUIDANCE, TASK_OUTPUT_GUIDANCE, TASK_STOP_GUIDANCE
from ..spec import Prompt
from ..workspaces.registry import TIER_NAMES
from .base import Tool, ToolContext, ToolInput, ToolOutput


class _Unbounded(Tool):
    """Delegation tools are bounded by the child's own limits, not a tool timeout."""

    def time_limit(self, args: object, settings: Any) -> float | None:
        return None


class TaskInput(ToolInput):
    description: str = Field(default="", max_length=200, description="A short (3-5 word) label.")
    prompt: Prompt = Field(
        min_length=1,
        description=(
            "The complete task for the child agent. It must be self-contained: the child sees "
            "nothing of this conversation, only this text. Include paths, the goal, constraints "
            "and the form of the answer you want back."
        ),
    )
    subagent_type: str | None = Field(
        default=None, description="The agent to start, from the list above (default: general)."
    )
    model: str | None = Field(default=None, description="Model alias or id (default: inherit).")
    isolation: str | None = Field(
        default=None,
        description="shared, worktree (own git branch) or container; default: your own tier. "
        "Never weaker than your own.",
        json_schema_extra={"enum": list(TIER_NAMES)},
    )
    resume: str | None = Field(
        default=None,
        description="A task_id of yours that has ended: that child goes on with its own "
        "conversation, workspace and branch, and this prompt as its next message.",
    )
    run_in_background: bool = Field(
        default=False,
        description="Return at once with a task_id; you are notified when it finishes, "
        "and can collect it with task_output.",
    )


class TaskTool(_Unbounded):
    name = "task"
    description = TASK_GUIDANCE  # the agent loop adds the caller's agent catalog
    input_model = TaskInput

    async def run(self, ctx: ToolContext, args: TaskInput) -> ToolOutput:
        return await ctx.spawner.spawn(args)


class TaskOutputInput(ToolInput):
    task_id: str = Field(min_length=1, description="The task_id a background task returned.")
    block: bool = Field(default=True, description="Wait for the task to finish.")
    timeout_s: float | None = Field(default=None, gt=0, description="Longest wait, in seconds.")


class TaskOutputTool(_Unbounded):
    name = "task_output"
    description = TASK_OUTPUT_GUIDANCE
    input_model = TaskOutputInput

    async def run(self, ctx: ToolContext, args: TaskOutputInput) -> ToolOutput:
        return await ctx.spawner.output(args.task_id, block=args.block, timeout_s=args.timeout_s)


class TaskStopInput(ToolInput):
    task_id: str = Field(min_length=1, description="The task to cancel (with its descendants).")


class TaskStopTool(_Unbounded):
    name = "task_stop"
    description = TASK_STOP_GUIDANCE
    input_model = TaskStopInput

    async def run(self, ctx: ToolContext, args: TaskStopInput) -> ToolOutput:
        return await ctx.spawner.stop(args.task_id)


def delegation_tools() -> list[Tool]:
    return [TaskTool(), TaskOutputTool(), TaskStopTool()]
