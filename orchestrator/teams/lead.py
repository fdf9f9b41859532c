"""A lead team: a lead agent, a shared task board, teammates, and every task checked.

The root run (agent ``team``) is driven by :class:`LeadDriver`. It makes the team's
integration branch ``orch/team/<id>`` at the user's HEAD and starts the lead (the team's
``lead`` agent, granted the board tools a lead has: ``board_add``, ``board_list``,
``board_update``, ``board_wait``, ``message``; it reads a throwaway checkout of the
integration branch). While a task is ready and a teammate is free, the driver starts a
teammate run (the ``writer`` agent, granted ``board_claim``, ``board_done``, ``board_list``,
``board_wait``, ``message``) on a branch of its own from the integration branch's tip; the
teammate claims a task, works, and hands it in. Its work then passes the team's gate and
reviewers (:mod:`.steps`) and is merged onto the integration branch (:mod:`.integrate`); a
failed gate, a rejection or a conflict sends the task back to the board with the reason,
until ``rounds`` attempts. Messages go through the board (:mod:`.board`) to the next turn of
their recipient. The team ends when the lead has ended and no task can move; it is approved
when every task is merged, and then merged into the user's HEAD with ``merge``.

Every board change is an event of the root, and after each the whole result is too
(``RunRecord.progress``): ``orch team board``, ``orch team messages`` and ``orch team status``
read them, and ``orch resume`` continues from them: merged tasks stay merged, claimed or
unchecked ones are ready again.
"""

from __future__ import annotations

import asyncio

from ..engine.runner import Runner
from ..errors import OrchError
from ..project.repo import diff_stats, is_ancestor, rev, short_run_id
from ..run import RunRecord
from ..spec import RunSpec
from ..tools.boardtools import LEAD_TOOLS, TEAMMATE_TOOLS
from ..untrusted import escaped
from ..workspaces.lifetime import stopped
from ..workspaces.registry import tier_config
from . import gate as gates
from . import review
from .board import Board, BoardState, BoardTask, Role
from .driver import TeamDriver
from .gate import trim
from .integrate import Conflict, delete_if_unused, ensure_branch, merge_onto
from .plan import TeamPlan
from .progress import TeamResult
from .steps import shown_candidate

POLL_S = 5.0  # the scheduler looks again at least this often
LEAD_PROMPT = """You lead a team of {count} teammate(s) ({names}) on this goal:
<goal>
{task}
</goal>

Break the goal into tasks on the team's board with board_add: a title, a detail saying what
done means and which files, and depends_on for tasks that need another merged first.
Teammates claim ready tasks; each works on its own branch from the team's integration branch
{integration}, and each finished task passes the test gate and the reviewers and is merged
there, or comes back to the board with the reason. Use board_wait to wait for progress
(never poll), message to talk to a teammate or to all, and board_update to change or cancel
a task nobody holds. When every task is done, answer with a short summary of what the team
delivered."""
TEAMMATE_PROMPT = """You are {name}, a teammate in a team run by its lead ("lead"). The goal:
<goal>
{task}
</goal>

Call board_claim to get a task, then do it in your workspace: your own branch from the
team's integration branch, with every task merged so far. When it is done and tested, call
board_done with its id and a summary, then end your turn with a one-line summary. If no
task is ready, end your turn. Use message to ask the lead or a teammate (they are
{others}), and board_wait to wait for an answer."""


