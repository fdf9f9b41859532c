"""Teams: writers, a test gate and reviewers taking rounds until the reviewers approve.

A team run is one QueryChain: a root run (agent ``team``, depth 0, its body the
:class:`TeamDriver`, its plan kept as its spec's ``driver``) and, each round, writer, gate and
reviewer runs as its children (depth 1), all in ``orch tree`` / ``orch ps``. The team is a
client of the engine: every run goes through ``Runner.spawn``; the runner writes every record.

A round:

1. **Write.** Round 1 starts ``writers`` writers in parallel, each on its own branch
   ``orch/<writer>/<id>`` from the user's HEAD (best of N when more than one). Later rounds
   go on with each candidate still in play: its writer's conversation resumed with the next
   message (the gate's output, or every reviewer's comments, tagged), or, when that
   conversation was not kept, a new writer on the same branch with the task and the message.
2. **Gate.** The team's ``gate`` command runs on each candidate in the writer's sandbox
   (:mod:`.gate`). A failing candidate's output goes back to its writer; no reviewer sees it.
3. **Review.** The reviewers (read-only, in parallel, each in a throwaway checkout in the
   writer's tier) see every candidate that passed, with its gate result beside its diff, and
   answer with a verdict; with several candidates they name their ``choice``. The chosen
   candidate goes on; the others stop, their branches kept and listed. ``approve`` (all,
   majority, any) decides (:func:`.review.decide`).

The loop ends on approval or after ``rounds`` rounds; with ``merge`` an approved branch is
merged into the user's HEAD exactly as ``orch worktrees merge`` does it (control files need
``allow_control_files``). After every step the whole :class:`.progress.TeamResult` goes into
the root's events: ``orch team status`` reads it, and ``orch resume`` on the root continues
from it (an interrupted round again; an unapproved team, ``rounds`` more rounds).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ..branches import merge as merge_branch
from ..catalog.definitions import AgentDefinition
from ..engine.agent import LoopOutcome
from ..engine.runner import Driven, Runner
from ..errors import OrchError, UsageError
from ..project.git import RepoPaths
from ..project.repo import diff_stats, discover, rev
from ..run import RunStatus
from ..spec import DriverCall, RunSpec
from ..tools.boardtools import LEAD_TOOLS, TEAMMATE_TOOLS
from ..workspaces.registry import tier_config
from ..workspaces.shared import SharedConfig
from . import gate as gates
from . import review
from .gate import trim
from .plan import TeamPlan, check_plan
from .progress import Candidate, ReviewRound, TeamResult, read_result
from .steps import Crew, shown_candidate, together
from .summary import summary

KIND = "team"  # the driver's name in ``RunSpec.driver``


async def base_commit(workdir: Path) -> tuple[RepoPaths, str]:
    """The repository around ``workdir`` and its HEAD (UsageError: none, or no commits)."""
    try:
        located = await discover(workdir)  # a linked worktree: its own HEAD is the base
        repo = located.main()
    except UsageError:
        raise UsageError(
            f"orch team needs a git repository: {workdir} is not inside one; "
            "run `git init` and make a first commit"
        ) from None
    head = await rev("HEAD", located)
    if head is None:
        raise UsageError(
            f"the git repository at {repo.main_root} has no commits yet; make a first commit, "
            "then run orch team"
        )
    return repo, head


class TeamDriver:
    """The body of a team's root run: its rounds, then the outcome the runner records."""

    done_phrase = "approved"  # what the team had done when its merge failed

    def __init__(self, runner: Runner, plan: TeamPlan) -> None:
        check_plan(plan, runner.catalog, runner.tools)
        self.plan = plan
        names = runner.tools.names()
        agents = [plan.writer, *plan.reviewers]
        tools = [t for a in agents for t in runner.catalog.agent(a).allowed_tools(names)]
        members = [runner.catalog.agent(a) for a in [*agents, *([plan.lead] if plan.lead else [])]]
        self.definition = AgentDefinition(
            name="team",
            description="Writers, a test gate and reviewers taking rounds (orch team run).",
            tools=list(dict.fromkeys([*tools, "task"])),
            system_prompt="",
            source="orch team",
            # a member of the repository's: no member is offered the user's MCP servers
            repository=any(runner.catalog.from_repository(m) for m in members),
        )
        self.writer_network = runner.catalog.agent(plan.writer).network  # (Crew.spawn: the team's)

    # -- the run ------------------------------------------------------------------------
    async def drive(self, run: Driven) -> LoopOutcome:
        self.root, self.runner = run.record, run.runner
        self.workdir = run.record.planned().spec.workdir
        self.repo, base = await base_commit(self.workdir)
        self.result = self._start(base)
        self.crew = Crew(
            self.runner,
            self.root,
            self.workdir,
            self.repo,
            self.plan,
            self.writer_network,
            runs=self.result.runs,
        )
        try:
            await self._work()
            if self.result.approved and self.plan.merge != "none":
                await self._merge()
        except OrchError as e:
            self.result.error = str(e)
        except asyncio.CancelledError:
            self.result.status = RunStatus.CANCELLED
            self.result.error = "cancelled"
            self._save()
            raise
        except Exception as e:  # a bug must end the team as failed, not leave it running
            self.result.error = f"{type(e).__name__}: {e}".strip()
        ok = self.result.approved and self.result.error is None
        self.result.status = RunStatus.SUCCEEDED if ok else RunStatus.FAILED
        await self._diffstat()
        self._save()
        return self._outcome()

    async def _work(self) -> None:
        """The team's work, until it is approved or cannot be (OrchError says why)."""
        if note := self._note():
            for c in self._active():
                c.feedback = f"{c.feedback or ''}\n\nA note from the user: {note}\n".lstrip()
        await self._rounds()

    def _start(self, base: str) -> TeamResult:
        """A new team's result, or the one a resumed team continues."""
        rec = self.root
        if rec.resumed_from is None:
            return self._fresh(base)
        old = self.runner.store.require_run(rec.resumed_from)
        before = read_result(self.runner.store, old)
        if before is None:
            raise OrchError(f"team run {old.run_id} left no progress to continue; start anew")
        if before.approved:
            raise OrchError(f"team run {old.run_id} was approved; there is nothing to continue")
        update = {"root_run_id": rec.run_id, "status": RunStatus.RUNNING, "error": None}
        return self._continued(before.model_copy(update={**update, "resumed_from": old.run_id}))

    def _fresh(self, base: str) -> TeamResult:
        rec, plan = self.root, self.plan
        return TeamResult(
            root_run_id=rec.run_id,
            chain_id=rec.chain_id,
            status=RunStatus.RUNNING,
            plan=plan,
            task=rec.prompt,
            base=base,
            max_rounds=plan.rounds,
        )

    def _continued(self, result: TeamResult) -> TeamResult:
        """A resumed team: a writer that failed (or was stopped) goes on, and a team that
        used its rounds gets as many again."""
        for c in result.candidates:
            if c.state == "failed" and (result.chosen is None or c.number == result.chosen):
                c.state, c.error = "writing", None
        if result.completed >= result.max_rounds:
            result.max_rounds = result.completed + self.plan.rounds
        return result

    def _note(self) -> str:
        """What the user added when resuming (a resumed root's prompt that is not the task)."""
        given = self.root.prompt.strip()
        return given if self.root.resumed_from and given != self.result.task.strip() else ""

    def _active(self) -> list[Candidate]:
        res = self.result
        if res.chosen is not None:
            return [c for c in res.candidates if c.number == res.chosen]
        return [c for c in res.candidates if c.state != "failed"]

    async def _rounds(self) -> None:
        res, plan = self.result, self.plan
        if not res.candidates:
            res.candidates = [Candidate(number=k) for k in range(1, plan.writers + 1)]
        for n in range(res.completed + 1, res.max_rounds + 1):
            res.rounds = n
            active = self._active()
            await together(*(self._write(n, c) for c in active if c.written < n))
            await self._diffstat()
            self._save()
            live = [c for c in active if c.state != "failed"]
            if not live and len(active) == 1:
                raise OrchError(f"round {n}: the {active[0].error}")
            if not live:
                why = "; ".join(f"candidate {c.number}: the {c.error}" for c in active)
                raise OrchError(f"round {n}: no writer left work to go on with ({why})")
            await together(*(self._gate(n, c) for c in live))
            self._save()
            passed = [c for c in live if c.state == "passed"]
            if passed:
                decided = await self._review(n, passed)
                if decided.approved:
                    res.approved = True
            res.completed = n
            self._save()
            if res.approved:
                return
        last = "the gate never passed" if not res.reviews else "not approved"
        raise OrchError(
            f"{last} after {res.max_rounds} round(s); the work so far is on "
            + (", ".join(c.branch for c in self._active() if c.branch) or "no branch")
        )

    # -- the steps ----------------------------------------------------------------------
    def _what(self, n: int, step: str, c: Candidate) -> str:
        which = f" (candidate {c.number})" if self.plan.writers > 1 else ""
        return f"team round {n}: {step}{which}"

    async def _write(self, n: int, c: Candidate) -> None:
        res, plan = self.result, self.plan
        common: dict[str, Any] = {
            "parent_run_id": self.root.run_id,
            "workdir": self.workdir,
            "description": self._what(n, "write", c),
            "model": plan.models.writer,
        }
        message = c.feedback or "Go on with the task; your work so far is on your branch."
        kept = c.writer_run is not None and self.runner.store.transcript(c.writer_run) is not None
        if c.writer_run is None or (c.branch is None and not kept):
            spec = RunSpec(
                prompt=res.task,
                agent=plan.writer,
                workspace=tier_config(plan.isolation),
                **common,
            )
        elif kept:
            spec = RunSpec(prompt=message, resume=c.writer_run, **common)
        else:  # its conversation was not kept: a new writer on the same branch
            assert c.branch is not None
            tier = tier_config(plan.isolation).model_copy(
                update={"branch": c.branch, "base": res.base}
            )
            prompt = review.writer_followup(res.task, c.branch, n, message)
            spec = RunSpec(prompt=prompt, agent=plan.writer, workspace=tier, **common)
        rec = await self.crew.child(spec)
        self.crew.ran(n, "writer", rec, c.number)
        c.writer_run = rec.run_id
        made = [str(a["branch"]) for a in rec.artifacts if a.get("kind") == "branch"]
        if c.branch is not None and made and made[0] != c.branch:
            raise OrchError(
                f"round {n}: the {plan.isolation} tier did not continue branch {c.branch} "
                f"(the writer's work went to {made[0]}); it does not support teams"
            )
        c.branch = c.branch or (made[0] if made else None)
        if c.branch is not None:
            c.commit = await rev(f"refs/heads/{c.branch}", self.repo)
        if rec.status != RunStatus.SUCCEEDED:
            c.state, c.error = (
                "failed",
                f"writer run {rec.run_id} {rec.status.value}: " + (rec.error or rec.status.value),
            )
        elif c.branch is None or c.commit is None:
            c.state = "failed"
            c.error = f"writer run {rec.run_id} left no branch with changes"
        else:
            c.written, c.state, c.feedback, c.error = n, "writing", None, None

    async def _gate(self, n: int, c: Candidate) -> None:
        if self.plan.gate is None:
            c.state = "passed"
            return
        assert c.branch is not None and c.commit is not None
        what = self._what(n, "gate", c)
        result = await self.crew.gate(n, c.number, c.branch, c.commit, what, self.result.base)
        trim(self.result.gates, c.number)
        self.result.gates.append(result)
        if result.passed:
            c.state = "passed"
        else:
            c.state, c.feedback = "gate_failed", gates.for_writer(result)

    async def _review(self, n: int, passed: list[Candidate]) -> ReviewRound:
        res = self.result
        shown = []
        for c in passed:
            assert c.branch is not None and c.commit is not None
            ran = [g for g in res.gates if g.round == n and g.candidate == c.number]
            gate = ran[-1] if ran else None
            shown.append(
                await shown_candidate(self.repo, res.base, c.number, c.branch, c.commit, gate)
            )
        numbers = [c.number for c in passed]
        earlier = {  # what each reviewer asked of the candidate that went on
            note.reviewer: note.verdict
            for r in res.reviews[-1:]
            for note in r.notes
            if note.verdict.choice == r.chosen
        }
        notes = await self.crew.reviews(n, res.task, res.base, shown, res.max_rounds, earlier)
        chosen, approvals, approved = review.decide([x.verdict for x in notes], self.plan.approve)
        decided = ReviewRound(
            round=n,
            candidates=numbers,
            notes=list(notes),
            chosen=chosen,
            approvals=approvals,
            approved=approved,
        )
        res.reviews.append(decided)
        res.chosen = chosen
        for c in res.candidates:
            if c.number == chosen:
                c.state = "chosen"
                if not approved:  # the comments on it (another candidate's are not its)
                    mine = [(x.reviewer, x.verdict) for x in notes if x.verdict.choice == chosen]
                    c.feedback = review.for_writer(n, mine)
            elif c.state not in ("failed", "gate_failed"):
                c.state = "kept"
        self.runner.event(
            self.root.run_id,
            "team_decision",
            {"round": n, "chosen": chosen, "approvals": approvals, "approved": approved},
        )
        return decided

    async def _merge(self) -> None:
        branch = self.result.branch
        assert branch is not None
        try:
            report = await asyncio.to_thread(
                merge_branch,
                self.workdir,
                branch,
                squash=self.plan.merge == "squash",
                allow_control_files=self.plan.allow_control_files,
            )
        except OrchError as e:
            raise OrchError(f"{self.done_phrase}, but merging {branch} failed: {e}") from None
        self.result.merged = True
        self.result.merge_commit = report.commit

    # -- reporting ----------------------------------------------------------------------
    def _lead(self) -> Candidate | None:
        """The candidate the team reports: the chosen one, else the only one."""
        res = self.result
        if res.chosen is not None:
            return next(c for c in res.candidates if c.number == res.chosen)
        return res.candidates[0] if len(res.candidates) == 1 else None

    def _save(self) -> None:
        """The whole result into the root's events (status, resume read it there)."""
        lead = self._lead()
        self.result.branch = lead.branch if lead else None
        self.result.commit = lead.commit if lead else None
        self.runner.progress(self.root.run_id, self.result.model_dump(mode="json"))

    async def _diffstat(self) -> None:
        """The reported candidate's diff stats against the base."""
        res, lead = self.result, self._lead()
        res.commit = lead.commit if lead else None
        if res.commit is not None:
            files, ins, dels = await diff_stats(self.repo, res.base, res.commit)
            res.diffstat = {"files_changed": files, "insertions": ins, "deletions": dels}

    def _outcome(self) -> LoopOutcome:
        res = self.result
        artifacts: list[dict[str, Any]] = []
        if res.branch and res.commit:
            artifacts.append(
                {
                    "kind": "branch",
                    "branch": res.branch,
                    "base": res.base,
                    "commit": res.commit,
                    **res.diffstat,
                }
            )
        error = None if res.status == RunStatus.SUCCEEDED else res.error or res.status.value
        return LoopOutcome(res.status, summary(res), error, artifacts)


