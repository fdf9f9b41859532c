"""`orch agents ...` and `orch skills ...`: what definitions are installed, and are they valid."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from ..catalog.agent_trust import guard, load_trusted
from ..process.opened import root_of
from .common import (
    AgentsDirOpt,
    JsonOpt,
    WorkdirOpt,
    announce_trust,
    err,
    handles_errors,
    out,
    print_json,
)
from .safe import safe_markup, safe_text

if TYPE_CHECKING:
    from ..catalog.definitions import Catalog, ValidationReport

agents_app = typer.Typer(
    help="Agent definitions: list, show, validate.", no_args_is_help=True, add_completion=False
)
skills_app = typer.Typer(help="Skills: list, show.", no_args_is_help=True, add_completion=False)


def open_catalog(agents_dirs: list[Path] | None = None, workdir: Path | None = None) -> Catalog:
    """The catalog for the project around ``workdir`` (default: cwd).

    ``--agents-dir`` flags come first, then ``agents_dirs`` from the settings
    (relative ones are taken from the project root).
    """
    root = root_of(workdir)
    settings, trust = load_trusted(root)
    announce_trust(trust)
    configured = [root / Path(d).expanduser() for d in settings.agents_dirs]
    from ..catalog.definitions import load_catalog

    dirs = [*(agents_dirs or []), *configured]
    found = load_catalog(root, agents_dirs=dirs, trust=trust, hidden=settings.sandbox.hidden)
    return guard(trust, found)


def _report_errors(catalog: Catalog) -> None:
    for e in catalog.errors:
        err.print(safe_text(f"error: {e}"))


def _short(text: str, width: int = 70) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def _source(source: str) -> str:
    if source.startswith("bundled:"):
        return "bundled"
    try:
        return str(Path(source).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return source.replace(str(Path.home()), "~", 1)


def _print_list(
    catalog: Catalog,
    kind: str,
    dumped: list[dict[str, Any]],
    json_out: bool,
    columns: dict[str, dict[str, Any]],
    rows: Sequence[Sequence[str]],
    warnings: Sequence[Sequence[str]],
) -> None:
    """``orch agents list`` / ``orch skills list``: JSON, or a table (with a WARN count) and the
    catalog's errors."""
    if json_out:
        print_json({kind: dumped, "errors": [str(e) for e in catalog.errors]})
        return
    table = Table(box=None, header_style="bold", expand=True)
    for title, options in {**columns, "WARN": {"no_wrap": True}}.items():
        table.add_column(title, **options)
    for row, warned in zip(rows, warnings, strict=True):
        table.add_row(*(safe_markup(cell) for cell in row), str(len(warned)) if warned else "")
    out.print(table)
    _report_errors(catalog)


def _print_body(warnings: list[str], title: str, body: str) -> None:
    """A definition's warnings, then its body (a system prompt, a skill's instructions)."""
    for warning in warnings:
        out.print(f"[yellow]warning:[/] {safe_markup(warning)}")
    out.rule(title)
    out.print(safe_text(body, multiline=True))


@agents_app.command("list")
@handles_errors
def agents_list(
    json_out: JsonOpt = False, agents_dir: AgentsDirOpt = None, workdir: WorkdirOpt = None
) -> None:
    """List the agents that `task` and `orch task --agent` can use."""
    catalog = open_catalog(agents_dir, workdir)
    agents = sorted(catalog.agents.values(), key=lambda a: a.name)
    columns: dict[str, dict[str, Any]] = {
        "NAME": {"no_wrap": True},
        "DESCRIPTION": {"no_wrap": True, "overflow": "ellipsis", "ratio": 3},
        "MODEL": {"no_wrap": True},
        "TOOLS": {"ratio": 2},
        "ISOLATION": {"no_wrap": True},
        "SOURCE": {"overflow": "fold", "ratio": 2},
    }
    rows = [
        (
            a.name,
            _short(a.description),
            a.model or "inherit",
            "all" if a.tools is None else ", ".join(a.tools) or "none",
            a.isolation or "-",
            _source(a.source),
        )
        for a in agents
    ]
    dumped = [a.model_dump(exclude={"system_prompt"}) for a in agents]
    _print_list(catalog, "agents", dumped, json_out, columns, rows, [a.warnings for a in agents])