class LeadDriver(TeamDriver):
    """The body of a lead team's root run."""

    def __init__(self, runner: Runner, plan: TeamPlan) -> None:
        super().__init__(runner, plan)
        self.definition = self.definition.model_copy(
            update={
                "tools": list(
                    dict.fromkeys([*(self.definition.tools or []), *LEAD_TOOLS, *TEAMMATE_TOOLS])
                )
            }
        )
        self.members = [f"teammate-{k}" for k in range(1, plan.teammates + 1)]
        self.started: dict[str, int] = {}  # member -> runs started
        self.idle = 0  # teammate runs in a row that ended without claiming a ready task

    done_phrase = "every task merged"

    async def _work(self) -> None:
        state = self.result.board or BoardState()
        self.result.board = state
        self.board = Board(
            state,
            self.members,
            record=self._recorded,
            deliver=self.runner.notify,
            describe=self.runner.describe,
        )
        if self.result.resumed_from is not None:
            self.board.resumed()
        assert self.result.branch is not None
        await self._integration(state)
        await self._run()
        self.result.approved = self.board.settled() and all(t.state == "done" for t in state.tasks)
        if not self.result.approved:
            failed = [t.id for t in state.tasks if t.state != "done"]
            raise OrchError(
                "not every task was merged ("
                + (", ".join(failed) or "the lead added no task")
                + f"); the work so far is on {self.result.branch}"
            )

    def _fresh(self, base: str) -> TeamResult:
        result = super()._fresh(base)
        result.branch = f"orch/team/{short_run_id(self.root.run_id)}"
        return result

    def _continued(self, result: TeamResult) -> TeamResult:
        if result.board is None:
            raise OrchError(f"team run {result.resumed_from} left no board to continue; start anew")
        return result

    async def _integration(self, state: BoardState) -> None:
        """The integration branch, made at the base; a resumed team's must still hold every
        task merged on it (nothing merged is ever silently dropped)."""
        branch = str(self.result.branch)
        merged = [t for t in state.tasks if t.state == "done" and t.commit]
        tip = await rev(f"refs/heads/{branch}", self.repo)
        if tip is None and merged:
            raise OrchError(
                f"the team's branch {branch} is gone, with {', '.join(t.id for t in merged)} "
                f"merged on it; restore it (git branch {branch} {merged[-1].commit}) and resume"
            )
        for t in merged:
            if tip is not None and not await is_ancestor(self.repo, str(t.commit), tip):
                raise OrchError(
                    f"the team's branch {branch} no longer holds {t.id}'s merge "
                    f"({str(t.commit)[:12]}); restore it and resume"
                )
        await ensure_branch(self.repo, branch, self.result.base)

    def _recorded(self, kind: str, data: dict[str, object]) -> None:
        self.runner.event(self.root.run_id, kind, dict(data))
        self._save()

    def _save(self) -> None:
        self.runner.progress(self.root.run_id, self.result.model_dump(mode="json"))

    async def _diffstat(self) -> None:
        """The integration branch's tip and its diff stats against the base."""
        res = self.result
        res.commit = await rev(f"refs/heads/{res.branch}", self.repo)
        if res.commit is not None:
            files, ins, dels = await diff_stats(self.repo, res.base, res.commit)
            res.diffstat = {"files_changed": files, "insertions": ins, "deletions": dels}

    # -- the team at work ---------------------------------------------------------------
    async def _run(self) -> None:
        lead = asyncio.create_task(self._lead_run(), name=f"orch-lead-{self.root.run_id}")
        jobs: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                for name in self.members:
                    job = jobs.get(name)
                    if job is not None and job.done():
                        jobs.pop(name)
                        job.result()  # a bug in a step ends the team, with its reason
                if lead.done():
                    lead.result()
                self._check_idle()
                ready = self.board.ready()
                for name in self.members:
                    rested = self.board.empty_at.get(name) != self.board.version
                    if ready and name not in jobs and rested:
                        jobs[name] = asyncio.create_task(self._teammate(name))
                        ready = ready[1:]
                if lead.done() and not jobs and not self._startable():
                    self.board.strand()
                    return
                changed = asyncio.ensure_future(self.board.wait_quietly(POLL_S))
                await asyncio.wait({lead, changed, *jobs.values()}, return_when="FIRST_COMPLETED")
                changed.cancel()
        finally:
            await stopped(*(j for j in (lead, *jobs.values()) if not j.done()))

    def _check_idle(self) -> None:
        """A team that makes no progress stops (``idle_runs``), saying why in one line."""
        limit = self.plan.idle_runs
        if self.idle >= limit:
            raise OrchError(
                f"the team made no progress: {self.idle} teammate runs in a row ended without "
                f"claiming a ready task (idle_runs = {limit}); the work so far is on "
                f"{self.result.branch}"
            )
        if self.board.stalled >= limit:
            raise OrchError(
                f"the team made no progress: the lead waited {limit} times in a row on a "
                f"board nobody else can move (idle_runs = {limit}); the work so far is on "
                f"{self.result.branch}"
            )

    def _startable(self) -> bool:
        """A ready task and a teammate who would be started for it."""
        rested = any(self.board.empty_at.get(n) != self.board.version for n in self.members)
        return bool(self.board.ready()) and rested

    def _seated(self, handle_record: RunRecord, name: str, role: Role) -> None:
        seat = self.board.sit(handle_record.run_id, name, role)
        self.runner.seats[handle_record.run_id] = seat

    def _unseated(self, run_id: str) -> None:
        self.board.leave(run_id)
        self.runner.seats.pop(run_id, None)

    async def _lead_run(self) -> None:
        plan, res = self.plan, self.result
        assert res.branch is not None
        tier = tier_config(plan.isolation).model_copy(
            update={"branch": res.branch, "discard": True}
        )
        prompt = LEAD_PROMPT.format(
            count=len(self.members),
            names=", ".join(self.members),
            task=res.task,
            integration=res.branch,
        )
        if res.resumed_from is not None:
            prompt += "\n\nThe team run was interrupted and goes on now. The board:\n"
            prompt += self.board.listing()
        spec = RunSpec(
            prompt=prompt,
            agent=plan.lead,
            description="lead",
            parent_run_id=self.root.run_id,
            workdir=self.workdir,
            workspace=tier,
            grants=list(LEAD_TOOLS),
        )
        handle = await self.crew.spawn(spec)
        self._seated(handle.record, "lead", "lead")
        for note in self.board.take_pending("lead"):
            self.runner.notify(handle.record.run_id, note)
        try:
            rec = await self.runner.wait(handle)
        finally:
            self._unseated(handle.record.run_id)
        self.crew.ran(0, "lead", rec)
        self._save()

    async def _teammate(self, name: str) -> None:
        plan, res = self.plan, self.result
        assert res.branch is not None
        k = self.started[name] = self.started.get(name, 0) + 1
        start = await rev(f"refs/heads/{res.branch}", self.repo)
        assert start is not None
        branch = f"orch/team-task/{short_run_id(self.root.run_id)}-{name}-{k}"
        await ensure_branch(self.repo, branch, start)
        others = ", ".join(["lead", *(m for m in self.members if m != name)])
        prompt = TEAMMATE_PROMPT.format(name=name, task=res.task, others=others)
        if pending := self.board.take_pending(name):
            prompt += "\n\nMessages for you:\n" + "\n".join(pending)
        tier = tier_config(plan.isolation).model_copy(update={"branch": branch, "base": start})
        spec = RunSpec(
            prompt=prompt,
            agent=plan.writer,
            description=f"{name}: claiming a task",
            model=plan.models.writer,
            parent_run_id=self.root.run_id,
            workdir=self.workdir,
            workspace=tier,
            grants=list(TEAMMATE_TOOLS),
        )
        handle = await self.crew.spawn(spec)
        rid = handle.record.run_id
        self._seated(handle.record, name, "teammate")
        try:
            rec = await self.runner.wait(handle)
        finally:
            self._unseated(rid)
        task = next((t for t in self.board.state.tasks if t.run_id == rid), None)
        self.crew.ran(task.attempts + 1 if task else 0, "teammate", rec)
        if task is None:
            if self.board.ready():  # it could have claimed one, and did not
                self.idle += 1
            await delete_if_unused(self.repo, branch, start)
            return
        self.idle = 0
        if task.state == "claimed":
            why = rec.error or rec.status.value
            self._back(
                task, f"{name} ended without board_done ({rec.status.value}: {escaped(why)})"
            )
        else:
            task.branch = branch
            await self._check(task, branch, start)

    def _back(self, task: BoardTask, why: str) -> None:
        self.board.give_back(task, why, limit=self.plan.rounds)

    async def _check(self, task: BoardTask, branch: str, start: str) -> None:
        """A handed-in task: its commits, the gate, the reviewers, the merge."""
        plan, res = self.plan, self.result
        n, number = task.attempts + 1, int(task.id.removeprefix("t"))
        commit = await rev(f"refs/heads/{branch}", self.repo)
        if commit is None or commit == start:
            self._back(task, "board_done, but no change was committed on the task's branch")
            return
        gate = None
        if plan.gate is not None:
            gate = await self.crew.gate(n, number, branch, commit, f"{task.id} gate", start)
            trim(res.gates, number)
            res.gates.append(gate)
            self._save()
            if not gate.passed:
                self._back(task, gates.for_writer(gate))
                return
        what = f"{task.title}\n{task.detail}".strip()
        shown = [await shown_candidate(self.repo, start, number, branch, commit, gate)]
        notes = await self.crew.reviews(n, what, start, shown, plan.rounds, {}, task.id)
        _, approvals, approved = review.decide([x.verdict for x in notes], plan.approve)
        self.crew.event(
            "team_decision",
            {"round": n, "chosen": number, "approvals": approvals, "approved": approved},
        )
        if not approved:
            self._back(task, review.for_writer(n, [(x.reviewer, x.verdict) for x in notes]))
            return
        message = f"{task.id}: {task.title}\n\norch-team: {self.root.run_id}\n"
        try:
            merged = await merge_onto(self.repo, str(res.branch), branch, message)
        except Conflict as e:
            self._back(
                task, f"{escaped(e)}; claim it again: you start from the new integration tip"
            )
            return
        self.board.finish(task, merged)
