"""A run: its record (what the store keeps) and its result (what callers get back).

Every agent execution, root or child, is one run. The record is the single
source of truth for its place in the QueryChain (chain_id, depth,
parent_run_id), its limits (allowed tools, max_depth) and its outcome, so a
resumed or reconciled run is held to the same limits it started with: its
``plan`` (the resolved spec and limits, :class:`~orchestrator.spec.RunPlan`) and its
``launch`` (how another process rebuilds its engine, :class:`~orchestrator.spec.Launch`).
"""

from __future__ import annotations

import enum
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .egress.summary import EgressSummary
from .errors import OrchError
from .spec import Launch, RunPlan


class RunStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"

    @property
    def ended(self) -> bool:
        return self not in (RunStatus.QUEUED, RunStatus.RUNNING)


# CLI exit code for each final status.
EXIT_CODES: dict[RunStatus, int] = {
    RunStatus.SUCCEEDED: 0,
    RunStatus.FAILED: 1,
    RunStatus.INTERRUPTED: 1,
    RunStatus.TIMED_OUT: 124,
    RunStatus.CANCELLED: 130,
}


def new_run_id() -> str:
    return "r-" + uuid.uuid4().hex[:12]


def new_chain_id() -> str:
    return "c-" + uuid.uuid4().hex[:12]


