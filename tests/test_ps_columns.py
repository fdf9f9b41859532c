"""`orch ps` and `orch watch` say what each agent is doing, one line a run at any width:
a description (the task's, else the prompt's first line) and when it was last active;
cells are cut with … and never wrapped. The layout rule itself (``cli/fit.py``) is
checked over many widths."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console

from orchestrator.cli.fit import GAP, Column, FitTable, cell, layout
from orchestrator.cli.live import ChainView
from orchestrator.run import Activity, RunRecord, RunStatus, Usage, new_run_id, now
from orchestrator.store import SqliteStore
from tests.support import orch

LONG_COMMAND = (
    "bash: pytest -q tests/test_parser.py -k 'corner and case and not slow' --maxfail=1 "
    "--durations=10 -p no:cacheprovider && ruff check . && mypy --strict orchestrator"
)
PROMPT = "Refactor the parser so that it handles every corner case we know of\nthen add tests"
DESCRIPTION = "add property tests for the tokenizer's handling of nested quotes and escapes"
PLAIN = {"FORCE_COLOR": "", "TTY_COMPATIBLE": "", "TTY_INTERACTIVE": "", "NO_COLOR": "1"}


@pytest.fixture
def chain(project: Path) -> dict[str, str]:
    """An ended chain: a root without a description, a child and a grandchild with long
    descriptions and long activities, last active 42 seconds ago."""
    store = SqliteStore.for_project(project)
    t = now()
    root, chain_id = new_run_id(), "c-" + new_run_id()[2:]
    ids = {"root": root, "chain": chain_id}
    parent: str | None = None
    for depth, (key, agent, desc) in enumerate(
        [
            ("root", "general", ""),
            ("child", "writer", DESCRIPTION),
            ("grand", "explorer", "x" * 300),
        ]
    ):
        run_id = root if depth == 0 else new_run_id()
        ids[key] = run_id
        act = Activity(tool="bash", summary=LONG_COMMAND, at=t - 42)
        store.create_run(
            RunRecord(
                run_id=run_id, chain_id=chain_id, parent_run_id=parent, depth=depth,
                agent=agent, description=desc, prompt=PROMPT, status=RunStatus.SUCCEEDED,
                isolation="worktree", usage=Usage(turns=3, tool_uses=7, input_tokens=12_345,
                output_tokens=678), last_activity=act, recent_activities=[act],
                created_at=t - 100, started_at=t - 100, updated_at=t - 42, ended_at=t - 42,
            )
        )  # fmt: skip
        parent = run_id
    store.close()
    return ids


@pytest.mark.parametrize("columns", [40, 80, 200])
def test_ps_and_watch_rows_take_one_line_at_any_width(
    project: Path, chain: dict[str, str], columns: int
) -> None:
    env = {**PLAIN, "COLUMNS": str(columns), "LINES": "50"}
    for args in (["ps"], ["watch", chain["root"], "--interval", "0.05"]):
        r = orch(*args, cwd=project, env=env)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.rstrip("\n").splitlines()
        assert all(cell_len(line) <= columns for line in lines), (args, lines)
        rows = [line for line in lines if "r-" in line and "orch watch" not in line]
        assert len(rows) == 3, (args, lines)  # each run on one line, none wrapped
        assert len(lines) == 5 + (args[0] == "watch"), (args, lines)  # header, rule (title)
        assert rows[0].startswith(chain["root"][:3])
        if columns >= 80:
            header = lines[-5]
            assert "description" in header and "last activity" in header and "active" in header
            assert all(re.search(r"  4\ds ago", row) for row in rows), rows
            assert "Refactor the" in rows[0]  # no description: the prompt's first line
            assert "add property" in rows[1] and "bash: pytest" in rows[1]
            assert "…" in rows[1]  # cut, never wrapped
        if columns == 200:
            assert "Refactor the parser so that it handles" in rows[0]
            assert DESCRIPTION[:40] in rows[1] and "bash: pytest -q tests/test_parser.py" in rows[1]
            # room for every column; a model without a price: its cost is unknown
            assert re.search(r"worktree .* 13,023 +n/a +7 +\d+m$", rows[0])


def test_ps_json_carries_the_description_and_the_last_activity(
    project: Path, chain: dict[str, str]
) -> None:
    rows = {r["run_id"]: r for r in json.loads(orch("ps", "--json", cwd=project).stdout)}
    root, child, grand = rows[chain["root"]], rows[chain["child"]], rows[chain["grand"]]
    assert root["description"] == PROMPT.splitlines()[0]  # the prompt's first line
    assert child["description"] == DESCRIPTION and grand["description"] == "x" * 300
    for r in (root, child, grand):
        assert abs(r["last_activity_at"] - (r["ended_at"])) < 1e-6
        assert r["last_activity"]["summary"] == LONG_COMMAND  # whole, in JSON


def test_the_live_tree_fits_any_width(project: Path, chain: dict[str, str]) -> None:
    store = SqliteStore.for_project(project)
    records = store.list_runs(chain_id=chain["chain"])
    for columns in (40, 80, 200):
        console = Console(width=columns, color_system=None, highlight=False)
        with console.capture() as cap:
            console.print(ChainView(records, chain["root"]))
        lines = cap.get().rstrip("\n").splitlines()
        assert all(cell_len(line) <= columns for line in lines), lines
        assert len(lines) == 6, lines  # title, header, rule, three runs
        assert lines[4].startswith("└─ writer") or lines[4].startswith("└─ wr")
        assert lines[5].startswith("   └─ ")
    store.close()


# -- the layout rule ----------------------------------------------------------------------
COLUMNS = [
    Column("run"),
    Column("status"),
    Column("isolation", drop=2),
    Column("description", flex=True, least=12),
    Column("activity", flex=True, least=12),
    Column("tokens", drop=3),
    Column("age", drop=4),
]


@given(
    st.integers(min_value=1, max_value=300),
    st.lists(st.integers(min_value=1, max_value=120), min_size=7, max_size=7),
)
def test_layout_never_overflows_and_shrinks_the_flex_columns_first(
    width: int, natural: list[int]
) -> None:
    widths = layout(COLUMNS, natural, width)
    kept = [w for w in widths if w is not None]
    assert kept and all(w >= 1 for w in kept)
    if width >= len(kept) * (1 + GAP):
        assert sum(kept) + GAP * (len(kept) - 1) <= width
    for w, n in zip(widths, natural, strict=True):
        assert w is None or w <= n  # never wider than its content
    # columns leave only when, with them, the others would not fit at the flex columns' least
    gone = {c.drop for c, w in zip(COLUMNS, widths, strict=True) if w is None}
    if gone:
        with_them = [
            i for i, c in enumerate(COLUMNS) if widths[i] is not None or c.drop == min(gone)
        ]
        need = sum(
            min(natural[i], COLUMNS[i].least) if COLUMNS[i].flex else natural[i] for i in with_them
        )
        assert need + GAP * (len(with_them) - 1) > width
    # fixed columns are only cut once every column that may leave has left
    cut = [i for i, w in enumerate(widths) if w is not None and w < natural[i]]
    if any(not COLUMNS[i].flex for i in cut):
        assert all(widths[i] is None for i, c in enumerate(COLUMNS) if c.drop)


def test_cells_are_cut_with_an_ellipsis_and_never_obeyed() -> None:
    table = FitTable([Column("a"), Column("b", flex=True)])
    table.add_row(cell("\x1b[2J[/]"), cell("y" * 100))
    console = Console(width=30, color_system=None)
    with console.capture() as cap:
        console.print(table)
    lines = cap.get().splitlines()
    assert lines[2].startswith("\\x1b[2J[/]") and lines[2].rstrip().endswith("…")
    assert len(lines) == 3 and all(cell_len(line) <= 30 for line in lines)


def test_an_unsandboxed_run_is_marked_at_any_width(project: Path) -> None:
    store = SqliteStore.for_project(project)
    t = now()
    marked: dict[str, int] = {}  # run id -> how often its row should say shared*
    for off in (True, False):
        run_id = new_run_id()
        marked[run_id] = 1 if off else 0
        store.create_run(
            RunRecord(
                run_id=run_id, chain_id="c-" + run_id[2:], prompt=PROMPT, description=DESCRIPTION,
                status=RunStatus.SUCCEEDED, workspace={"os_sandbox": "off" if off else "bwrap"},
                created_at=t, started_at=t, updated_at=t, ended_at=t,
            )
        )  # fmt: skip
    store.close()
    for columns in (40, 80, 200):
        r = orch("ps", cwd=project, env={**PLAIN, "COLUMNS": str(columns)})
        lines = r.stdout.rstrip("\n").splitlines()
        assert len(lines) == 5 and all(cell_len(line) <= columns for line in lines), lines
        if columns >= 80:  # the tier stays, marked (rows of one time: in id order)
            rows = {line.split()[0]: line.count("shared*") for line in lines[2:4]}
            assert rows == marked, lines
        assert lines[-1] == "* unsandboxed"


def test_the_live_tree_holds_to_the_screen_running_runs_first() -> None:
    t = now()
    root = RunRecord(run_id=new_run_id(), chain_id="c-1", status=RunStatus.RUNNING, started_at=t)
    kids = [
        RunRecord(
            run_id=new_run_id(), chain_id="c-1", parent_run_id=root.run_id, depth=1,
            description=f"child {n}", started_at=t, ended_at=None if n % 10 == 0 else t + n,
            status=RunStatus.RUNNING if n % 10 == 0 else RunStatus.SUCCEEDED,
        )
        for n in range(40)
    ]  # fmt: skip
    console = Console(width=80, height=12, color_system=None)
    with console.capture() as cap:
        console.print(ChainView([root, *kids], root.run_id))
    lines = cap.get().rstrip("\n").splitlines()
    assert len(lines) <= 11, lines  # the screen's height, less the prompt's line
    assert sum("running" in line for line in lines[3:]) == 5  # the root and the 4 running
    assert "child 39" in "".join(lines) and "child 1 " not in "".join(lines)  # latest ended
    assert lines[-1] == "… and 35 more: 35 succeeded"
