"""A lead team's shared task board and its messages.

The lead adds tasks (``board_add``, with ``depends_on``), teammates claim ready ones
(``board_claim``) and hand them in (``board_done``); anyone on the team lists the board,
waits for a change (``board_wait``) and sends messages (``message``). The board lives in the
process that drives the team (``lead.py``): every change happens without an ``await`` between
its check and its write, so two teammates never claim one task, and each change is written at
once to the team root's events (``board_task``, ``board_message``), so a crash leaves the
board in the store and ``orch resume`` continues from it.

Who may do what is the board's rule, not the model's: a :class:`Seat` binds a run to its
member name and role when the driver starts it, and the tools act only through their seat.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from ..errors import OrchError
from ..untrusted import escaped, framed, one_line

TaskState = Literal["ready", "waiting", "claimed", "checking", "done", "failed"]
Role = Literal["lead", "teammate"]
MAX_TASKS = 200
MAX_TEXT = 8_000  # characters of a title + detail, a message, a summary
MAX_MESSAGES = 200  # a team's messages in all
MAX_PENDING = 20  # messages kept for a member's next run


class BoardTask(BaseModel):
    id: str  # t1, t2, ...
    title: str
    detail: str = ""
    depends_on: list[str] = Field(default_factory=list)
    state: TaskState = "ready"
    owner: str | None = None  # the teammate working on it (or that finished it)
    run_id: str | None = None  # that teammate's run
    attempts: int = 0  # times handed in (board_done) or given back
    notes: list[str] = Field(default_factory=list)  # why it came back, newest last
    summary: str | None = None  # the teammate's, at board_done
    branch: str | None = None  # the branch its work was on
    commit: str | None = None  # the integration branch's commit that merged it


class Message(BaseModel):
    id: int
    at: float
    sender: str
    to: str  # a teammate's name, "lead" or "all"
    text: str


class BoardState(BaseModel):
    tasks: list[BoardTask] = Field(default_factory=list)
    messages: list[Message] = Field(default_factory=list)


@dataclass
class Seat:
    """One run's place on the board: what its tools act as."""

    board: Board
    name: str  # "lead", "teammate-1", ...
    role: Role
    run_id: str

    def add(self, title: str, detail: str, depends_on: list[str]) -> BoardTask:
        return self.board.add(self, title, detail, depends_on)

    def update(self, task_id: str, **changes: object) -> BoardTask:
        return self.board.update(self, task_id, **changes)

    def claim(self) -> BoardTask | None:
        return self.board.claim(self)

    def done(self, task_id: str, summary: str) -> BoardTask:
        return self.board.done(self, task_id, summary)

    def message(self, to: str, text: str) -> Message:
        return self.board.message(self, to, text)

    def listing(self) -> str:
        return self.board.listing()

    async def wait(self, timeout_s: float) -> str:
        return await self.board.wait(self, timeout_s)


