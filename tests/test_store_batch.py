"""Group commit of progress writes (orchestrator/store/batch.py): what one event-loop turn
queues is written in one transaction, in order, visible to this process at once and to
others a turn later; a failing write costs only itself."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from orchestrator.errors import NotFound
from orchestrator.run import RunRecord, RunStatus, Usage
from orchestrator.store import SqliteStore
from orchestrator.store.batch import GATHER_S
from orchestrator.store.sql import Query
from tests.support import spy_transactions


def _counting(store: SqliteStore) -> list[int]:
    """Count the store's transactions (its dialect's ``transaction`` and ``write``)."""
    made = [0]
    dialect = store.dialect
    transaction, write = dialect.transaction, dialect.write

    @contextmanager
    def counted() -> Iterator[Query]:
        made[0] += 1
        with transaction() as q:
            yield q

    def counted_write(sql: str, args: object = ()) -> object:
        made[0] += 1
        return write(sql, args)  # type: ignore[arg-type]

    dialect.transaction = counted  # type: ignore[method-assign]
    dialect.write = counted_write  # type: ignore[method-assign,assignment]
    store._behind._transaction = counted  # the queue made its own reference at start
    return made


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    made = SqliteStore.for_project(tmp_path)
    for i in range(20):
        made.create_run(RunRecord(run_id=f"r-{i}", chain_id="c"))
    yield made
    made.close()


def test_one_loop_turn_of_progress_is_one_transaction_in_order(store: SqliteStore) -> None:
    made = _counting(store)

    async def turn() -> int:
        for i in range(20):
            rid = f"r-{i}"
            store.add_event(rid, "tool_call", {"n": 1})
            store.note_activity(rid, "bash", "first", usage=Usage(tool_uses=1))
            store.register_resource(rid, "pgroup", f"g{i}")
            store.note_activity(rid, "bash", "second")
            store.patch_run(rid, status=RunStatus.RUNNING, summary=f"s{i}")
            store.add_event(rid, "tool_result", {"n": 2})
            store.save_transcript(rid, [{"role": "user", "content": f"t{i}"}])
            store.release_resource(rid, "pgroup", f"g{i}")
        before = made[0]
        await asyncio.sleep(GATHER_S * 3)  # the group gathered: its queue is written
        return made[0] - before

    assert asyncio.run(turn()) == 1  # 160 writes, one transaction
    for i in range(20):
        rid = f"r-{i}"
        record = store.require_run(rid)
        assert [a.summary for a in record.recent_activities] == ["first", "second"]
        assert record.usage.tool_uses == 1 and record.summary == f"s{i}"
        assert record.status is RunStatus.RUNNING
        assert [e["kind"] for e in store.events(rid)] == ["tool_call", "tool_result"]
        assert store.transcript(rid) == [{"role": "user", "content": f"t{i}"}]
    assert store.resources() == []  # registered, then released, in that order


def test_this_process_reads_what_it_queued_and_others_see_it_a_turn_later(
    store: SqliteStore,
) -> None:
    other = SqliteStore(store.path)

    async def turn() -> tuple[list[str], list[str], list[str]]:
        store.add_event("r-1", "tool_call")
        store.register_resource("r-1", "pgroup", "g")
        seen_by_other = [e["kind"] for e in other.events("r-1")]
        seen_here = [e["kind"] for e in store.events("r-1")]  # a read writes the queue first
        store.add_event("r-1", "tool_result")
        await asyncio.sleep(GATHER_S * 3)
        later = [e["kind"] for e in other.events("r-1")]
        return seen_by_other, seen_here, later

    seen_by_other, seen_here, later = asyncio.run(turn())
    assert seen_by_other == []
    assert seen_here == ["tool_call"]
    assert later == ["tool_call", "tool_result"]
    assert [r["ref"] for r in other.resources("r-1")] == ["g"]
    other.close()


def test_an_update_with_an_answer_follows_what_was_queued(store: SqliteStore) -> None:
    async def turn() -> RunRecord:
        store.note_activity("r-2", "bash", "queued first")
        return store.update_run("r-2", summary="then this")

    record = asyncio.run(turn())
    assert record.last_activity is not None and record.last_activity.summary == "queued first"
    assert record.summary == "then this"


def test_without_a_loop_a_write_is_made_at_once(store: SqliteStore) -> None:
    other = SqliteStore(store.path)
    store.add_event("r-3", "tool_call")
    store.note_activity("r-3", "bash", "now")
    assert [e["kind"] for e in other.events("r-3")] == ["tool_call"]
    assert other.require_run("r-3").last_activity is not None
    other.close()


def test_a_failing_queued_write_costs_only_itself(
    store: SqliteStore, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(unit: object) -> None:
        raise RuntimeError("this step breaks")

    async def turn() -> None:
        store.add_event("r-4", "before")
        store._behind.add(broken)
        store.add_event("r-4", "after")
        store.note_activity("r-4", "bash", "kept")
        await asyncio.sleep(GATHER_S * 3)

    with caplog.at_level(logging.WARNING, logger="orchestrator.store.batch"):
        asyncio.run(turn())
    assert [e["kind"] for e in store.events("r-4")] == ["before", "after"]
    assert store.require_run("r-4").last_activity is not None
    assert "this step breaks" in caplog.text
    assert "progress write was dropped" in caplog.text


def test_progress_for_a_run_that_is_not_there_is_a_no_op(store: SqliteStore) -> None:
    async def turn() -> None:
        store.note_activity("r-none", "bash", "x")
        store.patch_run("r-none", summary="x")
        store.add_event("r-5", "kept")
        await asyncio.sleep(GATHER_S * 3)

    asyncio.run(turn())
    assert store.get_run("r-none") is None
    assert [e["kind"] for e in store.events("r-5")] == ["kept"]


def test_close_writes_what_is_queued(tmp_path: Path) -> None:
    store = SqliteStore.for_project(tmp_path)
    store.create_run(RunRecord(run_id="r-c", chain_id="c"))

    async def turn() -> None:
        store.add_event("r-c", "last")
        store.close()  # before the turn ends

    asyncio.run(turn())
    again = SqliteStore.for_project(tmp_path)
    assert [e["kind"] for e in again.events("r-c")] == ["last"]
    again.close()


def test_a_broken_queued_write_never_fails_the_statement_that_writes_the_queue(
    store: SqliteStore, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(unit: object) -> None:
        raise RuntimeError("queued and broken")

    async def turn() -> RunRecord:
        store.add_event("r-6", "kept")
        store._behind.add(broken)
        return store.update_run("r-6", summary="mine")  # writes the queue first

    with caplog.at_level(logging.WARNING, logger="orchestrator.store.batch"):
        record = asyncio.run(turn())
    assert record.summary == "mine"
    assert [e["kind"] for e in store.events("r-6")] == ["kept"]
    assert "queued and broken" in caplog.text


def test_a_write_takes_the_queue_into_its_own_commit(store: SqliteStore) -> None:
    made = _counting(store)

    async def turn() -> tuple[int, RunRecord]:
        store.add_event("r-7", "tool_call")
        store.note_activity("r-7", "bash", "queued")
        before = made[0]
        record = store.update_run("r-7", summary="mine")
        return made[0] - before, record

    count, record = asyncio.run(turn())
    assert count == 1  # the queue and the update: one transaction
    assert record.last_activity is not None and record.last_activity.summary == "queued"
    assert record.summary == "mine"
    assert [e["kind"] for e in store.events("r-7")] == ["tool_call"]


def test_a_failing_write_rolls_back_only_itself(store: SqliteStore) -> None:
    async def turn() -> None:
        store.add_event("r-8", "tool_call")
        store.note_activity("r-8", "bash", "kept")
        with pytest.raises(NotFound):
            store.update_run("r-none", summary="refused")  # its transaction rolls back

    asyncio.run(turn())
    assert [e["kind"] for e in store.events("r-8")] == ["tool_call"]
    record = store.require_run("r-8")
    assert record.last_activity is not None and record.last_activity.summary == "kept"
    assert store.get_run("r-none") is None


def test_progress_of_a_run_this_process_wrote_reads_nothing(store: SqliteStore) -> None:
    transactions = spy_transactions(store)

    other = SqliteStore(store.path)
    other.create_run(RunRecord(run_id="r-made-elsewhere", chain_id="c"))
    other.close()

    async def turns(run_id: str) -> None:
        for i in range(5):
            store.note_activity(run_id, "bash", f"step {i}")
            store.patch_run(run_id, summary=f"s{i}")
            await asyncio.sleep(GATHER_S * 3)

    for run_id, read in (("r-9", 0), ("r-made-elsewhere", 1)):  # created here: known at once
        transactions.clear()
        asyncio.run(turns(run_id))
        said = [sql for t in transactions for sql in t]
        reads = [s for s in said if s.startswith("SELECT data")]
        updates = [s for s in said if s.startswith("UPDATE runs")]
        assert len(reads) == read and len(updates) == 5
        record = store.require_run(run_id)
        assert record.summary == "s4"
        assert [a.summary for a in record.recent_activities][-1] == "step 4"


def test_writes_that_take_the_queue_in_leave_one_flush_a_turn(store: SqliteStore) -> None:
    """A fan-out's spawns each write (taking the queue in) and start a child; the children
    then queue their starts. Those starts are one transaction, not one a child: a write
    that took the queue does not schedule a flush of its own."""
    made = _counting(store)

    async def child(i: int) -> None:
        store.patch_run(f"r-{i}", status=RunStatus.RUNNING)
        store.add_event(f"r-{i}", "run_started")

    async def fan_out() -> int:
        children = []
        for i in range(20):  # one loop turn: write, queue, start a child
            store.update_run(f"r-{i}", summary="spawned")
            store.add_event(f"r-{i}", "child_spawned")
            children.append(asyncio.create_task(child(i)))
        before = made[0]
        await asyncio.gather(*children)
        await asyncio.sleep(GATHER_S * 3)
        await asyncio.sleep(GATHER_S * 3)
        return made[0] - before

    assert asyncio.run(fan_out()) <= 2  # the last spawn's event, then the twenty starts
    for i in range(20):
        assert store.require_run(f"r-{i}").status is RunStatus.RUNNING
        assert [e["kind"] for e in store.events(f"r-{i}")] == ["child_spawned", "run_started"]
