"""A lead team's board: who may do what, atomic claims, dependencies, messages, waits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from orchestrator.errors import OrchError
from orchestrator.teams.board import Board, BoardState


def board(members: int = 2) -> tuple[Board, list[tuple[str, dict[str, Any]]], dict[str, list[str]]]:
    events: list[tuple[str, dict[str, Any]]] = []
    inbox: dict[str, list[str]] = {}

    def deliver(run_id: str, text: str) -> bool:
        if run_id.startswith("gone"):
            return False
        inbox.setdefault(run_id, []).append(text)
        return True

    b = Board(
        BoardState(),
        [f"teammate-{k}" for k in range(1, members + 1)],
        record=lambda kind, data: events.append((kind, dict(data))),
        deliver=deliver,
        describe=lambda rid, text: None,
    )
    return b, events, inbox


def test_only_the_lead_plans_and_only_a_holder_hands_in() -> None:
    b, events, _ = board()
    lead, one, two = b.sit("r-lead", "lead", "lead"), b.sit("r-1", "teammate-1", "teammate"), \
        b.sit("r-2", "teammate-2", "teammate")  # fmt: skip
    with pytest.raises(OrchError, match="only the lead adds tasks"):
        one.add("sneak", "", [])
    t1 = lead.add("first", "do it", [])
    t2 = lead.add("second", "after", [t1.id])
    assert (t1.id, t1.state, t2.state) == ("t1", "ready", "waiting")
    with pytest.raises(OrchError, match="no task 't9'"):
        lead.add("third", "", ["t9"])
    with pytest.raises(OrchError, match="only teammates claim"):
        lead.claim()
    got = one.claim()
    assert got is not None and got.id == "t1" and got.owner == "teammate-1"
    assert two.claim() is None  # t2 waits for t1: nothing is ready
    with pytest.raises(OrchError, match="already hold t1"):
        one.claim()
    with pytest.raises(OrchError, match="not yours to hand in"):
        two.done("t1", "mine now")
    with pytest.raises(OrchError, match="only the lead updates"):
        one.update("t2", title="renamed")
    with pytest.raises(OrchError, match="t1 is claimed"):
        lead.update("t1", cancel=True)
    assert one.done("t1", "did it").state == "checking"
    b.finish(b.task("t1"), "c0ffee")
    assert b.task("t2").state == "ready"  # its dependency is merged
    assert [k for k, _ in events].count("board_task") >= 5


def test_claims_are_atomic_under_many_claimants() -> None:
    b, _, _ = board(members=8)
    lead = b.sit("r-lead", "lead", "lead")
    for k in range(5):
        lead.add(f"task {k}", "", [])
    seats = [b.sit(f"r-{k}", f"teammate-{k}", "teammate") for k in range(1, 9)]

    async def claim(seat: Any) -> str | None:
        await asyncio.sleep(0)
        task = seat.claim()
        return task.id if task else None

    async def everyone() -> list[str | None]:
        return list(await asyncio.gather(*(claim(s) for s in seats)))

    got = asyncio.run(everyone())
    claimed = [g for g in got if g is not None]
    assert sorted(claimed) == ["t1", "t2", "t3", "t4", "t5"] and got.count(None) == 3


def test_a_task_that_keeps_coming_back_fails_and_so_do_its_dependents() -> None:
    b, _, _ = board()
    lead, one = b.sit("r-lead", "lead", "lead"), b.sit("r-1", "teammate-1", "teammate")
    lead.add("flaky", "", [])
    lead.add("after", "", ["t1"])
    for attempt in range(2):
        assert one.claim() is not None
        b.give_back(b.task("t1"), f"gate failed {attempt}", limit=2)
    assert b.task("t1").state == "failed" and b.task("t1").notes[-1] == "gate failed 1"
    assert one.claim() is None


def test_messages_reach_live_runs_now_and_others_later() -> None:
    b, events, inbox = board()
    lead = b.sit("r-lead", "lead", "lead")
    b.sit("r-1", "teammate-1", "teammate")
    lead.message("teammate-1", "start with the parser")
    lead.message("teammate-2", "you are next")  # no run yet: kept for its next one
    lead.message("all", "stand-up")
    assert inbox["r-1"][0].startswith('<message from="lead" to="teammate-1">')
    assert any("stand-up" in m for m in inbox["r-1"])
    assert [m for m in b.take_pending("teammate-2") if "you are next" in m]
    with pytest.raises(OrchError, match="no one called 'bob'"):
        lead.message("bob", "hi")
    assert [k for k, _ in events].count("board_message") == 3


def test_a_wait_ends_on_a_change_not_on_a_timer() -> None:
    b, _, _ = board()
    lead, one = b.sit("r-lead", "lead", "lead"), b.sit("r-1", "teammate-1", "teammate")

    async def scene() -> tuple[str, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        waiter = asyncio.create_task(lead.wait(30))
        await asyncio.sleep(0.05)
        one.message("lead", "done soon")
        said = await waiter
        return said, loop.time() - start

    said, took = asyncio.run(scene())
    assert said.startswith("The board changed") and took < 5
    assert asyncio.run(lead.wait(0.05)).startswith("Nothing changed in 0.05s")
