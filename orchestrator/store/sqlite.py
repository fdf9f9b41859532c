"""The SQLite run store: one file (WAL) per project, the only place that writes SQL.

Tables: ``runs`` (one row per run: its QueryChain position, limits, status,
progress and result), ``events`` (append-only: run_started, tool_call,
tool_result, child_spawned, run_finished, ...), ``outputs``, ``transcripts``
(a run's conversation as JSON text, bounded, for resume) and ``resources`` (process
groups, worktrees, containers a run owns, registered as they start, so a
crashed owner's leftovers can be found and reaped).

Safe across processes: WAL journal, a busy timeout, and short transactions
(``BEGIN IMMEDIATE`` for read-modify-write), so many writers never lose an
update or see "database is locked".

Private: the state directory is 0700 (see :func:`state_dir`), the database file and
its ``-wal``/``-shm`` files 0600, whatever the umask.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import NotFound
from ..run import Activity, RunRecord, RunStatus, now
from .base import ChainUsage, Endings, bound_transcript, make_private, state_dir

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    chain_id TEXT NOT NULL,
    parent_run_id TEXT,
    depth INTEGER NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    pid INTEGER,
    heartbeat_at REAL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_chain ON runs(chain_id);
CREATE INDEX IF NOT EXISTS runs_parent ON runs(parent_run_id);
CREATE INDEX IF NOT EXISTS runs_status ON runs(status);
CREATE INDEX IF NOT EXISTS runs_created ON runs(created_at);
CREATE INDEX IF NOT EXISTS runs_updated ON runs(updated_at);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_run ON events(run_id, id);
CREATE TABLE IF NOT EXISTS resources (
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    ref TEXT NOT NULL,
    owner_pid INTEGER NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (kind, ref)
);
CREATE TABLE IF NOT EXISTS outputs (
    run_id TEXT PRIMARY KEY,
    text TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS transcripts (
    run_id TEXT PRIMARY KEY,
    saved_at REAL NOT NULL,
    truncated INTEGER NOT NULL DEFAULT 0,
    messages TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS transcripts_saved ON transcripts(saved_at);
"""

RECENT_ACTIVITIES = 5
DB_FILE = "orch.db"
DB_MODE = 0o600
LIKE_ESCAPE = "\\"


def _marks(items: list[str]) -> str:
    return ",".join("?" * len(items))


def _like_prefix(prefix: str) -> str:
    """A LIKE pattern (``ESCAPE '\\'``) matching ids that start with prefix, taken literally."""
    for special in (LIKE_ESCAPE, "%", "_"):
        prefix = prefix.replace(special, LIKE_ESCAPE + special)
    return prefix + "%"


def _create_private(path: Path) -> None:
    """Create the database file 0600 (umask-independent) before SQLite opens it.

    One that exists already (another process made it, or an older orch) keeps its
    contents and loses any group/other bits if it is ours.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, DB_MODE)
    except FileExistsError:
        make_private(path, DB_MODE)
        return
    try:
        os.fchmod(fd, DB_MODE)
    finally:
        os.close(fd)


def _wal(conn: sqlite3.Connection, timeout_s: float = 30.0) -> None:
    """Put the database in WAL mode. On a new file, processes opening it at once race for
    the switch, and SQLite answers "locked" at once instead of waiting its busy timeout:
    try again for up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


