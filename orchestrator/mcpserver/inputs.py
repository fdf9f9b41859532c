"""What each tool of ``orch mcp`` takes: pydantic models, whose JSON schemas are the tools'
input schemas, and which validate every call (an MCP client's arguments are a model's)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..tools.delegate import TaskInput as TaskInput  # the task tool's own, as agents give it
from ..tools.delegate import TaskOutputInput as TaskOutputInput


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunRef(Closed):
    task_id: str = Field(
        min_length=1,
        max_length=200,
        description="A run id, or its first characters (as list_runs shows them).",
    )


class ListRunsInput(Closed):
    all: bool = Field(
        default=False,
        description="Every run the project's store holds; default: running ones and those "
        "that ended in the last hour.",
    )
    limit: int = Field(default=50, ge=1, le=1000, description="At most this many rows.")


class RunLogsInput(RunRef):
    tree: bool = Field(default=False, description="Add the events of its children and theirs.")
    limit: int = Field(default=200, ge=1, le=5000, description="The last this many events.")


class BranchInput(Closed):
    target: str = Field(
        min_length=1,
        max_length=300,
        description="A run id (or its first characters), or an orch branch name "
        "(orch/<agent>/<id>).",
    )


class MergeInput(BranchInput):
    squash: bool = Field(default=False, description="One squashed commit instead of a merge.")
