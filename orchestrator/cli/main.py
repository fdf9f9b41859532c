"""`orch`: the command line. typer + rich live here only; the engine is async inside."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..background import reconcile, spawn_worker
from ..errors import UsageError
from ..run import RunRecord, RunResult, RunStatus
from ..workspaces.base import process_start
from .common import (
    Project,
    chain_tree,
    err,
    find_run,
    handles_errors,
    open_project,
    out,
    print_json,
    run_label,
)

if TYPE_CHECKING:  # the engine is imported only by the commands that run agents: fast `orch ps`
    from ..delegation import Delegator
    from ..models import ModelProvider, ScriptedModel

app = typer.Typer(
    name="orch",
    help="Sandboxed multi-agent orchestrator: delegate work to child agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

WorkdirOpt = Annotated[
    Path | None, typer.Option("--workdir", "-C", help="Project directory (default: cwd).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def _register_subapps() -> None:
    from .catalog import agents_app, skills_app
    from .runs import register

    register(app)
    app.add_typer(agents_app, name="agents", help="Agent definitions: list, show, validate.")
    app.add_typer(skills_app, name="skills", help="Skills: list, show.")
    from .sandbox import sandbox_app
    from .team import team_app
    from .worktrees import worktrees_app

    app.add_typer(team_app, name="team", help="A writer and a reviewer on one branch.")
    app.add_typer(
        sandbox_app, name="sandbox", help="Container sandboxes: build, config, ps, prune."
    )

    app.add_typer(worktrees_app, name="worktrees", help="Agent branches: list, merge, prune.")


def is_git_repo(path: Path) -> bool:
    return (path / ".git").exists()


def all_agents_dirs(project: Project, flags: list[Path]) -> list[Path]:
    """``--agents-dir`` flags first, then ``agents_dirs`` from the settings (project-relative)."""
    return [*flags, *(project.root / Path(d).expanduser() for d in project.settings.agents_dirs)]


def make_delegator(project: Project, provider: ModelProvider, agents_dirs: list[Path]) -> Delegator:
    from ..definitions import load_catalog
    from ..delegation import Delegator

    catalog = load_catalog(project.root, agents_dirs=all_agents_dirs(project, agents_dirs))
    return Delegator(
        settings=project.settings, store=project.store, catalog=catalog, models=provider
    )


def run_tree(
    project: Project,
    prompt: str,
    *,
    provider: ModelProvider,
    agent: str,
    isolation: str | None,
    agents_dirs: list[Path],
    max_turns: int | None,
    timeout: float | None,
) -> RunRecord:
    delegator = make_delegator(project, provider, agents_dirs)

    async def go() -> RunRecord:
        async with provider:
            return await delegator.run_root(
                prompt,
                agent=agent,
                isolation=isolation,
                workdir=project.workdir,
                max_turns=max_turns,
                timeout_seconds=timeout,
            )

    return asyncio.run(go())


def start_background(
    project: Project,
    prompt: str,
    *,
    provider: ModelProvider,
    agent: str,
    isolation: str | None,
    agents_dirs: list[Path],
    max_turns: int | None,
    timeout: float | None,
    overrides: dict[str, object],
    model_spec: str | None,
) -> RunRecord:
    """Store the root run as queued and hand it to a detached worker process."""
    delegator = make_delegator(project, provider, agents_dirs)
    if model_spec and model_spec.startswith("scripted:"):
        model_spec = "scripted:" + str(Path(model_spec.removeprefix("scripted:")).resolve())
    record = delegator.prepare_root(
        prompt,
        agent=agent,
        isolation=isolation,
        workdir=project.workdir,
        max_turns=max_turns,
        timeout_seconds=timeout,
        background=True,
        options={
            "model_spec": model_spec,
            "agents_dirs": [str(p.resolve()) for p in agents_dirs],
            "overrides": {k: v for k, v in overrides.items() if v is not None},
        },
    )
    pid = spawn_worker(project.root, record.run_id)
    return project.store.update_run(record.run_id, pid=pid, pid_start=process_start(pid))


def report(
    project: Project, record: RunRecord, as_json: bool, script: ScriptedModel | None
) -> None:
    result = record.result()
    code = result.exit_code
    if as_json:
        print_json(result.model_dump(mode="json"))
    else:
        if result.summary:
            out.print(result.summary, markup=False)
        if result.status != RunStatus.SUCCEEDED:
            err.print(
                f"orch: run {result.run_id} {result.status.value}: {result.error}", markup=False
            )
    if script is not None and result.status == RunStatus.SUCCEEDED:
        problems = script.problems()
        if problems:
            err.print(
                f"orch: {script.source}: script not fully used: " + "; ".join(problems),
                markup=False,
            )
            code = 1
    raise typer.Exit(code)


@app.command()
@handles_errors
def task(
    prompt: Annotated[str, typer.Argument(help="What the agent should do.")],
    agent: Annotated[str, typer.Option("--agent", "-a", help="Agent definition.")] = "general",
    isolation: Annotated[
        str | None, typer.Option(help="shared | worktree | container (default: the agent's).")
    ] = None,
    background: Annotated[bool, typer.Option("--background", help="Run detached.")] = False,
    model: Annotated[
        str | None, typer.Option(help="Alias (sonnet/opus/haiku), id, or scripted:FILE.")
    ] = None,
    max_depth: Annotated[int | None, typer.Option(help="Delegation depth limit.")] = None,
    max_turns: Annotated[
        int | None, typer.Option(min=1, help="Turns before the run fails.")
    ] = None,
    timeout: Annotated[
        float | None, typer.Option(min=0.001, help="Seconds before the run times out.")
    ] = None,
    agents_dir: Annotated[
        list[Path] | None, typer.Option("--agents-dir", help="Extra agent directory (first wins).")
    ] = None,
    workdir: WorkdirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run an agent on PROMPT; it may delegate to child agents through `task`."""
    if not prompt.strip():
        raise UsageError("the prompt is empty; say what the agent should do")
    if isolation is not None and isolation not in ("shared", "worktree", "container"):
        raise UsageError(f"unknown isolation {isolation!r}; choose shared, worktree or container")
    if timeout is not None and not math.isfinite(timeout):
        raise UsageError("--timeout must be a number of seconds greater than 0")
    from ..models import ModelProvider

    project = open_project(workdir, max_depth=max_depth, model=model)
    if isolation in ("worktree", "container") and not is_git_repo(project.root):
        raise UsageError(
            f"--isolation {isolation} needs a git repository: run inside one "
            "(or `git init` and commit), or use --isolation shared"
        )
    provider = ModelProvider(project.settings, model)
    provider.check_ready()
    if background:
        record = start_background(
            project,
            prompt,
            provider=provider,
            agent=agent,
            isolation=isolation,
            agents_dirs=agents_dir or [],
            max_turns=max_turns,
            timeout=timeout,
            overrides={"max_depth": max_depth, "model": model},
            model_spec=model,
        )
        if as_json:
            print_json({"run_id": record.run_id, "chain_id": record.chain_id, "status": "running"})
        else:
            out.print(record.run_id)
            err.print(f"orch: running in the background; `orch watch {record.run_id}` follows it")
        return
    record = run_tree(
        project,
        prompt,
        provider=provider,
        agent=agent,
        isolation=isolation,
        agents_dirs=agents_dir or [],
        max_turns=max_turns,
        timeout=timeout,
    )
    report(project, record, as_json, provider.scripted)


