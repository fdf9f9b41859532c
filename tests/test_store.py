"""The store: lifecycle, events, cross-process safety, privacy, staying out of git, and
the RunStore protocol (what the engine and CLI may ask of any backend).

The contract tests take the ``store`` fixture: each runs against SQLite and against a real
Postgres server (``postgres`` marker; see tests/pgserver.py)."""

from __future__ import annotations

import ast
import inspect
import multiprocessing
import os
import re
import socket
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import typer

import orchestrator
import orchestrator.store
from orchestrator.cli.common import handles_errors, open_project
from orchestrator.errors import NotFound, UsageError
from orchestrator.process.opened import find_run
from orchestrator.project.orchignore import STATE_IGNORE
from orchestrator.project.statedir import Refused, adopt
from orchestrator.run import RunRecord, RunStatus, Usage
from orchestrator.store import RunStore, SqliteStore, StoreError, open_store, state_dir
from orchestrator.store.batch import GATHER_S
from orchestrator.store.sql import like_prefix
from orchestrator.store.sqlite import _wal
from orchestrator.workspaces.base import ResourceSink

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def _open(where: str) -> RunStore:
    """A store by where it is: a Postgres URL, else the path of a SQLite file."""
    if where.startswith("postgresql://"):
        from orchestrator.store.postgres import PostgresStore

        return PostgresStore(where)
    return SqliteStore(Path(where))


def _where(store: RunStore) -> str:
    return str(store.path) if isinstance(store, SqliteStore) else store.describe()


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunStore]:
    """A fresh store of each backend: SQLite in tmp_path/.orch, or a database of its own."""
    if request.param == "sqlite":
        made: RunStore = SqliteStore.for_project(tmp_path)
    else:
        made = _open(request.getfixturevalue("pg_url"))
    try:
        yield made
    finally:
        made.close()


