"""What ``orch mcp`` does for each tool call: the same admission, tiers, budgets and trust as
the CLI, on the project the server was started in.

A :class:`Desk` lives as long as the server (``async with``). Foreground ``task`` runs are
tasks of its own, not of the request that asked for them: when a request is cancelled (the
client cancels it, or goes away) its run is cancelled with plain asyncio semantics, and the
desk waits for every run it started to finish its ending (work committed to its branch)
before it closes. Background runs are handed to the worker host, as ``orch task
--background`` does, and go on after the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from ..branches import find_branch, merge
from ..catalog.agent_trust import guard
from ..catalog.definitions import Catalog, load_catalog
from ..catalog.guidance import agent_catalog
from ..egress.summary import of_run
from ..egress.summary import text as egress_text
from ..engine.conversation import cut
from ..engine.delegation import branch_line, format_child_result
from ..engine.runner import Runner
from ..errors import NotFound, UsageError
from ..models import ModelProvider, whole_run
from ..process.command import make_runner, root_spec
from ..process.detach import detach
from ..process.events import Feed, as_text, short, summary, when
from ..process.listing import (
    ps_rows,
    run_cost,
    total_cost,
    totals,
    totals_text,
    usage_row,
    usage_text,
)
from ..process.opened import Project, find_run
from ..process.rebuild import agents_dirs
from ..process.reconcile import reconcile
from ..process.stopping import cancel_tree
from ..project.repo import discover_sync
from ..run import RunRecord
from ..spec import RunSpec
from ..teams.review import branch_diff
from ..workspaces.registry import tier_config
from .inputs import (
    BranchInput,
    ListRunsInput,
    MergeInput,
    RunLogsInput,
    RunRef,
    TaskInput,
    TaskOutputInput,
)
from .limits import ServerLimits, check_room, tier_for

Progress = Callable[[float, str], Awaitable[None]]  # (seconds so far, what the run is doing)
PROGRESS_EVERY_S = 2.0
STOP_WAIT_S = 20.0
CLOSE_WAIT_S = 60.0  # for the runs it started to end when the server stops
DIFF_LIMIT = 100_000


@dataclass
class Answer:
    """A tool's result: text (what a client's model reads: MCP clients such as Claude Code
    show a structured result instead of the text, so none is sent), and whether it failed."""

    text: str
    is_error: bool = False


def _json(data: object) -> str:
    return json.dumps(data, indent=2, default=str)


@dataclass
class Desk:
    project: Project
    agents_dirs: list[Path] = field(default_factory=list)
    model_spec: str | None = None  # `orch mcp --model`: the default model of its runs
    limits: ServerLimits = field(default_factory=ServerLimits)
    runs: dict[str, asyncio.Task[RunRecord]] = field(default_factory=dict)  # foreground
    started: list[str] = field(default_factory=list)  # its runs not seen ended yet
    _runner: Runner | None = None
    _catalog: Catalog | None = None
    _exit: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    async def __aenter__(self) -> Desk:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        """The client has gone: its foreground runs are cancelled and end (their work
        committed); background runs, owned by the worker host, go on."""
        live = [t for t in self.runs.values() if not t.done()]
        for t in live:
            t.cancel()
        if live:
            await asyncio.wait(live, timeout=CLOSE_WAIT_S)
        await self._exit.aclose()
        self.project.store.close()

    # -- the runner ------------------------------------------------------------------------
    def catalog(self) -> Catalog:
        """The project's agents under its trust, as ``orch task`` loads them (once: the
        runner gets this one)."""
        if self._catalog is None:
            dirs = agents_dirs(self.project.root, self.project.settings, self.agents_dirs)
            found = load_catalog(
                self.project.root,
                agents_dirs=dirs,
                trust=self.project.trust,  # whose each agent is (catalog/owner.py)
                hidden=self.project.settings.sandbox.hidden,
            )
            self._catalog = guard(self.project.trust, found)
        return self._catalog

    def agents(self) -> str:
        """The agents a ``task`` may start (``subagent_type``), a line each, as orch's own
        agents see them in their ``task`` tool."""
        return agent_catalog(self.catalog().agents.values())

    async def runner(self) -> Runner:
        if self._runner is None:
            provider = ModelProvider(self.project.settings, self.model_spec)
            provider.check_ready()
            runner = make_runner(
                self.project,
                provider,
                self.agents_dirs,
                model_spec=self.model_spec,
                overrides={"model": self.model_spec},
                catalog=self.catalog(),
            )
            await self._exit.enter_async_context(runner.models)
            self._runner = runner
        return self._runner

    # -- task, task_output, task_stop ------------------------------------------------------
    async def task(self, args: TaskInput, progress: Progress) -> Answer:
        project = self.project
        if args.model is not None and whole_run(project.settings.resolve_model(args.model)):
            raise UsageError(
                f"model {args.model!r} plays a whole run (a script): start the server with "
                "`orch mcp --model ...` instead, or name a model alias or id"
            )
        self.started = [r for r in self.started if not project.store.require_run(r).status.ended]
        check_room(len(self.started), self.limits)
        if args.resume:
            spec = self._resumed(args)
        else:
            agent = self.catalog().agent(args.subagent_type or "general")
            isolation = tier_for(args.isolation, agent, self.limits)
            if tier_config(isolation).needs_git and not (project.root / ".git").exists():
                raise UsageError(
                    f"isolation {isolation} needs a git repository: start orch mcp in one "
                    "(or `git init` and commit)"
                )
            spec = root_spec(
                project,
                args.prompt,
                agent=agent.name,
                isolation=isolation,
                background=args.run_in_background,
                description=args.description,
            )
            if args.model:
                spec = spec.model_copy(update={"model": args.model})
        runner = await self.runner()
        handle = await runner.spawn(spec)
        self.started.append(handle.record.run_id)
        if spec.background:
            root, store, setting = project.root, project.store, project.settings.store
            record = await asyncio.to_thread(detach, root, handle.record, store, setting)
            data = {"task_id": record.run_id, "chain_id": record.chain_id, "status": "running"}
            return Answer(_json({**data, "collect_with": "task_output"}))
        job = asyncio.create_task(runner.run_handle(handle), name=f"mcp {handle.record.run_id}")
        self.runs = {r: t for r, t in self.runs.items() if not t.done()}
        self.runs[handle.record.run_id] = job
        try:
            await self._watch(job, handle.record.run_id, progress)
        except asyncio.CancelledError:
            job.cancel()  # the request went: so does its run (it ends on its own task)
            raise
        return self._result(self.project.store.require_run(handle.record.run_id))

    def _resumed(self, args: TaskInput) -> RunSpec:
        old = find_run(self.project.store, args.resume or "")
        if old.parent_run_id is not None:
            raise UsageError(
                f"{old.run_id} is a child run: its parent agent resumes it; resume a root run"
            )
        if old.isolation == "shared" and not self.limits.allow_shared:
            raise UsageError(
                f"{old.run_id} ran in your checkout (isolation shared), which is off for MCP "
                "clients; resume it with `orch resume`, or start the server with --allow-shared"
            )
        return RunSpec(
            prompt=args.prompt,
            workdir=self.project.workdir,
            resume=old.run_id,
            background=args.run_in_background,
            model=args.model,
        )

    async def _watch(self, job: asyncio.Task[RunRecord], run_id: str, progress: Progress) -> None:
        """Wait for ``job``, telling the client what the run does every few seconds."""
        started = time.monotonic()
        while not job.done():
            await asyncio.wait({job}, timeout=PROGRESS_EVERY_S)
            if not job.done():
                await progress(time.monotonic() - started, self._doing(run_id))

    def _doing(self, run_id: str) -> str:
        rec = self.project.store.get_run(run_id)
        if rec is None:
            return "starting"
        act = rec.last_activity.summary if rec.last_activity else rec.status.value
        u = rec.usage
        return f"{rec.run_id} {rec.status.value} · turns {u.turns} · tools {u.tool_uses} · {act}"

    def _result(self, record: RunRecord) -> Answer:
        out = format_child_result(record, self.project.settings.child_output_limit)
        return Answer(out.content, is_error=out.is_error)

    async def task_output(self, args: TaskOutputInput, progress: Progress) -> Answer:
        store = self.project.store
        rec = find_run(store, args.task_id)
        deadline = None if args.timeout_s is None else time.monotonic() + args.timeout_s
        started = told = time.monotonic()
        while args.block and not rec.status.ended:
            if deadline is not None and time.monotonic() >= deadline:
                break
            job = self.runs.get(rec.run_id)
            wait = PROGRESS_EVERY_S
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            if job is not None:
                await asyncio.wait({job}, timeout=wait)
            else:  # another process owns it: read its record as `orch result --wait` does
                await asyncio.sleep(min(wait, 0.2))
                await asyncio.to_thread(reconcile, store)
            rec = store.require_run(rec.run_id)
            if not rec.status.ended and time.monotonic() - told >= PROGRESS_EVERY_S:
                told = time.monotonic()  # progress every few seconds, however often it looks
                await progress(told - started, self._doing(rec.run_id))
        if rec.status.ended:
            return self._result(rec)
        data = {
            "task_id": rec.run_id,
            "status": rec.status.value,
            "tool_uses": rec.usage.tool_uses,
            "last_activity": rec.last_activity.summary if rec.last_activity else None,
            "summary": rec.summary[-1000:],
        }
        return Answer(_json(data))

    async def task_stop(self, args: RunRef) -> Answer:
        store = self.project.store
        rec = find_run(store, args.task_id)
        job = self.runs.get(rec.run_id)
        if job is not None and not job.done():  # ours: cancel it here, and wait for its end
            job.cancel()
            await asyncio.wait({job}, timeout=STOP_WAIT_S)
        final = await asyncio.to_thread(cancel_tree, store, rec, STOP_WAIT_S)
        rows = [{"task_id": r.run_id, "status": r.status.value} for r in final]
        stuck = [r for r in final if not r.status.ended]
        text = _json(rows)
        if stuck:
            text += f"\n{len(stuck)} run(s) did not stop within {STOP_WAIT_S:g}s; call again"
        return Answer(text, is_error=bool(stuck))

    # -- runs --------------------------------------------------------------------------------
    async def list_runs(self, args: ListRunsInput) -> Answer:
        store = self.project.store
        await asyncio.to_thread(reconcile, store)
        rows = ps_rows(store, show_all=args.all)[: args.limit]
        lines = [
            f"{r['run_id']} {r['agent']} d{r['depth']} {r['isolation']} {r['status']}"
            f" · {r['tokens']:,} tokens · {run_cost(r)} · {r['description']}"
            for r in rows
        ]
        text = "\n".join(lines) or "no runs" + ("" if args.all else " in the last hour")
        return Answer(text)

    async def run_result(self, args: RunRef) -> Answer:
        store = self.project.store
        await asyncio.to_thread(reconcile, store)
        rec = find_run(store, args.task_id)
        res = rec.result()
        full = store.output(rec.run_id)
        if full is not None:
            res.summary = full
        u = rec.usage
        used = totals(r.usage.model_dump() for r in [rec, *store.descendants(rec.run_id)])
        lines = [
            f"{rec.run_id} {rec.agent} {rec.isolation} {rec.status.value} · turns {u.turns} · "
            f"tools {u.tool_uses}",
            f"usage: {usage_text(usage_row(u.model_dump()))}",
            f"total_cost_usd: {used['total_cost_usd']} ("
            + (
                f"with the runs under it: {totals_text(used)})"
                if used["runs"] > 1
                else f"this run: {total_cost(used)})"
            ),
        ]
        if res.error:
            lines.append(f"error: {res.error}")
        lines += [branch_line(a) for a in rec.artifacts if a.get("kind") == "branch"]
        if (reached := of_run(store.events(rec.run_id))) is not None:
            lines.append(f"network: {egress_text(reached)}")
        where = f"the whole output: `orch result {rec.run_id} --json`"
        limit = self.project.settings.child_output_limit
        lines.append(cut(res.summary, limit, where) or "(no text yet)")
        return Answer("\n".join(lines))

    async def run_logs(self, args: RunLogsInput) -> Answer:
        store = self.project.store
        feed = Feed(store, find_run(store, args.task_id), tree=args.tree)
        events = feed.poll()[-args.limit :]
        lines = []
        for e in events:
            kind, data = as_text(e.get("kind")), e.get("data")
            said = summary(kind, data, feed.children) if isinstance(data, dict) else as_text(data)
            who = f"{short(e.get('run_id'))}/{feed.agent(str(e.get('run_id')))}"
            lines.append(f"{when(float(e['at']))} {who} {kind} {said}")
        return Answer("\n".join(lines) or "no events yet")

    # -- branches ----------------------------------------------------------------------------
    def _branch_of(self, target: str) -> str:
        target = target.strip()
        if "/" in target:
            return target
        try:
            return find_run(self.project.store, target).run_id
        except NotFound:
            return target

    async def branch_diff(self, args: BranchInput) -> Answer:
        root = self.project.root
        info = await asyncio.to_thread(find_branch, root, self._branch_of(args.target))
        base = info.base or info.head
        diff = await branch_diff(discover_sync(root), base, info.head, DIFF_LIMIT)
        head = (
            f"{info.branch} ({info.run_id or 'no run'}): {info.ahead} ahead, {info.behind} behind "
            f"your HEAD · {info.files_changed} files +{info.insertions} -{info.deletions}"
        )
        return Answer(f"{head}\n{diff}")

    async def merge_branch(self, args: MergeInput) -> Answer:
        """As `orch worktrees merge`, without its --stash or --allow-control-files: a dirty
        tree, a conflict or a change to control files is refused (a person merges those)."""
        root, target = self.project.root, self._branch_of(args.target)
        report = await asyncio.to_thread(merge, root, target, squash=args.squash)
        if report.already_merged:
            text = f"{report.branch} is already merged into {report.into}"
        else:
            how = "squash-merged" if report.squash else "merged"
            text = (
                f"{how} {report.branch} into {report.into} ({report.commit[:10]}): "
                f"{report.files_changed} files +{report.insertions} -{report.deletions}"
            )
        if report.warning:
            text += f"\n{report.warning}"
        return Answer(text)
