"""Every view shows what runs used the same way: tokens of each kind (the prompt cache's
reads and writes too), cost, and the sums of a chain and of a run with the runs under it.

Runs with known usage go into a real store; then the CLI (``orch result``, ``tree``,
``ps``, ``logs``, text and ``--json``), the MCP server's tools and the dashboard's JSON
show the same numbers, and ``total_cost_usd`` is their sum (``process/listing.py``
computes every sum).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from orchestrator.cli.main import app
from orchestrator.cli.runs import chain_lines, ps_table
from orchestrator.mcpserver.desk import Desk
from orchestrator.mcpserver.inputs import ListRunsInput, RunRef
from orchestrator.models.pricing import money
from orchestrator.process.listing import (
    ps_row,
    ps_rows,
    subtree_totals,
    totals,
    with_chain_use,
)
from orchestrator.process.opened import open_project
from orchestrator.run import RunRecord, RunStatus, Usage, now
from orchestrator.store import open_store
from tests.test_dashboard import http, serving

CHAIN = "c-0000000000c1"
IDS = ["r-00000000c0a0", "r-00000000c0a1", "r-00000000c0a2"]  # root, child, grandchild
USAGES = [
    Usage(turns=4, tool_uses=3, input_tokens=1_200, output_tokens=800,
          cache_creation_input_tokens=6_000, cache_read_input_tokens=42_000, cost_usd=0.0312,
          context_tokens=30_000, compactions=1),
    Usage(turns=2, tool_uses=1, input_tokens=300, output_tokens=200,
          cache_creation_input_tokens=2_000, cache_read_input_tokens=10_000, cost_usd=0.0075),
    Usage(turns=1, input_tokens=100, output_tokens=50, cache_read_input_tokens=500,
          cost_usd=0.0011),
]  # fmt: skip
TOTAL_USD = 0.0312 + 0.0075 + 0.0011
TOTAL_TOKENS = sum(u.tokens for u in USAGES)  # 63,150
UNPRICED = "r-00000000c0b0"  # a chain of its own: a model no price is known for


def record(run_id: str, depth: int, usage: Usage, **more: Any) -> RunRecord:
    t = now()
    return RunRecord(
        run_id=run_id, chain_id=more.pop("chain_id", CHAIN), depth=depth,
        agent=["general", "writer", "explorer"][depth], description=f"step {depth}",
        prompt="p", status=RunStatus.SUCCEEDED, isolation="shared", usage=usage,
        created_at=t - 100, started_at=t - 100, updated_at=t - 10, ended_at=t - 10, **more,
    )  # fmt: skip


@pytest.fixture
def stored(project: Path) -> Path:
    store = open_store(project)
    parent = None
    for depth, (run_id, usage) in enumerate(zip(IDS, USAGES, strict=True)):
        store.create_run(record(run_id, depth, usage, parent_run_id=parent))
        parent = run_id
    alone = Usage(turns=1, input_tokens=500, output_tokens=100)  # cost_usd 0: no price
    store.create_run(record(UNPRICED, 0, alone, chain_id="c-0000000000c2"))
    compacted = {"turn": 12, "how": "compacted", "reason": "threshold",
                 "before_tokens": 162_000, "after_tokens": 21_000, "cleared_results": 9,
                 "window": 200_000}  # fmt: skip
    store.add_event(IDS[0], "context_compacted", compacted)
    store.add_event(
        IDS[0], "run_finished", {"status": "succeeded", "usage": USAGES[0].model_dump()}
    )
    store.flush()
    store.close()
    return project


def cli(project: Path, *args: str) -> str:
    r = CliRunner().invoke(app, [*args, "-C", str(project)])
    assert r.exit_code == 0, (args, r.stdout, r.stderr)
    return r.stdout


def flat(text: str) -> str:
    """Text with its wrapped lines joined (80 columns here)."""
    return re.sub(r" ?\n(?!r-)", " ", text)


# -- the format, and the one sum ----------------------------------------------------------
@pytest.mark.parametrize(
    ("usd", "unpriced", "said"),
    [
        (0.0123, False, "$0.0123"),
        (0.012345, False, "$0.0123"),
        (0.00001, False, "<$0.0001"),
        (1.234, False, "$1.23"),
        (1234.5, False, "$1,234.50"),
        (0.0, False, "$0"),  # no tokens, nothing spent
        (0.0, True, "n/a"),  # tokens of a model without a price: unknown, not $0.0000
        (0.5, True, "≥$0.50"),  # a sum with some runs unpriced
    ],
)
def test_money_is_written_one_way(usd: float, unpriced: bool, said: str) -> None:
    assert money(usd, unpriced=unpriced) == said


def test_totals_add_every_kind_of_token_and_the_cost() -> None:
    t = totals(u.model_dump() for u in USAGES)
    assert t["runs"] == 3 and t["tokens"] == TOTAL_TOKENS and t["unpriced"] == 0
    assert t["cache_read_input_tokens"] == 52_500 and t["cache_creation_input_tokens"] == 8_000
    assert t["input_tokens"] == 1_600 and t["output_tokens"] == 1_050
    assert t["total_cost_usd"] == pytest.approx(TOTAL_USD) and t["total_cost_usd"] == 0.0398
    rows = [
        {"run_id": IDS[0], "parent_run_id": None, **USAGES[0].model_dump()},
        {"run_id": IDS[1], "parent_run_id": IDS[0], **USAGES[1].model_dump()},
        {"run_id": IDS[2], "parent_run_id": IDS[1], **USAGES[2].model_dump()},
    ]
    below = subtree_totals(rows)
    assert [below[i]["total_cost_usd"] for i in IDS] == [0.0398, 0.0086, 0.0011]
    assert totals([{"usage": {"input_tokens": "9", "cost_usd": float("nan")}}])["tokens"] == 0


# -- the same numbers in every view --------------------------------------------------------
def test_cli_mcp_and_dashboard_json_agree_and_total_cost_is_the_sum(stored: Path) -> None:
    result = json.loads(cli(stored, "result", IDS[0], "--json"))
    assert result["total_cost_usd"] == pytest.approx(TOTAL_USD)
    assert result["totals"]["tokens"] == TOTAL_TOKENS and result["totals"]["runs"] == 3
    assert result["usage"] == USAGES[0].model_dump()  # the run's own, whole
    child = json.loads(cli(stored, "result", IDS[1], "--json"))
    assert child["total_cost_usd"] == pytest.approx(0.0075 + 0.0011)

    tree = {r["run_id"]: r for r in json.loads(cli(stored, "tree", IDS[0], "--json"))}
    assert tree[IDS[0]]["total_cost_usd"] == result["total_cost_usd"]
    assert tree[IDS[2]]["total_cost_usd"] == pytest.approx(0.0011)

    ps = {r["run_id"]: r for r in json.loads(cli(stored, "ps", "--json"))}
    root = ps[IDS[0]]
    for key in ("cache_read_input_tokens", "cache_creation_input_tokens", "cost_usd"):
        assert root[key] == USAGES[0].model_dump()[key]
    assert root["tokens"] == USAGES[0].tokens and root["context_tokens"] == 30_000
    assert root["total_cost_usd"] == result["total_cost_usd"]
    assert root["chain"]["total_cost_usd"] == result["total_cost_usd"]
    assert {k: root["chain"][k] for k in result["totals"]} == result["totals"]

    project = open_project(stored)
    desk = Desk(project)
    said = asyncio.run(desk.run_result(RunRef(task_id=IDS[0]))).text
    assert "cache 42,000 read / 6,000 written (85% of input read)" in said
    assert f"total_cost_usd: {result['total_cost_usd']} (with the runs under it: 3 runs" in said
    assert "3 runs · 63,150 tokens · cache 52,500 read / 8,000 written" in said
    alone = asyncio.run(desk.run_result(RunRef(task_id=UNPRICED))).text
    assert "total_cost_usd: 0.0 (this run: n/a)" in alone
    listed = asyncio.run(desk.list_runs(ListRunsInput())).text
    assert re.search(rf"^{IDS[0]} general .* 50,000 tokens · \$0\.0312 · step 0$", listed, re.M)
    assert re.search(rf"^{UNPRICED} .* 600 tokens · n/a · ", listed, re.M)
    project.store.close()

    with serving(stored) as served:
        auth = f"Bearer {served.token}"
        status, body = http(served, "/api/runs", Authorization=auth)
        assert status == 200
        rows = {r["run_id"]: r for r in json.loads(body)["runs"]}
        status, body = http(served, f"/api/run/{IDS[0]}", Authorization=auth)
        assert status == 200
        page = json.loads(body)
    assert rows[IDS[0]]["chain"]["total_cost_usd"] == result["total_cost_usd"]
    assert rows[IDS[0]]["chain"]["text"].endswith("· $0.0398")
    assert [rows[i]["cost_text"] for i in IDS] == ["$0.0312", "$0.0075", "$0.0011"]
    assert rows[UNPRICED]["cost_text"] == "n/a"
    used = page["usage"]
    assert used["with_below"]["total_cost_usd"] == result["total_cost_usd"]
    assert used["chain"]["tokens"] == TOTAL_TOKENS
    assert used["cache_read_input_tokens"] == 42_000 and used["cost_usd"] == 0.0312
    assert used["text"].endswith("· $0.0312") and "compacted 1×" in used["text"]
    assert [c["cost_text"] for c in page["children"]] == ["$0.0075", "$0.0011"]


def test_the_text_views_show_cache_and_cost(stored: Path) -> None:
    said = flat(cli(stored, "result", IDS[0]))
    assert (
        "usage: 1,200 in · 800 out · cache 42,000 read / 6,000 written (85% of input read)"
        " · context compacted 1× · $0.0312"
    ) in said
    assert "with the runs under it: 3 runs · 63,150 tokens · cache 52,500 read" in said

    tree = flat(cli(stored, "tree", IDS[0]))
    for cost in ("$0.0312", "$0.0075", "$0.0011"):  # each run's own
        assert cost in tree
    assert "cache 42,000/6,000 · $0.0312" in tree
    totals_line = tree[tree.index("chain totals:") :].strip()
    assert totals_line.startswith("chain totals: 3 runs · 63,150 tokens · cache 52,500 read")
    assert totals_line.endswith("· $0.0398")
    assert "n/a" in cli(stored, "result", UNPRICED)  # never $0.0000 for an unknown price

    logs = cli(stored, "logs", IDS[0])
    assert (
        "context compacted (threshold) at turn 12: 162,000 → 21,000 tokens of 200,000, "
        "9 tool results cleared"
    ) in logs
    ended = next(line for line in logs.splitlines() if "run_finished" in line)
    assert "tokens 1,200 in / 800 out · cache 42,000 read / 6,000 written" in ended


def test_ps_has_a_cost_column_that_leaves_at_narrow_widths(stored: Path) -> None:
    store = open_store(stored)
    rows = ps_rows(store)
    store.close()
    for width, shown in ((200, True), (60, False)):
        console = Console(width=width, color_system=None, highlight=False)
        with console.capture() as cap:
            console.print(ps_table(rows))
        lines = cap.get().splitlines()
        assert ("cost" in lines[0]) is shown, lines
        by_run = {line.split()[0]: line for line in lines[2:]}
        if shown:
            assert re.search(r"50,000 +\$0\.0312 +3 ", by_run[IDS[0]])
            assert re.search(r"600 +n/a +0 ", by_run[UNPRICED])


def test_a_chain_with_a_run_of_unknown_price_says_its_sum_is_a_floor(project: Path) -> None:
    store = open_store(project)
    store.create_run(record(IDS[0], 0, USAGES[0]))
    store.create_run(record(IDS[1], 1, Usage(input_tokens=10), parent_run_id=IDS[0]))
    store.flush()
    store.close()
    assert flat(cli(project, "tree", IDS[0])).strip().endswith("· ≥$0.0312")
    row = next(r for r in json.loads(cli(project, "ps", "--json")) if r["run_id"] == IDS[0])
    assert row["chain"]["unpriced"] == 1 and row["chain"]["total_cost_usd"] == 0.0312


def test_a_live_chains_line_in_ps_says_its_cache_use_and_cost_against_its_budget() -> None:
    raws = []
    for depth, (run_id, usage) in enumerate(zip(IDS, USAGES, strict=True)):
        parent = IDS[depth - 1] if depth else None
        raw = record(run_id, depth, usage, parent_run_id=parent).model_dump(mode="json")
        raw["status"] = "running"
        raw["plan"] = {"budgets": {"running": 3, "runs": 40, "tokens": None, "usd": 1.5}}
        raws.append(raw)
    (line,) = chain_lines(with_chain_use([ps_row(r) for r in raws]))
    assert line == (
        f"chain {CHAIN}: runs 3/40 · live 3 (working at once ≤ 3) · tokens 63,150 · cache "
        "52,500 read / 8,000 written (85% of input read) · cost $0.0398/$1.50"
    )
