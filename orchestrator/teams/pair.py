"""Teams: a writer and a reviewer taking turns on one branch until the reviewer approves.

``run_team`` makes one QueryChain: a root run (agent ``team``, depth 0, no
model of its own: the :class:`_Team` driver is its body) and, for each round,
a writer run and one or two reviewer runs as its children (depth 1), all
visible in ``orch tree`` / ``orch ps``. The team is a client of the engine:
every run goes through ``Runner.spawn`` and the runner writes every record.

1. The writer works in its own worktree (or container) on a branch
   ``orch/<writer>/<id>`` made from the user's HEAD; its work is committed
   there when it ends.
2. The reviewer gets ``git diff base..branch`` in its prompt and the branch
   checked out in a workspace of its own, in the writer's tier (a container writer's
   branch is never checked out on the host), with read-only tools; it answers with a
   JSON :class:`Verdict`. A malformed verdict is asked for once more (a new reviewer
   run, told what was wrong); a second malformed one fails the round.
3. On ``changes_requested`` the writer goes on with the same branch (checked
   out again, new commits on top) and the review comments in its prompt.
   The loop ends on ``approve`` or after ``rounds`` rounds.

With ``merge`` an approved branch is merged into the user's HEAD exactly as
``orch worktrees merge`` does it. What the reviewer sees and answers (the diff, the
prompts, the verdict) is :mod:`orchestrator.teams.review`; this module runs the rounds and
reports them (:class:`TeamResult`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from ..branches import merge as merge_branch
from ..catalog.definitions import AgentDefinition
from ..engine.agent import LoopOutcome
from ..engine.runner import Runner
from ..errors import OrchError, UsageError
from ..project.git import RepoPaths
from ..project.repo import diff_stats, discover, rev
from ..run import RunRecord, RunStatus
from ..spec import RunSpec
from ..workspaces.registry import BRANCH_TIERS, tier_config
from ..workspaces.shared import SharedConfig
from .review import (
    Verdict,
    VerdictError,
    branch_diff,
    parse_verdict,
    reviewer_prompt,
    reviewer_retry,
    writer_followup,
)

TEAM_ISOLATIONS = BRANCH_TIERS  # a writer needs a branch of its own


# -- the result ---------------------------------------------------------------------


class TeamRun(BaseModel):
    """One writer or reviewer run of the team (a child of the root run)."""

    round: int
    role: Literal["writer", "reviewer"]
    run_id: str
    status: RunStatus
    error: str | None = None


class TeamResult(BaseModel):
    """What ``orch team run --json`` prints."""

    root_run_id: str
    chain_id: str
    status: RunStatus
    branch: str | None = None
    commit: str | None = None  # the branch tip after the last writer run
    base: str  # the user's HEAD when the team started
    rounds: int = 0  # rounds started
    max_rounds: int
    verdicts: list[Verdict] = Field(default_factory=list)  # one per completed review, in order
    runs: list[TeamRun] = Field(default_factory=list)
    approved: bool = False
    merged: bool = False
    merge_commit: str | None = None  # the user's HEAD after the merge
    error: str | None = None

    @property
    def exit_code(self) -> int:
        return 0 if self.approved and self.error is None else 1


# -- running a team -----------------------------------------------------------------


async def _base_commit(workdir: Path) -> tuple[RepoPaths, str]:
    try:
        repo = (await discover(workdir)).main()
    except UsageError:
        raise UsageError(
            f"orch team needs a git repository: {workdir} is not inside one; "
            "run `git init` and make a first commit"
        ) from None
    head = await rev("HEAD", repo)
    if head is None:
        raise UsageError(
            f"the git repository at {repo.main_root} has no commits yet; make a first commit, "
            "then run orch team"
        )
    return repo, head


class _Team:
    """One team run: the root record, its rounds, and what is reported at the end."""

    root: RunRecord  # set when the runner starts the root run (``drive``)
    runner: Runner

    def __init__(
        self,
        definition: AgentDefinition,
        *,
        repo: RepoPaths,
        workdir: Path,
        prompt: str,
        writer: str,
        reviewer: str,
        rounds: int,
        isolation: str,
        merge: bool,
        result: TeamResult,
        allow_control_files: bool = False,
    ) -> None:
        self.definition = definition
        self.allow_control_files = allow_control_files
        self.repo = repo
        self.workdir = workdir
        self.prompt = prompt
        self.writer = writer
        self.reviewer = reviewer
        self.max_rounds = rounds
        self.isolation = isolation
        self.merge = merge
        self.result = result
        self.stats: dict[str, int] = {}  # diff stats of the branch against the base

    def _note(self, n: int, role: Literal["writer", "reviewer"], rec: RunRecord) -> None:
        self.result.runs.append(
            TeamRun(round=n, role=role, run_id=rec.run_id, status=rec.status, error=rec.error)
        )

    async def drive(self, record: RunRecord, runner: Runner) -> LoopOutcome:
        """The root run's body: the rounds, then the outcome the runner records."""
        self.root, self.runner = record, runner
        self.result.root_run_id, self.result.chain_id = record.run_id, record.chain_id
        try:
            await self._rounds()
            if self.result.approved and self.merge:
                await self._merge()
        except OrchError as e:
            self.result.error = str(e)
        except Exception as e:  # a bug must end the team as failed, not leave it running
            self.result.error = f"{type(e).__name__}: {e}".strip()
        ok = self.result.approved and self.result.error is None
        return self._outcome(RunStatus.SUCCEEDED if ok else RunStatus.FAILED)

    async def _child(
        self, agent: str, prompt: str, description: str, isolation: str, **tier: str
    ) -> RunRecord:
        spec = RunSpec(
            prompt=prompt,
            agent=agent,
            description=description,
            parent_run_id=self.root.run_id,
            workdir=self.workdir,
            workspace=tier_config(isolation).model_copy(update=tier),
        )
        return await self.runner.wait(await self.runner.spawn(spec))

    async def _rounds(self) -> None:
        res = self.result
        previous: Verdict | None = None
        for n in range(1, self.max_rounds + 1):
            res.rounds = n
            if res.branch is None:
                prompt, options = self.prompt, {}
            else:
                assert previous is not None
                prompt = writer_followup(self.prompt, res.branch, n, previous)
                options = {"branch": res.branch, "base": res.base}
            wrec = await self._child(
                self.writer, prompt, f"team round {n}: write", self.isolation, **options
            )
            self._note(n, "writer", wrec)
            made = [str(a["branch"]) for a in wrec.artifacts if a.get("kind") == "branch"]
            if res.branch is not None and made and made[0] != res.branch:
                raise OrchError(
                    f"round {n}: the {self.isolation} tier did not continue branch {res.branch} "
                    f"(the writer's work went to {made[0]}); it does not support teams"
                )
            branch = res.branch or (made[0] if made else None)
            if branch is not None:
                res.branch = branch
                res.commit = await rev(f"refs/heads/{branch}", self.repo)
            if res.commit is not None:
                files, ins, dels = await diff_stats(self.repo, res.base, res.commit)
                self.stats = {"files_changed": files, "insertions": ins, "deletions": dels}
            if wrec.status != RunStatus.SUCCEEDED:
                why = wrec.error or wrec.status.value
                raise OrchError(f"round {n}: the writer run {wrec.run_id} {wrec.status}: {why}")
            if res.branch is None or res.commit is None:
                raise OrchError(
                    f"round {n}: the writer run {wrec.run_id} left no branch with changes; "
                    "there is nothing to review"
                )
            verdict = await self._review(n, res.branch, res.commit, previous)
            res.verdicts.append(verdict)
            self.runner.event(
                self.root.run_id,
                "team_verdict",
                {"round": n, "commit": res.commit, **verdict.model_dump()},
            )
            if verdict.approved:
                res.approved = True
                return
            previous = verdict
        raise OrchError(
            f"not approved after {self.max_rounds} round(s); the work so far is on branch "
            f"{res.branch}"
        )

    async def _review(self, n: int, branch: str, commit: str, previous: Verdict | None) -> Verdict:
        diff = await branch_diff(self.repo, self.result.base, commit)
        first = reviewer_prompt(
            self.prompt, branch, self.result.base, commit, diff, n, self.max_rounds, previous
        )
        prompt, problem, seen = first, "", []
        for attempt in (1, 2):
            what = f"team round {n}: review" + (" (again)" if attempt == 2 else "")
            # the writer's tier: a contained writer's branch is never checked out on the host
            rrec = await self._child(self.reviewer, prompt, what, self.isolation, branch=branch)
            self._note(n, "reviewer", rrec)
            seen.append(rrec.run_id)
            if rrec.status != RunStatus.SUCCEEDED:
                why = rrec.error or rrec.status.value
                raise OrchError(f"round {n}: the reviewer run {rrec.run_id} {rrec.status}: {why}")
            try:
                return parse_verdict(rrec.output)
            except VerdictError as e:
                problem = str(e)
                self.runner.event(
                    self.root.run_id,
                    "team_bad_verdict",
                    {"round": n, "run_id": rrec.run_id, "problem": problem},
                )
                prompt = reviewer_retry(first, rrec.output, problem)
        raise OrchError(
            f"round {n}: the reviewer's verdict was malformed twice (runs {', '.join(seen)}): "
            f"{problem}"
        )

    async def _merge(self) -> None:
        assert self.result.branch is not None
        try:
            report = await asyncio.to_thread(
                merge_branch,
                self.workdir,
                self.result.branch,
                allow_control_files=self.allow_control_files,
            )
        except OrchError as e:
            raise OrchError(f"approved, but merging {self.result.branch} failed: {e}") from None
        self.result.merged = True
        self.result.merge_commit = report.commit

    def summary(self) -> str:
        res = self.result
        lines = [f"team: {self.writer} + {self.reviewer}, {res.rounds} round(s)"]
        if res.branch:
            lines.append(f"branch {res.branch} at {(res.commit or '')[:12]} (base {res.base[:12]})")
        for i, v in enumerate(res.verdicts, 1):
            lines.append(f"review {i}: {v.verdict}: {v.summary}")
            lines += [f"  - {c.path}:{c.line}: {c.comment}" for c in v.comments]
        if res.merged:
            lines.append(f"merged into your HEAD at {(res.merge_commit or '')[:12]}")
        if res.approved:
            lines.append("approved")
        if res.error:
            lines.append(f"error: {res.error}" if res.approved else f"not approved: {res.error}")
        return "\n".join(lines)

    def _outcome(self, status: RunStatus) -> LoopOutcome:
        res = self.result
        res.status = status
        artifacts: list[dict[str, Any]] = []
        if res.branch and res.commit:
            artifacts.append(
                {
                    "kind": "branch",
                    "branch": res.branch,
                    "base": res.base,
                    "commit": res.commit,
                    **self.stats,
                }
            )
        error = None if status == RunStatus.SUCCEEDED else res.error or status.value
        return LoopOutcome(status, self.summary(), error, artifacts)


