"""The Postgres run store (psycopg 3, sync): its dialect of :mod:`orchestrator.store.sql`
(the queries of every SQL store), shared by every orch process given the same URL
(``ORCH_STORE`` or ``store`` in orch.toml).

Same contract as :class:`~orchestrator.store.sqlite.SqliteStore`, method by method:

- every write is one short transaction: a single statement in autocommit, or
  ``BEGIN; SELECT … FOR UPDATE; UPDATE; COMMIT`` for read-modify-write (``update_run``,
  ``end_if_active``, ``note_activity``), so writers in many processes never lose an update;
  progress writes (``note_activity``, ``add_event``, ``heartbeat``) commit asynchronously
  (:data:`ASYNC_COMMIT`) in transactions of their own, every other write synchronously
  (progress that joins another write's transaction commits as that write does);
- a run stored with a chain's room (``create_run``) holds the chain's advisory lock from
  its count to its commit, so two writers cannot both take the chain's last place;
- event ids come from an identity column; an event insert holds a transaction-level
  advisory lock on its run, so within a run ids are committed in increasing order and a
  reader following ``after_id`` never skips one;
- one connection per thread (``close()`` closes this thread's), opened on first use; the
  schema is created (an older orch's migrated: :data:`MIGRATIONS`) on a process's first
  connect to a database, under an advisory lock, so several processes connecting at once
  for the first time do not trip over each other.

Run ids sort byte-wise (``COLLATE "C"``) so an id prefix is an index range; whole outputs
are kept as JSON strings (Postgres text holds no NUL character, an output may).

The URL may hold a password: it is kept in memory only, for connecting. ``describe()``
and every message name the store without it (:mod:`orchestrator.storeurl`); a driver's
error text is scrubbed of it and never chained.

psycopg is imported when a store is opened, never at module import: plain ``orch``
startup does not pay for it, and works without the ``postgres`` extra.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..storeurl import endpoint, local_paths, redact, scrub
from .base import StoreError, StoreUnreachable
from .schema import Types, tables
from .sql import Query, Row, SqlStore, Written

if TYPE_CHECKING:
    import psycopg

CONNECT_TIMEOUT_S = 10
# SQLSTATE classes of a server away for now: connection exception, operator intervention
# (an admin shutdown, a server starting), insufficient resources (too many connections)
AWAY_CLASSES = ("08", "57", "53")
MISSING_DRIVER = (
    "the run store is a Postgres URL but psycopg is not installed; "
    "run `pip install 'orch[postgres]'` (or unset ORCH_STORE / `store` to use SQLite)"
)

# Progress writes (note_activity, add_event, heartbeat) commit asynchronously: no WAL flush
# to wait for, so a tool call costs no fsync. A server crash may lose the last fraction of a
# second of them (never a status, an output or an ending: those commit synchronously, and a
# later synchronous commit flushes every earlier one); the database stays consistent.
ASYNC_COMMIT = "set_config('synchronous_commit', 'off', true)"
SCHEMA_LOCK = 0x6F72636873746F72  # "orchstor": held while creating the tables
SCHEMA_VERSION = 2
COST_USD = "cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0"
# ids sort byte-wise (COLLATE "C") so an id prefix is an index range; orch_schema holds the
# version, its presence says the tables are there
SCHEMA = (
    tables(
        Types(
            real="DOUBLE PRECISION",
            boolean="BOOLEAN",
            false="FALSE",
            serial="BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
            key_collation=' COLLATE "C"',
            usage=f"\n    tokens BIGINT NOT NULL DEFAULT 0,\n    {COST_USD},",
        )
    )
    + "CREATE TABLE IF NOT EXISTS orch_schema (version INTEGER NOT NULL);\n"
)
# what brings the tables of a version up to the next (idempotent: IF NOT EXISTS). 1 -> 2:
# runs.cost_usd; an older row counts $0 (no orch before it priced a request) until its run
# is written again. runs.tokens of an older row counts input + output until then.
MIGRATIONS = {2: f"ALTER TABLE runs ADD COLUMN IF NOT EXISTS {COST_USD}"}
_INHERITED: list[Any] = []  # connections of a parent process (after fork): never used, kept


@functools.lru_cache(maxsize=256)
def _pg(sql: str) -> str:
    """The store's ``?`` placeholders as psycopg's ``%s`` (its SQL holds no other ? or %)."""
    return sql.replace("?", "%s")


def _version(conn: psycopg.Connection[Any]) -> int:
    """The schema version of the database's tables (0: none there yet)."""
    row = conn.execute("SELECT to_regclass('orch_schema') IS NOT NULL").fetchone()
    if not (row and row[0]):
        return 0
    row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM orch_schema").fetchone()
    return int(row[0]) if row else 0


