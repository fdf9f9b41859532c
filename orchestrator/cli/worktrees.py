"""``orch worktrees``: list, merge and prune the branches that worktree runs leave behind."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ..errors import NotFound
from ..process.opened import find_run, root_of
from .common import WorkdirOpt, handles_errors
from .safe import safe_text, shown

if TYPE_CHECKING:
    from ..branches import PruneReport
    from ..store import RunStore

worktrees_app = typer.Typer(
    help="Branches of runs with isolation 'worktree' (orch/<agent>/<id>): list, merge, prune.",
    no_args_is_help=True,
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]
# ``orch worktrees merge`` and ``orch team run --merge``
AllowControlOpt = Annotated[
    bool,
    typer.Option(
        "--allow-control-files",
        help="Also merge changes to control files (any dot-file or dot-directory, CI, agent "
        "rules, MCP, editor and package-manager configuration, hooks); without it such a "
        "branch is refused.",
    ),
]


def _open_store(root: Path) -> RunStore:
    from ..catalog.agent_trust import load_trusted
    from ..store import open_store

    return open_store(root, load_trusted(root)[0].store)  # ORCH_STORE, or `store` if trusted


def _target(root: Path, target: str) -> str:
    """A branch name as given; else the run it names (any unique prefix, as every command
    takes one). A run the store does not know is left to the branches' own names."""
    target = target.strip()
    if "/" in target:
        return target
    store = _open_store(root)
    try:
        return find_run(store, target).run_id
    except NotFound:
        return target
    finally:
        store.close()


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


def _run_checker(root: Path) -> tuple[Callable[[str], bool], Callable[[], None]]:
    """``is_running(run_id)`` from the store (a run it does not know counts as ended)."""
    store = _open_store(root)

    def is_running(run_id: str) -> bool:
        record = store.get_run(run_id)
        return record is not None and not record.status.ended

    return is_running, store.close


@worktrees_app.command("list")
@handles_errors
def list_cmd(workdir: WorkdirOpt = None, as_json: JsonFlag = False) -> None:
    """List orch branches: ahead/behind your HEAD, size of the change, merged or not."""
    from ..branches import list_branches  # GitPython: imported when used

    infos = list_branches(root_of(workdir))
    if as_json:
        _print_json([i.model_dump() for i in infos])
        return
    if not infos:
        typer.echo("no orch branches")
        return
    table = Table("branch", "run", "ahead", "behind", "changes", "merged", "worktree")
    for i in infos:
        changes = f"{i.files_changed} files +{i.insertions} -{i.deletions}"
        table.add_row(
            safe_text(i.branch),
            safe_text(i.run_id or "-"),
            str(i.ahead),
            str(i.behind),
            changes,
            "yes" if i.merged else "no",
            safe_text(i.path or "-"),
        )
    Console().print(table)


@worktrees_app.command("merge")
@handles_errors
def merge_cmd(
    target: Annotated[
        str,
        typer.Argument(
            metavar="RUN|BRANCH", help="A run id (or its first characters), or a branch name."
        ),
    ],
    squash: Annotated[bool, typer.Option("--squash", help="One squashed commit.")] = False,
    stash: Annotated[
        bool, typer.Option("--stash", help="Stash your uncommitted changes around the merge.")
    ] = False,
    allow_control: AllowControlOpt = False,
    workdir: WorkdirOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """Merge a run's branch into your current branch (refuses on conflicts, a dirty tree, or
    changes to control files)."""
    from ..branches import merge

    root = root_of(workdir)
    report = merge(
        root, _target(root, target), squash=squash, stash=stash, allow_control_files=allow_control
    )
    if as_json:
        _print_json(report.model_dump())
    elif report.already_merged:
        typer.echo(shown(f"{report.branch} is already merged into {report.into}"))
    else:
        how = "squash-merged" if report.squash else "merged"
        typer.echo(
            shown(
                f"{how} {report.branch} into {report.into} ({report.commit[:10]}): "
                f"{report.files_changed} files +{report.insertions} -{report.deletions}"
            )
        )
    if report.control_files and not as_json:
        files = ", ".join(report.control_files)
        typer.echo(shown(f"orch: merged changes to control files: {files}"), err=True)
    if report.warning and not as_json:
        typer.echo(shown(f"orch: {report.warning}"), err=True)


@worktrees_app.command("prune")
@handles_errors
def prune_cmd(
    force: Annotated[
        bool, typer.Option("--force", help="Also delete branches with unmerged commits.")
    ] = False,
    workdir: WorkdirOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """Remove worktrees of ended runs (committing leftover work), delete merged branches and
    the checkpoint refs of ended container runs."""

    from ..branches import prune
    from ..workspaces.container.export import prune_refs

    async def go(root: Path) -> tuple[PruneReport, list[str]]:
        is_running, close = _run_checker(root)
        try:
            report = await prune(root, force=force, is_running=is_running)
            return report, await prune_refs(root, is_running)
        finally:
            close()

    report, refs = asyncio.run(go(root_of(workdir)))
    if as_json:
        _print_json({**report.model_dump(), "deleted_refs": refs})
        return
    for ref in refs:
        typer.echo(shown(f"deleted {ref} (left by a run that ended)"))
    for artifact in report.salvaged:
        typer.echo(shown(f"salvaged work of an ended run onto {artifact['branch']}"))
    for path in report.removed_worktrees:
        typer.echo(shown(f"removed worktree {path}"))
    for run_id in report.running:
        typer.echo(shown(f"kept worktree of running run {run_id}"))
    for branch in report.deleted_branches:
        typer.echo(shown(f"deleted branch {branch}"))
    for branch in report.kept_branches:
        typer.echo(shown(f"kept unmerged branch {branch} (merge it, or prune --force)"))
    if not any(
        (
            report.salvaged,
            report.removed_worktrees,
            report.running,
            report.deleted_branches,
            report.kept_branches,
            refs,
        )
    ):
        typer.echo("nothing to prune")
