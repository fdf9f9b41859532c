"""Watching and steering runs from any terminal: ps, watch, cancel, and the detached worker."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.live import Live
from rich.text import Text

from ..engine.owner import this_node
from ..models.pricing import money
from ..process.listing import (
    cache_text,
    ps_row,
    ps_rows,
    run_cost,
    total_cost,
    tree_order,
    with_chain_use,
)
from ..process.opened import find_run
from ..process.reconcile import reconcile
from ..process.stopping import cancel_tree, raise_if_stuck
from ..run import EXIT_CODES, RunRecord, RunStatus, now
from .common import (
    STATUS_STYLE,
    WorkdirOpt,
    age,
    handles_errors,
    open_project,
    open_waiting,
    out,
    patience,
    print_json,
    tier_notes,
)
from .fit import Column, FitTable, cell
from .safe import safe_text, shown

if TYPE_CHECKING:
    from ..process.events import Feed

T = TypeVar("T")

PS_COLUMNS = [
    Column("run"),
    Column("agent"),
    Column("status"),
    Column("isolation", drop=2),
    Column("description", flex=True, least=12),
    Column("last activity", flex=True, least=12),
    Column("active", justify="right"),
    Column("tokens", justify="right", drop=4),
    Column("cost", justify="right", drop=3),
    Column("tools", justify="right", drop=6),
    Column("age", justify="right", drop=5),
]


def chain_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per chain with live runs: its use of its budgets, its cache use and cost."""
    lines = []
    for r in rows:
        chain, budgets = r.get("chain"), (r.get("chain") or {}).get("budgets")
        if not chain or not budgets or not chain["live"]:
            continue
        cap, usd = budgets.get("tokens"), budgets.get("usd")
        cache = cache_text(chain)
        lines.append(
            f"chain {r.get('chain_id')}: runs {chain['runs']}/{budgets['runs']} · live "
            f"{chain['live']} (working at once ≤ {budgets['running']}) · tokens "
            f"{chain['tokens']:,}"
            + (f"/{cap:,}" if cap else "")
            + (f" · {cache}" if cache else "")
            + f" · cost {total_cost(chain)}"
            + (f"/{money(usd)}" if usd else "")
        )
    return lines


def ps_table(rows: list[dict[str, Any]], title: str = "") -> FitTable:
    """Runs as a table of one-line cells at any width (``fit.py``): what shrinks first is
    the description and the activity, then tools, age, tokens, cost and isolation leave
    (not isolation when a run is unsandboxed or on the network)."""
    here = this_node()
    remote = any(r.get("node") not in (None, here) for r in rows)
    columns = [*PS_COLUMNS, *([Column("node", drop=1)] if remote else [])]
    noted: dict[str, list[str]] = {}  # unsandboxed, or on the network: always said
    for r in rows:
        if note := tier_notes(r).strip(" ()"):
            noted.setdefault(note, []).append(shown(r["run_id"]))
    if noted:
        columns[3] = Column("isolation")
    table = FitTable(columns, title=Text(title) if title else None)
    for r in rows:  # every cell a Text: what a model or an agent file chose is never markup
        status = RunStatus(r["status"])
        act = r.get("last_activity") or {}
        active = r.get("last_activity_at")
        table.add_row(
            cell(r["run_id"]),
            cell("  " * int(r.get("depth", 0)) + shown(r.get("agent", ""))),
            cell(status.value, STATUS_STYLE.get(status, "")),
            cell(str(r.get("isolation", "")) + ("*" if tier_notes(r) else "")),
            cell(r.get("description", "")),
            cell(act.get("summary", "") if isinstance(act, dict) else ""),
            cell(age(active) + " ago" if active else "-"),
            cell(f"{r['tokens']:,}"),
            cell(run_cost(r)),
            cell(r["tool_uses"]),
            cell(age(r.get("started_at") or r.get("created_at"))),
            *([cell(r.get("node") or here)] if remote else []),
        )
    if len(noted) == 1:
        table.notes.append(cell(f"* {next(iter(noted))}"))
    else:
        table.notes += [cell(f"* {note}: {', '.join(ids)}") for note, ids in noted.items()]
    return table


