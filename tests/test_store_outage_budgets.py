"""A chain's budgets while the store is away (issue 45): enforced from what the process
knows, never loosened. A dollar budget is checked against the last sum read plus what the
run spent since; a child is admitted only into the store (its chain's room counted there),
so none is admitted while the store is away."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from orchestrator.engine.budget import exhausted, forget
from orchestrator.run import RunRecord, RunStatus, Usage
from orchestrator.spec import Budgets, RunPlan, RunSpec
from orchestrator.store import ChainUsage, RunStore
from orchestrator.store.base import StoreUnreachable
from tests.support import RUN_DEADLINE_S, harness, task_call, tool_results
from tests.test_store_outage import HOLD


class _Away:
    """A store that answered once, then is away (or refuses, ``refuse``)."""

    def __init__(self, used: ChainUsage, refuse: bool = False) -> None:
        self.used: ChainUsage | None = used
        self.refuse = refuse

    def chain_usage(self, chain_id: str, *, tokens: bool = False, usd: bool = False) -> ChainUsage:
        used, self.used = self.used, None
        if used is not None:
            return used
        if self.refuse:
            raise ValueError("refused")
        raise StoreUnreachable("the store at here is unreachable")

    def transient(self, error: BaseException) -> bool:
        return isinstance(error, StoreUnreachable)


def _record(run_id: str, usd: float) -> RunRecord:
    spec = RunSpec(prompt="x", workdir=Path("/tmp"))
    budgets = Budgets(running=4, runs=10, usd=usd)
    return RunRecord(
        run_id=run_id, chain_id="c", plan=RunPlan(spec=spec, max_turns=5, budgets=budgets)
    )


def test_a_dollar_budget_holds_on_what_the_process_knows_while_the_store_is_away() -> None:
    store = cast(RunStore, _Away(ChainUsage(runs=3, live=2, tokens=100, usd=0.6)))
    record = _record("r-usd", usd=1.0)
    assert exhausted(store, record, Usage(cost_usd=0.1)) is None  # read: 0.6 of 1.0
    # away: 0.6 read + 0.2 spent since = 0.8, room left; the run goes on
    assert exhausted(store, record, Usage(cost_usd=0.3)) is None
    # away: 0.6 + 0.45 = 1.05: stopped, as the store would have said
    said = exhausted(store, record, Usage(cost_usd=0.55))
    assert said is not None and "max_chain_usd" in said
    forget(record.run_id)


def test_without_a_read_the_run_s_own_spend_counts_and_a_refusal_is_raised() -> None:
    store = cast(RunStore, _Away(ChainUsage(runs=1, live=1, tokens=0)))
    cast(_Away, store).used = None  # never answered
    record = _record("r-own", usd=1.0)
    assert exhausted(store, record, Usage(cost_usd=0.5)) is None
    said = exhausted(store, record, Usage(cost_usd=1.0))
    assert said is not None and "max_chain_usd" in said
    refusing = cast(RunStore, _Away(ChainUsage(runs=1, live=1, tokens=0), refuse=True))
    assert exhausted(refusing, record, Usage()) is None
    with pytest.raises(ValueError):  # not the store away: not hidden
        exhausted(refusing, record, Usage())
    forget(record.run_id)


def _split_while_held(project: Path, **settings: Any) -> tuple[Any, RunRecord]:
    """A root that asks for a child while another process holds the SQLite file 3 s."""
    script: dict[str, Any] = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [task_call("count")], "latency_s": 1.0},
                    {"text": "ROOT-DONE"},
                ],
            },
            {"depth": 1, "turns": [{"text": "CHILD"}]},
        ]
    }
    h = harness(project, script, **settings)

    async def play() -> RunRecord:
        job = asyncio.create_task(h.runner.run(h.spec("split")))
        await asyncio.sleep(0.3)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", HOLD, str(h.store.path), "3", stdout=subprocess.PIPE
        )
        assert proc.stdout is not None
        assert await proc.stdout.readline() == b"held\n"
        try:
            return await job
        finally:
            await proc.wait()

    return h, asyncio.run(asyncio.wait_for(play(), RUN_DEADLINE_S))


def test_a_child_asked_for_while_another_process_holds_the_sqlite_file_waits_for_it(
    project: Path,
) -> None:
    """Its chain's room can be counted only in the store: the child's spawn waits for the
    file (within store_outage_s), is admitted with its budgets checked, and runs."""
    h, record = _split_while_held(project)
    stored = h.store.require_run(record.run_id)
    assert stored.status == RunStatus.SUCCEEDED, stored.error
    [child] = [r for r in h.runs(record.chain_id) if r.run_id != record.run_id]
    assert child.status == RunStatus.SUCCEEDED, child.error
    results = tool_results(h.requests_of(record.run_id)[1])
    assert len(results) == 1 and not results[0].get("is_error"), results
    assert "CHILD" in str(results[0]["content"])


def test_no_child_is_admitted_past_store_outage_s() -> None:
    """A store away longer than the spawner's patience (store_outage_s): the spawn fails
    with the store's own error, after trying again; an error that is not the store away
    fails at once."""
    from orchestrator.engine.creations import Creations
    from orchestrator.run import RunRecord as Record
    from orchestrator.store.base import StoreUnreachable

    class Away:
        def __init__(self, error: Exception) -> None:
            self.error, self.tries = error, 0

        def transient(self, error: BaseException) -> bool:
            return isinstance(error, StoreUnreachable)

        def create_runs(self, pairs: object) -> list[None]:
            self.tries += 1
            raise self.error

    async def spawn(store: Away) -> float:
        creations = Creations(cast(RunStore, store), patience_s=0.4)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(type(store.error)):
            await creations.store_run(Record(run_id="r-1", chain_id="c-1", prompt="x"), None)
        return loop.time() - t0

    away = Away(StoreUnreachable("the store at /x cannot be used for now"))
    waited = asyncio.run(spawn(away))
    assert away.tries >= 3 and 0.2 <= waited < 2.0
    broken = Away(ValueError("not the store away"))
    assert asyncio.run(spawn(broken)) < 0.2 and broken.tries == 1
