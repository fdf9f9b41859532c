"""What a foreground ``orch task`` shows while it runs, and the branch lines it ends with.

On an interactive terminal, :class:`LiveChain` draws the run's chain as a compact tree,
one line an agent (name, description, status, last activity, tokens, cost, time), redrawn
every ``POLL_S`` seconds from the store by a thread of its own: the engine's event loop
never waits for the view, and the view reads what every run writes anyway (the same
records as ``orch ps``), whichever process writes them. Every cell is one line cut with
``…`` (``fit.py``), and everything a model chose is shown, never obeyed (``safe.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.text import Text

from ..process.listing import ps_row, run_cost, total_cost, totals, tree_order
from ..run import RunRecord, RunStatus
from ..store import RunStore
from .common import STATUS_STYLE
from .fit import Column, FitTable, cell
from .safe import safe_text, shown

if TYPE_CHECKING:
    from ..engine.runner import Runner
    from ..spec import RunSpec

LiveView = Callable[[RunRecord], AbstractContextManager[Any]]
POLL_S = 0.2  # five frames a second: lively, and a store read of a few rows each
SLACK = 20  # ... or less often: at most one part in SLACK of the time goes to the view
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"

COLUMNS = [
    Column("agent"),
    Column("description", flex=True, least=10),
    Column("status"),
    Column("last activity", flex=True, least=10),
    Column("tokens in/out", justify="right", drop=2),
    Column("time", justify="right", drop=1),
]
COST = Column("cost", justify="right", drop=3)  # when a run has a price: it leaves first


def tokens(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 10_000 else str(n)


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes}m{s:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def tree_lines(rows: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Rows in tree order, each with the tree lines drawn before its agent's name."""
    ordered = tree_order(rows)
    ids = {r["run_id"] for r in ordered}
    parent = {
        r["run_id"]: r.get("parent_run_id") if r.get("parent_run_id") in ids else None
        for r in ordered
    }
    last: dict[str | None, str] = {}  # parent -> its last child in the view
    for r in ordered:
        last[parent[r["run_id"]]] = r["run_id"]
    out: list[tuple[str, dict[str, Any]]] = []
    for r in ordered:
        run_id, lead = r["run_id"], ""
        up = parent[run_id]
        if up is not None:
            lead = "└─ " if last[up] == run_id else "├─ "
            p = up
            while parent[p] is not None:  # the ancestors' own lines, right to left
                lead = ("   " if last[parent[p]] == p else "│  ") + lead
                p = parent[p]
        out.append((lead, r))
    return out


def visible(
    rows: list[tuple[str, dict[str, Any]]], room: int
) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    """At most ``room`` rows, in tree order: the root, the runs still going, then those
    that ended last; and the rows left out."""
    if len(rows) <= room:
        return rows, []
    ended = sorted(
        (n for n, (_, r) in enumerate(rows) if n and RunStatus(r["status"]).ended),
        key=lambda n: rows[n][1].get("ended_at") or 0.0,
    )
    going = [n for n, (_, r) in enumerate(rows) if n and not RunStatus(r["status"]).ended]
    keep = {0, *going[: room - 1]}
    keep.update(ended[::-1][: max(0, room - len(keep))])
    return [rows[n] for n in sorted(keep)], [r for n, (_, r) in enumerate(rows) if n not in keep]


class ChainView:
    """One frame: a title line, then the chain's runs as a tree of one-line rows."""

    def __init__(self, records: list[RunRecord], root_id: str, frame: int = 0) -> None:
        self.records, self.root_id, self.frame = records, root_id, frame

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        t = time.time()
        rows = [ps_row(r.model_dump(mode="json")) for r in self.records]
        live = sum(1 for r in self.records if not r.status.ended)
        used = totals(rows)
        priced = used["total_cost_usd"] > 0  # else no cost to show (a model without a price)
        cost = f" · {total_cost(used)}" if priced else ""
        title = Text.assemble(
            ("orch ▸ ", "bold"),
            safe_text(self.root_id),
            (f" · {len(rows)} agent{'s' if len(rows) != 1 else ''}, {live} running{cost}", "dim"),
        )
        table = FitTable([*COLUMNS[:-1], *([COST] if priced else []), COLUMNS[-1]], title=title)
        spin = SPINNER[self.frame % len(SPINNER)]
        shown_rows, left = visible(tree_lines(rows), max(3, console.height - 6))
        for lead, r in shown_rows:
            status = RunStatus(r["status"])
            act = r.get("last_activity") or {}
            start, end = r.get("started_at"), (r.get("ended_at") if status.ended else t)
            table.add_row(
                Text.assemble((lead, "dim"), (shown(r.get("agent", "")), "bold")),
                cell(r.get("description", "")),
                cell(f"{spin} " if status == RunStatus.RUNNING else "")
                + cell(status.value, STATUS_STYLE.get(status, "")),
                cell(r["error"], "red")
                if status.ended and r.get("error")
                else cell(act.get("summary", "") if isinstance(act, dict) else "", "dim"),
                # in: every input token, the cache's reads and writes too
                cell(f"{tokens(r['tokens'] - r['output_tokens'])}/{tokens(r['output_tokens'])}"),
                *([cell(run_cost(r))] if priced else []),
                cell(duration(max(0.0, end - start)) if start and end else "-"),
            )
        if left:
            ended = Counter(RunStatus(r["status"]).value for r in left)
            what = ", ".join(f"{n} {status}" for status, n in sorted(ended.items()))
            table.notes.append(Text(f"… and {len(left)} more: {what}", style="dim"))
        yield table
        yield Text("")  # before the answer


