"""The contract of a run store: exactly what the engine and the CLI ask of it.

A store keeps ``runs`` (one record per run), their append-only ``events``,
their whole ``outputs``, their ``transcripts`` (the conversation as sent to the
model, plain JSON, for ``resume``) and the ``resources`` they own (process
groups, worktrees, containers), and is shared by every ``orch`` process of a project.
SQLite (:mod:`orchestrator.store.sqlite`, the default) and Postgres
(:mod:`orchestrator.store.postgres`, psycopg 3) implement the same protocol, so nothing
here names a file, a connection or a driver: messages say where the runs are with
:meth:`RunStore.describe`.

Every write is atomic on its own (one transaction) and safe against other
processes writing the same store at the same time; reads see committed data.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from ..errors import OrchError
from ..models.base import clean_text
from ..project.statedir import STATE_DIR_MODE as STATE_DIR_MODE
from ..project.statedir import state_dir as state_dir
from ..project.statedir import state_path as state_path
from ..run import RunRecord, RunStatus, now
from ..workspaces.base import ResourceSink

if TYPE_CHECKING:
    from .journal import KeptEnding

TRANSCRIPT_LIMIT = 2 * 1024 * 1024  # bytes of JSON kept per transcript
MAX_REASON = 500  # characters of the reason an ending could not be stored


def bound_transcript(
    messages: list[dict[str, Any]], limit: int = TRANSCRIPT_LIMIT
) -> tuple[str, bool]:
    """The JSON a store keeps for a transcript, and whether it was cut.

    Over ``limit`` characters of JSON, the first message (the task) is kept with a note
    and then the most recent turns that fit, starting at an assistant message so the
    conversation still alternates; every backend keeps the same text.
    """
    text = json.dumps(messages, separators=(",", ":"), default=str)
    if len(text) <= limit or len(messages) < 2:
        return text, False
    sizes = [len(json.dumps(m, separators=(",", ":"), default=str)) + 1 for m in messages]
    budget = limit - sizes[0] - 200  # the note
    start = len(messages)
    used = 0
    for i in range(len(messages) - 1, 0, -1):
        if used + sizes[i] > budget:
            break
        used += sizes[i]
        if messages[i].get("role") == "assistant":
            start = i  # a tail may begin only here
    first = dict(messages[0])
    content = first.get("content")
    blocks: list[Any] = (
        list(content) if isinstance(content, list) else [{"type": "text", "text": str(content)}]
    )
    note = f"[transcript cut: {start - 1} earlier messages dropped to fit {limit:,} bytes]"
    first["content"] = [*blocks, {"type": "text", "text": note}]
    return json.dumps([first, *messages[start:]], separators=(",", ":"), default=str), True


def make_private(path: Path, mode: int, *, created: bool = False) -> None:
    """Give ``path`` exactly ``mode`` if we just created it, else drop looser bits.

    Only for what we own: a directory or file of another user is left alone.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    if st.st_uid != os.getuid():
        return
    current = stat.S_IMODE(st.st_mode)
    if (created and current != mode) or current & ~mode:
        os.chmod(path, mode)


class StoreError(OrchError):
    """The store cannot be used (a server unreachable, a driver missing): one line for the
    user, naming where the store is without any password."""


class StoreUnreachable(StoreError):
    """The store is away for now (a server down or restarting, a file held locked): what
    a dialect's ``transient`` says of a driver's error, in one line."""


@dataclass(frozen=True)
class ChainUsage:
    runs: int  # every run of the chain, ended ones included
    live: int  # queued or running
    tokens: int  # every token of all its runs (``Usage.tokens``: cache writes, reads too)
    usd: float = 0.0  # dollars all its runs spent (``Usage.cost_usd``)


@dataclass(frozen=True)
class ChainRoom:
    """What a chain must still have for one more run: checked by ``create_run`` in the
    transaction that stores the run, so two spawners cannot both take the last place."""

    runs: int  # the chain's runs, ended ones included, must be fewer than this
    tokens: int | None = None  # and its tokens fewer than this (None: no token budget)
    usd: float | None = None  # and its dollars less than this (None: no dollar budget)

    def used_up(self, used: ChainUsage) -> bool:
        """Whether a chain that has used ``used`` has no room left (one budget used up)."""
        return (
            used.runs >= self.runs
            or (self.tokens is not None and used.tokens >= self.tokens)
            or (self.usd is not None and used.usd >= self.usd)
        )


class ChainFull(Exception):
    """``create_run`` stored nothing: the chain had no room (what it used, what it had)."""

    def __init__(self, used: ChainUsage, room: ChainRoom) -> None:
        super().__init__(f"chain full: {used} against {room}")
        self.used = used
        self.room = room