def ps(
    show_all: Annotated[bool, typer.Option("--all", "-a", help="Every run.")] = False,
    workdir: WorkdirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Runs as a table: running ones and those that ended in the last hour."""
    project = open_project(workdir)
    rows = ps_rows(project.store, show_all=show_all)
    if as_json:
        print_json(rows)
        return
    if not rows:
        out.print("no runs" + ("" if show_all else " in the last hour (try --all)"))
        return
    out.print(ps_table(rows))
    for line in chain_lines(rows):
        out.print(cell(line))


def watch(
    run_id: Annotated[
        str | None, typer.Argument(help="A run id or its first characters (default: all running).")
    ] = None,
    workdir: WorkdirOpt = None,
    interval: Annotated[float, typer.Option(help="Refresh every S seconds.")] = 0.5,
) -> None:
    """A live view of a run and its children until they end; exits with the run's code.
    While the run store is away it says so once and goes on when it answers."""
    wait = patience()
    project = open_waiting(workdir, wait)
    store = project.store
    root = wait.call(lambda: find_run(store, run_id)) if run_id else None

    def snapshot() -> list[dict[str, Any]]:
        if root is not None:
            raw = [r for r in store.list_raw() if r["chain_id"] == root.chain_id]
        else:
            raw = store.list_raw(since=now() - 5)
        return with_chain_use(tree_order([ps_row(r) for r in raw]))

    def busy(rows: list[dict[str, Any]]) -> bool:
        return any(not RunStatus(r["status"]).ended for r in rows)

    with Live(ps_table(wait.call(snapshot)), console=out, refresh_per_second=4) as live:
        while True:
            rows = wait.call(snapshot)
            live.update(ps_table(rows, title=f"orch watch · {time.strftime('%H:%M:%S')}"))
            if not busy(rows):
                break
            time.sleep(interval)
            wait.call(lambda: reconcile(store))
    if root is not None:
        final = wait.call(lambda: store.require_run(root.run_id))
        raise typer.Exit(EXIT_CODES.get(final.status, 1))


def cancel(
    run_id: Annotated[str, typer.Argument(help="The run to cancel, with all its descendants.")],
    workdir: WorkdirOpt = None,
    wait: Annotated[float, typer.Option(help="Seconds to wait for the owner to stop them.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Cancel a run and every descendant; returns once they have all stopped."""
    project = open_project(workdir)
    final = cancel_tree(project.store, find_run(project.store, run_id), wait)
    if as_json:
        print_json([{"run_id": r.run_id, "status": r.status.value} for r in final])
    else:
        for r in final:
            style = STATUS_STYLE.get(r.status, "")
            out.print(Text.assemble(safe_text(f"{r.run_id} {r.agent} "), (r.status.value, style)))
    raise_if_stuck(final, wait)


def worker(
    run_id: Annotated[str, typer.Argument()],
    workdir: WorkdirOpt = None,
) -> None:
    """(internal) Run a queued run detached from any terminal."""
    from ..process.executor import attach
    from ..process.rebuild import recipe
    from .common import announce_trust, open_project

    project = open_project(workdir or Path.cwd(), quiet=True)
    made = recipe(project.workdir, project.store.require_run(run_id).launch)
    if made.trust is not None:
        announce_trust(made.trust)  # (into the run's log)
    runner = attach(made.runner(project.store))

    async def go() -> RunRecord:
        async with runner.models:
            return await runner.adopt(run_id)

    done = asyncio.run(go())
    raise typer.Exit(EXIT_CODES.get(done.status, 1) if done.status.ended else 0)


def host(
    key: Annotated[str, typer.Option("--key")],
    lock_fd: Annotated[int | None, typer.Option("--lock-fd")] = None,
    run: Annotated[str | None, typer.Option("--run")] = None,
    launcher: Annotated[int, typer.Option("--launcher")] = 0,
    workdir: WorkdirOpt = None,
) -> None:
    """(internal) The worker host of a state dir: runs many detached runs in one process."""
    from ..catalog.agent_trust import load_trusted
    from ..process.command import not_dumpable
    from ..process.workerhost import serve
    from ..project.paths import project_root
    from ..store import open_store

    not_dumpable()
    root = project_root(workdir or Path.cwd())
    store = open_store(root, load_trusted(root)[0].store)  # the launcher's (its key says which)
    first = (run, launcher) if run else None
    raise typer.Exit(serve(root, key, store, lock_fd=lock_fd, first=first))


def logs(
    run_id: Annotated[str, typer.Argument(help="Run id (or a unique prefix).")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Stream events until the run has ended.")
    ] = False,
    tree: Annotated[
        bool, typer.Option("--tree", "-t", help="Add the events of its children and theirs.")
    ] = False,
    workdir: WorkdirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """A run's events, one line each: time, run/agent, event, what it says.

    --json prints the raw events: a JSON array, or one object a line with --follow. While
    the run store is away, --follow says so once and goes on when it answers."""
    from ..process.events import Feed
    from .logview import line

    wait = patience() if follow else None
    ask = wait.call if wait is not None else _now
    project = open_waiting(workdir, wait)
    store = project.store
    feed = ask(lambda: Feed(store, find_run(store, run_id), tree=tree))
    if as_json and not follow:
        print_json(feed.poll())
        return
    width = out.width if out.is_terminal or os.environ.get("COLUMNS") else None
    ticks = 0
    try:
        while True:
            for e in ask(lambda: _poll(feed)):
                if as_json:
                    sys.stdout.write(json.dumps(e, default=str) + "\n")
                else:
                    rid = e["run_id"]
                    agent, depth = feed.agent(rid), feed.depth(rid)
                    text = line(e, agent, indent=depth, width=width, children=feed.children)
                    out.print(text, soft_wrap=True)
            sys.stdout.flush()
            if not follow or feed.done:
                break
            time.sleep(0.2)
            ticks += 1
            if ticks % 5 == 0:
                ask(lambda: reconcile(store))  # a run whose owner died ends (interrupted)
                ask(feed.check)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except BrokenPipeError:  # `orch logs … | head`: the reader has gone (as Rich does it)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(1) from None
    if follow:
        raise typer.Exit(ask(feed.exit_code))


def _now(fn: Callable[[], T]) -> T:
    return fn()


def _poll(feed: Feed) -> list[dict[str, Any]]:
    """``feed.poll()``; on a failure, the feed as it was (no event read is lost)."""
    marks = {rid: (f.after, f.finished) for rid, f in feed.runs.items()}
    try:
        return feed.poll()
    except Exception:
        for rid, (after, finished) in marks.items():
            feed.runs[rid].after, feed.runs[rid].finished = after, finished
        raise


def register(app: typer.Typer) -> None:
    app.command()(handles_errors(ps))
    app.command()(handles_errors(logs))
    app.command()(handles_errors(watch))
    app.command()(handles_errors(cancel))
    app.command("_worker", hidden=True)(handles_errors(worker))
    app.command("_host", hidden=True)(handles_errors(host))
