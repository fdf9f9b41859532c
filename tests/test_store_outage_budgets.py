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


def test_no_child_is_admitted_while_another_process_holds_the_sqlite_file(project: Path) -> None:
    """The root asks for a child while the file is held: the child is refused in one line
    (its chain's room cannot be counted), nothing of it is stored, and the root goes on
    and ends ``succeeded`` once the file is free."""
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
    h = harness(project, script)

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

    record = asyncio.run(asyncio.wait_for(play(), RUN_DEADLINE_S))
    stored = h.store.require_run(record.run_id)
    assert stored.status == RunStatus.SUCCEEDED, stored.error
    assert [r.run_id for r in h.runs(record.chain_id)] == [record.run_id]
    second = h.requests_of(record.run_id)[1]
    results = tool_results(second)
    assert len(results) == 1 and results[0].get("is_error"), results
    text = str(results[0]["content"])
    assert "cannot be used for now" in text and "\n" not in text.strip(), text