def _one_line(error: BaseException) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return clean_text(text)[:MAX_REASON]


class Endings(Protocol):
    """Writing a run's ending, so that it is written: every store has this one ``end``
    (its classes inherit it), made only of the protocol's primitives."""

    def end(
        self,
        run_id: str,
        status: RunStatus,
        *,
        output: str | None = None,
        owner: bool = False,
        **fields: Any,
    ) -> RunRecord | None:
        """End ``run_id`` with ``status``: the status, the time, ``fields`` (error, summary,
        usage, evidence, artifacts...) and ``output`` (kept whole too) in one write, then
        its one ``run_finished`` event (:meth:`RunRecord.finished_event`; a failed write of
        the event ends nothing). Only a run still queued or running is ended (else None),
        but for ``owner``: the process that ran it writes its own ending over any other.

        When that write fails (the store refuses a value, a disk or server error), the
        smallest ending there is is written: ``failed``, the time, the reason in one line,
        so a run never stays ``running`` because its ending could not be stored. When even
        that fails, a :class:`StoreError` says so in one line (the run is then ended by
        reconcile: ``orch ps``). When the store is away (``transient``), the ending is kept
        (``keep_ending``: written when it answers, or journaled) and the record as it will
        be is returned."""
        store = cast("RunStore", self)  # what every class that inherits this is
        write = store.update_run if owner else store.end_if_active
        if output is not None:
            fields["output"] = output
        fields = {"status": status, "ended_at": now(), **fields}
        try:
            done = write(run_id, **fields)
            if done is not None and output is not None:
                store.save_output(run_id, output)
        except Exception as e:
            if store.transient(e):
                return store.keep_ending(run_id, fields, output=output, owner=owner)
            why = _one_line(e)
            reason = f"the run ended {status.value}, but its ending could not be stored ({why})"
            try:
                done = write(run_id, status=RunStatus.FAILED, ended_at=now(), error=reason)
            except Exception as again:
                raise StoreError(
                    f"run {run_id} could not be recorded as ended ({_one_line(again)}); "
                    "`orch ps` ends it once the store works again"
                ) from None
        if done is not None:
            with contextlib.suppress(Exception):
                store.add_event(run_id, "run_finished", done.finished_event())
        return done