async def run_team(
    runner: Runner,
    *,
    prompt: str,
    workdir: Path,
    writer: str = "writer",
    reviewer: str = "reviewer",
    rounds: int = 3,
    isolation: str = "worktree",
    merge: bool = False,
    allow_control_files: bool = False,
) -> TeamResult:
    """Run a writer/reviewer team on ``prompt`` in the git repository around ``workdir``."""
    if not prompt.strip():
        raise UsageError("the prompt is empty; say what the writer should do")
    if rounds < 1:
        raise UsageError(f"--rounds must be at least 1, not {rounds}")
    if isolation not in TEAM_ISOLATIONS:
        raise UsageError(
            f"a team needs a branch per writer: isolation must be "
            f"{' or '.join(TEAM_ISOLATIONS)}, not {isolation!r}"
        )
    if runner.settings.max_depth < 1:
        raise UsageError("a team's writer and reviewer run at depth 1; set max_depth to 1 or more")
    workdir = await asyncio.to_thread(workdir.resolve)
    repo, base = await _base_commit(workdir)
    names = runner.tools.names()
    writer_tools = runner.catalog.agent(writer).allowed_tools(names)
    reviewer_tools = runner.catalog.agent(reviewer).allowed_tools(names)
    if writes := sorted(runner.tools.writers().intersection(reviewer_tools)):
        raise UsageError(
            f"the reviewer must be read-only, but agent {reviewer!r} has {', '.join(writes)}; "
            "pick an agent with only read_file, glob and grep (like the bundled 'reviewer')"
        )
    definition = AgentDefinition(
        name="team",
        description="A writer and a reviewer taking turns on one branch (orch team run).",
        tools=list(dict.fromkeys([*writer_tools, *reviewer_tools, "task"])),
        system_prompt="",
        source="orch team",
    )
    result = TeamResult(
        root_run_id="", chain_id="", status=RunStatus.RUNNING, base=base, max_rounds=rounds
    )
    team = _Team(
        definition,
        repo=repo,
        workdir=workdir,
        prompt=prompt,
        writer=writer,
        reviewer=reviewer,
        rounds=rounds,
        isolation=isolation,
        merge=merge,
        result=result,
        allow_control_files=allow_control_files,
    )
    spec = RunSpec(prompt=prompt, workdir=workdir, workspace=SharedConfig())
    record = await runner.run(spec, driver=team)
    result.root_run_id, result.chain_id = record.run_id, record.chain_id
    result.status = record.status
    if record.status != RunStatus.SUCCEEDED and result.error is None:
        result.error = record.error
    return result