def team_spec(prompt: str, workdir: Path, plan: TeamPlan, *, background: bool = False) -> RunSpec:
    """The spec of a team's root run."""
    if not prompt.strip():
        raise UsageError("the prompt is empty; say what the writer should do")
    return RunSpec(
        prompt=prompt,
        workdir=workdir,
        description=(plan.name and f"team {plan.name}: " or "team: ") + prompt.split("\n")[0][:60],
        workspace=SharedConfig(),
        background=background,
        driver=DriverCall(kind=KIND, params=plan.model_dump(mode="json")),
        # a lead team's root holds the board tools its lead and teammates are granted
        grants=[*LEAD_TOOLS, *TEAMMATE_TOOLS] if plan.lead is not None else [],
        network=plan.network,  # its members' (none set: each agent's own)
    )


async def run_team(runner: Runner, *, prompt: str, workdir: Path, plan: TeamPlan) -> TeamResult:
    """Run a team on ``prompt`` in the git repository around ``workdir``, to its end."""
    if runner.settings.max_depth < 1:
        raise UsageError(
            "a team's writers and reviewers run at depth 1; set max_depth to 1 or more"
        )
    workdir = await asyncio.to_thread(workdir.resolve)
    await base_commit(workdir)  # a clear error before anything is stored
    record = await runner.run(team_spec(prompt, workdir, plan))
    found = read_result(runner.store, record)
    if found is None:  # it failed before its first step
        raise OrchError(f"team run {record.run_id} {record.status.value}: {record.error}")
    return found