class RunStore(ResourceSink, Endings, Protocol):
    """Where runs, events, outputs and owned resources are kept (see the module doc)."""

    def describe(self) -> str:
        """Where the runs are kept, for messages (a file path, a DSN without password)."""
        ...

    def close(self) -> None:
        """Close this thread's connection (after writing the queued progress); the next
        call opens a new one."""
        ...

    def flush(self) -> None:
        """Write the queued progress now (a run ends here: nothing of it may wait for a
        loop turn that never comes)."""
        ...

    # -- the store away (``batch``: what waits; ``journal``: endings kept on disk) ------
    def keep_at_most(self, writes: int) -> None:
        """Keep up to ``writes`` queued while the store is away (``store_outage_queue``)."""
        ...

    def transient(self, error: BaseException) -> bool:
        """Whether ``error`` says the store is away for now, not that it refused a write."""
        ...

    def keep_ending(
        self, run_id: str, fields: dict[str, Any], *, output: str | None, owner: bool
    ) -> RunRecord | None:
        """Keep an ending the store could not take, for when it answers (see ``end``)."""
        ...

    def away_since(self) -> float | None:
        """Since when (epoch seconds) this process has found the store away, else None."""
        ...

    def unwritten(self) -> list[KeptEnding]:
        """The endings still waiting for the store."""
        ...

    def forget_unwritten(self) -> None:
        """Drop the waiting endings (journaled: the next command writes them)."""
        ...

    def end_kept(self, ending: KeptEnding) -> RunRecord | None:
        """Write an ending a journal kept, as its process meant it."""
        ...

    def paths(self) -> tuple[Path, ...]:
        """Every filesystem path through which this store can be read or written (a SQLite
        file and its directory, a server's Unix-socket directory): hidden from sandboxes."""
        ...

    # -- runs -----------------------------------------------------------------
    def create_run(self, record: RunRecord, *, room: ChainRoom | None = None) -> None:
        """Insert a new run (its run_id not yet in the store), one transaction; with
        ``room``, only if its chain has that room then (else :class:`ChainFull`)."""
        ...

    def create_runs(
        self, runs: Sequence[tuple[RunRecord, ChainRoom | None]]
    ) -> list[ChainFull | None]:
        """``create_run`` for each (record, room) in order, in one transaction: each room
        counts the runs inserted before it; what could not be stored is its ChainFull."""
        ...

    def get_run(self, run_id: str) -> RunRecord | None:
        """The run with this exact id, or None."""
        ...

    def require_run(self, run_id: str) -> RunRecord:
        """The run with this exact id; NotFound (naming describe()) if there is none."""
        ...

    def find_runs(self, prefix: str) -> list[RunRecord]:
        """Runs whose id starts with prefix taken literally (no wildcards), oldest first."""
        ...

    def list_runs(
        self,
        *,
        chain_id: str | None = None,
        statuses: list[RunStatus] | None = None,
        since: float | None = None,
        limit: int | None = None,
    ) -> list[RunRecord]:
        """Runs matching all filters given (since: updated since, or still live), oldest first."""
        ...

    def chain_usage(self, chain_id: str, *, tokens: bool = False, usd: bool = False) -> ChainUsage:
        """A chain's use of its budgets: runs in total, runs queued or running, and (when
        asked: SQLite reads every record of the chain) its tokens and its dollars; what was
        not asked for is 0. This process's queued progress is written first, so the sum is
        what every writer of the chain has committed."""
        ...

    def list_raw(
        self, *, since: float | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Runs as plain dicts plus ``heartbeat_at``, unvalidated (fast `orch ps`), oldest
        first; ``limit``: only the latest that many."""
        ...

    def descendants(self, run_id: str) -> list[RunRecord]:
        """Every run below run_id (children, their children, ...), breadth first."""
        ...

    def update_run(self, run_id: str, **fields: Any) -> RunRecord:
        """Set fields of a run, read-modify-write in one transaction; NotFound if absent."""
        ...

    def end_if_active(self, run_id: str, **fields: Any) -> RunRecord | None:
        """Compare-and-set in one transaction: only if still queued/running, else None."""
        ...

    def note_activity(self, run_id: str, tool: str, activity: str, **fields: Any) -> None:
        """A tool call as last/recent activity, plus fields; no-op if absent; a progress
        write (``add_event``)."""
        ...

    def patch_run(self, run_id: str, **fields: Any) -> None:
        """Set fields of a run, no answer, no-op if absent; a progress write (``add_event``)."""
        ...

    # -- ownership across processes -------------------------------------------
    def heartbeat(self, run_ids: list[str]) -> None:
        """Stamp now as the heartbeat of these runs, one transaction."""
        ...

    def request_cancel(self, run_ids: list[str]) -> None:
        """Flag these runs for cancellation by their owner process, one transaction."""
        ...

    def cancel_requests(self, run_ids: list[str]) -> set[str]:
        """Which of these runs have a pending cancel request."""
        ...

    # -- events and outputs ---------------------------------------------------
    def add_event(self, run_id: str, kind: str, data: dict[str, Any] | None = None) -> None:
        """Append an event (its id increases within the store); a progress write: in an
        event loop, written with the loop turn's other progress (``batch``)."""
        ...

    def events(self, run_id: str, after_id: int = 0) -> list[dict[str, Any]]:
        """Events of a run with id > after_id, in order: dicts of id, run_id, at, kind, data."""
        ...

    def save_output(self, run_id: str, text: str) -> None:
        """Store (or replace) the whole output text of a run, one transaction."""
        ...

    def output(self, run_id: str) -> str | None:
        """The whole output text of a run, or None if none was saved."""
        ...

    # -- transcripts (resume) ---------------------------------------------------
    def save_transcript(self, run_id: str, messages: list[dict[str, Any]]) -> None:
        """Store (or replace) a run's conversation as sent to the model, a progress write;
        bounded by :func:`bound_transcript` (the first message and the latest turns)."""
        ...

    def transcript(self, run_id: str) -> list[dict[str, Any]] | None:
        """A run's saved conversation, or None if none was saved (or it was pruned)."""
        ...

    def prune_transcripts(self, older_than: float) -> int:
        """Delete transcripts last saved before ``older_than`` (epoch seconds), one
        transaction on an indexed column; returns how many went."""
        ...

    # -- resources (ResourceSink) ---------------------------------------------
    def register_resource(self, run_id: str, kind: str, ref: str) -> None:
        """Record that run_id (in this process) owns (kind, ref); upsert; a progress write
        (``add_event``)."""
        ...

    def release_resource(self, run_id: str, kind: str, ref: str) -> None:
        """Forget (kind, ref) once it is cleaned up; a no-op if unknown; a progress write."""
        ...

    def resources(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """Owned resources (one run's or all): dicts of run_id, kind, ref, owner_pid, created_at."""
        ...
