"""The SQL run store: every query, once, over a :class:`Dialect` that owns the database.

Tables (the dialect creates them, in its own types): ``runs`` (one row per run: its
QueryChain position, limits, status, progress and result, as JSON in ``data``),
``events`` (append-only: run_started, tool_call, tool_result, child_spawned,
run_finished, ...), ``outputs``, ``transcripts`` (a run's conversation as JSON text,
bounded, for resume) and ``resources`` (process groups, worktrees, containers a run owns,
registered as they start, so a crashed owner's leftovers can be found and reaped).

:class:`SqlStore` holds the queries every backend shares, written with ``?`` placeholders
and standard SQL (``ON CONFLICT … DO UPDATE``, ``RETURNING``). A dialect owns the rest:
its connections (one per thread), its transactions (a write is one transaction; a
read-modify-write holds the run's row from the read to the commit), how a driver's
errors reach the user, how an output is kept, and the few statements whose SQL differs
(the row lock, the event insert, the heartbeat and the sums of a chain's usage).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ..errors import NotFound
from ..run import Activity, RunRecord, RunStatus, now
from .base import ChainFull, ChainRoom, ChainUsage, Endings, StoreUnreachable, bound_transcript
from .batch import Step, WriteBehind, statement
from .dialect import Dialect as Dialect
from .dialect import Query as Query
from .dialect import Row as Row
from .dialect import Written as Written
from .kept import OUTPUT_UPSERT, KeptEndings
from .known import Known, Stale

RECENT_ACTIVITIES = 5
LIKE_ESCAPE = "\\"
LIVE = "status IN ('queued', 'running')"
BATCH = 500  # ids per IN (...) when walking a tree (SQLite allows 32766 variables)


def marks(items: Sequence[Any]) -> str:
    return ",".join("?" * len(items))


def like_prefix(prefix: str) -> str:
    """A LIKE pattern (``ESCAPE '\\'``) matching ids that start with prefix, taken literally."""
    for special in (LIKE_ESCAPE, "%", "_"):
        prefix = prefix.replace(special, LIKE_ESCAPE + special)
    return prefix + "%"


def _record(row: Row) -> RunRecord:
    return RunRecord.model_validate_json(row[0])


class SqlStore(KeptEndings, Endings):
    """The :class:`~orchestrator.store.base.RunStore` over a SQL database (its dialect)."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self._update: str | None = None  # the UPDATE of a run's changing columns
        self._known = Known()  # live records as last committed here (``known``)
        # progress writes, one transaction per loop turn (``batch``), from known records
        self._behind = WriteBehind(
            lambda: self._known.transaction(dialect.transaction),
            self._load_known,
            self._save,
            dialect.progress_commit,
            reload=self._load,
            transient=dialect.transient,
            event=self._event,
            where=dialect.describe(),
            off_loop=dialect.off_loop,
        )

    # every statement of the store writes the queued progress first: this process reads
    # what it wrote, in the order it wrote it (a transaction: in the same commit)
    def _transaction(self) -> AbstractContextManager[Query]:
        self._away()
        return self._behind.joined()

    def _away(self) -> None:
        """While the store is away, a statement made on an event loop (of a store whose
        writes go to a thread) fails at once, transient, instead of trying the store there:
        after the writes that wait, it could not be written anyway (``end`` keeps an
        ending; the supervisor beats again next tick)."""
        if waiting := self._behind.away():
            raise StoreUnreachable(
                f"the store at {self.describe()} is unreachable for now; "
                f"{int(waiting)} writes wait for it"
            )

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        self._behind.flush()
        return self.dialect.read(sql, args)

    def _write(self, sql: str, args: Sequence[Any] = ()) -> Written:
        self._away()
        self._behind.flush(now=True)  # after what waits, even while the store is away
        return self.dialect.write(sql, args)

    def describe(self) -> str:
        return self.dialect.describe()

    def paths(self) -> tuple[Path, ...]:
        return self.dialect.paths()

    def close(self) -> None:
        self._behind.close()
        self.dialect.close()

    def flush(self) -> None:
        self._behind.flush()

    def keep_at_most(self, writes: int) -> None:
        """Keep up to ``writes`` queued while the store is away (``store_outage_queue``)."""
        self._behind.limit = writes

    def _absent(self, *ids: str) -> bool:
        """True if an id cannot be in the store (its text columns hold no NUL)."""
        return not self.dialect.holds_nul and any("\x00" in i for i in ids)

    def _columns(self, record: RunRecord) -> dict[str, Any]:
        """The columns of runs that change with the record (``data`` last)."""
        cols: dict[str, Any] = {
            "status": record.status.value,
            "updated_at": record.updated_at,
            "pid": record.pid,
        }
        if self.dialect.usage_columns:  # its JSON may hold a \u0000 a json function refuses
            cols["tokens"] = record.usage.tokens
            cols["cost_usd"] = record.usage.cost_usd
        cols["data"] = record.model_dump_json()
        return cols

    # -- runs ---------------------------------------------------------------------
    def create_run(self, record: RunRecord, *, room: ChainRoom | None = None) -> None:
        if (full := self.create_runs([(record, room)])[0]) is not None:
            raise full

    def create_runs(
        self, runs: Sequence[tuple[RunRecord, ChainRoom | None]]
    ) -> list[ChainFull | None]:
        out: list[ChainFull | None] = []
        with self._transaction() as q:
            for record, room in runs:
                out.append(self._insert(q, record, room))
        return out

    def _insert(self, q: Query, record: RunRecord, room: ChainRoom | None) -> ChainFull | None:
        """Insert the run if its chain has ``room`` (else its ChainFull, nothing stored)."""
        if room is not None:
            if self.dialect.lock_chain:
                q(self.dialect.lock_chain, (record.chain_id,))
            counted = {"tokens": room.tokens is not None, "usd": room.usd is not None}
            if room.used_up(used := self._usage(q, record.chain_id, **counted)):
                return ChainFull(used, room)
        cols = {
            "run_id": record.run_id,
            "chain_id": record.chain_id,
            "parent_run_id": record.parent_run_id,
            "depth": record.depth,
            "created_at": record.created_at,
            **self._columns(record),
        }
        names = ", ".join(cols)
        q(f"INSERT INTO runs ({names}) VALUES ({marks(list(cols))})", list(cols.values()))
        self._known.stage(record)
        return None

    def _load(self, q: Query, run_id: str) -> RunRecord | None:
        """The run, its row held to the end of the transaction (its version: the row's)."""
        if self._absent(run_id):
            return None
        rows = q(self.dialect.lock_run(), (run_id,))
        if not rows:
            return None
        record = _record(rows[0])
        record.updated_at = float(rows[0][1])
        return record

    def _load_known(self, q: Query, run_id: str) -> RunRecord | None:
        """The run as this process last committed it, else as the store has it."""
        return self._known.get(run_id) or self._load(q, run_id)

    def _save(self, q: Query, record: RunRecord) -> None:
        """Write the record over the version it was read as (``Stale`` if another writer's
        is there now)."""
        seen = record.updated_at
        record.updated_at = now()
        cols = self._columns(record)
        if self._update is None:  # the same columns every time: the statement is made once
            sets = ", ".join(f"{name} = ?" for name in cols)
            self._update = f"UPDATE runs SET {sets} WHERE run_id = ? AND updated_at = ?"
            self._update += " RETURNING run_id"
        if not q(self._update, [*cols.values(), record.run_id, seen]):
            self._known.forget(record.run_id)
            raise Stale(record.run_id)
        self._known.stage(record)

    def update_run(self, run_id: str, **fields: Any) -> RunRecord:
        """Set fields of a run in one transaction (read-modify-write, no lost updates)."""
        with self._transaction() as q:
            record = self._load(q, run_id)
            if record is None:
                raise NotFound(f"no run {run_id!r} in {self.describe()}")
            for key, value in fields.items():
                setattr(record, key, value)
            self._save(q, record)
            return record

    def end_if_active(self, run_id: str, **fields: Any) -> RunRecord | None:
        """Set an ending on a run still queued or running, in one transaction.

        For those who end a run they do not own (reconcile, a forced cancel): if the
        owner finished it meanwhile, its own ending stands and None is returned.
        """
        with self._transaction() as q:
            record = self._load(q, run_id)
            if record is None or record.status.ended:
                return None
            for key, value in fields.items():
                setattr(record, key, value)
            self._save(q, record)
            return record

    def note_activity(self, run_id: str, tool: str, activity: str, **fields: Any) -> None:
        """Progress write for one tool call: last/recent activity plus counters."""
        act = Activity(tool=tool, summary=activity[:200], at=now())
        self._behind.add(lambda unit: _noted(unit.run(run_id), act, fields), run_id)

    def patch_run(self, run_id: str, **fields: Any) -> None:
        """Set fields of a run with this loop turn's progress (no answer; no-op if absent)."""
        self._behind.add(lambda unit: _noted(unit.run(run_id), None, fields), run_id)

    def get_run(self, run_id: str) -> RunRecord | None:
        if self._absent(run_id):
            return None
        rows = self._read("SELECT data FROM runs WHERE run_id = ?", (run_id,))
        return _record(rows[0]) if rows else None

    def require_run(self, run_id: str) -> RunRecord:
        record = self.get_run(run_id)
        if record is None:
            raise NotFound(
                f"no run {run_id!r} in {self.describe()}; `orch ps --all` lists the runs it holds"
            )
        return record

    def chain_usage(self, chain_id: str, *, tokens: bool = False, usd: bool = False) -> ChainUsage:
        self._behind.flush()
        return self._usage(self.dialect.read, chain_id, tokens=tokens, usd=usd)

    def _usage(self, q: Query, chain_id: str, *, tokens: bool, usd: bool = False) -> ChainUsage:
        used = self.dialect.chain_tokens if tokens else "0"
        spent = self.dialect.chain_usd if usd else "0"
        rows = q(
            f"SELECT COUNT(*), COALESCE(SUM(CASE WHEN {LIVE} THEN 1 ELSE 0 END), 0), {used},"
            f" {spent} FROM runs WHERE chain_id = ?",
            (chain_id,),
        )
        runs, live, used_tokens, used_usd = rows[0]
        return ChainUsage(int(runs), int(live), tokens=int(used_tokens), usd=float(used_usd))

    def find_runs(self, prefix: str) -> list[RunRecord]:
        if self._absent(prefix):
            return []
        rows = self._read(
            "SELECT run_id, data FROM runs WHERE run_id LIKE ? ESCAPE ?"
            " ORDER BY created_at, run_id",
            (like_prefix(prefix), LIKE_ESCAPE),
        )
        # LIKE may ignore ASCII case (SQLite's does), ids do not
        return [RunRecord.model_validate_json(d) for i, d in rows if i.startswith(prefix)]

    def list_runs(
        self,
        *,
        chain_id: str | None = None,
        statuses: list[RunStatus] | None = None,
        since: float | None = None,
        limit: int | None = None,
    ) -> list[RunRecord]:
        sql = "SELECT data FROM runs WHERE 1 = 1"
        args: list[Any] = []
        if chain_id is not None:
            sql += " AND chain_id = ?"
            args.append(chain_id)
        if statuses:
            sql += f" AND status IN ({marks(statuses)})"
            args.extend(s.value for s in statuses)
        if since is not None:
            sql += f" AND (updated_at >= ? OR {LIVE})"
            args.append(since)
        sql += " ORDER BY created_at, run_id"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        return [_record(r) for r in self._read(sql, args)]

    def children(self, run_id: str) -> list[RunRecord]:
        rows = self._read(
            "SELECT data FROM runs WHERE parent_run_id = ? ORDER BY created_at, run_id", (run_id,)
        )
        return [_record(r) for r in rows]

    def descendants(self, run_id: str) -> list[RunRecord]:
        """Breadth first, one query per level: children in the order of their parents."""
        out: list[RunRecord] = []
        frontier = [run_id]
        while frontier:
            order = {parent: i for i, parent in enumerate(frontier)}
            kids = [k for batch in _batches(frontier) for k in self._children_of(batch)]
            kids.sort(key=lambda k: order[k.parent_run_id or ""])  # stable: oldest first
            out.extend(kids)
            frontier = [k.run_id for k in kids]
        return out

    def _children_of(self, parents: list[str]) -> Iterator[RunRecord]:
        rows = self._read(
            f"SELECT data FROM runs WHERE parent_run_id IN ({marks(parents)})"
            " ORDER BY created_at, run_id",
            parents,
        )
        return (_record(r) for r in rows)

    # -- ownership: heartbeats and cross-process cancel requests ---------------------
    def heartbeat(self, run_ids: list[str]) -> None:
        if run_ids:
            self._write(self.dialect.heartbeat.format(ids=marks(run_ids)), (now(), *run_ids))

    def request_cancel(self, run_ids: list[str]) -> None:
        if run_ids:
            self._write(
                f"UPDATE runs SET cancel_requested = TRUE WHERE run_id IN ({marks(run_ids)})",
                run_ids,
            )

    def cancel_requests(self, run_ids: list[str]) -> set[str]:
        if not run_ids:
            return set()
        rows = self._read(
            f"SELECT run_id FROM runs WHERE cancel_requested AND run_id IN ({marks(run_ids)})",
            run_ids,
        )
        return {r[0] for r in rows}

    def list_raw(
        self, *, since: float | None = None, limit: int | None = None
    ) -> list[dict[str, Any]]:
        """Runs as plain dicts (no model validation): fast enough for `orch ps` over 10k runs."""
        sql = "SELECT data, heartbeat_at FROM runs"
        args: list[Any] = []
        if since is not None:
            sql += f" WHERE updated_at >= ? OR {LIVE}"
            args.append(since)
        if limit is not None:  # the latest: read newest first, given back oldest first
            sql += " ORDER BY created_at DESC, run_id DESC LIMIT ?"
            args.append(limit)
        else:
            sql += " ORDER BY created_at, run_id"
        found = self._read(sql, args)
        out = []
        for data, hb in reversed(found) if limit is not None else found:
            row: dict[str, Any] = json.loads(data)
            row["heartbeat_at"] = hb
            out.append(row)
        return out

    # -- events -------------------------------------------------------------------
    def add_event(self, run_id: str, kind: str, data: dict[str, Any] | None = None) -> None:
        self._behind.add(self._event(run_id, kind, data or {}), run_id)

    def _event(self, run_id: str, kind: str, data: dict[str, Any]) -> Step:
        row = (run_id, now(), kind, json.dumps(data, default=str))
        return statement(self.dialect.insert_event, row)

    def events(self, run_id: str, after_id: int = 0) -> list[dict[str, Any]]:
        if self._absent(run_id):
            return []
        rows = self._read(
            "SELECT id, run_id, at, kind, data FROM events WHERE run_id = ? AND id > ? ORDER BY id",
            (run_id, after_id),
        )
        return [
            {"id": i, "run_id": r, "at": at, "kind": k, "data": json.loads(d)}
            for i, r, at, k, d in rows
        ]

    # -- whole outputs ------------------------------------------------------------
    def save_output(self, run_id: str, text: str) -> None:
        self._write(OUTPUT_UPSERT, (run_id, self.dialect.dump_output(text)))

    def output(self, run_id: str) -> str | None:
        if self._absent(run_id):
            return None
        rows = self._read("SELECT text FROM outputs WHERE run_id = ?", (run_id,))
        return self.dialect.load_output(rows[0][0]) if rows else None

    # -- transcripts --------------------------------------------------------------
    def save_transcript(self, run_id: str, messages: list[dict[str, Any]]) -> None:
        text, truncated = bound_transcript(messages)
        row = (run_id, now(), truncated, text)
        self._behind.add(
            statement(
                "INSERT INTO transcripts (run_id, saved_at, truncated, messages)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (run_id) DO UPDATE SET"
                " saved_at = excluded.saved_at, truncated = excluded.truncated,"
                " messages = excluded.messages",
                row,
            ),
            run_id,
        )

    def transcript(self, run_id: str) -> list[dict[str, Any]] | None:
        if self._absent(run_id):
            return None
        rows = self._read("SELECT messages FROM transcripts WHERE run_id = ?", (run_id,))
        if not rows:
            return None
        messages: list[dict[str, Any]] = json.loads(rows[0][0])
        return messages

    def prune_transcripts(self, older_than: float) -> int:
        # a read first: most commands find nothing to prune and take no write lock
        probe = "SELECT 1 FROM transcripts WHERE saved_at < ? LIMIT 1"
        if not self._read(probe, (older_than,)):
            return 0
        return self._write("DELETE FROM transcripts WHERE saved_at < ?", (older_than,)).count

    # -- resources (ResourceSink) -------------------------------------------------
    def register_resource(self, run_id: str, kind: str, ref: str) -> None:
        row = (run_id, kind, ref, os.getpid(), now())
        self._behind.add(
            statement(
                "INSERT INTO resources (run_id, kind, ref, owner_pid, created_at)"
                " VALUES (?,?,?,?,?) ON CONFLICT (kind, ref) DO UPDATE SET"
                " run_id = excluded.run_id, owner_pid = excluded.owner_pid,"
                " created_at = excluded.created_at",
                row,
            ),
            run_id,
        )

    def release_resource(self, run_id: str, kind: str, ref: str) -> None:
        sql = "DELETE FROM resources WHERE kind = ? AND ref = ?"
        self._behind.add(statement(sql, (kind, ref)), run_id)

    def resources(self, run_id: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT run_id, kind, ref, owner_pid, created_at FROM resources"
        args: tuple[Any, ...] = ()
        if run_id is not None:
            sql += " WHERE run_id = ?"
            args = (run_id,)
        return [
            {"run_id": r, "kind": k, "ref": ref, "owner_pid": p, "created_at": c}
            for r, k, ref, p, c in self._read(sql + " ORDER BY created_at", args)
        ]


def _noted(record: RunRecord | None, act: Activity | None, fields: dict[str, Any]) -> None:
    """Change a run (if there is one) by a progress write: the activity, then fields."""
    if record is None:
        return
    if act is not None:
        record.last_activity = act
        record.recent_activities = [*record.recent_activities, act][-RECENT_ACTIVITIES:]
    for key, value in fields.items():
        setattr(record, key, value)


def _batches(ids: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(ids), BATCH):
        yield ids[start : start + BATCH]