class LiveChain:
    """While its ``with`` body runs, a thread redraws the chain of ``root`` from the store."""

    def __init__(self, store: RunStore, root: RunRecord, console: Console) -> None:
        self.store, self.root, self.console = store, root, console
        self.frame = 0
        self.frames = 0  # drawn, for the record (tests, the overhead measure)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="orch-live", daemon=True)
        self._live = Live(console=console, auto_refresh=False, transient=False)

    def view(self) -> ChainView:
        self.frame += 1
        records = self.store.list_runs(chain_id=self.root.chain_id)
        return ChainView(records or [self.root], self.root.run_id, self.frame)

    def _loop(self) -> None:
        pause = POLL_S
        try:
            while not self._stop.wait(pause):
                began = time.perf_counter()
                with contextlib.suppress(Exception):  # a frame missed never fails the run
                    self._live.update(self.view(), refresh=True)
                    self.frames += 1
                # a big chain is drawn less often: the view takes at most ~5% of the time
                pause = max(POLL_S, SLACK * (time.perf_counter() - began))
        finally:
            self.store.close()  # this thread's connection

    def __enter__(self) -> LiveChain:
        self._live.start()
        self._live.update(ChainView([self.root], self.root.run_id), refresh=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._live.update(self.view(), refresh=True)
        finally:
            self._live.stop()


def live_view(store: RunStore, console: Console, as_json: bool) -> LiveView | None:
    """The live view of a foreground run, where it can be drawn: an interactive terminal
    (rich's test: a tty, not TERM=dumb; FORCE_COLOR and TTY_INTERACTIVE say otherwise), and
    never with ``--json``."""
    if as_json or not console.is_interactive:
        return None
    return lambda record: LiveChain(store, record, console)


def diffstat(files: int, ins: int, dels: int) -> str:
    """git's summary line (``git diff --shortstat``), word for word."""
    if not files:
        return " 0 files changed"
    line = f" {files} file{'s' if files != 1 else ''} changed"
    if ins or not dels:
        line += f", {ins} insertion{'s' if ins != 1 else ''}(+)"
    if dels or not ins:
        line += f", {dels} deletion{'s' if dels != 1 else ''}(-)"
    return line


def branch_lines(runs: list[RunRecord]) -> list[Text]:
    """For each branch the runs left (the root first, then its descendants): its name and
    commit, and a diffstat line."""
    lines: list[Text] = []
    for r in runs:
        for a in r.artifacts:
            if a.get("kind") != "branch":
                continue
            n = [int(a.get(k) or 0) for k in ("files_changed", "insertions", "deletions")]
            line = Text.assemble(
                ("branch ", "bold"),
                safe_text(a.get("branch", ""), "cyan"),
                ("  commit ", "bold"),
                safe_text(str(a.get("commit", ""))[:12]),
            )
            if r.depth > 0:
                line.append_text(safe_text(f"  ({r.agent} {r.run_id})", "dim"))
            lines.append(line)
            lines.append(Text(diffstat(*n)))
    return lines


def run_tree(runner: Runner, spec: RunSpec, view: LiveView | None = None) -> RunRecord:
    """Run a root spec to its end (shown by ``view`` meanwhile, if given); in the
    background: store it, then detach it (out of the event loop: it may wait for a host)."""
    from ..process.detach import detach
    from ..project.paths import project_root

    async def go() -> RunRecord:
        async with runner.models:
            handle = await runner.spawn(spec)
            if spec.background:
                return handle.record
            with view(handle.record) if view else contextlib.nullcontext():
                return await runner.run_handle(handle)

    record = asyncio.run(go())
    if spec.background:
        record = detach(project_root(spec.workdir), record, runner.store, runner.settings.store)
    return record
