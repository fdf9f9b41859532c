"""Shared pieces of the CLI edge: error handling, opening a project, rendering."""

from __future__ import annotations

import functools
import json
import signal
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.text import Text
from rich.tree import Tree

from ..egress.rules import NetworkMode as NetworkMode  # the --network flag's values
from ..egress.summary import of_run
from ..egress.summary import text as egress_text
from ..errors import OrchError
from ..process import opened
from ..process.away import Patience
from ..process.listing import run_cost, totals, totals_text, usage_row, usage_text
from ..process.opened import Project
from ..run import RunRecord, RunResult, RunStatus
from ..store import RunStore
from ..trust import Trust, TrustCap
from .safe import safe_text, shown

# The project a command works on; every command that reads a project takes it (doctor too):
#     def cmd(..., workdir: WorkdirOpt = None) -> None: project = open_project(workdir)
WorkdirOpt = Annotated[
    Path | None,
    typer.Option(
        "--workdir", "-C", metavar="DIR", help="Project directory (default: the current one)."
    ),
]

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]
AgentsDirOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--agents-dir",
        help="Extra directory of agent *.md files; wins over the others (repeatable).",
    ),
]

# Choices of options, listed by help and checked by Typer: TIER_NAMES
# (workspaces/registry.py, not imported here: `orch ps` stays fast) and Settings.executor.
Isolation = Literal["shared", "worktree", "container"]
Executor = Literal["local", "ray"]
ISOLATION_HELP = (
    "Where the agent works: in your directory (shared), on a branch of its own in a git "
    "worktree, or in a Docker container. Default: the agent's, else shared."
)

P = ParamSpec("P")
R = TypeVar("R")

OUT: dict[str, Any] = {"highlight": False}
ERR: dict[str, Any] = {"stderr": True, "highlight": False, "soft_wrap": True}
out = Console(**OUT)
err = Console(**ERR)


def reset_consoles() -> None:
    """Detect the terminal again (colour, width) for the standard streams this process has
    now: a command forked from the warm process got the caller's (``warm/server.py``)."""
    out.__init__(**OUT)  # type: ignore[misc]
    err.__init__(**ERR)  # type: ignore[misc]


STATUS_STYLE = {
    RunStatus.QUEUED: "dim",
    RunStatus.RUNNING: "cyan",
    RunStatus.SUCCEEDED: "green",
    RunStatus.FAILED: "red",
    RunStatus.TIMED_OUT: "yellow",
    RunStatus.CANCELLED: "magenta",
    RunStatus.INTERRUPTED: "red",
}


def fail(message: str, code: int = 2) -> typer.Exit:
    err.print(safe_text(f"orch: {message}"))  # one line, whatever the message holds
    return typer.Exit(code)


