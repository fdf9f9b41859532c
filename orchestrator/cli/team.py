"""`orch team`: committed teams (``.orch/teams/NAME.toml``) and team runs (teams/driver.py)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from ..errors import UsageError
from .common import (
    AgentsDirOpt,
    JsonOpt,
    WorkdirOpt,
    err,
    handles_errors,
    open_project,
    out,
    print_json,
)
from .live import live_view, run_tree
from .safe import safe_text
from .worktrees import AllowControlOpt

if TYPE_CHECKING:  # the engine is imported when a team runs, keeping other commands fast
    from ..catalog.definitions import Catalog
    from ..process.opened import Project
    from ..teams.progress import TeamResult
    from ..tools.base import ToolRegistry

team_app = typer.Typer(
    help="Teams: writers, a test gate and reviewers taking rounds until the reviewers approve.",
    no_args_is_help=True,
    add_completion=False,
)


@team_app.callback()
def team_callback() -> None:
    """Teams: writers, a test gate and reviewers taking rounds until the reviewers approve.

    A team is committed as .orch/teams/NAME.toml; `orch team run --team NAME PROMPT` runs it."""


def show(result: TeamResult) -> None:
    from ..teams.summary import summary

    out.print(f"[bold]team[/] {result.root_run_id} · chain {result.chain_id}")
    for line in summary(result).splitlines():
        out.print(safe_text(line))
    out.print(f"[dim]the runs: orch tree {result.root_run_id}[/]")


def toml_value(value: object) -> str:
    """A value as TOML writes it (strings, numbers, lists, inline tables)."""
    if isinstance(value, dict):
        items = [f"{k} = {toml_value(v)}" for k, v in value.items() if v is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)


def _catalog(project: Project, agents_dir: list[Path]) -> tuple[Catalog, ToolRegistry]:
    """The agents and tools a team is checked against (those its run would have)."""
    from ..catalog.agent_trust import guard
    from ..catalog.definitions import load_catalog
    from ..process.rebuild import agents_dirs
    from ..tools import builtin_tools
    from ..tools.base import ToolRegistry
    from ..tools.delegate import delegation_tools

    dirs = agents_dirs(project.root, project.settings, agents_dir)
    found = load_catalog(
        project.root, agents_dirs=dirs, trust=project.trust, hidden=project.settings.sandbox.hidden
    )
    catalog = guard(project.trust, found)
    return catalog, ToolRegistry([*builtin_tools(), *delegation_tools()])


@team_app.command("list")
@handles_errors
def list_teams(workdir: WorkdirOpt = None, as_json: JsonOpt = False) -> None:
    """The committed teams of this repository (.orch/teams/*.toml)."""
    from ..catalog.teamfiles import TEAMS_DIR, team_names
    from ..teams.plan import load_team

    project = open_project(workdir)
    rows: list[dict[str, str | None]] = []
    for name in team_names(project.root):
        try:
            rows.append({"name": name, "description": load_team(project.root, name).description})
        except UsageError as e:
            rows.append({"name": name, "description": None, "error": str(e)})
    if as_json:
        print_json(rows)
        return
    if not rows:
        err.print(f"no teams: commit one as {TEAMS_DIR}/NAME.toml (see docs/AGENTS.md)")
    for row in rows:
        text = row.get("error") or row["description"] or ""
        out.print(safe_text(f"{row['name']}  {text}"))


@team_app.command("show")
@handles_errors
def show_team(
    name: Annotated[str, typer.Argument(help="A team's name (its file's, without .toml).")],
    workdir: WorkdirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A team's settings, the defaults filled in."""
    from ..teams.plan import load_team

    project = open_project(workdir)
    team = load_team(project.root, name)
    data = team.model_dump(mode="json")
    if as_json:
        print_json({"name": name, **data})
        return
    for key, value in data.items():
        if value is not None and (shown := toml_value(value)) != "{}":
            out.print(safe_text(f"{key} = {shown}"))


@team_app.command("validate")
@handles_errors
def validate(
    name: Annotated[str | None, typer.Argument(help="One team (default: every one).")] = None,
    agents_dir: AgentsDirOpt = None,
    workdir: WorkdirOpt = None,
) -> None:
    """Check team files against the agents here; exit 1 when one is wrong."""
    from ..catalog.teamfiles import TEAMS_DIR
    from ..catalog.teamfiles import team_names as names_of
    from ..teams.plan import (
        check_file_trust,
        check_plan,
        load_team,
        make_plan,
        resolve_gate_from,
    )

    project = open_project(workdir)
    catalog, tools = _catalog(project, agents_dir or [])
    names = [name] if name is not None else names_of(project.root)
    if not names:
        err.print(f"no teams: commit one as {TEAMS_DIR}/NAME.toml (see docs/AGENTS.md)")
    bad = 0
    for team in names:
        try:
            file = load_team(project.root, team)
            check_file_trust(team, f"{TEAMS_DIR}/{team}.toml", project.trust)
            resolve_gate_from(file, None, project.trust.trusted)
            check_plan(make_plan(file, team), catalog, tools)
        except UsageError as e:
            bad += 1
            err.print(safe_text(f"orch: {e}"))
            continue
        out.print(safe_text(f"ok  {team}"))
    raise typer.Exit(1 if bad else 0)


@team_app.command("run")
@handles_errors
def run(
    prompt: Annotated[str, typer.Argument(help="What the writers should do.")],
    team: Annotated[
        str | None, typer.Option("--team", "-t", help="A committed team (.orch/teams/NAME.toml).")
    ] = None,
    writer: Annotated[str | None, typer.Option("--writer", help="Writer agent.")] = None,
    writers: Annotated[
        int | None, typer.Option("--writers", min=1, help="Writers in parallel (best of N).")
    ] = None,
    reviewer: Annotated[
        list[str] | None,
        typer.Option("--reviewer", help="Reviewer agent, read-only (repeat for several)."),
    ] = None,
    approve: Annotated[
        Literal["all", "majority", "any"] | None,
        typer.Option(help="Which reviewers must approve."),
    ] = None,
    rounds: Annotated[int | None, typer.Option("--rounds", min=1, help="Rounds at most.")] = None,
    gate: Annotated[
        str | None, typer.Option("--gate", help="Test command run in the writer's sandbox.")
    ] = None,
    gate_timeout: Annotated[
        float | None, typer.Option("--gate-timeout", min=0.001, help="Seconds; over it fails.")
    ] = None,
    gate_from: Annotated[
        Literal["base", "candidate"] | None,
        typer.Option(
            "--gate-from",
            help="Whose tests the gate runs: base (the base's tests on the writer's code) or "
            "candidate (the branch as it is). Default: the team's; else candidate in a trusted "
            "repository, base in any other.",
        ),
    ] = None,
    isolation: Annotated[
        Literal["worktree", "container"] | None,
        typer.Option(
            help="Where the writers work: a git worktree, or a Docker container "
            "(default: the team's, else worktree)."
        ),
    ] = None,
    merge: Annotated[
        bool | None,
        typer.Option("--merge/--no-merge", help="Merge the approved branch into your HEAD."),
    ] = None,
    squash: Annotated[bool, typer.Option("--squash", help="Merge it as one commit.")] = False,
    allow_control_files: AllowControlOpt = False,  # with --merge
    model: Annotated[
        str | None, typer.Option(help="Alias (sonnet/opus/haiku), id, or scripted:FILE.")
    ] = None,
    writer_model: Annotated[str | None, typer.Option(help="The writers' model.")] = None,
    reviewer_model: Annotated[str | None, typer.Option(help="The reviewers' model.")] = None,
    lead: Annotated[
        bool, typer.Option("--lead", help="A lead agent splits PROMPT into tasks on a board.")
    ] = False,
    lead_agent: Annotated[
        str | None, typer.Option("--lead-agent", help="The lead's agent (default: general).")
    ] = None,
    teammates: Annotated[
        int | None, typer.Option("--teammates", min=1, help="A lead team's teammates.")
    ] = None,
    background: Annotated[bool, typer.Option("--background", help="Run detached.")] = False,
    agents_dir: AgentsDirOpt = None,
    workdir: WorkdirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run a team on PROMPT; exit 0 when the reviewers approve, 1 otherwise.

    Flags override the team file; without --team, the default team (writer + reviewer)."""
    from ..catalog.teamfiles import TEAMS_DIR
    from ..models import ModelProvider, portable
    from ..process.command import make_runner
    from ..teams.driver import base_commit, team_spec
    from ..teams.plan import (
        check_file_trust,
        check_plan,
        load_team,
        make_plan,
        resolve_gate_from,
    )
    from ..teams.progress import read_result

    if not prompt.strip():
        raise UsageError("the prompt is empty; say what the writers should do")
    if gate_timeout is not None and not math.isfinite(gate_timeout):
        raise UsageError("--gate-timeout must be a number of seconds greater than 0")
    project = open_project(workdir, model=model)
    file = load_team(project.root, team) if team is not None else None
    if team is not None:
        check_file_trust(team, f"{TEAMS_DIR}/{team}.toml", project.trust)
    mode = "squash" if squash else {True: "merge", False: "none", None: None}[merge]
    plan = make_plan(
        file,
        team,
        writer=writer,
        writers=writers,
        reviewers=reviewer or None,
        approve=approve,
        rounds=rounds,
        gate=gate,
        gate_timeout=gate_timeout,
        gate_from=resolve_gate_from(file, gate_from, project.trust.trusted),
        isolation=isolation,
        merge=mode,
        allow_control_files=allow_control_files or None,
        lead=lead_agent or (file.lead if file else None) or ("general" if lead else None),
        teammates=teammates,
        models={
            "writer": writer_model or (file.models.writer if file else None),
            "reviewers": reviewer_model or (file.models.reviewers if file else None),
        },
    )
    catalog, tools = _catalog(project, agents_dir or [])
    check_plan(plan, catalog, tools)  # bad input: one line before anything else
    if background and model:
        model = portable(model)  # a detached process reads it from elsewhere
    provider = ModelProvider(project.settings, model)
    provider.check_ready()
    runner = make_runner(
        project,
        provider,
        agents_dir or [],
        model_spec=model,
        overrides={"model": model},
        catalog=catalog,
    )
    if runner.settings.max_depth < 1:
        raise UsageError(
            "a team's writers and reviewers run at depth 1; set max_depth to 1 or more"
        )
    asyncio.run(base_commit(project.workdir))  # no repository, no commit: one line, nothing run
    spec = team_spec(prompt, project.workdir, plan, background=background)
    view = None if background else live_view(project.store, err, as_json)
    record = run_tree(runner, spec, view)
    if background:
        if as_json:
            print_json({"run_id": record.run_id, "chain_id": record.chain_id, "status": "running"})
        else:
            out.print(record.run_id)
            err.print(f"orch: team running in the background; `orch team status {record.run_id}`")
        return
    result = read_result(project.store, project.store.require_run(record.run_id))
    if result is None:
        raise UsageError(f"team run {record.run_id} {record.status.value}: {record.error}")
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


@team_app.command("status")
@handles_errors
def status(
    run_id: Annotated[str, typer.Argument(help="A team run (its root's id or a prefix).")],
    workdir: WorkdirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Where a team run stands: its round, gate results, verdicts and branch."""
    from ..process.opened import find_run
    from ..teams.progress import read_result

    project = open_project(workdir, quiet=True)
    record = find_run(project.store, run_id)
    result = read_result(project.store, record)
    if result is None:
        raise UsageError(
            f"run {record.run_id} is not a team run (or has not started); "
            "`orch ps` lists runs, team roots have agent 'team'"
        )
    if as_json:
        print_json(result.model_dump(mode="json"))
        return
    show(result)
    out.print(f"status  {result.status.value}")


def _follow(run_id: str, workdir: Path | None, as_json: bool, follow: bool, what: str) -> None:
    """Print a team's board or messages (``what``), then with ``follow`` what changes."""
    import time

    from ..engine.owner import owner_alive
    from ..process.opened import find_run
    from ..teams.progress import read_result

    project = open_project(workdir, quiet=True)
    record = find_run(project.store, run_id)
    seen: list[str] = []
    while True:
        record = project.store.require_run(record.run_id)
        result = read_result(project.store, record)
        if result is None or result.board is None:
            raise UsageError(
                f"run {record.run_id} is not a lead team's run; `orch team run --lead` makes one"
            )
        if what == "board":
            items = [t.model_dump(mode="json") for t in result.board.tasks]
            lines = [
                f"{t.id} {t.state}"
                + (f" [{t.owner}]" if t.owner else "")
                + f": {t.title}"
                + (f" (after {', '.join(t.depends_on)})" if t.depends_on else "")
                for t in result.board.tasks
            ]
        else:
            items = [m.model_dump(mode="json") for m in result.board.messages]
            lines = [f"#{m.id} {m.sender} -> {m.to}: {m.text}" for m in result.board.messages]
        if as_json and not follow:
            print_json(items)
            return
        if as_json:  # --follow: one JSON line (the whole list) each time it changes
            if lines != seen:
                out.print(json.dumps(items), soft_wrap=True, markup=False, highlight=False)
        elif what == "board" and lines != seen:
            if seen:
                out.print("[dim]--[/]")
            for line in lines:
                out.print(safe_text(line))
        elif what == "messages":
            for line in lines[len(seen) :]:
                out.print(safe_text(line))
        seen = lines
        if not follow or record.status.ended:
            return
        if not owner_alive(record):  # its process is gone: nothing will change it now
            err.print(f"orch: team run {record.run_id}'s process is gone; `orch resume` it")
            return
        time.sleep(0.5)


@team_app.command("board")
@handles_errors
def board(
    run_id: Annotated[str, typer.Argument(help="A lead team's run (its root's id or a prefix).")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Show it again as it changes.")
    ] = False,
    workdir: WorkdirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A lead team's board: each task, its state and who holds it."""
    _follow(run_id, workdir, as_json, follow, "board")


@team_app.command("messages")
@handles_errors
def messages(
    run_id: Annotated[str, typer.Argument(help="A lead team's run (its root's id or a prefix).")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Then each new one.")] = False,
    workdir: WorkdirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The messages a lead team's members sent one another."""
    _follow(run_id, workdir, as_json, follow, "messages")
