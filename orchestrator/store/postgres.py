"""The Postgres run store (psycopg 3, sync): the tables and semantics of the SQLite store,
shared by every orch process given the same URL (``ORCH_STORE`` or ``store`` in orch.toml).

Same contract as :class:`~orchestrator.store.sqlite.SqliteStore`, method by method:

- every write is one short transaction: a single statement in autocommit, or
  ``BEGIN; SELECT … FOR UPDATE; UPDATE; COMMIT`` for read-modify-write (``update_run``,
  ``end_if_active``, ``note_activity``), so writers in many processes never lose an update;
  progress writes (``note_activity``, ``add_event``, ``heartbeat``) commit asynchronously
  (:data:`ASYNC_COMMIT`), every other write synchronously;
- event ids come from an identity column; an event insert holds a transaction-level
  advisory lock on its run, so within a run ids are committed in increasing order and a
  reader following ``after_id`` never skips one;
- one connection per thread (``close()`` closes this thread's), opened on first use; the
  schema is created on the first connect to a database, under an advisory lock, so several
  processes connecting at once for the first time do not trip over each other.

Run ids sort byte-wise (``COLLATE "C"``) so an id prefix is an index range; whole outputs
are kept as JSON strings (Postgres text holds no NUL character, an output may).

The URL may hold a password: it is kept in memory only, for connecting. ``describe()``
and every message name the store without it (:mod:`orchestrator.store.url`); a driver's
error text is scrubbed of it and never chained.

psycopg is imported when a store is opened, never at module import: plain ``orch``
startup does not pay for it, and works without the ``postgres`` extra.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import NotFound, UsageError
from ..run import Activity, RunRecord, RunStatus, now
from .base import ChainUsage, Endings, StoreError, bound_transcript
from .pgschema import SCHEMA, SCHEMA_LOCK, SCHEMA_VERSION
from .sqlite import LIKE_ESCAPE, RECENT_ACTIVITIES, _like_prefix
from .url import endpoint, local_paths, redact, scrub

if TYPE_CHECKING:
    import psycopg

CONNECT_TIMEOUT_S = 10
MISSING_DRIVER = (
    "the run store is a Postgres URL but psycopg is not installed; "
    "run `pip install 'orch[postgres]'` (or unset ORCH_STORE / `store` to use SQLite)"
)

LIVE = "status IN ('queued', 'running')"
# Progress writes (note_activity, add_event, heartbeat) commit asynchronously: no WAL flush
# to wait for, so a tool call costs no fsync. A server crash may lose the last fraction of a
# second of them (never a status, an output or an ending: those commit synchronously, and a
# later synchronous commit flushes every earlier one); the database stays consistent.
ASYNC_COMMIT = "set_config('synchronous_commit', 'off', true)"
_INHERITED: list[Any] = []  # connections of a parent process (after fork): never used, kept


def _tokens(record: RunRecord) -> int:
    """The run's input + output tokens, kept in a column (its JSON may hold a \\u0000 escape,
    which Postgres's json functions refuse)."""
    return record.usage.input_tokens + record.usage.output_tokens


def _absent(*ids: str) -> bool:
    """True if an id cannot be in the store (Postgres text holds no NUL)."""
    return any("\x00" in i for i in ids)


