"""One run executing in this process, from its start to its ending.

A :class:`LiveRun` is what the Runner keeps of a run it admitted or adopted and
that has not ended: its record as created (its chain position and limits never
change), its resolved spec, where it executes and its job. An :class:`Execution`
runs it: opens its workspace (``async with``, the tier from ``spec.workspace``),
runs a fresh ``AgentRun`` (or a driver, for orchestration code like a team)
under its limits (timeout, stall watchdog, SubagentStart hooks), turns every way
of ending into a status and writes the ending with ``store.end``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..catalog.definitions import AgentDefinition, Catalog
from ..catalog.guidance import resolve_agent
from ..config import Settings
from ..egress.proxy import Door, Egress
from ..egress.rules import Reach
from ..errors import OrchError
from ..models import ModelProvider
from ..policy.checks import Policy, run_hooks
from ..run import RunRecord, RunStatus, now
from ..spec import RunSpec
from ..store import RunStore
from ..tools.base import BoardSeat, ToolContext, ToolRegistry
from ..workspaces import RunOutcome, TierConfig, Workspace, WorkspaceSpec
from ..workspaces.base import Runtime
from ..workspaces.registry import choose_tier, tier_config
from . import budget
from .agent import AgentRun, LoopOutcome, RunContext
from .calls import ToolCall
from .delegation import ChildSpawner, Engine
from .mcptools import RunTools, run_tools
from .memory import MemorySource
from .owner import me, this_node

Provision = Callable[[TierConfig, WorkspaceSpec], Workspace]
# a driver's body: the run's record, its workspace's runtime, its commands' environment
Drive = Callable[[RunRecord, Runtime, dict[str, str]], Awaitable[LoopOutcome]]


@dataclass
class LiveRun:
    """A run of this process that has not ended."""

    record: RunRecord  # as created: its chain position and limits never change
    spec: RunSpec  # resolved (agent, tier, workdir)
    here: Path | None = None  # a cluster node's copy of the spawner's repository: run there
    job: asyncio.Task[RunRecord] | None = None
    progress: float = field(default_factory=time.monotonic)  # its last progress (monotonic)
    workspace: Workspace | None = None  # while open: its children's specs name it
    notifications: list[str] | None = None  # while its loop runs: its next turn's notes
    said: str | None = None  # a description given since it started (``Runner.describe``)
    reach: Reach | None = None  # while open: what its commands reach (as its record says)

    @property
    def held(self) -> bool:
        """Adopted on a cluster node: its spawner writes its ending once its work is home."""
        return self.here is not None


class Host(Engine, Protocol):
    """What an execution needs of the Runner that started it."""

    catalog: Catalog
    models: ModelProvider
    tools: ToolRegistry
    provision: Provision
    held: dict[str, str]
    live: dict[str, LiveRun]  # the runs of this process that have not ended
    seats: dict[str, BoardSeat]  # run id -> its seat on a lead team's board
    egress: Egress  # the process's egress proxy (runs whose network is an allow-list)

    def child_env(self) -> dict[str, str]: ...

    def state_dir(self, workdir: Path) -> Path: ...

    def store_paths(self, workdir: Path) -> list[str]: ...

    async def memory(self, workdir: Path) -> MemorySource: ...


class Execution:
    def __init__(
        self,
        host: Host,
        live: LiveRun,
        definition: AgentDefinition,
        drive: Drive | None = None,
    ) -> None:
        self.host = host
        self.live = live
        self.definition = definition
        self.drive = drive  # a driver's, instead of a model loop
        self.settings: Settings = host.settings
        self.store: RunStore = host.store

    def _parent_workspace(self) -> Workspace | None:
        """The spawner's open workspace, when the spawner runs in this process."""
        parent = self.host.live.get(self.live.record.parent_run_id or "")
        return parent.workspace if parent is not None else None

    async def run(self) -> RunRecord:
        record, store, definition = self.live.record, self.store, self.definition
        spec = self.live.spec
        if self.live.here is not None:
            spec = spec.model_copy(update={"workdir": self.live.here})
        assert spec.workspace is not None  # admission resolved it
        pid, pid_start = me()
        started = {
            "status": RunStatus.RUNNING,
            "started_at": now(),
            "pid": pid,
            "pid_start": pid_start,
            "node": this_node(),
        }
        store.patch_run(record.run_id, **started)
        store.add_event(record.run_id, "run_started", record.started_event())
        reach = self._reach(record)
        wspec = WorkspaceSpec.for_run(
            self.settings,
            record,
            base=spec.workdir,
            sink=store,
            network=reach,
            egress=self._door(record.run_id, reach),  # (open while the workspace is)
            state_dir=self.host.state_dir(spec.workdir),
            store_paths=self.host.store_paths(spec.workdir),
            parent=self._parent_workspace(),
        )
        outcome = LoopOutcome(RunStatus.FAILED, "", "did not start")
        ctx: RunContext | None = None
        workspace: Workspace | None = None
        try:
            workspace = self.host.provision(spec.workspace, wspec)
            self.live.workspace = workspace
            async with self._opened(wspec.egress), workspace as ws:
                info = ws.info()  # progress, as the start: the run's own copy says the same
                store.patch_run(record.run_id, workspace=info)
                self.live.reach = Reach.from_info(info.get("network"))  # its children's bound
                record = record.model_copy(update={**started, "workspace": info})
                notifications: list[str] = []
                self.live.notifications = notifications  # Runner.notify appends here
                evidence = record.evidence.model_copy()
                spawner = ChildSpawner(self.host, record, ws.root, notifications, evidence)
                memory = None
                if self.settings.project_memory:
                    memory = await self.host.memory(spec.workdir)
                runtime, env = ws.runtime(), self._env(record)
                # its MCP servers start in its sandbox now, and stop when it ends
                async with run_tools(
                    record,
                    definition,
                    self.host.catalog,
                    self.host.tools,
                    runtime=runtime,
                    env=env,
                    settings=self.settings,
                    store=store,
                    model=self.drive is None,
                    network=info.get("network") == "host",
                ) as tools:
                    ctx = self._context(record, runtime, env, tools, spawner, notifications)
                    ctx.memory = memory
                    try:
                        outcome = await self._guarded(ctx, spawner)
                        self.live.notifications = None  # no turn will read them now
                    except asyncio.CancelledError:
                        outcome = LoopOutcome(RunStatus.CANCELLED, outcome.text, "cancelled")
                        raise
                    finally:
                        # Background children end before the workspace closes, so what
                        # they wrote is in the commit of a worktree, not lost after it.
                        await asyncio.shield(spawner.close())
                        said = self.live.said or record.description  # (Runner.describe)
                        ws.set_outcome(RunOutcome(status=outcome.status.value, description=said))
        except asyncio.CancelledError:
            cancelled = LoopOutcome(RunStatus.CANCELLED, outcome.text, "cancelled")
            self.finish(ctx, cancelled, workspace)
            raise
        except OrchError as e:
            outcome = LoopOutcome(RunStatus.FAILED, outcome.text, str(e))
        except Exception as e:  # never leave a run `running` behind a crash of ours
            outcome = LoopOutcome(RunStatus.FAILED, outcome.text, f"{type(e).__name__}: {e}")
        return self.finish(ctx, outcome, workspace)

    def _reach(self, record: RunRecord) -> Reach:
        """What the run's commands reach: the spawner's word, else its agent's, else the
        settings' network; never wider than its parent's (as the parent's record says: read
        from the store only when the parent runs in another process)."""
        asked = self.live.spec.network or self.definition.network or self.settings.network
        reach = Reach.of(asked)
        if record.parent_run_id is None:
            return reach
        live = self.host.live.get(record.parent_run_id)
        if live is not None and live.reach is not None:
            return reach.meet(live.reach)
        parent = self.store.get_run(record.parent_run_id)
        held = (parent.workspace or {}).get("network") if parent is not None else None
        return reach.meet(Reach.from_info(held))  # no record of it: no network

    def _door(self, run_id: str, reach: Reach) -> Door | None:
        """The run's door to the egress proxy (an allow-list only): each request through it
        an ``egress`` event of the run."""
        if reach.mode != "allow":
            return None
        store = self.store
        return Door.new(reach, lambda event: store.add_event(run_id, "egress", event))

    @contextlib.asynccontextmanager
    async def _opened(self, door: Door | None) -> AsyncIterator[None]:
        """``door`` open around the run's workspace (nothing without one)."""
        if door is None:
            yield
            return
        async with self.host.egress.opened(door):
            yield

    def _env(self, record: RunRecord) -> dict[str, str]:
        """The environment of the run's commands and servers (the tier whitelists it)."""
        return {
            **self.host.child_env(),
            "ORCH_CHAIN_ID": record.chain_id,
            "ORCH_PARENT_RUN_ID": record.run_id,
            "ORCH_DEPTH": str(record.depth),
        }

    def _context(
        self,
        record: RunRecord,
        runtime: Runtime,
        env: dict[str, str],
        tools: RunTools,
        spawner: ChildSpawner,
        notifications: list[str],
    ) -> RunContext:
        host, settings = self.host, self.settings
        return RunContext(
            record=record,
            definition=self.definition,
            settings=settings,
            store=self.store,
            model=host.models.get(record.model),
            tools=tools.registry,
            policy=Policy.for_run(settings, tools.allowed, record.depth, record.max_depth),
            catalog=host.catalog,
            tool_ctx=ToolContext(
                run_id=record.run_id,
                runtime=runtime,
                settings=settings,
                env=env,
                evidence=spawner.evidence,
                spawner=spawner,
                skills=host.catalog.skills,
                board=host.seats.get(record.run_id),
            ),
            notifications=notifications,
            host_root=self.live.workspace.root if self.live.workspace else None,
        )

    def _ahead(self, calls: list[ToolCall]) -> AbstractAsyncContextManager[object]:
        """A reply's foreground container children: their containers start now."""
        count, ws = 0, self.live.workspace
        for call in calls:
            args = call.sent.get("input")
            if call.sent.get("name") == "task" and isinstance(args, dict):
                with contextlib.suppress(OrchError, TypeError):  # admission will say why
                    asked = tier_config(args["isolation"]) if args.get("isolation") else None
                    agent = resolve_agent(self.host.catalog, args.get("subagent_type"))
                    tier = choose_tier(asked, agent.isolation, self.live.record.isolation)
                    count += tier.type == "container" and not args.get("run_in_background")
        if not count or ws is None:
            return contextlib.nullcontext()
        from ..workspaces.container.pool import ahead

        return ahead(ws.spec, count)

    def _progressed(self) -> None:
        self.live.progress = time.monotonic()

    async def _guarded(self, ctx: RunContext, spawner: ChildSpawner) -> LoopOutcome:
        """The run under its limits: timeout, stall watchdog, hooks, and errors as outcomes."""
        record, plan = ctx.record, self.live.record.planned()
        loop = AgentRun(
            ctx,
            max_turns=plan.max_turns,
            before_finish=spawner.before_finish,
            on_progress=self._progressed,
            ahead=self._ahead,
        )
        timeout_seconds = plan.timeout_seconds
        stall, away = asyncio.timeout(None), asyncio.timeout(None)
        stalled: list[bool] = []
        gone: list[float] = []  # how long the store had been away when the run stopped
        watchdog = asyncio.create_task(self._watch_stall(ctx, stall, stalled))
        storewatch = asyncio.create_task(self._watch_store(away, gone))
        try:  # a hook refused (hookguard.HookRefused) is an OrchError: the run fails
            if record.depth > 0 and self.settings.hooks.subagent_start:
                started = await run_hooks(
                    self.settings.hooks.subagent_start,
                    "SubagentStart",
                    record.agent,
                    {"run_id": record.run_id, "agent": record.agent, "prompt": record.prompt},
                    cwd=ctx.hook_cwd,
                    env=ctx.env,
                )
                if started.blocked:
                    why = f"SubagentStart hook: {started.message}"
                    return LoopOutcome(RunStatus.FAILED, "", why)
            async with asyncio.timeout(timeout_seconds), stall, away:
                if self.drive is not None:
                    return await self.drive(record, ctx.tool_ctx.runtime, ctx.env)
                history = None
                if record.resumed_from is not None:
                    history = self.store.transcript(record.resumed_from)
                    if history is None:
                        raise OrchError(f"the conversation of {record.resumed_from} is gone")
                return await loop.run(record.prompt, history)
        except TimeoutError:
            if gone:
                why = (
                    f"the store was unreachable for {gone[0]:.0f} s, more than store_outage_s"
                    f" ({self.settings.store_outage_s:g} s): the run stopped with its output so far"
                )
                return LoopOutcome(RunStatus.INTERRUPTED, loop.last_text, why)
            why = (
                f"stalled: no progress for {self.settings.stall_timeout:g}s"
                if stalled
                else f"timed out after {timeout_seconds:g}s"
            )
            return LoopOutcome(RunStatus.TIMED_OUT, loop.last_text, why)
        except OrchError as e:
            return LoopOutcome(RunStatus.FAILED, loop.last_text, str(e))
        except Exception as e:  # a model or tool bug must end the run, not the tree
            return LoopOutcome(RunStatus.FAILED, loop.last_text, f"{type(e).__name__}: {e}".strip())
        finally:
            watchdog.cancel()
            storewatch.cancel()

    async def _watch_store(self, away: asyncio.Timeout, gone: list[float]) -> None:
        """A run whose store is away longer than ``store_outage_s`` stops, ``interrupted``
        (its model calls and tools go on until then: they need no store)."""
        limit = self.settings.store_outage_s
        while True:
            await asyncio.sleep(min(max(limit / 4, 0.05), 1.0))
            since = self.store.away_since()
            if since is not None and time.time() - since > limit:
                gone.append(time.time() - since)
                away.reschedule(asyncio.get_running_loop().time())
                return

    async def _watch_stall(
        self, ctx: RunContext, stall: asyncio.Timeout, stalled: list[bool]
    ) -> None:
        """A background run with no progress for ``stall_timeout`` ends as timed_out.

        Progress is a model reply or a finished tool call; a run with a tool call (or a
        wait for its children) under way is busy, not stalled: those have their own limits.
        """
        limit = self.settings.stall_timeout
        if limit <= 0:
            return
        self._progressed()
        while True:
            await asyncio.sleep(min(limit / 4, 5.0))
            if ctx.inflight > 0:
                self._progressed()
                continue
            try:
                rec_bg = self.store.get_run(ctx.run_id)
            except Exception as e:  # the store away: looked at again next time
                if not self.store.transient(e):
                    raise
                continue
            idle = time.monotonic() - self.live.progress
            if rec_bg is not None and rec_bg.background and idle > limit:
                stalled.append(True)
                stall.reschedule(asyncio.get_running_loop().time())
                return

    def finish(
        self, ctx: RunContext | None, outcome: LoopOutcome, workspace: Workspace | None
    ) -> RunRecord:
        """Write the run's ending (``store.end``). A run adopted on a cluster node keeps its
        status ``running`` here (its status held in the Runner's ``held``): its spawner ends
        it with ``Runner.end_held`` once the node's work is home, so an ended run's branch
        is there."""
        run_id = self.live.record.run_id
        budget.forget(run_id)
        artifacts = [*(workspace.artifacts() if workspace is not None else []), *outcome.artifacts]
        fields: dict[str, object] = {
            "summary": outcome.text[:2000],
            "error": outcome.error,
            "artifacts": artifacts,
        }
        if ctx is not None:
            fields["usage"] = ctx.usage
            fields["evidence"] = ctx.evidence
        if self.live.held:
            try:
                held = self.store.update_run(run_id, output=outcome.text, **fields)
                self.store.save_output(run_id, outcome.text)
            except Exception:  # ended here after all: ``end`` writes what it can
                held = None
            if held is not None:
                self.host.held[run_id] = outcome.status.value
                return held.model_copy(update={"status": outcome.status})
        ended = self.store.end(run_id, outcome.status, output=outcome.text, owner=True, **fields)
        return ended if ended is not None else self.store.require_run(run_id)
