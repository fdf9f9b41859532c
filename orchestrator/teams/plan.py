"""A team's definition: the committed file ``.orch/teams/NAME.toml`` and the plan a run follows.

A :class:`TeamFile` is what the file may say (unknown keys are an error); a :class:`TeamPlan`
is the file with the command's flags laid over it, and is what a team's root run keeps (its
``RunSpec.driver``): a resumed or detached team follows the plan it started with, not a file
edited since. The files are read beneath the project root through safefs (no link followed,
capped): a repository's files are the repository's, not the host's. What a plan asks of the
catalog (its agents exist, its reviewers are read-only, its isolation is strong enough for
them) is checked by :func:`check_plan`, at ``orch team validate`` and at run start.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError

from ..catalog.definitions import Catalog
from ..catalog.teamfiles import read_team
from ..egress.rules import NetworkSetting
from ..errors import UsageError
from ..tools.base import ToolRegistry
from ..trust import Trust
from ..workspaces.registry import BRANCH_TIERS, rank

MAX_WRITERS = 8
MAX_REVIEWERS = 8

Approve = Literal["all", "majority", "any"]
MergeMode = Literal["none", "merge", "squash"]
TeamIsolation = Literal["worktree", "container"]
assert set(TeamIsolation.__args__) == set(BRANCH_TIERS)  # type: ignore[attr-defined]


class RoleModels(BaseModel):
    """``models = { writer = "opus", reviewers = "haiku" }``: None keeps the agent's own."""

    model_config = ConfigDict(extra="forbid")

    writer: StrictStr | None = None
    reviewers: StrictStr | None = None


class TeamFile(BaseModel):
    """What ``.orch/teams/NAME.toml`` may say."""

    model_config = ConfigDict(extra="forbid")

    description: StrictStr = ""
    writer: StrictStr = "writer"  # an agent name
    writers: int = Field(default=1, ge=1, le=MAX_WRITERS, strict=True)  # > 1: best of N
    reviewers: list[StrictStr] = Field(
        default_factory=lambda: ["reviewer"], min_length=1, max_length=MAX_REVIEWERS
    )
    approve: Approve = "all"
    rounds: int = Field(default=3, ge=1, le=50, strict=True)
    gate: StrictStr | None = None  # a command, run in the writer's sandbox after each turn
    gate_timeout: float = Field(default=600.0, gt=0, le=86_400)
    # whose tests the gate runs (teams/gatefrom.py): "base" (the base's tests and test
    # configuration against the candidate's code) or "candidate" (the branch as it is).
    # Unset: "candidate" in a trusted repository, else "base" (resolve_gate_from).
    gate_from: Literal["base", "candidate"] | None = None
    isolation: TeamIsolation = "worktree"
    merge: MergeMode = "none"
    models: RoleModels = Field(default_factory=RoleModels)
    # A lead team: this agent breaks the goal into tasks on a board that ``teammates``
    # writers (the ``writer`` agent) claim; each task is gated, reviewed and merged.
    lead: StrictStr | None = None
    teammates: int = Field(default=2, ge=1, le=MAX_WRITERS, strict=True)
    # A lead team ends, failed, after this many idle runs in a row: teammate runs that
    # ended without claiming a ready task, or the lead's waits on a board nobody can move.
    idle_runs: int = Field(default=3, ge=1, le=100, strict=True)
    # Every member's network instead of its agent's (egress/rules.py); a repository's team
    # may not reach wider than the user's settings unless trusted.
    network: NetworkSetting | None = None


class TeamPlan(TeamFile):
    """A team file (or the default team) with the command's flags over it: what a run keeps."""

    name: str | None = None  # the team file's name; None: the default team and flags
    allow_control_files: bool = False  # with merge: merge a branch that changes them

    @property
    def title(self) -> str:
        return self.name or "default team"