def first_line(text: str) -> str:
    """The first line of ``text`` with words in it (what a run is for, by its prompt)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def now() -> float:
    return time.time()


class Usage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    turns: int = 0
    tool_uses: int = 0
    input_tokens: int = 0  # input neither read from nor written to the prompt cache
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cost_usd: float = 0.0  # every request priced (pricing.py); 0 for a model it cannot price
    context_tokens: int = 0  # the input of the latest request: how full the window is
    compactions: int = 0  # times the conversation was cleared or compacted to fit its window

    @property
    def tokens(self) -> int:
        """Every token in and out (``max_chain_tokens`` counts these)."""
        return (
            self.input_tokens
            + self.output_tokens
            + self.cache_creation_input_tokens
            + self.cache_read_input_tokens
        )


class CommandEvidence(BaseModel):
    command: str
    exit_code: int | None  # None: killed (timeout / cancel) or refused before running


class Evidence(BaseModel):
    """What the run actually did, gathered by the orchestrator, never claimed by the model."""

    files_read: list[str] = Field(default_factory=list)
    files_written: list[str] = Field(default_factory=list)
    commands: list[CommandEvidence] = Field(default_factory=list)
    children: list[str] = Field(default_factory=list)

    def note_read(self, path: str) -> None:
        if path not in self.files_read:
            self.files_read.append(path)

    def note_written(self, path: str) -> None:
        if path not in self.files_written:
            self.files_written.append(path)


class Activity(BaseModel):
    tool: str
    summary: str
    at: float


class RunRecord(BaseModel):
    """One row of the runs table."""

    run_id: str
    chain_id: str
    parent_run_id: str | None = None
    depth: int = 0
    max_depth: int = 3
    resumed_from: str | None = None  # the run whose conversation this one continues
    agent: str = "general"
    description: str = ""
    isolation: str = "shared"
    background: bool = False
    model: str = ""
    status: RunStatus = RunStatus.QUEUED
    prompt: str = ""
    summary: str = ""  # final text when ended; latest assistant text while running
    output: str = ""  # whole final text (summary may be cut for the parent)
    error: str | None = None
    allowed_tools: list[str] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    evidence: Evidence = Field(default_factory=Evidence)
    artifacts: list[dict[str, Any]] = Field(default_factory=list)
    workspace: dict[str, Any] = Field(default_factory=dict)
    last_activity: Activity | None = None
    recent_activities: list[Activity] = Field(default_factory=list)
    pid: int | None = None
    pid_start: int | None = None  # the owner's start time (clock ticks): guards against pid reuse
    # Where the owner runs: this machine's host name for a local run, ``host/ray-<id>`` for a
    # run on a Ray node (its pid means nothing elsewhere: reconcile goes by its heartbeat).
    node: str | None = None
    plan: RunPlan | None = None  # what it was admitted to do (None: an odd or old record)
    # A driver's own state (a team's ``TeamResult``), replaced at each of its steps: what
    # ``orch team status`` shows and ``orch resume`` continues from.
    progress: dict[str, Any] | None = None
    launch: Launch = Field(default_factory=Launch)  # kept for a detached root's worker
    created_at: float = Field(default_factory=now)
    started_at: float | None = None
    updated_at: float = Field(default_factory=now)
    ended_at: float | None = None

    # An older orch kept the plan and the launch in this one dict: read into ``plan`` and
    # ``launch`` once loaded (an after-validator keeps pydantic's fast JSON path), never
    # written again.
    options: dict[str, Any] | None = Field(default=None, exclude=True, repr=False)

    @model_validator(mode="after")
    def _legacy_options(self) -> RunRecord:
        """A plan that no longer validates is dropped, so the record still loads for ``orch
        ps``; running it says what is missing."""
        options, self.options = self.options, None
        if not options:
            return self
        if self.plan is None and "spec" in options:
            keys = ("spec", "max_turns", "timeout_seconds", "budgets")
            plan = {k: options[k] for k in keys if options.get(k) is not None}
            try:
                self.plan = RunPlan.model_validate(plan)
            except ValidationError:
                self.plan = None
        if "launch" not in self.model_fields_set and options.get("launch"):
            self.launch = Launch.model_validate(options["launch"])
        return self

    def planned(self) -> RunPlan:
        """This run's plan; an OrchError for a record that keeps none."""
        if self.plan is None:
            raise OrchError(
                f"run {self.run_id} keeps no plan to run by (stored by an older orch?); "
                "start it again with `orch task`"
            )
        return self.plan

    def started_event(self) -> dict[str, Any]:
        """The data of this run's ``run_started`` event: where it stands in its chain."""
        return {
            "agent": self.agent,
            "model": self.model,
            "depth": self.depth,
            "max_depth": self.max_depth,
            "chain_id": self.chain_id,
            "parent_run_id": self.parent_run_id,
            "allowed_tools": self.allowed_tools,
            "isolation": self.isolation,
            "resumed_from": self.resumed_from,
        }

    def finished_event(self) -> dict[str, Any]:
        """The data of this run's ``run_finished`` event, the one shape of every ending."""
        return {
            "status": self.status.value,
            "error": self.error,
            "usage": self.usage.model_dump(),
            "evidence": self.evidence.model_dump(),
            "artifacts": self.artifacts,
        }

    def result(self) -> RunResult:
        return RunResult(
            run_id=self.run_id,
            chain_id=self.chain_id,
            parent_run_id=self.parent_run_id,
            depth=self.depth,
            agent=self.agent,
            isolation=self.isolation,
            status=self.status,
            resumed_from=self.resumed_from,
            node=self.node,
            summary=self.output or self.summary,
            error=self.error,
            evidence=self.evidence,
            artifacts=self.artifacts,
            usage=self.usage,
            workspace=self.workspace,
            started_at=self.started_at,
            ended_at=self.ended_at,
        )


class RunResult(BaseModel):
    """What `orch result --json` and `orch task --json` print: the contract of a finished run."""

    run_id: str
    chain_id: str
    parent_run_id: str | None
    depth: int
    agent: str
    isolation: str
    status: RunStatus
    resumed_from: str | None = None
    node: str | None = None
    summary: str
    error: str | None
    evidence: Evidence
    artifacts: list[dict[str, Any]]
    usage: Usage
    workspace: dict[str, Any]
    started_at: float | None
    ended_at: float | None
    # what its commands reached through the egress proxy (an allow-list network), if any
    egress: EgressSummary | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.status, 1)