class PostgresStore(Endings):
    """The :class:`~orchestrator.store.base.RunStore` over one Postgres database."""

    def __init__(self, url: str) -> None:
        try:
            import psycopg
        except ImportError:
            raise UsageError(MISSING_DRIVER) from None
        self._psycopg = psycopg
        self._url = url
        self._where = redact(url)
        self._endpoint = endpoint(url)
        self._local = threading.local()
        self._schema_ready = False
        self._conn()  # fail now, in one line, if the server cannot be used

    def describe(self) -> str:
        return self._where

    def paths(self) -> tuple[Path, ...]:
        """The server's Unix-socket directories and the client's password and key files the
        URL names (none over TCP with a password in the URL)."""
        return tuple(Path(d) for d in local_paths(self._url))

    # -- connection ---------------------------------------------------------------
    def _conn(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "pid", None) != os.getpid():
            _INHERITED.append(conn)  # a forked child: the socket is the parent's
            conn = None
        if conn is not None and (conn.closed or conn.broken):
            conn.close()
            conn = None
        if conn is None:
            conn = self._connect()
            self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def _connect(self) -> psycopg.Connection[Any]:
        pg = self._psycopg
        try:
            conn: psycopg.Connection[Any] = pg.connect(
                self._url,
                autocommit=True,
                connect_timeout=CONNECT_TIMEOUT_S,
                application_name="orch",
            )
        except pg.Error as e:
            raise StoreError(
                f"cannot connect to the Postgres run store at {self._endpoint} "
                f"({self._reason(e)}); check that the server runs and the URL in "
                "ORCH_STORE or `store` in orch.toml"
            ) from None
        try:
            if not self._schema_ready:
                self._ensure_schema(conn)
                self._schema_ready = True
        except pg.Error as e:
            conn.close()
            raise StoreError(self._failure(e)) from None
        return conn

    def _ensure_schema(self, conn: psycopg.Connection[Any]) -> None:
        probe = "SELECT to_regclass('orch_schema') IS NOT NULL"
        row = conn.execute(probe).fetchone()
        if row and row[0]:
            return
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            conn.execute(SCHEMA)
            conn.execute(
                "INSERT INTO orch_schema (version) SELECT %s"
                " WHERE NOT EXISTS (SELECT 1 FROM orch_schema)",
                (SCHEMA_VERSION,),
            )

    def close(self) -> None:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "pid", None) == os.getpid():
            conn.close()
        self._local.conn = None

    def _reason(self, error: Exception) -> str:
        lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
        return scrub(lines[0] if lines else type(error).__name__, self._url)[:300]

    def _failure(self, error: Exception) -> str:
        return (
            f"the Postgres run store at {self._endpoint} failed ({self._reason(error)}); "
            "check the server and run the command again"
        )

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """A driver error becomes one StoreError line (no password, nothing chained)."""
        try:
            yield
        except self._psycopg.Error as e:
            conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
            if conn is not None and (conn.closed or conn.broken):
                self.close()  # the next call reconnects
            raise StoreError(self._failure(e)) from None

    @contextmanager
    def _tx(self) -> Iterator[psycopg.Cursor[Any]]:
        with self._guard():
            conn = self._conn()
            with conn.transaction(), conn.cursor() as cur:
                yield cur

    def _rows(self, sql: str, args: Any = ()) -> list[tuple[Any, ...]]:
        with self._guard():
            return self._conn().execute(sql, args).fetchall()

    def _write(self, sql: str, args: Any = ()) -> int:
        """One statement in autocommit: a transaction of its own; returns its row count."""
        with self._guard():
            return self._conn().execute(sql, args).rowcount

    # -- runs ---------------------------------------------------------------------
    def create_run(self, record: RunRecord) -> None:
        self._write(
            "INSERT INTO runs (run_id, chain_id, parent_run_id, depth, status, created_at,"
            " updated_at, pid, tokens, data) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)",
            (
                record.run_id,
                record.chain_id,
                record.parent_run_id,
                record.depth,
                record.status.value,
                record.created_at,
                record.updated_at,
                record.pid,
                _tokens(record),
                record.model_dump_json(),
            ),
        )

    def _load(
        self, cur: psycopg.Cursor[Any], run_id: str, *, progress: bool = False
    ) -> RunRecord | None:
        """The run, its row locked to the end of the transaction (``progress``: which then
        commits asynchronously, see :data:`ASYNC_COMMIT`)."""
        if _absent(run_id):
            return None
        also = f", {ASYNC_COMMIT}" if progress else ""
        row = cur.execute(f"SELECT data{also} FROM runs WHERE run_id = %s FOR UPDATE", (run_id,))
        found = row.fetchone()
        return RunRecord.model_validate_json(found[0]) if found else None

    def _save(self, cur: psycopg.Cursor[Any], record: RunRecord) -> None:
        record.updated_at = now()
        cur.execute(
            "UPDATE runs SET status=%s, updated_at=%s, pid=%s, tokens=%s, data=%s WHERE run_id=%s",
            (
                record.status.value,
                record.updated_at,
                record.pid,
                _tokens(record),
                record.model_dump_json(),
                record.run_id,
            ),
        )

    def update_run(self, run_id: str, **fields: Any) -> RunRecord:
        """Set fields of a run in one transaction (row locked: no lost updates)."""
        with self._tx() as cur:
            record = self._load(cur, run_id)
            if record is None:
                raise NotFound(f"no run {run_id!r} in {self.describe()}")
            for key, value in fields.items():
                setattr(record, key, value)
            self._save(cur, record)
            return record

    def end_if_active(self, run_id: str, **fields: Any) -> RunRecord | None:
        """Set an ending on a run still queued or running (compare-and-set under the row
        lock); if its owner ended it meanwhile, that ending stands and None is returned."""
        with self._tx() as cur:
            record = self._load(cur, run_id)
            if record is None or record.status.ended:
                return None
            for key, value in fields.items():
                setattr(record, key, value)
            self._save(cur, record)
            return record

    def note_activity(self, run_id: str, tool: str, activity: str, **fields: Any) -> None:
        """Progress write for one tool call: last/recent activity plus counters."""
        with self._tx() as cur:
            record = self._load(cur, run_id, progress=True)
            if record is None:
                return
            act = Activity(tool=tool, summary=activity[:200], at=now())
            record.last_activity = act
            record.recent_activities = [*record.recent_activities, act][-RECENT_ACTIVITIES:]
            for key, value in fields.items():
                setattr(record, key, value)
            self._save(cur, record)

    def get_run(self, run_id: str) -> RunRecord | None:
        if _absent(run_id):
            return None
        rows = self._rows("SELECT data FROM runs WHERE run_id = %s", (run_id,))
        return RunRecord.model_validate_json(rows[0][0]) if rows else None

    def require_run(self, run_id: str) -> RunRecord:
        record = self.get_run(run_id)
        if record is None:
            raise NotFound(
                f"no run {run_id!r} in {self.describe()}; `orch ps --all` lists the runs it holds"
            )
        return record

    def chain_usage(self, chain_id: str, *, tokens: bool = False) -> ChainUsage:
        used = "COALESCE(SUM(tokens), 0)" if tokens else "0"
        rows = self._rows(
            f"SELECT COUNT(*), COUNT(*) FILTER (WHERE {LIVE}), {used}"
            " FROM runs WHERE chain_id = %s",
            (chain_id,),
        )
        runs, live, used_tokens = rows[0]
        return ChainUsage(runs=int(runs), live=int(live), tokens=int(used_tokens))

    def find_runs(self, prefix: str) -> list[RunRecord]:
        if _absent(prefix):
            return []
        rows = self._rows(
            "SELECT data FROM runs WHERE run_id LIKE %s ESCAPE %s AND starts_with(run_id, %s)"
            " ORDER BY created_at, run_id",
            (_like_prefix(prefix), LIKE_ESCAPE, prefix),
        )
        return [RunRecord.model_validate_json(r[0]) for r in rows]

    def list_runs(
        self,
        *,
        chain_id: str | None = None,
        statuses: list[RunStatus] | None = None,
        since: float | None = None,
        limit: int | None = None,
    ) -> list[RunRecord]:
        sql = "SELECT data FROM runs WHERE TRUE"
        args: list[Any] = []
        if chain_id is not None:
            sql += " AND chain_id = %s"
            args.append(chain_id)
        if statuses:
            sql += " AND status = ANY(%s)"
            args.append([s.value for s in statuses])
        if since is not None:
            sql += f" AND (updated_at >= %s OR {LIVE})"
            args.append(since)
        sql += " ORDER BY created_at, run_id"
        if limit is not None:
            sql += " LIMIT %s"
            args.append(limit)
        return [RunRecord.model_validate_json(r[0]) for r in self._rows(sql, args)]

    def children(self, run_id: str) -> list[RunRecord]:
        rows = self._rows(
            "SELECT data FROM runs WHERE parent_run_id = %s ORDER BY created_at, run_id",
            (run_id,),
        )
        return [RunRecord.model_validate_json(r[0]) for r in rows]

    def descendants(self, run_id: str) -> list[RunRecord]:
        """Breadth first, one query per level: children in the order of their parents."""
        out: list[RunRecord] = []
        frontier = [run_id]
        while frontier:
            rows = self._rows(
                "SELECT data FROM runs WHERE parent_run_id = ANY(%s)"
                " ORDER BY array_position(%s, parent_run_id), created_at, run_id",
                (frontier, frontier),
            )
            kids = [RunRecord.model_validate_json(r[0]) for r in rows]
            out.extend(kids)
            frontier = [c.run_id for c in kids]
        return out

    # -- ownership: heartbeats and cross-process cancel requests ---------------------
    def heartbeat(self, run_ids: list[str]) -> None:
        if run_ids:
            self._write(
                f"WITH _ AS (SELECT {ASYNC_COMMIT}) UPDATE runs SET heartbeat_at = %s"
                " FROM _ WHERE run_id = ANY(%s)",
                (now(), run_ids),
            )

    def request_cancel(self, run_ids: list[str]) -> None:
        if run_ids:
            self._write(
                "UPDATE runs SET cancel_requested = TRUE WHERE run_id = ANY(%s)", (run_ids,)
            )

    def cancel_requests(self, run_ids: list[str]) -> set[str]:
        if not run_ids:
            return set()
        rows = self._rows(
            "SELECT run_id FROM runs WHERE cancel_requested AND run_id = ANY(%s)", (run_ids,)
        )
        return {r[0] for r in rows}

    def list_raw(self, *, since: float | None = None) -> list[dict[str, Any]]:
        """Runs as plain dicts (no model validation): fast enough for `orch ps` over 10k runs."""
        sql = "SELECT data, heartbeat_at FROM runs"
        args: list[Any] = []
        if since is not None:
            sql += f" WHERE updated_at >= %s OR {LIVE}"
            args.append(since)
        sql += " ORDER BY created_at, run_id"
        out = []
        for data, hb in self._rows(sql, args):
            row: dict[str, Any] = json.loads(data)
            row["heartbeat_at"] = hb
            out.append(row)
        return out

    # -- events -------------------------------------------------------------------
    def add_event(self, run_id: str, kind: str, data: dict[str, Any] | None = None) -> int:
        # the run's advisory lock is taken before the id is drawn and held to the commit
        rows = self._rows(
            "WITH lock AS (SELECT pg_advisory_xact_lock(hashtextextended(%s, 0)),"
            f" {ASYNC_COMMIT}) INSERT INTO events (run_id, at, kind, data)"
            " SELECT %s, %s, %s, %s FROM lock RETURNING id",
            (run_id, run_id, now(), kind, json.dumps(data or {}, default=str)),
        )
        return int(rows[0][0])

    def events(self, run_id: str, after_id: int = 0) -> list[dict[str, Any]]:
        if _absent(run_id):
            return []
        rows = self._rows(
            "SELECT id, run_id, at, kind, data FROM events WHERE run_id = %s AND id > %s"
            " ORDER BY id",
            (run_id, after_id),
        )
        return [
            {"id": i, "run_id": r, "at": at, "kind": k, "data": json.loads(d)}
            for i, r, at, k, d in rows
        ]

    # -- whole outputs ------------------------------------------------------------
    def save_output(self, run_id: str, text: str) -> None:
        self._write(
            "INSERT INTO outputs (run_id, text) VALUES (%s, %s)"
            " ON CONFLICT (run_id) DO UPDATE SET text = EXCLUDED.text",
            (run_id, json.dumps(text, ensure_ascii=False)),
        )

    def output(self, run_id: str) -> str | None:
        if _absent(run_id):
            return None
        rows = self._rows("SELECT text FROM outputs WHERE run_id = %s", (run_id,))
        return str(json.loads(rows[0][0])) if rows else None

    # -- transcripts --------------------------------------------------------------
    def save_transcript(self, run_id: str, messages: list[dict[str, Any]]) -> None:
        text, truncated = bound_transcript(messages)
        self._write(
            "INSERT INTO transcripts (run_id, saved_at, truncated, messages)"
            " VALUES (%s, %s, %s, %s) ON CONFLICT (run_id) DO UPDATE SET"
            " saved_at = EXCLUDED.saved_at, truncated = EXCLUDED.truncated,"
            " messages = EXCLUDED.messages",
            (run_id, now(), truncated, text),
        )

    def transcript(self, run_id: str) -> list[dict[str, Any]] | None:
        if _absent(run_id):
            return None
        rows = self._rows("SELECT messages FROM transcripts WHERE run_id = %s", (run_id,))
        if not rows:
            return None
        messages: list[dict[str, Any]] = json.loads(rows[0][0])
        return messages

    def prune_transcripts(self, older_than: float) -> int:
        # a read first: most commands find nothing to prune and write nothing
        probe = "SELECT 1 FROM transcripts WHERE saved_at < %s LIMIT 1"
        if not self._rows(probe, (older_than,)):
            return 0
        return self._write("DELETE FROM transcripts WHERE saved_at < %s", (older_than,))

    # -- resources (ResourceSink) -------------------------------------------------
    def register_resource(self, run_id: str, kind: str, ref: str) -> None:
        self._write(
            "INSERT INTO resources (run_id, kind, ref, owner_pid, created_at)"
            " VALUES (%s,%s,%s,%s,%s) ON CONFLICT (kind, ref) DO UPDATE SET"
            " run_id = EXCLUDED.run_id, owner_pid = EXCLUDED.owner_pid,"
            " created_at = EXCLUDED.created_at",
            (run_id, kind, ref, os.getpid(), now()),
        )

    def release_resource(self, run_id: str, kind: str, ref: str) -> None:
        self._write("DELETE FROM resources WHERE kind = %s AND ref = %s", (kind, ref))

    def resources(self, run_id: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT run_id, kind, ref, owner_pid, created_at FROM resources"
        args: tuple[Any, ...] = ()
        if run_id is not None:
            sql += " WHERE run_id = %s"
            args = (run_id,)
        return [
            {"run_id": r, "kind": k, "ref": ref, "owner_pid": p, "created_at": c}
            for r, k, ref, p, c in self._rows(sql + " ORDER BY created_at", args)
        ]
