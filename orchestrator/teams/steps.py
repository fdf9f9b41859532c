"""The steps every team takes with a branch: gate it, review it. Both drivers use them: the
rounds of a team (``driver.py``) and the tasks of a lead's board (``lead.py``).

A :class:`Crew` is what those steps need of a team run: its root, its plan, the repository
and the list its member runs are reported in. Each step is a child run of the root, started
through ``Runner.spawn``: a gate (:mod:`.gate`) in a throwaway checkout of the branch in the
writer's tier, reviewers in parallel, each in a throwaway checkout, answering a
:class:`~.review.Verdict` (a malformed one is asked for once more).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from ..egress.rules import NetworkSetting
from ..engine.delegation import RunHandle
from ..engine.runner import Runner
from ..errors import OrchError
from ..project.git import RepoPaths
from ..run import RunRecord, RunStatus
from ..spec import Limits, RunSpec
from ..workspaces.registry import tier_config
from . import gate as gates
from . import review
from .gatefrom import gate_commit
from .integrate import delete_if_unused, ensure_branch
from .plan import TeamPlan
from .progress import ReviewNote, TeamRun

T = TypeVar("T")
Role = Literal["writer", "gate", "reviewer", "lead", "teammate"]
Shown = tuple[int, str, str, str]  # (candidate, branch, commit, its diff and gate text)


async def together(*steps: Awaitable[T]) -> list[T]:
    """Every step at once; when one fails, the others are cancelled (and waited for)
    before its error goes on: no member run outlives a team that has ended."""
    jobs = [asyncio.ensure_future(step) for step in steps]
    try:
        return list(await asyncio.gather(*jobs))
    except BaseException:
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        raise


def reviewer_tags(reviewers: list[str]) -> list[str]:
    """Each reviewer's tag: its agent name, with #2, #3 for an agent named again."""
    seen: dict[str, int] = {}
    tags = []
    for name in reviewers:
        seen[name] = seen.get(name, 0) + 1
        tags.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return tags