class SqliteStore(Endings):
    """The :class:`~orchestrator.store.base.RunStore` over one SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        _create_private(path)
        self._conn().executescript(SCHEMA)
        for suffix in ("-wal", "-shm"):  # SQLite gives them the db's mode; older ones may not
            make_private(path.with_name(path.name + suffix), DB_MODE)

    @classmethod
    def for_project(cls, project_root: Path) -> SqliteStore:
        """The SQLite store of a project, whatever ORCH_STORE says (use ``open_store``)."""
        return cls(state_dir(project_root) / DB_FILE)

    def describe(self) -> str:
        return str(self.path)

    def paths(self) -> tuple[Path, ...]:
        """The database's directory (its ``-wal``, ``-shm``, ``-journal`` files too) and file."""
        return (self.path.parent, self.path)

    # -- connection ---------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            _wal(conn)
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=30000")
            self._local.conn = conn
        return conn

    def close(self) -> None:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    # -- runs ---------------------------------------------------------------------
    def create_run(self, record: RunRecord) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO runs (run_id, chain_id, parent_run_id, depth, status, created_at,"
                " updated_at, pid, data) VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    record.run_id,
                    record.chain_id,
                    record.parent_run_id,
                    record.depth,
                    record.status.value,
                    record.created_at,
                    record.updated_at,
                    record.pid,
                    record.model_dump_json(),
                ),
            )

    def _load(self, db: sqlite3.Connection, run_id: str) -> RunRecord | None:
        row = db.execute("SELECT data FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        return RunRecord.model_validate_json(row[0]) if row else None

    def _save(self, db: sqlite3.Connection, record: RunRecord) -> None:
        record.updated_at = now()
        db.execute(
            "UPDATE runs SET status=?, updated_at=?, pid=?, data=? WHERE run_id=?",
            (
                record.status.value,
                record.updated_at,
                record.pid,
                record.model_dump_json(),
                record.run_id,
            ),
        )

    def update_run(self, run_id: str, **fields: Any) -> RunRecord:
        """Set fields of a run in one transaction (read-modify-write, no lost updates)."""
        with self._tx() as db:
            record = self._load(db, run_id)
            if record is None:
                raise NotFound(f"no run {run_id!r} in {self.describe()}")
            for key, value in fields.items():
                setattr(record, key, value)
            self._save(db, record)
            return record

    def end_if_active(self, run_id: str, **fields: Any) -> RunRecord | None:
        """Set an ending on a run still queued or running, in one transaction.

        For those who end a run they do not own (reconcile, a forced cancel): if the
        owner finished it meanwhile, its own ending stands and None is returned.
        """
        with self._tx() as db:
            record = self._load(db, run_id)
            if record is None or record.status.ended:
                return None
            for key, value in fields.items():
                setattr(record, key, value)
            self._save(db, record)
            return record

    def note_activity(self, run_id: str, tool: str, activity: str, **fields: Any) -> None:
        """Progress write for one tool call: last/recent activity plus counters."""
        with self._tx() as db:
            record = self._load(db, run_id)
            if record is None:
                return
            act = Activity(tool=tool, summary=activity[:200], at=now())
            record.last_activity = act
            record.recent_activities = [*record.recent_activities, act][-RECENT_ACTIVITIES:]
            for key, value in fields.items():
                setattr(record, key, value)
            self._save(db, record)

    def get_run(self, run_id: str) -> RunRecord | None:
        return self._load(self._conn(), run_id)

    def require_run(self, run_id: str) -> RunRecord:
        record = self.get_run(run_id)
        if record is None:
            raise NotFound(
                f"no run {run_id!r} in {self.describe()}; `orch ps --all` lists the runs it holds"
            )
        return record

    def chain_usage(self, chain_id: str, *, tokens: bool = False) -> ChainUsage:
        used = (
            "COALESCE(SUM(json_extract(data, '$.usage.input_tokens')"
            " + json_extract(data, '$.usage.output_tokens')), 0)"
            if tokens
            else "0"
        )
        row = (
            self._conn()
            .execute(
                "SELECT COUNT(*), COALESCE(SUM(status IN ('queued', 'running')), 0),"
                f" {used} FROM runs WHERE chain_id = ?",
                (chain_id,),
            )
            .fetchone()
        )
        return ChainUsage(runs=int(row[0]), live=int(row[1]), tokens=int(row[2]))

    def find_runs(self, prefix: str) -> list[RunRecord]:
        rows = self._conn().execute(
            "SELECT data FROM runs WHERE run_id LIKE ? ESCAPE ? AND substr(run_id, 1, ?) = ?"
            " ORDER BY created_at",  # substr: LIKE ignores ASCII case, ids do not
            (_like_prefix(prefix), LIKE_ESCAPE, len(prefix), prefix),
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
        sql = "SELECT data FROM runs WHERE 1=1"
        args: list[Any] = []
        if chain_id is not None:
            sql += " AND chain_id = ?"
            args.append(chain_id)
        if statuses:
            sql += f" AND status IN ({','.join('?' * len(statuses))})"
            args.extend(s.value for s in statuses)
        if since is not None:
            sql += " AND (updated_at >= ? OR status IN ('queued', 'running'))"
            args.append(since)
        sql += " ORDER BY created_at"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        rows = self._conn().execute(sql, args).fetchall()
        return [RunRecord.model_validate_json(r[0]) for r in rows]

    def children(self, run_id: str) -> list[RunRecord]:
        rows = self._conn().execute(
            "SELECT data FROM runs WHERE parent_run_id = ? ORDER BY created_at", (run_id,)
        )
        return [RunRecord.model_validate_json(r[0]) for r in rows]

    def descendants(self, run_id: str) -> list[RunRecord]:
        out: list[RunRecord] = []
        frontier = [run_id]
        while frontier:
            kids = [c for parent in frontier for c in self.children(parent)]
            out.extend(kids)
            frontier = [c.run_id for c in kids]
        return out

    # -- ownership: heartbeats and cross-process cancel requests ---------------------
    def heartbeat(self, run_ids: list[str]) -> None:
        if not run_ids:
            return
        with self._tx() as db:
            db.execute(
                f"UPDATE runs SET heartbeat_at = ? WHERE run_id IN ({_marks(run_ids)})",
                (now(), *run_ids),
            )

    def request_cancel(self, run_ids: list[str]) -> None:
        if not run_ids:
            return
        with self._tx() as db:
            db.execute(
                f"UPDATE runs SET cancel_requested = 1 WHERE run_id IN ({_marks(run_ids)})",
                run_ids,
            )

    def cancel_requests(self, run_ids: list[str]) -> set[str]:
        if not run_ids:
            return set()
        rows = self._conn().execute(
            f"SELECT run_id FROM runs WHERE cancel_requested = 1 AND run_id IN ({_marks(run_ids)})",
            run_ids,
        )
        return {r[0] for r in rows}

    def list_raw(self, *, since: float | None = None) -> list[dict[str, Any]]:
        """Runs as plain dicts (no model validation): fast enough for `orch ps` over 10k runs."""
        sql = "SELECT data, heartbeat_at FROM runs"
        args: list[Any] = []
        if since is not None:
            sql += " WHERE updated_at >= ? OR status IN ('queued', 'running')"
            args.append(since)
        sql += " ORDER BY created_at"
        out = []
        for data, hb in self._conn().execute(sql, args):
            row: dict[str, Any] = json.loads(data)
            row["heartbeat_at"] = hb
            out.append(row)
        return out

    # -- events -------------------------------------------------------------------
    def add_event(self, run_id: str, kind: str, data: dict[str, Any] | None = None) -> int:
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO events (run_id, at, kind, data) VALUES (?,?,?,?)",
                (run_id, now(), kind, json.dumps(data or {}, default=str)),
            )
            return int(cur.lastrowid or 0)

    def events(self, run_id: str, after_id: int = 0) -> list[dict[str, Any]]:
        rows = self._conn().execute(
            "SELECT id, run_id, at, kind, data FROM events WHERE run_id = ? AND id > ? ORDER BY id",
            (run_id, after_id),
        )
        return [
            {"id": i, "run_id": r, "at": at, "kind": k, "data": json.loads(d)}
            for i, r, at, k, d in rows
        ]

    # -- whole outputs ------------------------------------------------------------
    def save_output(self, run_id: str, text: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO outputs (run_id, text) VALUES (?, ?)", (run_id, text)
            )

    def output(self, run_id: str) -> str | None:
        row = (
            self._conn().execute("SELECT text FROM outputs WHERE run_id = ?", (run_id,)).fetchone()
        )
        return str(row[0]) if row else None

    # -- transcripts --------------------------------------------------------------
    def save_transcript(self, run_id: str, messages: list[dict[str, Any]]) -> None:
        text, truncated = bound_transcript(messages)
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO transcripts (run_id, saved_at, truncated, messages)"
                " VALUES (?, ?, ?, ?)",
                (run_id, now(), int(truncated), text),
            )

    def transcript(self, run_id: str) -> list[dict[str, Any]] | None:
        row = (
            self._conn()
            .execute("SELECT messages FROM transcripts WHERE run_id = ?", (run_id,))
            .fetchone()
        )
        if row is None:
            return None
        messages: list[dict[str, Any]] = json.loads(row[0])
        return messages

    def prune_transcripts(self, older_than: float) -> int:
        # a read first: most commands find nothing to prune and take no write lock
        probe = "SELECT 1 FROM transcripts WHERE saved_at < ? LIMIT 1"
        if self._conn().execute(probe, (older_than,)).fetchone() is None:
            return 0
        with self._tx() as db:
            cur = db.execute("DELETE FROM transcripts WHERE saved_at < ?", (older_than,))
            return int(cur.rowcount)

    # -- resources (ResourceSink) -------------------------------------------------
    def register_resource(self, run_id: str, kind: str, ref: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO resources (run_id, kind, ref, owner_pid, created_at)"
                " VALUES (?,?,?,?,?)",
                (run_id, kind, ref, os.getpid(), now()),
            )

    def release_resource(self, run_id: str, kind: str, ref: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM resources WHERE kind = ? AND ref = ?", (kind, ref))

    def resources(self, run_id: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT run_id, kind, ref, owner_pid, created_at FROM resources"
        args: tuple[Any, ...] = ()
        if run_id is not None:
            sql += " WHERE run_id = ?"
            args = (run_id,)
        rows = self._conn().execute(sql, args).fetchall()
        return [
            {"run_id": r, "kind": k, "ref": ref, "owner_pid": p, "created_at": c}
            for r, k, ref, p, c in rows
        ]