def _writer(db: str, run_id: str, n: int) -> None:
    store = _open(db)
    for i in range(n):
        store.note_activity(run_id, "bash", f"step {i}")
        store.add_event(run_id, "tick", {"i": i})
    store.close()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask() -> Iterator[None]:
    """Restore the process umask after a test that changes it."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_lifecycle_and_events(store: RunStore) -> None:
    rec = RunRecord(run_id="r-1", chain_id="c-1")
    store.create_run(rec)
    assert store.require_run("r-1").status == RunStatus.QUEUED
    store.update_run("r-1", status=RunStatus.RUNNING)
    store.update_run("r-1", status=RunStatus.SUCCEEDED, usage=Usage(turns=2, tool_uses=3))
    got = store.require_run("r-1")
    assert got.status == RunStatus.SUCCEEDED and got.usage.tool_uses == 3
    store.add_event("r-1", "tool_call", {"tool": "bash"})
    store.add_event("r-1", "tool_result", {"tool": "bash"})
    kinds = [e["kind"] for e in store.events("r-1")]
    assert kinds == ["tool_call", "tool_result"]
    first = store.events("r-1")[0]["id"]
    assert [e["kind"] for e in store.events("r-1", after_id=first)] == ["tool_result"]
    if isinstance(store, SqliteStore):
        mode = sqlite3.connect(store.path).execute("PRAGMA journal_mode").fetchone()[0]
        assert mode == "wal"


def test_missing_run_names_where_the_store_is(store: RunStore, tmp_path: Path) -> None:
    if isinstance(store, SqliteStore):
        assert store.describe() == str(tmp_path / ".orch" / "orch.db")
    else:
        assert store.describe().startswith("postgresql://orch@127.0.0.1:")
    where = store.describe()
    with pytest.raises(NotFound, match=re.escape(where)):
        store.require_run("r-nope")
    with pytest.raises(NotFound, match=re.escape(where)):
        store.update_run("r-nope", summary="x")
    assert store.get_run("r-nope") is None and store.output("r-nope") is None
    assert store.end_if_active("r-nope", summary="x") is None
    store.note_activity("r-nope", "bash", "ls")  # a no-op, as documented
    assert store.get_run("r-nope") is None


def test_state_dir_keeps_itself_out_of_git(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    open_store(tmp_path).create_run(RunRecord(run_id="r-2", chain_id="c"))
    assert (tmp_path / ".orch" / ".gitignore").read_text() == STATE_IGNORE
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert status == ""


def test_orch_home_overrides_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCH_HOME", str(tmp_path / "elsewhere"))
    store = open_store(tmp_path / "proj")
    assert store.describe() == str(tmp_path / "elsewhere" / "orch.db")
    assert _mode(tmp_path / "elsewhere") == 0o700


def test_concurrent_writers_lose_nothing(store: RunStore) -> None:
    ids = [f"r-{i}" for i in range(4)]
    for rid in ids:
        store.create_run(RunRecord(run_id=rid, chain_id="c"))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(_where(store), rid, 100)) for rid in ids]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rid in ids:
        assert len(store.events(rid)) == 100
        rec = store.require_run(rid)
        assert rec.last_activity is not None and rec.last_activity.summary == "step 99"
        assert len(rec.recent_activities) == 5


def test_an_ending_is_never_overwritten_by_someone_else(store: RunStore) -> None:
    store.create_run(RunRecord(run_id="r-done", chain_id="c", status=RunStatus.SUCCEEDED))
    assert store.end_if_active("r-done", status=RunStatus.INTERRUPTED) is None
    assert store.require_run("r-done").status == RunStatus.SUCCEEDED
    store.create_run(RunRecord(run_id="r-live", chain_id="c", status=RunStatus.RUNNING))
    ended = store.end_if_active("r-live", status=RunStatus.INTERRUPTED)
    assert ended is not None and ended.status == RunStatus.INTERRUPTED


# -- id prefixes are literal ------------------------------------------------------
def test_id_prefixes_are_literal_never_like_wildcards(store: RunStore) -> None:
    store.create_run(RunRecord(run_id="r-abc123", chain_id="c"))
    assert [r.run_id for r in store.find_runs("r-a")] == ["r-abc123"]
    for pattern in ("%", "_", "r_", "r-%", "r-a_c", "\\", "R-A"):
        assert store.find_runs(pattern) == [], pattern
    # `orch result %` resolves its argument with find_run: it must not pick the only run
    with pytest.raises(NotFound):
        find_run(store, "%")
    with pytest.raises(NotFound):
        find_run(store, "_")
    assert find_run(store, "r-ab").run_id == "r-abc123"

    assert like_prefix("a%b_c\\") == "a\\%b\\_c\\\\%"
    odd = "x%_\\y"  # an id holding every LIKE special character is found by its own prefix
    store.create_run(RunRecord(run_id=odd, chain_id="c"))
    store.create_run(RunRecord(run_id="xa\\\\y", chain_id="c"))  # what an unescaped x%_\ hits
    assert [r.run_id for r in store.find_runs("x%_\\")] == [odd]
    assert [r.run_id for r in store.find_runs("x%")] == [odd]


# -- privacy -----------------------------------------------------------------------
@pytest.mark.parametrize("mask", [0o022, 0o000, 0o277])
def test_state_is_private_whatever_the_umask(tmp_path: Path, umask: None, mask: int) -> None:
    os.umask(mask)
    store = open_store(tmp_path)
    store.create_run(RunRecord(run_id="r-1", chain_id="c"))
    os.umask(0o022)
    home = tmp_path / ".orch"
    assert _mode(home) == 0o700
    db = home / "orch.db"
    for path in (db, db.with_name("orch.db-wal"), db.with_name("orch.db-shm")):
        assert path.exists(), path
        assert _mode(path) == 0o600, path


def test_an_older_store_is_adopted_then_tightened(tmp_path: Path) -> None:
    home = tmp_path / ".orch"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    db = home / "orch.db"
    raw = sqlite3.connect(db)
    raw.execute("CREATE TABLE keep (x)")
    raw.commit()
    raw.close()
    db.chmod(0o644)
    wal = db.with_name("orch.db-wal")
    wal.touch()
    wal.chmod(0o666)
    with pytest.raises(Refused, match="without this user's owner mark"):
        open_store(tmp_path)  # an older orch's store (or a copy): the user adopts it
    adopt(home)
    store = open_store(tmp_path)
    assert _mode(home) == 0o700
    assert _mode(db) == 0o600 and _mode(wal) == 0o600
    assert store.list_runs() == []
    tables = {r[0] for r in sqlite3.connect(db).execute("SELECT name FROM sqlite_master")}
    assert {"keep", "runs"} <= tables  # contents kept, schema added


def test_state_dir_alone_is_private_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCH_HOME", str(tmp_path / "deep" / "home"))
    path = state_dir(tmp_path)
    assert path == tmp_path / "deep" / "home" and _mode(path) == 0o700


# -- choosing the backend ------------------------------------------------------------
def test_open_store_is_sqlite_unless_told_otherwise(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    assert isinstance(store, SqliteStore)


def _need_psycopg() -> None:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but psycopg is missing: .ci/run installs '.[dev,postgres]'")
        pytest.skip("psycopg is not installed (pip install -e '.[dev,postgres]')")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens there once it is closed


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_an_unreachable_postgres_is_one_line_naming_host_and_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    _need_psycopg()
    port = _closed_port()
    monkeypatch.setenv("ORCH_STORE", f"{scheme}://orch:s3cret@127.0.0.1:{port}/orch")
    with pytest.raises(StoreError) as info:
        open_store(tmp_path)
    msg = str(info.value)
    assert f"127.0.0.1:{port}" in msg and "ORCH_STORE" in msg
    assert "s3cret" not in msg and "\n" not in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert not (tmp_path / ".orch" / "orch.db").exists()


def test_without_psycopg_a_postgres_url_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # what `import psycopg` meets without it
    monkeypatch.setenv("ORCH_STORE", "postgresql://orch:s3cret@127.0.0.1:1/orch")
    with pytest.raises(UsageError) as info:
        open_store(tmp_path)
    msg = str(info.value)
    assert "pip install 'orch[postgres]'" in msg and "s3cret" not in msg and "\n" not in msg
    assert not (tmp_path / ".orch" / "orch.db").exists()


def test_an_unknown_orch_store_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCH_STORE", "mysql://x:s3cret@h/db")
    with pytest.raises(UsageError, match="unset it") as info:
        open_store(tmp_path)
    assert "s3cret" not in str(info.value)


def test_the_cli_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _need_psycopg()
    port = _closed_port()
    monkeypatch.setenv("ORCH_STORE", f"postgresql://orch:s3cret@127.0.0.1:{port}/orch")
    with pytest.raises(typer.Exit) as info:
        handles_errors(open_project)(tmp_path)
    assert info.value.exit_code == 1
    err = capsys.readouterr().err
    assert err.startswith("orch: ") and f"127.0.0.1:{port}" in err and "s3cret" not in err
    assert err.count("\n") == 1


def test_plain_orch_never_imports_the_postgres_store(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path\n"
        "from orchestrator.cli.common import open_project\n"
        "import orchestrator.cli.main\n"
        f"open_project(Path({str(tmp_path)!r})).store.close()\n"
        "print(sorted(m for m in sys.modules if 'psycopg' in m or m.endswith('.postgres')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ORCH_STORE"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_broken_database_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = state_dir(tmp_path)  # orch's own state directory, its database broken
    (home / "orch.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(typer.Exit):
        handles_errors(open_project)(tmp_path)
    assert ".orch/orch.db" in capsys.readouterr().err


# -- the protocol ------------------------------------------------------------------
def _protocol_members() -> set[str]:
    names: set[str] = set()
    for cls in RunStore.__mro__:
        if getattr(cls, "_is_protocol", False) and cls.__module__.startswith("orchestrator"):
            names |= {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
    return names


def _store_uses() -> dict[str, set[str]]:
    """Attributes the engine and CLI take from a store (``x.store.y``, ``store.y``, ``sink.y``)."""
    pkg = Path(orchestrator.__file__).parent
    uses: dict[str, set[str]] = {}
    for path in pkg.rglob("*.py"):
        if (pkg / "store") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
            if name in ("store", "sink"):
                uses.setdefault(node.attr, set()).add(str(path.relative_to(pkg)))
    return uses


def _backends() -> list[type]:
    from orchestrator.store.postgres import PostgresStore  # importable without psycopg

    return [SqliteStore, PostgresStore]


def test_every_backend_fits_the_protocol(store: RunStore) -> None:
    sink: ResourceSink = store  # a RunStore is where workspaces register what they start
    sink.register_resource("r-1", "process_group", "1:2")
    assert [r["ref"] for r in store.resources("r-1")] == ["1:2"]
    sink.release_resource("r-1", "process_group", "1:2")
    assert store.resources() == []
    for cls in _backends():
        for name in _protocol_members():
            mine = inspect.signature(getattr(cls, name))
            assert str(mine) == str(inspect.signature(getattr(RunStore, name))), (cls, name)


def test_sqlite_store_fits_the_protocol(tmp_path: Path) -> None:
    store: RunStore = SqliteStore(tmp_path / "orch.db")  # mypy checks the fit
    assert store.resources() == []
    if TYPE_CHECKING:  # and for the Postgres store
        from orchestrator.store.postgres import PostgresStore

        _: RunStore = PostgresStore("postgresql://")


def test_the_protocol_is_exactly_what_the_engine_and_cli_use() -> None:
    members = _protocol_members()
    uses = _store_uses()
    missing = {name: where for name, where in uses.items() if name not in members}
    assert not missing, f"used on a store but not declared on RunStore: {missing}"
    from orchestrator.store.postgres import PostgresStore
    from orchestrator.store.sql import SqlStore

    def public(cls: type) -> set[str]:  # what a backend's class adds to what it inherits
        return {n for c in cls.__mro__ if c is not object for n in vars(c) if n[0] != "_"}

    # children: a helper of descendants (and of tests); for_project: the SQLite constructor
    assert public(SqlStore) - members == {"children"}
    assert public(SqliteStore) - members == {"children", "for_project"}
    assert public(PostgresStore) - members == {"children"}


def test_package_exports() -> None:
    assert sorted(orchestrator.store.__all__) == [
        "ChainFull",
        "ChainRoom",
        "ChainUsage",
        "RunStore",
        "SqliteStore",
        "StoreError",
        "open_store",
        "state_dir",
        "store_paths",
        "store_url",
    ]
    for name in orchestrator.store.__all__:
        assert hasattr(orchestrator.store, name)
    assert not hasattr(orchestrator.store, "Store")


def test_reaping_never_kills_a_stranger_that_reuses_a_group_id() -> None:
    from orchestrator.pgroups import group_ref, kill_group_ref, process_start

    stranger = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        start = process_start(stranger.pid)
        assert start is not None
        stale = f"{stranger.pid}:{start - 100}"  # what a crashed run registered long ago
        assert kill_group_ref(stale) == 0
        assert stranger.poll() is None
        assert kill_group_ref(group_ref(stranger.pid)) == 1  # its own registration kills it
        assert stranger.wait(5) == -9
    finally:
        stranger.kill()
        stranger.wait(30)


class _Racing:
    """A connection whose switch to WAL another process's open is racing: "locked"."""

    def __init__(self, fails: int, error: str = "database is locked") -> None:
        self.fails, self.error, self.calls = fails, error, 0

    def execute(self, sql: str) -> None:
        assert sql == "PRAGMA journal_mode=WAL"
        self.calls += 1
        if self.calls <= self.fails:
            raise sqlite3.OperationalError(self.error)


