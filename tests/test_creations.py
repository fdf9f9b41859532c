"""Runs admitted in one loop turn are stored in one transaction (engine/creations.py):
a reply's children together, budgets counted in order, and a spawner cancelled while it
waits leaves no queued run behind."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from orchestrator.engine.creations import Creations
from orchestrator.run import RunRecord, RunStatus
from orchestrator.store import ChainFull, ChainRoom, SqliteStore
from tests.support import harness, init_repo, task_call


def _fan(n: int) -> dict[str, Any]:
    calls = [task_call(f"child {i}", description=f"c{i}") for i in range(n)]
    return {"conversations": [
        {"depth": 0, "turns": [{"tool_calls": calls}, {"text": "done"}]},
        {"depth": 1, "runs": "*", "turns": [{"text": "ok"}]},
    ]}  # fmt: skip


def test_a_replys_children_are_stored_in_one_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = init_repo(tmp_path / "repo", {"a.txt": "a\n"})
    h = harness(repo, _fan(30), max_parallel_children=30, max_chain_running=31)
    batches: list[int] = []
    create_runs = h.store.create_runs

    def counted(runs: Any) -> Any:
        batches.append(len(runs))
        return create_runs(runs)

    monkeypatch.setattr(h.store, "create_runs", counted)
    root = h.run()
    assert root.status is RunStatus.SUCCEEDED, root.error
    assert batches == [1, 30]  # the root, then its thirty children at once
    kids = h.store.children(root.run_id)
    assert len(kids) == 30 and all(k.status is RunStatus.SUCCEEDED for k in kids)


def test_a_batch_counts_the_chains_budget_in_order(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "repo", {"a.txt": "a\n"})
    h = harness(repo, _fan(8), max_chain_runs=5)  # the root and four children
    root = h.run()
    assert root.status is RunStatus.SUCCEEDED, root.error
    assert len(h.store.children(root.run_id)) == 4
    results = [r for r in h.requests_of(root.run_id)[1].messages[-1]["content"]]
    refused = [r for r in results if "max_chain_runs (5) is used up" in str(r["content"])]
    assert len(refused) == 4 and all(r["is_error"] for r in refused)
    assert all("this chain has 5 runs" in str(r["content"]) for r in refused)


def test_a_spawner_cancelled_while_it_waits_leaves_no_queued_run(tmp_path: Path) -> None:
    store = SqliteStore.for_project(tmp_path)
    creations = Creations(store)

    async def before_the_write() -> None:
        waiting = asyncio.create_task(
            creations.store_run(RunRecord(run_id="r-a", chain_id="c"), None)
        )
        await asyncio.sleep(0)  # it has joined the turn; the turn's write comes next
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    async def after_the_write() -> None:
        record = RunRecord(run_id="r-b", chain_id="c")
        waiting = asyncio.create_task(creations.store_run(record, None))
        await asyncio.sleep(0)
        asyncio.get_running_loop().call_soon(waiting.cancel)  # right after the turn's write
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(before_the_write())
    assert store.get_run("r-a") is None  # never stored
    asyncio.run(after_the_write())
    ended = store.require_run("r-b")  # stored, then ended: nobody will run it
    assert ended.status is RunStatus.CANCELLED and ended.error == "cancelled before it started"
    store.close()


def test_a_full_chain_refuses_only_the_runs_past_its_room(tmp_path: Path) -> None:
    store = SqliteStore.for_project(tmp_path)
    creations = Creations(store)

    async def turn() -> list[BaseException | None]:
        runs = [RunRecord(run_id=f"r-{i}", chain_id="c") for i in range(5)]
        got = await asyncio.gather(
            *(creations.store_run(r, ChainRoom(runs=3)) for r in runs), return_exceptions=True
        )
        return list(got)

    got = asyncio.run(turn())
    assert got[:3] == [None, None, None]
    assert all(isinstance(e, ChainFull) and e.used.runs == 3 for e in got[3:])
    assert store.chain_usage("c").runs == 3
    store.close()