class Board:
    """The board of one team run (its state, and who sits at it)."""

    def __init__(
        self,
        state: BoardState,
        members: list[str],
        *,
        record: Callable[[str, dict[str, object]], None],
        deliver: Callable[[str, str], bool],
        describe: Callable[[str, str], None],
    ) -> None:
        self.state = state
        self.members = members  # the teammates' names
        self._record = record  # an event on the team root
        self._deliver = deliver  # (run id, text): into that run's next turn, if it is live
        self._describe = describe  # (run id, text): what `orch ps` shows the run doing
        self.seats: dict[str, Seat] = {}  # run id -> seat
        self.pending: dict[str, list[str]] = {}  # member -> messages not yet delivered
        self._changed = asyncio.Event()
        self.version = 0  # changes so far
        self.empty_at: dict[str, int] = {}  # member -> the version its last claim found none
        self.stalled = 0  # the lead's waits in a row on a board nobody else can move

    # -- seats --------------------------------------------------------------------------
    def sit(self, run_id: str, name: str, role: Role) -> Seat:
        seat = Seat(self, name, role, run_id)
        self.seats[run_id] = seat
        return seat

    def seat(self, run_id: str) -> Seat | None:
        return self.seats.get(run_id)

    def leave(self, run_id: str) -> None:
        self.seats.pop(run_id, None)

    # -- reading ------------------------------------------------------------------------
    def task(self, task_id: str) -> BoardTask:
        for t in self.state.tasks:
            if t.id == task_id:
                return t
        known = ", ".join(t.id for t in self.state.tasks) or "none yet"
        raise OrchError(f"no task {task_id!r} on the board (tasks: {known})")

    def ready(self) -> list[BoardTask]:
        self._unblock()
        return [t for t in self.state.tasks if t.state == "ready"]

    def settled(self) -> bool:
        """Every task is done or failed (and there is at least one)."""
        return bool(self.state.tasks) and all(
            t.state in ("done", "failed") for t in self.state.tasks
        )

    def listing(self) -> str:
        if not self.state.tasks:
            return "The board is empty."
        lines = []
        for t in self.state.tasks:
            deps = f" (after {', '.join(t.depends_on)})" if t.depends_on else ""
            who = f" [{t.owner}]" if t.owner else ""
            lines.append(f"{t.id} {t.state}{who}: {escaped(one_line(t.title))}{deps}")
            if t.notes and t.state in ("ready", "failed"):
                lines.append(f"    last note: {one_line(t.notes[-1])[:400]}")
        return "\n".join(lines)

    # -- changes ------------------------------------------------------------------------
    def _changed_now(self) -> None:
        self.version += 1
        self.stalled = 0
        self._changed.set()
        self._changed = asyncio.Event()

    def _save(self, task: BoardTask) -> None:
        self._record("board_task", task.model_dump(mode="json"))
        self._changed_now()

    def _unblock(self) -> None:
        done = {t.id for t in self.state.tasks if t.state == "done"}
        for t in self.state.tasks:
            if t.state == "waiting" and all(d in done for d in t.depends_on):
                t.state = "ready"
                self._save(t)

    def add(self, seat: Seat, title: str, detail: str, depends_on: list[str]) -> BoardTask:
        if seat.role != "lead":
            raise OrchError("only the lead adds tasks; send the lead a message instead")
        if len(self.state.tasks) >= MAX_TASKS:
            raise OrchError(f"the board holds at most {MAX_TASKS} tasks")
        if not title.strip() or len(title) + len(detail) > MAX_TEXT:
            raise OrchError(f"a task needs a title, and at most {MAX_TEXT} characters in all")
        for d in depends_on:
            self.task(d)  # an unknown id: a clear error
        task = BoardTask(
            id=f"t{len(self.state.tasks) + 1}",
            title=title.strip(),
            detail=detail,
            depends_on=list(dict.fromkeys(depends_on)),
            state="waiting" if depends_on else "ready",
        )
        self.state.tasks.append(task)
        self._save(task)
        self._unblock()
        return task

    def update(self, seat: Seat, task_id: str, **changes: object) -> BoardTask:
        if seat.role != "lead":
            raise OrchError("only the lead updates tasks; send the lead a message instead")
        task = self.task(task_id)
        if task.state in ("claimed", "checking", "done"):
            raise OrchError(f"task {task_id} is {task.state}; it can be changed when it is back")
        for key in ("title", "detail"):
            value = changes.get(key)
            if isinstance(value, str) and value.strip():
                setattr(task, key, value)
        if changes.get("cancel"):
            task.state = "failed"
            task.notes.append("cancelled by the lead")
        self._save(task)
        return task

    def claim(self, seat: Seat) -> BoardTask | None:
        """The first ready task, now the seat's: atomic (no await inside)."""
        if seat.role != "teammate":
            raise OrchError("only teammates claim tasks")
        mine = [t for t in self.state.tasks if t.run_id == seat.run_id]
        for t in mine:
            if t.state == "claimed":
                raise OrchError(f"you already hold {t.id}; finish it with board_done first")
            if t.state == "checking":  # one task a run: the checks look at this run's branch
                raise OrchError(f"you handed in {t.id}; end your turn now")
        ready = self.ready()
        if not ready:
            self.empty_at[seat.name] = self.version  # started again once the board changes
            return None
        task = ready[0]
        task.state, task.owner, task.run_id = "claimed", seat.name, seat.run_id
        self._save(task)
        self._describe(seat.run_id, f"{seat.name}: {task.id} {task.title}")
        return task

    def done(self, seat: Seat, task_id: str, summary: str) -> BoardTask:
        task = self.task(task_id)
        if task.run_id != seat.run_id or task.state != "claimed":
            raise OrchError(f"task {task_id} is not yours to hand in (it is {task.state})")
        task.state, task.summary = "checking", summary[:MAX_TEXT]
        self._save(task)
        return task

    def give_back(self, task: BoardTask, why: str, *, limit: int) -> None:
        """A task the checks (or a crash) sent back: ready again, or failed after ``limit``."""
        task.attempts += 1
        task.notes.append(why[:MAX_TEXT])
        task.run_id = None
        task.state = "failed" if task.attempts >= limit else "ready"
        if task.state == "ready":
            task.owner = None
        self._save(task)

    def resumed(self) -> None:
        """A resumed team's board: what was under way is ready again, and what failed
        (not what the lead cancelled) gets its attempts again."""
        for task in self.state.tasks:
            if task.state in ("claimed", "checking"):
                task.state, task.owner, task.run_id = "ready", None, None
                task.notes.append("the team run was interrupted; ready again")
            elif task.state == "failed" and "cancelled by the lead" not in task.notes:
                task.state = "waiting" if task.depends_on else "ready"
                task.owner, task.run_id, task.attempts = None, None, 0
                task.notes.append("the team run goes on; ready again")

    def strand(self) -> None:
        """Tasks that can never be ready (they wait on a failed one) fail, saying why."""
        failed = {t.id for t in self.state.tasks if t.state == "failed"}
        for t in self.state.tasks:
            if t.state == "waiting" and failed.intersection(t.depends_on):
                t.state = "failed"
                t.notes.append(f"depends on failed {', '.join(sorted(failed & set(t.depends_on)))}")
                self._save(t)

    def finish(self, task: BoardTask, commit: str) -> None:
        task.state, task.commit = "done", commit
        self._save(task)
        self._unblock()

    # -- messages -----------------------------------------------------------------------
    def message(self, seat: Seat, to: str, text: str) -> Message:
        names = ["lead", *self.members]
        if to not in (*names, "all"):
            raise OrchError(f"no one called {to!r}; send to {', '.join(names)} or all")
        if not text.strip() or len(text) > MAX_TEXT:
            raise OrchError(f"a message needs text, at most {MAX_TEXT} characters")
        if len(self.state.messages) >= MAX_MESSAGES:
            raise OrchError(f"this team has sent {MAX_MESSAGES} messages, its most; work on")
        sent = Message(
            id=len(self.state.messages) + 1, at=time.time(), sender=seat.name, to=to, text=text
        )
        self.state.messages.append(sent)
        self._record("board_message", sent.model_dump(mode="json"))
        note = framed("message", text, from_=seat.name, to=to)
        targets = [n for n in names if n != seat.name] if to == "all" else [to]
        for name in targets:
            live = [s.run_id for s in self.seats.values() if s.name == name]
            if not any(self._deliver(rid, note) for rid in live):
                waiting = self.pending.setdefault(name, [])
                waiting.append(note)
                del waiting[:-MAX_PENDING]  # the latest few wait for its next run
        self._changed_now()
        return sent

    def take_pending(self, name: str) -> list[str]:
        return self.pending.pop(name, [])

    async def wait_quietly(self, timeout_s: float) -> None:
        """Until the board changes (a driver's wait), at most ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._changed.wait()

    def movable(self) -> bool:
        """Whether anyone but the lead can still change the board: a task is ready (a
        teammate is started for it), held or being checked, or a teammate's run is live."""
        busy = any(t.state in ("ready", "claimed", "checking") for t in self.state.tasks)
        return busy or any(s.role == "teammate" for s in self.seats.values())

    async def wait(self, seat: Seat, timeout_s: float) -> str:
        """Until the board changes or a message for the seat arrives, at most ``timeout_s``;
        at once when every task is settled, or when the lead waits on a board nobody else
        can move (each such wait counts: ``stalled``; the driver ends the team after
        ``idle_runs`` of them in a row)."""
        if self.settled():
            return f"Every task is done or failed.\n{self.listing()}"
        if seat.role == "lead" and not self.movable():
            self.stalled += 1
            self._changed.set()  # the driver looks at once (the version stays: no change)
            self._changed = asyncio.Event()
            return (
                "Nothing can change the board but you: no task is ready, held or being "
                "checked, and no teammate is at work. Add tasks with board_add, or end your "
                f"turn with a summary.\n{self.listing()}"
            )
        changed = self._changed
        try:
            async with asyncio.timeout(timeout_s):
                await changed.wait()
        except TimeoutError:
            return f"Nothing changed in {timeout_s:g}s.\n{self.listing()}"
        return f"The board changed.\n{self.listing()}"