def test_the_switch_to_wal_is_tried_again_while_another_open_holds_it() -> None:
    # seen in CI: four launchers opening a new store at once, one got "database is locked"
    # from the WAL switch, which answers at once instead of waiting its busy timeout
    racing = _Racing(fails=3)
    _wal(racing, timeout_s=5)  # type: ignore[arg-type]
    assert racing.calls == 4
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        _wal(_Racing(fails=10**6), timeout_s=0.2)  # type: ignore[arg-type]  # bounded
    other = _Racing(fails=1, error="disk I/O error")
    with pytest.raises(sqlite3.OperationalError, match="disk"):
        _wal(other, timeout_s=5)  # type: ignore[arg-type]  # other errors: at once
    assert other.calls == 1


def test_a_chains_last_places_are_taken_once(store: RunStore) -> None:
    """``create_run`` with room counts the chain and inserts in one transaction: writers
    on many connections at once never store more runs than the room."""
    import threading

    from orchestrator.store import ChainFull, ChainRoom

    where, room = _where(store), ChainRoom(runs=12)
    start = threading.Barrier(4)
    stored: list[bool] = []

    def writer(i: int) -> None:
        mine = _open(where)
        try:
            start.wait()
            for j in range(6):
                try:
                    mine.create_run(RunRecord(run_id=f"r-{i}-{j}", chain_id="c-room"), room=room)
                    stored.append(True)
                except ChainFull as full:
                    assert full.used.runs >= room.runs and full.room == room
                    stored.append(False)
        finally:
            mine.close()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(stored) == 24 and stored.count(True) == 12
    assert store.chain_usage("c-room").runs == 12

    spent = RunRecord(run_id="r-t", chain_id="c-tokens", usage=Usage(input_tokens=10))
    store.create_run(spent)
    with pytest.raises(ChainFull):
        store.create_run(
            RunRecord(run_id="r-t2", chain_id="c-tokens"), room=ChainRoom(runs=9, tokens=10)
        )
    store.create_run(RunRecord(run_id="r-t3", chain_id="c-tokens"), room=ChainRoom(9, 11))
    assert store.chain_usage("c-tokens").runs == 2