def _problem(e: ValidationError) -> str:
    """Pydantic's errors as one line: ``key: what is wrong``."""
    parts = []
    for err in e.errors()[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "file"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


def parse_team(text: str, where: str) -> TeamFile:
    """A team file's text, validated; UsageError names the file and the key."""
    try:
        data: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{where}: not TOML ({e}); fix the file") from None
    except RecursionError:
        raise UsageError(f"{where}: nested too deeply to be a team file; fix the file") from None
    try:
        return TeamFile.model_validate(data)
    except ValidationError as e:
        raise UsageError(f"{where}: {_problem(e)}; fix the file") from None


def load_team(root: Path, name: str) -> TeamFile:
    """The team file ``root/.orch/teams/NAME.toml``, read beneath ``root`` and validated."""
    text, rel = read_team(root, name)
    return parse_team(text, rel)


def make_plan(file: TeamFile | None, name: str | None, **flags: Any) -> TeamPlan:
    """The plan of a run: the file (or the default team) with the flags that were given."""
    base = file.model_dump() if file is not None else {}
    given = {k: v for k, v in flags.items() if v is not None}
    try:
        return TeamPlan.model_validate({**base, **given, "name": name})
    except ValidationError as e:
        raise UsageError(f"team {name or 'flags'}: {_problem(e)}") from None


def check_plan(plan: TeamPlan, catalog: Catalog, tools: ToolRegistry) -> None:
    """What a plan asks of the catalog; UsageError with one line when it cannot be run."""
    who = f"team {plan.name!r}" if plan.name else "the team"
    names = tools.names()
    roles = [("writer", plan.writer)] + [("reviewer", r) for r in plan.reviewers]
    if plan.lead is not None:
        roles.append(("lead", plan.lead))
        if plan.writers > 1:
            raise UsageError(f"{who}: a lead team has teammates, not best-of-N writers")
    for role, agent in roles:
        if agent not in catalog.agents:
            known = ", ".join(sorted(catalog.agents))
            raise UsageError(f"{who}: {role} {agent!r} is not an agent (agents: {known})")
        definition = catalog.agents[agent]
        if definition.isolation and rank(definition.isolation) > rank(plan.isolation):
            raise UsageError(
                f"{who}: agent {agent!r} requires isolation {definition.isolation!r}, "
                f"stronger than the team's {plan.isolation!r}; set isolation = "
                f'"{definition.isolation}"'
            )
        if role == "reviewer":
            allowed = definition.allowed_tools(names)
            if writes := sorted(tools.writers().intersection(allowed)):
                raise UsageError(
                    f"{who}: reviewer {agent!r} has tools that write ({', '.join(writes)}); a "
                    "reviewer must be read-only: pick an agent with only read_file, glob and "
                    "grep (like the bundled 'reviewer')"
                )
    if plan.gate is not None and not plan.gate.strip():
        raise UsageError(f"{who}: gate is empty; give a command, or leave gate out")
    if plan.gate is not None and "\x00" in plan.gate:
        raise UsageError(f"{who}: gate holds a NUL character, which no command can; remove it")


def resolve_gate_from(
    file: TeamFile | None, flag: str | None, trusted: bool
) -> Literal["base", "candidate"]:
    """Whose tests the gate runs: the flag, else the team file's, else "candidate" in a
    trusted repository and "base" in any other. A repository's team file may relax it to
    "candidate" only once the repository is trusted (UsageError, one line)."""
    if flag is not None:
        return "candidate" if flag == "candidate" else "base"
    chosen = file.gate_from if file is not None else None
    if chosen == "candidate" and not trusted:
        raise UsageError(
            'gate_from = "candidate" lets a writer change the tests its gate runs; a '
            "repository's team may set it only once trusted (`orch trust`), or pass "
            "--gate-from candidate"
        )
    return chosen or ("candidate" if trusted else "base")


def check_file_trust(name: str, where: str, trust: Trust) -> None:
    """A repository's team file that asks what needs trust (``agent_trust.team_floors``: a
    network the user's settings do not reach, a model that reads a file of this machine)
    runs only once the repository is trusted, like its ``orch.toml`` (``trust.py``)."""
    if trust.honoured:
        return
    for f in trust.floors:
        if f.kind != "teams" or f.name != name:
            continue
        if f.key == "network":
            raise UsageError(
                f"{where}: network reaches wider than this machine's settings allow; a "
                "repository's team may widen it only once trusted (`orch trust`)"
            )
        role, model = next(iter(dict(f.value).items()))
        raise UsageError(
            f"{where}: models.{role} = {model!r} reads a file on this machine; a "
            "repository's team may name one only once trusted (`orch trust`), or pass "
            "the model as a flag"
        )