@app.command()
@handles_errors
def demo(
    workdir: Annotated[
        Path | None, typer.Option("--workdir", "-C", help="Where to make the demo project.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Offline: a scripted parent delegates to children; prints the chain and results."""
    from ..demo import make_demo_project
    from ..models import ModelProvider

    where, script_path = make_demo_project(workdir)
    project = open_project(where)
    provider = ModelProvider(project.settings, f"scripted:{script_path}")
    prompt = "Give me a short report on this project: its test framework and its modules."
    if not as_json:
        out.print(f"[dim]demo project: {where}[/]")
        out.print(f"[bold]user ▸[/] {prompt}\n")
    record = run_tree(
        project,
        prompt,
        provider=provider,
        agent="general",
        isolation=None,
        agents_dirs=[],
        max_turns=None,
        timeout=60,
    )
    runs = project.store.list_runs(chain_id=record.chain_id)
    if as_json:
        print_json(
            {
                "result": record.result().model_dump(mode="json"),
                "chain": [r.model_dump(mode="json") for r in runs],
            }
        )
        raise typer.Exit(record.result().exit_code)
    out.print(chain_tree(runs))
    out.print("\n[bold]orch ▸[/] ", end="")
    out.print(record.output + "\n", markup=False)
    out.print(
        f"[dim]explore it: orch tree {record.run_id} -C {where} · "
        f"orch logs {record.run_id} -C {where}[/]"
    )
    report(
        project, record, False, provider.scripted
    ) if record.status != RunStatus.SUCCEEDED else None
    problems = provider.scripted.problems() if provider.scripted else []
    if problems:
        raise UsageError("demo script not fully used: " + "; ".join(problems))


@app.command()
@handles_errors
def result(
    run_id: Annotated[str, typer.Argument(help="Run id (or a unique prefix).")],
    wait: Annotated[bool, typer.Option("--wait", help="Block until the run has ended.")] = False,
    workdir: WorkdirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A run's result: status, final text, usage, evidence, artifacts."""
    project = open_project(workdir)
    record = find_run(project.store, run_id)
    ticks = 0
    while wait and not record.status.ended:
        time.sleep(0.2)
        ticks += 1
        if ticks % 5 == 0:
            reconcile(project.store)
        record = project.store.require_run(record.run_id)
    res: RunResult = record.result()
    full = project.store.output(record.run_id)
    if full is not None:
        res.summary = full
    if as_json:
        print_json(res.model_dump(mode="json"))
    else:
        out.print(run_label(record))
        if res.error:
            out.print(f"[red]error:[/] {res.error}")
        out.print(res.summary or "(no text yet)", markup=False)
    raise typer.Exit(res.exit_code if record.status.ended else 0)


@app.command()
@handles_errors
def logs(
    run_id: Annotated[str, typer.Argument(help="Run id (or a unique prefix).")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Stream until it ends.")] = False,
    workdir: WorkdirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A run's event stream (run_started, tool_call, tool_result, child_spawned, ...)."""
    project = open_project(workdir)
    store = project.store
    record = find_run(store, run_id)
    if as_json and not follow:
        print_json(store.events(record.run_id))
        return
    last = 0
    ticks = 0
    while True:
        for e in store.events(record.run_id, after_id=last):
            last = e["id"]
            if as_json:  # one JSON object a line while following
                sys.stdout.write(json.dumps(e, default=str) + "\n")
                sys.stdout.flush()
            else:
                data = json.dumps(e["data"], default=str)
                out.print(f"[dim]{e['id']:>5}[/] [bold]{e['kind']:<14}[/] ", end="")
                out.print(data[:300], markup=False)
        if not follow or store.require_run(record.run_id).status.ended:
            if not store.events(record.run_id, after_id=last):
                return
            continue
        time.sleep(0.2)
        ticks += 1
        if ticks % 5 == 0:
            reconcile(store)


@app.command()
@handles_errors
def tree(
    ref: Annotated[str, typer.Argument(help="A run id or a chain id.")],
    workdir: WorkdirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The QueryChain of a run: every run of its chain with depth and status."""
    project = open_project(workdir)
    runs = project.store.list_runs(chain_id=ref)
    if not runs:
        runs = project.store.list_runs(chain_id=find_run(project.store, ref).chain_id)
    if as_json:
        print_json([r.model_dump(mode="json") for r in runs])
        return
    out.print(chain_tree(runs))


_register_subapps()


def main() -> None:
    app()