def test_progress_never_writes_over_another_writers_change(
    store: RunStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Progress starts from the record as this process last wrote it; when another
    process changed the run since (here: ended it), the write is made again from the
    store's version: the ending stands and the progress is kept, for every run of a
    group write at once, with nothing dropped."""
    import asyncio
    import logging

    other = _open(_where(store))
    ids = ["r-k1", "r-k2", "r-k3"]
    try:
        for rid in ids:
            store.create_run(RunRecord(run_id=rid, chain_id="c", status=RunStatus.RUNNING))

        async def progress(summary: str) -> None:
            for rid in ids:
                store.patch_run(rid, summary=summary)
            await asyncio.sleep(GATHER_S * 3)

        asyncio.run(progress("first"))  # now known to this process
        for rid in ids:
            assert other.end_if_active(rid, status=RunStatus.CANCELLED, error="stopped")
        with caplog.at_level(logging.WARNING, logger="orchestrator.store.batch"):
            asyncio.run(progress("second"))  # one group: every run in it out of date
            store.note_activity("r-k1", "bash", "no loop: written at once")
        assert "dropped" not in caplog.text
        for rid in ids:
            for seen in (store.require_run(rid), other.require_run(rid)):
                assert seen.status is RunStatus.CANCELLED and seen.error == "stopped"
                assert seen.summary == "second"
        activity = other.require_run("r-k1").last_activity
        assert activity is not None and activity.summary == "no loop: written at once"
    finally:
        other.close()


def test_list_raw_gives_the_latest_runs_oldest_first(store: RunStore) -> None:
    """What the dashboard's first page reads: only the latest rows, not every run."""
    for i in range(5):
        store.create_run(RunRecord(run_id=f"r-{i:012d}", chain_id="c", created_at=1000.0 + i))
    store.flush()
    assert [r["run_id"] for r in store.list_raw(limit=2)] == ["r-000000000003", "r-000000000004"]
    assert len(store.list_raw()) == 5 and store.list_raw(limit=10)[0]["run_id"] == "r-000000000000"
