"""`orch team run`: a writer and a reviewer taking turns on one branch (teams/pair.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from .common import WorkdirOpt, err, handles_errors, open_project, out, print_json
from .safe import safe_markup as escape  # also writes out control characters
from .safe import safe_text
from .worktrees import AllowControlOpt

if TYPE_CHECKING:  # the engine is imported when a team runs, keeping other commands fast
    from ..teams.pair import TeamResult

team_app = typer.Typer(
    help="Teams: a writer and a reviewer taking turns on one branch until it is approved.",
    no_args_is_help=True,
    add_completion=False,
)


@team_app.callback()
def team_callback() -> None:
    """Teams: a writer and a reviewer taking turns on one branch until it is approved."""


def show(result: TeamResult) -> None:
    out.print(f"[bold]team[/] {result.root_run_id} · chain {result.chain_id}")
    if result.branch:
        out.print(f"branch  {escape(result.branch)} at {(result.commit or '')[:12]}")
    out.print(f"rounds  {result.rounds} of {result.max_rounds}")
    for i, v in enumerate(result.verdicts, 1):
        style = "green" if v.approved else "yellow"
        out.print(f"review {i}: [{style}]{escape(v.verdict)}[/] {escape(v.summary)}")
        for c in v.comments:
            out.print(f"  - {escape(c.path)}:{c.line}: {escape(c.comment)}")
    if result.merged:
        out.print(f"[green]merged[/] into your HEAD at {(result.merge_commit or '')[:12]}")
    if result.approved and result.error is None:
        out.print("[green]approved[/]")
    out.print(f"[dim]the runs: orch tree {result.root_run_id}[/]")


@team_app.command("run")
@handles_errors
def run(
    prompt: Annotated[str, typer.Argument(help="What the writer should do.")],
    writer: Annotated[str, typer.Option("--writer", help="Writer agent.")] = "writer",
    reviewer: Annotated[
        str, typer.Option("--reviewer", help="Reviewer agent (read-only tools only).")
    ] = "reviewer",
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Rounds at most.")] = 3,
    isolation: Annotated[
        Literal["worktree", "container"],
        typer.Option(help="Where the writer works: a git worktree, or a Docker container."),
    ] = "worktree",
    merge: Annotated[
        bool, typer.Option("--merge", help="Merge the branch into your HEAD when approved.")
    ] = False,
    allow_control_files: AllowControlOpt = False,  # with --merge
    model: Annotated[
        str | None, typer.Option(help="Alias (sonnet/opus/haiku), id, or scripted:FILE.")
    ] = None,
    agents_dir: Annotated[
        list[Path] | None, typer.Option("--agents-dir", help="Extra agent directory (first wins).")
    ] = None,
    workdir: WorkdirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Writer and reviewer on one branch until approved; exit 0 on approve, 1 otherwise."""
    from ..models import ModelProvider
    from ..process.command import make_runner
    from ..teams.pair import run_team

    project = open_project(workdir, model=model)
    provider = ModelProvider(project.settings, model)
    provider.check_ready()
    runner = make_runner(project, provider, agents_dir or [])

    async def go() -> TeamResult:
        async with provider:
            return await run_team(
                runner,
                prompt=prompt,
                workdir=project.workdir,
                writer=writer,
                reviewer=reviewer,
                rounds=rounds,
                isolation=isolation,
                merge=merge,
                allow_control_files=allow_control_files,
            )

    result = asyncio.run(go())
    code = result.exit_code
    if as_json:
        print_json(result.model_dump(mode="json"))
    else:
        show(result)
    if result.error:
        err.print(safe_text(f"orch: team {result.root_run_id}: {result.error}"))
    script = provider.scripted
    if script is not None and code == 0 and (problems := script.problems()):
        err.print(
            safe_text(f"orch: {script.source}: script not fully used: " + "; ".join(problems))
        )
        code = 1
    raise typer.Exit(code)
