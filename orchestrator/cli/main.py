"""`orch`: the command line. typer + rich live here only; the engine is async inside."""

from __future__ import annotations

import atexit
import functools
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import UsageError
from ..process.command import make_runner, root_spec
from ..process.listing import subtree_totals
from ..process.opened import Project, find_run
from ..process.reconcile import reconcile
from ..run import RunRecord, RunResult, RunStatus
from .common import (
    ISOLATION_HELP,
    AgentsDirOpt,
    Executor,
    Isolation,
    JsonOpt,
    NetworkMode,
    WorkdirOpt,
    budget_line,
    chain_totals_line,
    chain_tree,
    egress_line,
    err,
    handles_errors,
    open_project,
    open_waiting,
    out,
    patience,
    print_json,
    result_json,
    run_label,
    stop_on_sigterm,
    usage_lines,
    with_egress,
)
from .helpstyle import OrchGroup
from .live import branch_lines, live_view, run_tree
from .safe import safe_markup, safe_text

if TYPE_CHECKING:  # the engine is imported only by the commands that run agents: fast `orch ps`
    from ..egress.rules import NetworkSetting
    from ..engine.runner import Runner
    from ..models import ModelProvider, ScriptedModel
    from ..spec import RunSpec

app = typer.Typer(
    cls=OrchGroup,  # classic help for every command below it (helpstyle.py)
    name="orch",
    help="Sandboxed multi-agent orchestrator: delegate work to child agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_subapps() -> None:
    from .catalog import agents_app, skills_app
    from .runs import register

    register(app)
    app.add_typer(agents_app, name="agents", help="Agent definitions: list, show, validate.")
    app.add_typer(skills_app, name="skills", help="Skills: list, show.")
    from .sandbox import sandbox_app
    from .team import team_app
    from .worktrees import worktrees_app

    app.add_typer(team_app, name="team", help="Teams: writers, a test gate, reviewers.")
    app.add_typer(
        sandbox_app, name="sandbox", help="Container sandboxes: build, config, ps, prune."
    )

    app.add_typer(worktrees_app, name="worktrees", help="Agent branches: list, merge, prune.")
    from .doctor import register as register_doctor
    from .trust import register as register_trust

    register_trust(app)
    register_doctor(app)
    from .state import register as register_state

    register_state(app)
    from .mcp import register as register_mcp

    register_mcp(app)
    from .dashboard import register as register_dashboard

    register_dashboard(app)


def is_git_repo(path: Path) -> bool:
    return (path / ".git").exists()


def report(
    project: Project, record: RunRecord, as_json: bool, script: ScriptedModel | None
) -> None:
    result = with_egress(project.store, record.result())
    code = result.exit_code
    if as_json:
        print_json(result_json(project.store, record, result))
    else:
        if result.summary:
            out.print(safe_text(result.summary, multiline=True))
        runs = [record, *project.store.descendants(record.run_id)]
        for line in branch_lines(runs):  # on stderr: stdout stays the answer alone
            err.print(line)
        if (network := egress_line(result)) is not None:
            err.print(network)
        if result.status != RunStatus.SUCCEEDED:
            err.print(safe_text(f"orch: run {result.run_id} {result.status.value}: {result.error}"))
    if script is not None and result.status == RunStatus.SUCCEEDED:
        problems = script.problems()
        if problems:
            err.print(
                safe_text(f"orch: {script.source}: script not fully used: " + "; ".join(problems))
            )
            code = 1
    raise typer.Exit(code)


def network_flag(mode: NetworkMode | None, allow: list[str] | None) -> NetworkSetting | None:
    """``--network``/``--allow`` as a ``network`` setting (None: not given)."""
    if mode is not None and allow:
        raise UsageError("--network and --allow do not go together: --allow alone is a list")
    if not allow:
        return mode
    from ..egress.rules import parse_setting

    try:
        return parse_setting({"allow": list(allow)})
    except ValueError as e:
        raise UsageError(f"--allow: {e}") from None


@app.command()
@handles_errors
def task(
    prompt: Annotated[str, typer.Argument(help="What the agent should do.")],
    agent: Annotated[str, typer.Option("--agent", "-a", help="Agent definition.")] = "general",
    description: Annotated[
        str,
        typer.Option(
            "--description",
            "-d",
            help="What the run is for, in a few words: shown by ps and watch, the subject of "
            "its commit (default: the prompt's first line).",
        ),
    ] = "",
    isolation: Annotated[Isolation | None, typer.Option(help=ISOLATION_HELP)] = None,
    background: Annotated[bool, typer.Option("--background", help="Run detached.")] = False,
    model: Annotated[
        str | None, typer.Option(help="Alias (sonnet/opus/haiku), id, or scripted:FILE.")
    ] = None,
    max_depth: Annotated[int | None, typer.Option(help="Delegation depth limit.")] = None,
    auto_background_after: Annotated[
        float | None,
        typer.Option(
            min=0, help="Seconds before a foreground child moves to the background (0: never)."
        ),
    ] = None,
    stall_timeout: Annotated[
        float | None,
        typer.Option(
            min=0, help="Seconds without progress before a background run ends (0: never)."
        ),
    ] = None,
    max_parallel: Annotated[
        int | None, typer.Option(min=1, help="Children of one parent running at once.")
    ] = None,
    executor: Annotated[
        Executor | None,
        typer.Option(help="Where worktree and container runs execute: here, or on a Ray cluster."),
    ] = None,
    max_turns: Annotated[
        int | None, typer.Option(min=1, help="Turns before the run fails.")
    ] = None,
    timeout: Annotated[
        float | None, typer.Option(min=0.001, help="Seconds before the run times out.")
    ] = None,
    network: Annotated[
        NetworkMode | None,
        typer.Option(help="What the commands reach: none, or the machine's network (host)."),
    ] = None,
    allow: Annotated[
        list[str] | None,
        typer.Option(
            "--allow",
            metavar="HOST",
            help="Reach only this host (repeat it): pypi.org, '*.github.com', "
            "127.0.0.1:8080; through orch's egress proxy.",
        ),
    ] = None,
    agents_dir: AgentsDirOpt = None,
    workdir: WorkdirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run an agent on PROMPT; it may delegate to child agents through `task`."""
    if not prompt.strip():
        raise UsageError("the prompt is empty; say what the agent should do")
    if timeout is not None and not math.isfinite(timeout):
        raise UsageError("--timeout must be a number of seconds greater than 0")
    from ..models import ModelProvider, portable
    from ..workspaces.registry import tier_config

    config = tier_config(isolation) if isolation is not None else None
    overrides: dict[str, Any] = {
        "max_depth": max_depth,
        "model": model,
        "auto_background_after": auto_background_after,
        "stall_timeout": stall_timeout,
        "max_parallel_children": max_parallel,
        "executor": executor,
    }  # flags override orch.toml, and travel with a detached run to its worker
    wanted = network_flag(network, allow)  # the run's, over its agent's; its children's default
    if wanted is not None:
        overrides["network"] = wanted if isinstance(wanted, str) else wanted.model_dump(mode="json")
    project = open_project(workdir, **overrides)
    if config is not None and config.needs_git and not is_git_repo(project.root):
        raise UsageError(
            f"--isolation {isolation} needs a git repository: run inside one "
            "(or `git init` and commit), or use --isolation shared"
        )
    if background and os.environ.get("ORCH_PARENT_RUN_ID"):
        raise UsageError(
            "this orch runs inside an agent's command (ORCH_PARENT_RUN_ID is set): it joins that "
            "agent's chain and cannot run detached; drop --background"
        )
    if background and model:
        model = portable(model)  # a detached process reads it from elsewhere
    provider = ModelProvider(project.settings, model)
    provider.check_ready()
    spec = root_spec(
        project,
        prompt,
        agent=agent,
        isolation=isolation,
        max_depth=max_depth,
        max_turns=max_turns,
        timeout=timeout,
        background=background,
        description=description,
        network=wanted,
    )
    runner = make_runner(
        project,
        provider,
        agents_dir or [],
        model_spec=model,
        overrides=overrides,
    )
    _run_root(project, runner, spec, provider, as_json)


def _run_root(
    project: Project,
    runner: Runner,
    spec: RunSpec,
    provider: ModelProvider,
    as_json: bool,
    **shown: str,
) -> None:
    """Run a root run: in the foreground drawn live and reported; in the background (the
    spec's ``background``) only its id is printed (``shown``: more keys of that JSON)."""
    background = spec.background
    record = run_tree(runner, spec, None if background else live_view(project.store, out, as_json))
    if not background:
        report(project, record, as_json, provider.scripted)
    elif as_json:
        ids = {"run_id": record.run_id, "chain_id": record.chain_id}
        print_json({**ids, **shown, "status": "running"})
    else:
        out.print(record.run_id)
        err.print(f"orch: running in the background; `orch watch {record.run_id}` follows it")


@app.command()
@handles_errors
def resume(
    run_id: Annotated[str, typer.Argument(help="An ended root run (id or unique prefix).")],
    prompt: Annotated[
        str | None,
        typer.Argument(help="What it should do next (a team: optional, a note to its writers)."),
    ] = None,
    background: Annotated[bool, typer.Option("--background", help="Run detached.")] = False,
    model: Annotated[
        str | None, typer.Option(help="Alias, id, or scripted:FILE (default: the run's).")
    ] = None,
    agents_dir: AgentsDirOpt = None,
    workdir: WorkdirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Continue an ended root run: its conversation, workspace and branch, with PROMPT next.

    A new run (its record says resumed_from) in the same delegation tree, with the same agent
    and isolation; a child run is resumed by its parent agent (the task tool's resume). A team
    run goes on from its last round (orch team status shows it)."""
    from ..models import ModelProvider, portable, whole_run
    from ..spec import RunSpec

    project = open_project(workdir, model=model)
    old = find_run(project.store, run_id)
    if old.plan is not None and old.plan.spec.driver is not None:  # a team: where it stands
        from ..teams.progress import read_result

        before = read_result(project.store, old)
        if before is None:
            raise UsageError(f"team run {old.run_id} left no progress to go on from; start anew")
        if before.approved:
            raise UsageError(f"team run {old.run_id} was approved; there is nothing to go on with")
        prompt = prompt or before.task  # the team's task: nothing added for its writers
    if prompt is None or not prompt.strip():
        raise UsageError("the prompt is empty; say what the agent should do next")
    if background and model:
        model = portable(model)  # a detached process reads it from elsewhere
    provider = ModelProvider(project.settings, model)
    provider.check_ready()
    spec = RunSpec(
        prompt=prompt,
        workdir=project.workdir,
        resume=old.run_id,
        background=background,
        model=None if model is None or whole_run(model) else model,
    )
    runner = make_runner(
        project, provider, agents_dir or [], model_spec=model, overrides={"model": model}
    )
    _run_root(project, runner, spec, provider, as_json, resumed_from=old.run_id)


@app.command()
@handles_errors
def demo(
    workdir: Annotated[
        Path | None,
        typer.Option(
            "--workdir", "-C", metavar="DIR", help="Make the demo project here (and keep it)."
        ),
    ] = None,
    keep: Annotated[
        bool, typer.Option("--keep", help="Keep the demo project to explore it afterwards.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Offline: a scripted parent delegates to children; prints the chain and results.

    The demo project goes in a temporary directory, removed when the demo ends, however it
    ends, unless --keep (or -C DIR) says where to keep it."""
    from ..demo import demo_project

    with demo_project(workdir, keep=keep) as (where, script_path), stop_on_sigterm():
        _demo(where, script_path, kept=keep or workdir is not None, as_json=as_json)


def _demo(where: Path, script_path: Path, *, kept: bool, as_json: bool) -> None:
    from ..models import ModelProvider

    project = open_project(where)
    provider = ModelProvider(project.settings, f"scripted:{script_path}")
    prompt = "Give me a short report on this project: its test framework and its modules."
    if not as_json:
        if kept:
            out.print(f"[dim]demo project (kept): {safe_markup(where)}[/]", soft_wrap=True)
        out.print(f"[bold]user ▸[/] {prompt}\n")
    spec = root_spec(project, prompt, agent="general", isolation=None, timeout=60)
    record = run_tree(make_runner(project, provider, []), spec)
    runs = project.store.list_runs(chain_id=record.chain_id)
    if as_json:
        print_json(
            {
                "result": result_json(project.store, record, record.result()),
                "chain": [r.model_dump(mode="json") for r in runs],
                "project": str(where) if kept else None,
            }
        )
        raise typer.Exit(record.result().exit_code)
    out.print(chain_tree(runs))
    out.print("\n[bold]orch ▸[/] ", end="")
    out.print(safe_text(record.output + "\n", multiline=True))
    if kept:
        out.print(
            f"[dim]kept at {safe_markup(where)}; explore it: orch tree {record.run_id} "
            f"-C {safe_markup(where)} · orch logs {record.run_id} -C {safe_markup(where)}[/]",
            soft_wrap=True,  # paths whole, to copy
        )
    else:
        out.print("[dim]the demo project is removed now; `orch demo --keep` keeps it[/]")
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
    patient = patience() if wait else None  # a store away meanwhile: said once, waited for
    project = open_waiting(workdir, patient)
    store = project.store
    record = patient.call(lambda: find_run(store, run_id)) if patient else find_run(store, run_id)
    ticks, rid = 0, record.run_id
    while patient is not None and not record.status.ended:
        time.sleep(0.2)
        ticks += 1
        if ticks % 5 == 0:
            patient.call(lambda: reconcile(store))
        record = patient.call(lambda: store.require_run(rid))
    res: RunResult = with_egress(project.store, record.result())
    full = project.store.output(record.run_id)
    if full is not None:
        res.summary = full
    if as_json:
        print_json(result_json(project.store, record, res))
    else:
        out.print(run_label(record))
        for used in usage_lines(project.store, record):
            out.print(used, markup=False, highlight=False)
        if res.error:
            out.print(safe_text("error:", "red") + " " + safe_text(res.error))
        out.print(safe_text(res.summary or "(no text yet)", multiline=True))
        for line in branch_lines([record]):
            out.print(line)
        if (network := egress_line(res)) is not None:
            out.print(network)
    raise typer.Exit(res.exit_code if record.status.ended else 0)


@app.command()
@handles_errors
def tree(
    ref: Annotated[str, typer.Argument(help="A run id (or its first characters), or a chain id.")],
    workdir: WorkdirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A run's delegation tree: every run of it with depth, status and usage."""
    project = open_project(workdir)
    runs = project.store.list_runs(chain_id=ref)
    if not runs:
        runs = project.store.list_runs(chain_id=find_run(project.store, ref).chain_id)
    if as_json:
        rows = [r.model_dump(mode="json") for r in runs]
        below = subtree_totals(rows)  # each run's cost with the runs under it
        print_json([{**r, "total_cost_usd": below[r["run_id"]]["total_cost_usd"]} for r in rows])
        return
    out.print(chain_tree(runs))
    out.print(budget_line(runs), markup=False)
    out.print(chain_totals_line(runs), markup=False)


_register_subapps()


@functools.cache
def command() -> Any:
    """The app as a click command, built once: building it reads the signature of every
    command (tens of ms); the warm process builds it before it forks (``warm/server.py``)."""
    return typer.main.get_command(app)


def main() -> None:
    """Run the CLI, then leave at once: everything is written and flushed by then, and
    tearing down the interpreter's modules (the SDK's thousands of types) only costs time."""
    try:
        command()()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except KeyboardInterrupt:  # outside a command's own handling (parsing its arguments)
        sys.stderr.write("orch: interrupted\n")
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()  # what registered cleanups (temp dirs) still run
    os._exit(code)
