"""The SQLite run store: one file (WAL) per project, the default; its dialect of
:mod:`orchestrator.store.sql` (which holds the queries and the tables' meaning).

Safe across processes: WAL journal, a busy timeout, and short transactions
(``BEGIN IMMEDIATE`` for read-modify-write), so many writers never lose an
update or see "database is locked".

Private: the state directory is 0700 (see :func:`state_dir`), the database file and
its ``-wal``/``-shm`` files 0600, whatever the umask.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .base import StoreUnreachable, make_private, state_dir
from .schema import Types, tables
from .sql import Query, Row, SqlStore, Written

# the types of an older orch's tables (a file any SQLite reads)
SCHEMA = tables(
    Types(
        real="REAL",
        boolean="INTEGER",
        false="0",
        serial="INTEGER PRIMARY KEY AUTOINCREMENT",
    )
)

# the fields of Usage that Usage.tokens adds up
TOKEN_KINDS = (
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
)
DB_FILE = "orch.db"
# what SQLite says when the file is away for now: held by another process past the busy
# timeout, a disk error, a full disk, a file that cannot be opened (a remount)
AWAY = ("locked", "busy", "disk i/o error", "disk is full", "unable to open")
DB_MODE = 0o600
# how long a statement waits for another process's lock on a thread that must not stand
# still: an event loop's, or the store's writer thread (the loop's next statement waits
# for its group); past it the file is away for now and the outage path carries the write
LOOP_BUSY_S = 0.025


def _must_not_wait() -> bool:
    """Whether this thread runs an event loop or is the store's writer thread."""
    if threading.current_thread().name.startswith("orch-store"):
        return True
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


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


class SqliteDialect:
    """SQLite's side of the SQL store: one connection per thread (WAL, a busy timeout, in
    autocommit), every write in ``BEGIN IMMEDIATE`` (the write lock taken before the read
    of a read-modify-write), outputs kept as they are."""

    holds_nul = True
    usage_columns = False
    # Usage.tokens and Usage.cost_usd (a field an older orch's record lacks counts 0)
    chain_tokens = (
        "COALESCE(SUM("
        + " + ".join(f"COALESCE(json_extract(data, '$.usage.{k}'), 0)" for k in TOKEN_KINDS)
        + "), 0)"
    )
    chain_usd = "COALESCE(SUM(json_extract(data, '$.usage.cost_usd')), 0.0)"
    insert_event = "INSERT INTO events (run_id, at, kind, data) VALUES (?,?,?,?) RETURNING id"
    heartbeat = "UPDATE runs SET heartbeat_at = ? WHERE run_id IN ({ids})"
    progress_commit = ""  # synchronous=NORMAL: every commit alike
    lock_chain = ""  # BEGIN IMMEDIATE holds the database's write lock
    off_loop = True  # a file another process holds is waited for off the loop (``batch``)
    busy_timeout_s = 30.0  # how long a statement waits for another process's lock

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        _create_private(path)
        self.conn().executescript(SCHEMA)
        for suffix in ("-wal", "-shm"):  # SQLite gives them the db's mode; older ones may not
            make_private(path.with_name(path.name + suffix), DB_MODE)

    def describe(self) -> str:
        return str(self.path)

    def transient(self, error: BaseException) -> bool:
        """The file is away for now (see :data:`AWAY`), not a statement refused."""
        if isinstance(error, StoreUnreachable):  # said by the store itself (``SqlStore.away``)
            return True
        text = str(error).lower()
        return isinstance(error, sqlite3.OperationalError) and any(w in text for w in AWAY)

    def paths(self) -> tuple[Path, ...]:
        """The database's directory (its ``-wal``, ``-shm``, ``-journal`` files too) and file."""
        return (self.path.parent, self.path)

    def conn(self) -> sqlite3.Connection:
        """This thread's connection, opened on first use; its busy timeout short on a
        thread that must not stand still (:data:`LOOP_BUSY_S`), else ``busy_timeout_s``."""
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        busy = min(self.busy_timeout_s, LOOP_BUSY_S) if _must_not_wait() else self.busy_timeout_s
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=busy, isolation_level=None)
            _wal(conn, busy)
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
            self._local.busy = None
        if self._local.busy != busy:
            conn.execute(f"PRAGMA busy_timeout={int(busy * 1000)}")
            self._local.busy = busy
        return conn

    def close(self) -> None:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    @contextmanager
    def _said(self) -> Iterator[None]:
        """The file away for now (``transient``) said in one line, as StoreUnreachable."""
        try:
            yield
        except sqlite3.OperationalError as e:
            if not self.transient(e):
                raise
            raise StoreUnreachable(
                f"the SQLite run store at {self.path} cannot be used for now ({e}); check "
                "that no other process holds it and that its disk is writable"
            ) from e

    @contextmanager
    def _immediate(self) -> Iterator[sqlite3.Connection]:
        with self._said():
            conn = self.conn()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    @contextmanager
    def transaction(self) -> Iterator[Query]:
        with self._immediate() as conn:
            yield lambda sql, args: conn.execute(sql, args).fetchall()

    def read(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._said():
            return self.conn().execute(sql, args).fetchall()

    def write(self, sql: str, args: Sequence[Any] = ()) -> Written:
        with self._immediate() as conn:
            cur = conn.execute(sql, args)
            rows = cur.fetchall()
            return Written(rows=rows, count=cur.rowcount)

    def lock_run(self) -> str:
        return (
            "SELECT data, updated_at FROM runs WHERE run_id = ?"  # BEGIN IMMEDIATE holds the lock
        )

    def dump_output(self, text: str) -> str:
        return text

    def load_output(self, stored: str) -> str:
        return str(stored)


class SqliteStore(SqlStore):
    """The :class:`~orchestrator.store.base.RunStore` over one SQLite file."""

    dialect: SqliteDialect

    def __init__(self, path: Path) -> None:
        super().__init__(SqliteDialect(path))
        self.path = path

    @classmethod
    def for_project(cls, project_root: Path) -> SqliteStore:
        """The SQLite store of a project, whatever ORCH_STORE says (use ``open_store``)."""
        return cls(state_dir(project_root) / DB_FILE)
