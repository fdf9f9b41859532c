"""RunSpec: what to run, the one input of ``Runner.spawn``.

A spec says what the caller asks for; the runner resolves the rest (the agent
definition, the model, the tools, the chain position, the tier) and holds it
to the parent's limits. Every way of starting a run builds one: ``orch task``
(root), the ``task`` tool (a child), a team (its root and its turns), the
detached worker (the stored spec of a queued run) and ``orch resume``.

What admission makes of a spec is kept with the run (``RunRecord.plan``, a
:class:`RunPlan`), with how another process rebuilds the engine that runs it
(``RunRecord.launch``, a :class:`Launch`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from .egress.rules import NetworkSetting
from .workspaces.registry import WorkspaceConfig


def not_blank(text: str) -> str:
    """A prompt with words in it (whitespace alone is refused)."""
    if not text.strip():
        raise ValueError("prompt must not be blank")
    return text


# A task's prompt, wherever one is asked for (a spec, the ``task`` tool's input).
Prompt = Annotated[str, Field(min_length=1), AfterValidator(not_blank)]


class Limits(BaseModel):
    """Limits asked for; None takes the agent's, then the settings' value."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int | None = Field(default=None, ge=1)
    timeout_seconds: float | None = Field(default=None, gt=0)
    max_depth: int | None = Field(default=None, ge=0)  # a root's; children keep their chain's


class Budgets(BaseModel):
    """A chain's budgets, set by its root and kept by every run of it (nested, resumed)."""

    model_config = ConfigDict(extra="forbid")

    running: int = Field(ge=1)  # runs working at once (max_chain_running)
    runs: int = Field(ge=1)  # runs in total (max_chain_runs)
    tokens: int | None = Field(default=None, ge=1)  # tokens in total (max_chain_tokens)
    usd: float | None = Field(default=None, gt=0)  # dollars in total (max_chain_usd)


class DriverCall(BaseModel):
    """A run whose body is orchestration code (a team), not a model's loop: the kind of
    driver and its parameters, kept with the run so another process (a detached worker,
    ``orch resume``) rebuilds the same driver (``Runner.drivers``)."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)


class RunSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: Prompt
    agent: str | None = None  # None: the default agent ("general")
    description: str = ""
    model: str | None = None  # alias or id; None: the agent's, else the parent's, else default
    # Chain position: None starts a new chain at depth 0; a run id makes a child of that
    # run (same chain, depth + 1, the parent's limits).
    parent_run_id: str | None = None
    workdir: Path  # the spawner's workspace root (the user's directory for a root run)
    # The tier: None takes the agent definition's, else the parent's (never weaker).
    workspace: WorkspaceConfig | None = None
    limits: Limits = Field(default_factory=Limits)
    background: bool = False
    # A run id: continue that ended run's conversation with ``prompt`` as the next user
    # message (a new run, same agent, tier, branch and chain; see admission.resumable).
    resume: str | None = None
    driver: DriverCall | None = None  # a root run driven by code (``Runner.drivers``)
    # Tools a driver grants the run beyond its agent's (a lead team's board tools); only
    # ``granted`` tools, and never more than its parent has.
    grants: list[str] = Field(default_factory=list)
    # The run's network instead of its agent's (a team's, the CLI's); never wider than its
    # parent's (egress.rules.Reach.meet).
    network: NetworkSetting | None = None


class RunPlan(BaseModel):
    """What a run was admitted to do, kept with its record: the resolved spec (agent,
    tier and workdir settled) and the limits it is held to wherever it executes."""

    model_config = ConfigDict(extra="forbid")

    spec: RunSpec
    max_turns: int = Field(ge=1)
    timeout_seconds: float | None = None
    budgets: Budgets | None = None  # its chain's (None: a record of an older orch)


class Launch(BaseModel):
    """How another process (a detached worker, a worker host, a cluster node) rebuilds the
    engine of a run: the same model, agent dirs, settings flags and trust, never more."""

    model_config = ConfigDict(extra="forbid")

    model_spec: str | None = None
    agents_dirs: list[str] = Field(default_factory=list)
    overrides: dict[str, Any] = Field(default_factory=dict)  # the flags that made the settings
    trust: str | None = None  # the launcher's honoured trust digest: a worker's cap
