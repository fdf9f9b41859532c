"""``orch mcp``: serve orch's tools to an MCP client on stdin/stdout (``mcpserver/``)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from .common import WorkdirOpt, handles_errors, open_project


@handles_errors
def mcp(
    model: Annotated[
        str | None,
        typer.Option(help="Default model of its runs: alias, id, or scripted:FILE."),
    ] = None,
    agents_dir: Annotated[
        list[Path] | None, typer.Option("--agents-dir", help="Extra agent directory (first wins).")
    ] = None,
    allow_shared: Annotated[
        bool,
        typer.Option(
            "--allow-shared",
            help="Let clients run agents in your checkout (isolation shared); by default "
            "their runs get a branch of their own.",
        ),
    ] = False,
    max_live: Annotated[
        int, typer.Option(min=1, help="Runs of this server unfinished at once, at most.")
    ] = 8,
    workdir: WorkdirOpt = None,
) -> None:
    """Serve orch to an MCP client over stdio: task, task_output, task_stop, list_runs,
    run_result, run_logs, branch_diff, merge_branch.

    Add it to Claude Code with `claude mcp add orch -- orch mcp -C /path/to/repo`; see
    docs/MCP.md for Codex and Cursor. Its runs take the project's settings and trust, as
    `orch task` does; its foreground runs end when the client goes away."""
    from ..mcpserver.desk import Desk
    from ..mcpserver.limits import ServerLimits
    from ..mcpserver.server import serve

    project = open_project(workdir, model=model)  # what trust left out goes to stderr
    limits = ServerLimits(allow_shared=allow_shared, max_live=max_live)
    desk = Desk(project, agents_dirs=agents_dir or [], model_spec=model, limits=limits)
    try:
        asyncio.run(serve(desk))
    except KeyboardInterrupt:  # the client stops its server with SIGINT: not an error
        raise typer.Exit(0) from None


def register(app: typer.Typer) -> None:
    app.command()(mcp)
