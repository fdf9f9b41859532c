"""The tools of a lead team's board (``teams/board.py``): thin, through the run's seat.

They are ``granted`` tools: no agent has them by its definition; a lead team's driver
grants the lead ``board_add``, ``board_list``, ``board_update``, ``board_wait`` and
``message``, and each teammate ``board_claim``, ``board_done``, ``board_list``,
``board_wait`` and ``message`` (``RunSpec.grants``). The board decides who may do what.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from ..errors import OrchError
from ..untrusted import escaped, framed, one_line
from .base import BoardSeat, Tool, ToolContext, ToolFailure, ToolInput, ToolOutput

WAIT_MAX_S = 600.0


def _seat(ctx: ToolContext) -> BoardSeat:
    if ctx.board is None:
        raise ToolFailure("this run has no seat on a team board (board tools are a lead team's)")
    return ctx.board


class _BoardTool(Tool):
    granted: ClassVar[bool] = True

    async def run(self, ctx: ToolContext, args: Any) -> ToolOutput:
        try:
            return ToolOutput(await self.act(_seat(ctx), args))
        except OrchError as e:
            raise ToolFailure(str(e)) from None

    async def act(self, seat: BoardSeat, args: Any) -> str:
        raise NotImplementedError


class AddInput(ToolInput):
    title: str = Field(min_length=1, max_length=300, description="The task, in a line.")
    detail: str = Field(default="", max_length=7_000, description="What done means, files.")
    depends_on: list[str] = Field(
        default_factory=list, description="Ids of tasks that must be done (merged) first."
    )


class BoardAddTool(_BoardTool):
    name = "board_add"
    description = (
        "Add a task to the team's board (lead only). A teammate claims it when the tasks "
        "it depends on are merged. Returns the new task's id."
    )
    input_model = AddInput

    async def act(self, seat: BoardSeat, args: AddInput) -> str:
        task = seat.add(args.title, args.detail, args.depends_on)
        return f"Added {task.id}: {task.title}"


class NoInput(ToolInput):
    pass


class BoardListTool(_BoardTool):
    name = "board_list"
    description = "The team's board: every task, its state and who holds it."
    input_model = NoInput

    async def act(self, seat: BoardSeat, args: NoInput) -> str:
        return seat.listing()


class UpdateInput(ToolInput):
    task_id: str
    title: str | None = Field(default=None, max_length=300)
    detail: str | None = Field(default=None, max_length=7_000)
    cancel: bool = Field(default=False, description="Drop the task: it will not be done.")


class BoardUpdateTool(_BoardTool):
    name = "board_update"
    description = "Change a task that nobody holds (lead only): its title, detail, or cancel it."
    input_model = UpdateInput

    async def act(self, seat: BoardSeat, args: UpdateInput) -> str:
        task = seat.update(args.task_id, title=args.title, detail=args.detail, cancel=args.cancel)
        return f"Updated {task.id}: {task.title}"


class WaitInput(ToolInput):
    timeout_s: float = Field(default=60.0, gt=0, le=WAIT_MAX_S)


class BoardWaitTool(_BoardTool):
    name = "board_wait"
    description = (
        "Wait until the board changes or a message arrives (at most timeout_s seconds), "
        "then see the board. Use it instead of polling."
    )
    input_model = WaitInput

    def time_limit(self, args: Any, settings: Any) -> float | None:
        return WAIT_MAX_S + 5

    async def act(self, seat: BoardSeat, args: WaitInput) -> str:
        return await seat.wait(args.timeout_s)


class BoardClaimTool(_BoardTool):
    name = "board_claim"
    description = (
        "Claim the next ready task (teammates): returns its id, title and detail, or says "
        "none is ready. Work on it in your workspace, then call board_done."
    )
    input_model = NoInput

    async def act(self, seat: BoardSeat, args: NoInput) -> str:
        task = seat.claim()
        if task is None:
            return "No task is ready. End your turn with a one-line summary."
        earlier = "".join(f"\nIt came back before: {n}" for n in task.notes[-2:])
        detail = framed("detail", task.detail, by="lead") if task.detail.strip() else ""
        return f"Claimed {task.id}: {escaped(one_line(task.title))}\n{detail}{earlier}"


class DoneInput(ToolInput):
    task_id: str
    summary: str = Field(min_length=1, max_length=4_000, description="What you changed.")


class BoardDoneTool(_BoardTool):
    name = "board_done"
    description = (
        "Hand in your task (teammates): your work is committed, checked by the team's gate "
        "and reviewers, and merged; if a check fails the task comes back with the reason."
    )
    input_model = DoneInput

    async def act(self, seat: BoardSeat, args: DoneInput) -> str:
        task = seat.done(args.task_id, args.summary)
        return f"Handed in {task.id}. End your turn now with a one-line summary."


class MessageInput(ToolInput):
    to: str = Field(description="A teammate's name (teammate-1, ...), lead, or all.")
    text: str = Field(min_length=1, max_length=7_000)


class MessageTool(_BoardTool):
    name = "message"
    description = "Send a message to a teammate, the lead, or all: it arrives at their next turn."
    input_model = MessageInput

    async def act(self, seat: BoardSeat, args: MessageInput) -> str:
        seat.message(args.to, args.text)
        return f"Sent to {args.to}."


LEAD_TOOLS = ("board_add", "board_list", "board_update", "board_wait", "message")
TEAMMATE_TOOLS = ("board_claim", "board_done", "board_list", "board_wait", "message")


def board_tools() -> list[Tool]:
    return [
        BoardAddTool(),
        BoardListTool(),
        BoardUpdateTool(),
        BoardWaitTool(),
        BoardClaimTool(),
        BoardDoneTool(),
        MessageTool(),
    ]
