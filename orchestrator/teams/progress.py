"""Where a team run stands: its candidates, gate results, reviews and outcome.

:class:`TeamResult` is at once what ``orch team run --json`` prints, what ``orch team status``
shows and what ``orch resume`` continues from: the team's driver writes it whole into its
root run's record (``RunRecord.progress``, replaced) after every step, so another process
(a terminal watching a background team, a resume after a cancel) reads it from the store
(:func:`read_result`) without the driver.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, ValidationError, computed_field

from ..errors import OrchError
from ..run import RunRecord, RunStatus
from ..store import RunStore
from .board import BoardState
from .gate import GateResult
from .plan import TeamPlan
from .review import Verdict


class TeamRun(BaseModel):
    """One writer, gate or reviewer run of the team (a child of the root run)."""

    round: int
    role: Literal["writer", "gate", "reviewer", "lead", "teammate"]
    candidate: int | None = None  # the writer's or gate's candidate
    run_id: str
    status: RunStatus
    error: str | None = None


class Candidate(BaseModel):
    """One writer's line of work: its branch and how far it got."""

    number: int  # 1..N
    branch: str | None = None
    commit: str | None = None  # its tip after its last writer run
    writer_run: str | None = None  # its last writer run (resumed with the next message)
    written: int = 0  # the last round its writer finished
    state: Literal["writing", "gate_failed", "passed", "chosen", "kept", "failed"] = "writing"
    feedback: str | None = None  # the next message for its writer (gate output, reviews)
    error: str | None = None


class ReviewNote(BaseModel):
    """One reviewer's verdict, tagged with who gave it."""

    reviewer: str  # its tag: the agent's name, with #2, #3 when a team names it twice
    run_id: str
    verdict: Verdict


class ReviewRound(BaseModel):
    """The reviews of one round and what the team made of them."""

    round: int
    candidates: list[int]  # the candidates the reviewers saw (those that passed the gate)
    notes: list[ReviewNote] = Field(default_factory=list)
    chosen: int  # the candidate going on (the reviewers' choice among several)
    approvals: int = 0  # reviewers approving the chosen candidate
    approved: bool = False


class TeamResult(BaseModel):
    """A team run, whole: what it was asked, where it stands, how it ended."""

    root_run_id: str
    chain_id: str
    status: RunStatus
    plan: TeamPlan
    task: str  # what the writers were asked
    base: str  # the user's HEAD when the team started
    rounds: int = 0  # rounds started
    completed: int = 0  # rounds finished (a resume goes on after them)
    max_rounds: int
    candidates: list[Candidate] = Field(default_factory=list)
    chosen: int | None = None  # the candidate the reviewers chose (or the only one)
    branch: str | None = None  # the chosen (or only) candidate's branch
    commit: str | None = None  # its tip
    gates: list[GateResult] = Field(default_factory=list)
    reviews: list[ReviewRound] = Field(default_factory=list)
    runs: list[TeamRun] = Field(default_factory=list)
    diffstat: dict[str, int] = Field(default_factory=dict)  # files_changed, insertions, ...
    approved: bool = False
    merged: bool = False
    merge_commit: str | None = None  # the user's HEAD after the merge
    resumed_from: str | None = None  # the team root this one continues
    board: BoardState | None = None  # a lead team's board: its tasks and messages
    error: str | None = None

    @property
    def exit_code(self) -> int:
        return 0 if self.approved and self.error is None else 1

    @computed_field  # type: ignore[prop-decorator]
    @property
    def verdicts(self) -> list[Verdict]:
        """Every verdict, in order (round by round, reviewer by reviewer)."""
        return [n.verdict for r in self.reviews for n in r.notes]

    def kept(self) -> list[Candidate]:
        """The candidates not chosen whose branches are kept."""
        return [c for c in self.candidates if c.branch and c.number != self.chosen]


def read_result(store: RunStore, root: RunRecord) -> TeamResult | None:
    """A team root's last progress (None: not a team, or it never started), with the
    root's own ending laid over it once it has ended; OrchError when it cannot be read."""
    if root.progress is None:
        return None
    try:
        result = TeamResult.model_validate(root.progress)
    except ValidationError:
        raise OrchError(
            f"the progress of team run {root.run_id} cannot be read (another orch's, or "
            "damaged); `orch logs` still shows its events"
        ) from None
    if root.status.ended:
        result.status = root.status
        if root.status != RunStatus.SUCCEEDED and result.error is None:
            result.error = root.error or root.status.value
    return result