@agents_app.command("show")
@handles_errors
def agents_show(
    name: Annotated[str, typer.Argument(help="The agent's name (`orch agents list`).")],
    json_out: JsonOpt = False,
    agents_dir: AgentsDirOpt = None,
    workdir: WorkdirOpt = None,
) -> None:
    """Show one agent: its settings, warnings and system prompt."""
    agent = open_catalog(agents_dir, workdir).agent(name)
    if json_out:
        print_json(agent.model_dump())
        return
    table = Table(box=None, show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    rows = {
        "name": agent.name,
        "description": " ".join(agent.description.split()),
        "source": agent.source,
        "model": agent.model or "inherit",
        "tools": "all" if agent.tools is None else ", ".join(agent.tools) or "none",
        "disallowed": ", ".join(agent.disallowed_tools) or "-",
        "isolation": agent.isolation or "default",
        "background": "yes" if agent.background else "no",
        "max turns": str(agent.max_turns) if agent.max_turns else "default",
        "permission": agent.permission_mode or "-",
        "skills": ", ".join(agent.skills) or "-",
    }
    for key, value in rows.items():
        table.add_row(key, safe_markup(value))
    out.print(table)
    _print_body(agent.warnings, "system prompt", agent.system_prompt or "(empty)")


@agents_app.command("validate")
@handles_errors
def agents_validate(
    paths: Annotated[
        list[Path], typer.Argument(help="Agent .md files, SKILL.md files or directories.")
    ],
    json_out: JsonOpt = False,
    start: Annotated[
        bool,
        typer.Option(
            "--start/--no-start",
            help="Start the MCP servers agents name (in the OS sandbox, the project read-only, "
            "10 s at most) to check the tools they name.",
        ),
    ] = True,
    workdir: WorkdirOpt = None,
) -> None:
    """Check definition files, and the MCP servers and tools agents name; exit 1 if any
    fails to load."""
    from ..catalog.definitions import validate_files

    reports = validate_files(paths)
    _check_mcp(reports, start, workdir)
    failed = [r for r in reports if not r.ok]
    if json_out:
        print_json([r.model_dump() for r in reports])
    else:
        for r in reports:
            if r.ok:
                out.print(
                    f"[green]ok[/] {safe_markup(r.path)} ({r.kind} {safe_markup(r.name or '')})"
                )
            else:
                out.print(f"[red]error:[/] {safe_markup(r.error or r.path)}")
            for warning in r.warnings:
                out.print(f"  [yellow]warning:[/] {safe_markup(warning)}")
        total = sum(len(r.warnings) for r in reports)
        out.print(f"{len(reports)} checked, {len(failed)} failed, {total} warnings", markup=False)
    if failed:
        raise typer.Exit(1)


def _check_mcp(reports: list[ValidationReport], start: bool, workdir: Path | None) -> None:
    """Add to each agent's report what is wrong with the MCP servers and tools it names."""
    import asyncio

    from ..catalog.definitions import load_agent_file
    from ..catalog.mcpcheck import mcp_warnings, named
    from ..catalog.owner import Owners
    from ..catalog.shadow import keep_users_servers
    from ..mcpclient.declared import load_declared

    loaded = [
        (r.path, load_agent_file(Path(r.path))) for r in reports if r.kind == "agent" and r.ok
    ]
    agents = {path: d for path, d in loaded if named(d)[0]}
    if not agents:  # no agent names a server: no project is read
        return
    root = root_of(workdir)
    settings, trust = load_trusted(root)
    # as a run gets them: a repository's server never takes a name of the user's untrusted
    declared = keep_users_servers(root, load_declared(root, Path.home()), Path.home(), trust)
    owners = Owners.for_trust(root, trust, settings.sandbox.hidden)
    theirs = {
        d.name
        for path, d in agents.items()
        if owners.inside(path) or owners.repository_dir(Path(path).parent)
    }
    found = asyncio.run(
        mcp_warnings(list(agents.values()), declared, root, settings, start=start, theirs=theirs)
    )
    for r in reports:
        if r.path in agents:
            r.warnings += found.get(agents[r.path].name, [])


@skills_app.command("list")
@handles_errors
def skills_list(json_out: JsonOpt = False, workdir: WorkdirOpt = None) -> None:
    """List the skills agents can load with load_skill."""
    catalog = open_catalog(workdir=workdir)
    skills = sorted(catalog.skills.values(), key=lambda s: s.name)
    columns: dict[str, dict[str, Any]] = {
        "NAME": {"no_wrap": True},
        "DESCRIPTION": {"no_wrap": True, "overflow": "ellipsis", "ratio": 2},
        "SOURCE": {"overflow": "fold", "ratio": 1},
    }
    rows = [(s.name, _short(s.description, 90), _source(s.source)) for s in skills]
    dumped = [s.model_dump(exclude={"body"}) for s in skills]
    _print_list(catalog, "skills", dumped, json_out, columns, rows, [s.warnings for s in skills])


@skills_app.command("show")
@handles_errors
def skills_show(
    name: Annotated[str, typer.Argument(help="The skill's name (`orch skills list`).")],
    json_out: JsonOpt = False,
    workdir: WorkdirOpt = None,
) -> None:
    """Show one skill's description and full instructions."""
    skill = open_catalog(workdir=workdir).skill(name)
    if json_out:
        print_json(skill.model_dump())
        return
    out.print(f"[bold]{safe_markup(skill.name)}[/] ({safe_markup(skill.source)})")
    out.print(safe_text(" ".join(skill.description.split())))
    _print_body(skill.warnings, "", skill.body)