@dataclass
class Crew:
    """A team run's member runs: how they start and where they are reported."""

    runner: Runner
    root: RunRecord
    workdir: Path
    repo: RepoPaths
    plan: TeamPlan
    writer_network: NetworkSetting | None
    runs: list[TeamRun] = field(default_factory=list)

    @property
    def tags(self) -> list[str]:
        return reviewer_tags(self.plan.reviewers)

    async def child(self, spec: RunSpec, driver: gates.GateDriver | None = None) -> RunRecord:
        """Start a member run as a child of the root and wait for its end."""
        return await self.runner.wait(await self.spawn(spec, driver))

    async def spawn(self, spec: RunSpec, driver: gates.GateDriver | None = None) -> RunHandle:
        """Start a member run: with the team's network when the team file sets one."""
        if self.plan.network is not None:
            spec = spec.model_copy(update={"network": self.plan.network})
        return await self.runner.spawn(spec, driver=driver)

    def ran(self, n: int, role: Role, rec: RunRecord, candidate: int | None = None) -> None:
        self.runs.append(
            TeamRun(
                round=n,
                role=role,
                candidate=candidate,
                run_id=rec.run_id,
                status=rec.status,
                error=rec.error,
            )
        )

    def event(self, kind: str, data: dict[str, object]) -> None:
        self.runner.event(self.root.run_id, kind, dict(data))

    # -- the gate -----------------------------------------------------------------------
    async def gate(
        self, n: int, number: int, branch: str, commit: str, what: str, base: str
    ) -> gates.GateResult:
        """The team's gate on ``branch`` (at ``commit``), as a run of its own; with
        ``gate_from = "base"`` on a commit of ``commit`` with ``base``'s tests
        (``gatefrom.py``), on a branch of its own for the gate's run."""
        plan = self.plan
        assert plan.gate is not None
        swapped: list[str] = []
        gated = branch
        if (plan.gate_from or "base") == "base":
            on, swapped = await gate_commit(self.repo, base, commit, plan.gate)
            if on != commit:
                gated = f"orch/team-gate/{self.root.run_id.removeprefix('r-')[:8]}-{number}-{n}"
                await ensure_branch(self.repo, gated, on)
        try:
            result = await self._gate(n, number, gated, commit, what)
        finally:
            if gated != branch:
                await delete_if_unused(self.repo, gated, on)
        result.gate_from, result.swapped = plan.gate_from or "base", swapped
        return result

    async def _gate(
        self, n: int, number: int, branch: str, commit: str, what: str
    ) -> gates.GateResult:
        plan = self.plan
        assert plan.gate is not None
        tier = tier_config(plan.isolation).model_copy(update={"branch": branch, "discard": True})
        spec = RunSpec(
            prompt=f"Run the team's test gate: {plan.gate}",
            description=what,
            parent_run_id=self.root.run_id,
            workdir=self.workdir,
            workspace=tier,
            limits=Limits(timeout_seconds=plan.gate_timeout + gates.GRACE_S),
        )
        driver = gates.GateDriver(plan.gate, plan.gate_timeout, self.writer_network)
        rec = await self.child(spec, driver)
        self.ran(n, "gate", rec, number)
        result = gates.gate_result(rec, n, number, commit, plan.gate)
        self.event("team_gate", result.model_dump(mode="json", exclude={"output"}))
        return result

    # -- the reviewers ------------------------------------------------------------------
    async def reviews(
        self,
        n: int,
        task: str,
        base: str,
        shown: list[Shown],
        rounds: int,
        earlier: dict[str, review.Verdict],
        label: str = "",
    ) -> list[ReviewNote]:
        """Every reviewer's verdict on the candidates ``shown`` (in parallel); ``label``:
        what their runs are called (default: the round)."""
        label = label or f"team round {n}"
        numbers = [s[0] for s in shown]
        return await together(
            *(
                self._reviewer(
                    n, agent, tag, task, base, shown, numbers, rounds, earlier.get(tag), label
                )
                for agent, tag in zip(self.plan.reviewers, self.tags, strict=True)
            )
        )

    async def _reviewer(
        self,
        n: int,
        agent: str,
        tag: str,
        task: str,
        base: str,
        shown: list[Shown],
        numbers: list[int],
        rounds: int,
        previous: review.Verdict | None,
        label: str,
    ) -> ReviewNote:
        first = review.reviewer_prompt(task, shown, base, n, rounds, previous)
        checkout = shown[0][1]  # the first candidate is checked out, in the writer's tier
        tier = tier_config(self.plan.isolation).model_copy(
            update={"branch": checkout, "discard": True}
        )
        prompt, problem, seen = first, "", []
        for attempt in (1, 2):
            spec = RunSpec(
                prompt=prompt,
                agent=agent,
                description=f"{label}: review by {tag}" + (" (again)" * (attempt - 1)),
                model=self.plan.models.reviewers,
                parent_run_id=self.root.run_id,
                workdir=self.workdir,
                workspace=tier,
            )
            rec = await self.child(spec)
            self.ran(n, "reviewer", rec)
            seen.append(rec.run_id)
            if rec.status != RunStatus.SUCCEEDED:
                why = rec.error or rec.status.value
                raise OrchError(f"round {n}: reviewer {tag} (run {rec.run_id}) {rec.status}: {why}")
            try:
                verdict = review.check_choice(review.parse_verdict(rec.output), numbers)
            except review.VerdictError as e:
                problem = str(e)
                self.event(
                    "team_bad_verdict",
                    {"round": n, "reviewer": tag, "run_id": rec.run_id, "problem": problem},
                )
                prompt = review.reviewer_retry(first, rec.output, problem)
                continue
            self.event(
                "team_verdict",
                {"round": n, "reviewer": tag, "run_id": rec.run_id, **verdict.model_dump()},
            )
            return ReviewNote(reviewer=tag, run_id=rec.run_id, verdict=verdict)
        raise OrchError(
            f"round {n}: the verdict of reviewer {tag} was malformed twice "
            f"(runs {', '.join(seen)}): {problem}"
        )


async def shown_candidate(
    repo: RepoPaths, base: str, number: int, branch: str, commit: str, gate: gates.GateResult | None
) -> Shown:
    """One candidate as the reviewers see it: its gate result beside its diff."""
    diff = await review.branch_diff(repo, base, commit)
    body = review.candidate_block(base, commit, diff, gates.for_reviewer(gate))
    return (number, branch, commit, body)
