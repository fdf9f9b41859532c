"""``orch doctor``: check what orch needs here, each problem with its fix (checks in
``orchestrator/doctor/``; this module only renders them)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from ..errors import UsageError
from .common import WorkdirOpt, handles_errors, out, print_json
from .safe import safe_text

if TYPE_CHECKING:  # the checks are imported when doctor runs, not by every command
    from ..doctor import Report

STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
NAME_WIDTH = 12


def render(report: Report) -> None:
    """One line per check, then its fix indented below it; a summary line last."""
    from ..doctor import Status

    for c in report.checks:
        line = Text.assemble(
            (f"{c.status.value:<5}", STYLE[c.status.value]), " ", f"{c.name:<{NAME_WIDTH}}", " "
        )
        line.append_text(safe_text(c.detail))  # paths and server messages: shown, never obeyed
        out.print(line, soft_wrap=True)
        if c.fix and c.status in (Status.WARN, Status.FAIL):
            fix = Text(" " * 6 + f"{'fix:':<{NAME_WIDTH}} ", style="dim")
            fix.append_text(safe_text(c.fix))
            out.print(fix, soft_wrap=True)
    failed = [c.name for c in report.checks if c.status is Status.FAIL]
    warned = [c.name for c in report.checks if c.status is Status.WARN]
    if not report.ok:
        out.print(
            Text(f"the default tiers (shared, worktree) cannot run: {', '.join(failed)}", "red")
        )
    elif failed or warned:
        problems = ", ".join(failed + warned)
        out.print(f"the default tiers can run; to look at: {problems}", soft_wrap=True)
    else:
        out.print("all good")


@handles_errors
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Print the checks as JSON.")] = False,
    offline: Annotated[
        bool, typer.Option("--offline", help="Do not probe the model endpoint over the network.")
    ] = False,
    workdir: WorkdirOpt = None,
) -> None:
    """Check Python, git, bubblewrap, Docker, the API settings, the store, trust and the
    warm process; each problem comes with its fix. Exits 1 when the default isolation
    modes (shared, worktree) cannot run."""
    from ..doctor import diagnose

    wd = (workdir or Path.cwd()).expanduser()
    if not wd.is_dir():
        raise UsageError(f"--workdir {wd} is not a directory; pass an existing directory")
    report = diagnose(wd.resolve(), offline=offline)
    if as_json:
        print_json(report.model_dump(mode="json"))
    else:
        render(report)
    if not report.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor)