def handles_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Bad input → one line on stderr and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except OrchError as e:
            raise fail(str(e), e.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except sqlite3.Error as e:
            msg = f"the run store cannot be used ({e}); check .orch/orch.db or ORCH_HOME"
            raise fail(msg) from None
        except OSError as e:
            where = f" ({e.filename})" if e.filename else ""
            raise fail(f"{e.strerror or e}{where}; check the path and its permissions") from None

    return wrapper


def announce_trust(trust: Trust) -> None:
    """The one line on stderr naming the untrusted settings left out, if any."""
    if line := trust.notice():
        err.print(safe_text(line))


def open_project(
    workdir: Path | None = None,
    *,
    trust_cap: TrustCap | None = None,
    quiet: bool = False,
    **overrides: Any,
) -> Project:
    """The project of a command (``process/opened.py``), what its trust left out said on
    stderr unless ``quiet``; OrchError while orch's interpreter loads code from a place an
    agent of the project could write (``process/interpreter.py``)."""
    from ..process.interpreter import refusal  # the door: orch loads nothing an agent wrote

    if (why := refusal(opened.root_of(workdir))) is not None:
        raise OrchError(why)
    notice = None if quiet else announce_trust
    return opened.open_project(workdir, trust_cap=trust_cap, notice=notice, **overrides)


def patience() -> Patience:
    """How a waiting command (``watch``, ``logs --follow``, ``result --wait``) reads a store
    that may go away: "store unreachable, retrying" once on stderr, then on by itself."""
    return Patience(lambda said: err.print(safe_text(f"orch: {said}")))


def open_waiting(workdir: Path | None, wait: Patience | None) -> Project:
    """The project of a waiting command: with ``wait``, a store away at the start is
    waited for too (what trust left out said once)."""
    if wait is None:
        return open_project(workdir)
    tries = [0]

    def attempt() -> Project:
        tries[0] += 1
        return open_project(workdir, quiet=tries[0] > 1)

    return wait.call(attempt)


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM (a closed terminal, a `kill`) stops the command as Ctrl+C does: cleanups run."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def age(ts: float | None) -> str:
    if ts is None:
        return "-"
    s = max(0.0, time.time() - ts)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    if s < 86400:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def tier_notes(workspace: dict[str, Any]) -> str:
    """What a run's tier record says a reader must know: unsandboxed, or on the network."""
    notes = []
    if workspace.get("os_sandbox") == "off":
        notes.append("unsandboxed")
    if workspace.get("network") == "host":
        notes.append("network")
    elif isinstance(workspace.get("network"), dict):
        notes.append("allow-listed network")
    return f" ({', '.join(notes)})" if notes else ""


def with_egress(store: RunStore, result: RunResult) -> RunResult:
    """``result`` with what its run reached through the egress proxy (its ``egress``
    events), when it asked for anything."""
    result.egress = of_run(store.events(result.run_id))
    return result


def egress_line(result: RunResult) -> Text | None:
    """``network: ...`` for a person, when the run asked the egress proxy for anything."""
    if result.egress is None:
        return None
    return safe_text(f"network: {egress_text(result.egress)}", "dim")


def result_json(store: RunStore, record: RunRecord, result: RunResult) -> dict[str, Any]:
    """What ``--json`` prints of a run's result: the result, and ``totals``: what the run
    used with every run under it, its ``total_cost_usd`` at the top too (Claude Code's
    name; a session's cost with its subagents')."""
    used = totals(r.usage.model_dump() for r in [record, *store.descendants(record.run_id)])
    return {
        **result.model_dump(mode="json"),
        "total_cost_usd": used["total_cost_usd"],
        "totals": used,
    }


def usage_lines(store: RunStore, record: RunRecord) -> list[str]:
    """What a run used (cache reads and writes, cost), and with the runs under it if any."""
    u = usage_row(record.usage.model_dump())
    lines = [f"usage: {usage_text(u)}"]
    below = store.descendants(record.run_id)
    if below:
        used = totals(r.usage.model_dump() for r in [record, *below])
        lines.append(f"with the runs under it: {totals_text(used)}")
    return lines


def chain_totals_line(runs: list[RunRecord]) -> str:
    """``chain totals: 3 runs · 250,000 tokens · cache … · $0.0456``"""
    return "chain totals: " + totals_text(totals(r.usage.model_dump() for r in runs))


def run_label(r: RunRecord) -> Text:
    """One line about a run; agent, isolation and description are shown, never obeyed."""
    style = STATUS_STYLE.get(r.status, "")
    u = r.usage
    cache = (
        f" · cache {u.cache_read_input_tokens:,}/{u.cache_creation_input_tokens:,}"
        if u.cache_read_input_tokens or u.cache_creation_input_tokens
        else ""
    )
    used = f"turns {u.turns} · tools {u.tool_uses} · tok {u.input_tokens:,}/{u.output_tokens:,}"
    label = Text.assemble(
        safe_text(r.run_id, "bold"),
        " ",
        safe_text(r.agent),
        " ",
        safe_text(f"d{r.depth} {shown(r.isolation)}{tier_notes(r.workspace)}", "dim"),
        " ",
        (r.status.value, style),
        " ",
        (f"{used}{cache} · {run_cost(usage_row(u.model_dump()))}", "dim"),
    )
    if r.description and r.depth > 0:
        label.append(" — ")
        label.append_text(safe_text(r.description))
    return label


def chain_tree(runs: list[RunRecord]) -> Tree:
    by_parent: dict[str | None, list[RunRecord]] = {}
    ids = {r.run_id for r in runs}
    for r in runs:
        parent = r.parent_run_id if r.parent_run_id in ids else None
        by_parent.setdefault(parent, []).append(r)
    chain = runs[0].chain_id if runs else "-"
    tree = Tree(Text.assemble("chain ", safe_text(chain, "bold")))

    def add(node: Tree, parent: str | None) -> None:
        for r in by_parent.get(parent, []):
            add(node.add(run_label(r)), r.run_id)

    add(tree, None)
    return tree


def budget_line(runs: list[RunRecord]) -> str:
    """The chain's use of its budgets (set by its root, kept by every run)."""
    budgets = next((r.plan.budgets for r in runs if r.plan and r.plan.budgets), None)
    if not budgets:
        return f"chain: {len(runs)} runs"
    from ..models.pricing import money
    from ..process.listing import totals

    live = sum(1 for r in runs if not r.status.ended)
    used = totals(r.usage.model_dump() for r in runs)
    tokens, spent = used["tokens"], used["total_cost_usd"]
    cap, usd = budgets.tokens, budgets.usd
    line = (
        f"chain budgets: runs {len(runs)}/{budgets.runs} · live {live} "
        f"(working at once ≤ {budgets.running}) · tokens {tokens:,}" + (f"/{cap:,}" if cap else "")
    )
    if usd is not None or spent:
        line += f" · spent {money(spent)}" + (f"/{money(usd)}" if usd is not None else "")
    return line