class PostgresDialect:
    """Postgres's side of the SQL store (see the module doc)."""

    holds_nul = False
    usage_columns = True
    chain_tokens = "COALESCE(SUM(tokens), 0)"
    chain_usd = "COALESCE(SUM(cost_usd), 0)"
    # the run's advisory lock is taken before the id is drawn and held to the commit
    insert_event = (
        "WITH e (run_id, at, kind, data) AS (VALUES (?::text, ?::float8, ?::text, ?::text)),"
        " lock AS (SELECT pg_advisory_xact_lock(hashtextextended(e.run_id, 0)) FROM e)"
        " INSERT INTO events (run_id, at, kind, data)"
        " SELECT e.run_id, e.at, e.kind, e.data FROM e, lock RETURNING id"
    )
    progress_commit = f"SELECT {ASYNC_COMMIT}"
    off_loop = False  # a server away fails at once: its retries stay on the loop
    # two keys (orch's, the chain's): a space apart from the one-key locks above
    lock_chain = "SELECT pg_advisory_xact_lock(1869767528, hashtext(?))"
    heartbeat = (
        f"WITH _ AS (SELECT {ASYNC_COMMIT}) UPDATE runs SET heartbeat_at = ?"
        " FROM _ WHERE run_id IN ({ids})"
    )

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
        self.conn()  # fail now, in one line, if the server cannot be used

    def describe(self) -> str:
        return self._where

    def transient(self, error: BaseException) -> bool:
        """A server away for now: no connection, or one closed or refused by the server
        (a restart's admin shutdown), never a statement it refused."""
        if isinstance(error, StoreUnreachable):
            return True
        if not isinstance(error, self._psycopg.OperationalError):
            return False
        state = getattr(error, "sqlstate", None)
        return state is None or state[:2] in AWAY_CLASSES

    def paths(self) -> tuple[Path, ...]:
        """The server's Unix-socket directories and the client's password and key files the
        URL names (none over TCP with a password in the URL)."""
        return tuple(Path(d) for d in local_paths(self._url))

    # -- connection ---------------------------------------------------------------
    def conn(self) -> psycopg.Connection[Any]:
        """This thread's connection (autocommit), opened on first use or after a break."""
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
            raise (StoreUnreachable if self.transient(e) else StoreError)(
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
        """Create the tables, or bring an older orch's up to :data:`SCHEMA_VERSION` (a newer
        orch's are left as they are), under an advisory lock held to the commit."""
        if _version(conn) >= SCHEMA_VERSION:
            return
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            conn.execute(SCHEMA)
            found = _version(conn)  # another process may have done it while we waited
            for version, migration in sorted(MIGRATIONS.items()):
                if found < version:
                    conn.execute(migration)
            conn.execute(
                "INSERT INTO orch_schema (version) SELECT %s"
                " WHERE NOT EXISTS (SELECT 1 FROM orch_schema)",
                (SCHEMA_VERSION,),
            )
            conn.execute(
                "UPDATE orch_schema SET version = %s WHERE version < %s",
                (SCHEMA_VERSION, SCHEMA_VERSION),
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
            raise (StoreUnreachable if self.transient(e) else StoreError)(
                self._failure(e)
            ) from None

    @contextmanager
    def transaction(self) -> Iterator[Query]:
        """``BEGIN; SELECT … FOR UPDATE; UPDATE; COMMIT`` (see :meth:`lock_run`)."""
        with self._guard():
            conn = self.conn()
            with conn.transaction(), conn.cursor() as cur:

                def query(sql: str, args: Sequence[Any]) -> list[Row]:
                    cur.execute(_pg(sql), args)
                    return cur.fetchall() if cur.description else []

                yield query

    def read(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._guard():
            return self.conn().execute(_pg(sql), args).fetchall()

    def write(self, sql: str, args: Sequence[Any] = ()) -> Written:
        """One statement in autocommit: a transaction of its own."""
        with self._guard():
            cur = self.conn().execute(_pg(sql), args)
            return Written(rows=cur.fetchall() if cur.description else [], count=cur.rowcount)

    def lock_run(self) -> str:
        return "SELECT data, updated_at FROM runs WHERE run_id = ? FOR UPDATE"

    def dump_output(self, text: str) -> str:
        return json.dumps(text, ensure_ascii=False)  # a JSON string: text holds no NUL

    def load_output(self, stored: str) -> str:
        return str(json.loads(stored))


class PostgresStore(SqlStore):
    """The :class:`~orchestrator.store.base.RunStore` over one Postgres database."""

    dialect: PostgresDialect

    def __init__(self, url: str) -> None:
        super().__init__(PostgresDialect(url))
