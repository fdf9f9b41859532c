"""The Runner: where every run, root or child, starts and ends.

``Runner.spawn(spec)`` is the one way in. It resolves the spec (agent
definition, model, tools never more than the parent's, chain position, tier
never weaker than the parent's), stores the run ``queued`` and starts it: as a
task of this process, or, for a root run asked for in the background, in a
detached worker process that picks it up with :meth:`Runner.adopt`. With an
``Executor`` (``--executor ray``), a worktree or container run that got its place is
executed on a cluster node instead (``executors/ray.py``), which adopts it there.

A started run waits for a slot (the per-parent cap), opens its workspace
(``async with``, the tier from ``spec.workspace``), runs a fresh ``AgentRun``
(or a :class:`Driver`, for orchestration code like a team) under its limits:
timeout, stall watchdog, SubagentStart hooks, and turns every way of ending
into a status. ``_finish`` is the one place that writes a run's ending.

The path of a ``task`` call: ``TaskTool.run`` → ``ChildSpawner.spawn``
(delegation.py) → ``Runner.spawn`` → ``Runner._execute`` → ``AgentRun.run``;
the child's record comes back to ``ChildSpawner``, which formats the one
tool_result the parent sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

from .admission import Admission
from .agent import AgentRun, LoopOutcome, RunContext
from .config import DEFAULT_COMMIT_EXCLUDE, Settings
from .definitions import AgentDefinition, Catalog
from .delegation import ChildSpawner, Executor, RunHandle, spawned_event
from .ending import announce, end_failed
from .errors import OrchError
from .gate import ChainGate
from .models import ModelProvider
from .paths import project_root
from .policy import Policy, run_hooks, scrubbed_env
from .process.owner import me, supervised, this_node
from .run import RunRecord, RunStatus, now
from .spec import RunSpec
from .store import RunStore, store_paths
from .tools import builtin_tools
from .tools.base import Tool, ToolContext, ToolRegistry
from .tools.delegate import delegation_tools
from .workspaces import RunOutcome, TierConfig, Workspace, WorkspaceSpec

Provision = Callable[[TierConfig, WorkspaceSpec], Workspace]


class Driver(Protocol):
    """Orchestration code run as a run of its own (e.g. a team's root) instead of a model."""

    definition: AgentDefinition

    async def drive(self, record: RunRecord, runner: Runner) -> LoopOutcome: ...


class Runner:
    def __init__(
        self,
        *,
        settings: Settings,
        store: RunStore,
        catalog: Catalog,
        models: ModelProvider,
        tools: list[Tool] | None = None,
        launch: dict[str, Any] | None = None,
        provision: Provision | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.settings = settings
        # How another process rebuilds this runner (kept with detached runs for their worker).
        self.launch = launch or {}
        # How a tier config becomes a workspace (tests inject a fake runtime here).
        self.provision: Provision = provision or (lambda config, spec: config.provision(spec))
        self.store = store
        self.executor = executor  # None: every run executes in this process
        self._here: dict[str, Path] = {}  # run id -> its workdir on this node (adopted remotely)
        self.held: dict[str, str] = {}  # run id -> the status _finish held back (on a node)
        self.catalog = catalog
        self.models = models
        self.tools = ToolRegistry(tools if tools is not None else builtin_tools())
        if tools is None:
            for tool in delegation_tools():
                self.tools.add(tool)
        self.jobs: dict[str, asyncio.Task[RunRecord]] = {}  # live runs of this process
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._progress: dict[str, float] = {}  # run id -> monotonic time of its last progress
        self._env: dict[str, str] | None = None
        self._state_dir: Path | None = None
        # Runs admitted by this process and not yet ended: their record as created (its
        # chain position and limits never change) and their resolved spec.
        self._live: dict[str, tuple[RunRecord, RunSpec]] = {}
        self._gates: dict[str, ChainGate] = {}  # chain id -> its max_chain_running gate
        self.rules = Admission(settings, store, catalog, models, self.tools)

    # -- starting runs ------------------------------------------------------------------
    async def spawn(self, spec: RunSpec, *, driver: Driver | None = None) -> RunHandle:
        """Store the run ``queued`` and start it (a background root: only stored, for the
        caller to detach, ``process/detach.py``); refusals raise OrchError, nothing stored."""
        record = self._admit(spec, driver)
        if record.parent_run_id is None and record.background and driver is None:
            return RunHandle(record, None)  # stored, unstarted: the CLI detaches it
        return RunHandle(record, self._start(record, driver))

    async def adopt(self, run_id: str, *, workdir: Path | None = None) -> RunRecord:
        """Run a stored queued run to its end (the detached worker's side of ``spawn``).

        ``workdir``: a cluster node's copy of the spawner's repository, where the run
        executes here whatever the executor (the node's side of ``Executor.run``)."""
        return await self.run_handle(self.start(run_id, workdir=workdir))

    def start(self, run_id: str, *, workdir: Path | None = None) -> RunHandle:
        """Start a stored queued run in this process without waiting for it (a worker host
        adopts many this way, under one supervisor of its own); no job if it is not queued."""
        record = self.store.require_run(run_id)
        if record.status != RunStatus.QUEUED:
            return RunHandle(record, None)
        if workdir is not None:
            self._here[run_id] = workdir
        return RunHandle(record, self._start(record, None))

    async def run(self, spec: RunSpec, *, driver: Driver | None = None) -> RunRecord:
        """Spawn a root run and wait for its end, with heartbeats and cancel requests."""
        return await self.run_handle(await self.spawn(spec, driver=driver))

    async def run_handle(self, handle: RunHandle) -> RunRecord:
        if handle.job is None:
            return handle.record
        async with self.supervised(), self.warm_pool(handle.record):
            try:
                return await handle.job
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # we were cancelled (Ctrl+C): the job was cancelled with us
                return self.store.require_run(handle.record.run_id)  # `orch cancel`

    async def wait(self, handle: RunHandle) -> RunRecord:
        """Wait for a child; if the waiter is cancelled, so is the child."""
        job = handle.job
        if job is None:
            return self.store.require_run(handle.record.run_id)
        try:
            async with self.waiting(handle.record.parent_run_id or ""):
                await asyncio.wait({job})
        except asyncio.CancelledError:
            await self.cancel([handle.record.run_id])
            raise
        return self.outcome(handle)

    def outcome(self, handle: RunHandle) -> RunRecord:
        """A finished run's record; one cancelled on its own is a result, not an error."""
        job = handle.job
        if job is None or job.cancelled():
            return self.store.require_run(handle.record.run_id)
        return job.result()

    async def cancel(self, run_ids: list[str]) -> None:
        jobs = [self.jobs[r] for r in run_ids if r in self.jobs and not self.jobs[r].done()]
        for job in jobs:
            job.cancel()
        if jobs:
            await asyncio.gather(*jobs, return_exceptions=True)

    def event(self, run_id: str, kind: str, data: dict[str, Any]) -> None:
        """An event in a run's stream (for drivers: they never write the store)."""
        self.store.add_event(run_id, kind, data)

    def _start(self, record: RunRecord, driver: Driver | None) -> asyncio.Task[RunRecord]:
        job = asyncio.create_task(self._execute(record, driver), name=f"orch-run-{record.run_id}")
        self.jobs[record.run_id] = job
        job.add_done_callback(lambda _: self.jobs.pop(record.run_id, None))
        return job

    # -- admission: resolve a spec into a stored record ----------------------------------
    def _admit(self, spec: RunSpec, driver: Driver | None) -> RunRecord:
        parent = None
        if spec.parent_run_id is not None:  # a live parent of this process: no store read
            live = self._live.get(spec.parent_run_id)
            parent = live[0] if live else self.store.require_run(spec.parent_run_id)
        record, resolved = self.rules.admit(
            spec, driver.definition if driver else None, parent, launch=self.launch
        )
        self.store.create_run(record)
        self._live[record.run_id] = (record, resolved)
        if parent is not None:
            self.store.add_event(parent.run_id, "child_spawned", spawned_event(record))
        return record

    # -- running ------------------------------------------------------------------------
    def child_env(self) -> dict[str, str]:
        """The scrubbed environment for child processes, computed once per runner."""
        if self._env is None:
            self._env = scrubbed_env(self.settings)
        return dict(self._env)

    def gate(self, record: RunRecord) -> ChainGate:
        """The in-process gate of the record's chain (max_chain_running)."""
        gate = self._gates.get(record.chain_id)
        if gate is None:
            running = int((record.options.get("budgets") or {}).get("running", 0))
            gate = ChainGate(running or self.settings.max_chain_running)
            self._gates[record.chain_id] = gate
        return gate

    @contextlib.asynccontextmanager
    async def waiting(self, run_id: str) -> AsyncIterator[None]:
        """While a run waits for its children, its place in the chain's gate is theirs."""
        live = self._live.get(run_id)
        if live is None:
            yield
            return
        async with self.gate(live[0]).waiting(run_id):
            yield

    def state_dir(self, workdir: Path) -> Path:
        """Where the store lives (hidden from sandboxed commands); found once per runner."""
        if self._state_dir is None:
            home = os.environ.get("ORCH_HOME")
            self._state_dir = Path(home) if home else project_root(workdir) / ".orch"
        return self._state_dir

    async def _execute(self, record: RunRecord, driver: Driver | None) -> RunRecord:
        slot = None
        if record.parent_run_id is not None:
            slot = self._slots.setdefault(
                record.parent_run_id, asyncio.Semaphore(self.settings.max_parallel_children)
            )
        acquired = False
        gate = self.gate(record)
        try:
            if slot is not None:
                await slot.acquire()
                acquired = True
            await gate.enter(record.run_id)  # queued until the chain has a place for it
            executor = self.executor
            if driver is None and record.run_id not in self._here and executor is not None:
                if executor.takes(record):
                    try:
                        return await executor.run(record)
                    except OrchError as e:  # its work could not come home: it failed
                        text = self.store.require_run(record.run_id).output
                        failed = LoopOutcome(RunStatus.FAILED, text, str(e))
                        return self._finish(record, None, failed, None)
            return await self._run(record, driver)
        except asyncio.CancelledError:
            ended = self.store.end_if_active(
                record.run_id,
                status=RunStatus.CANCELLED,
                ended_at=now(),
                error="cancelled before it started",
            )
            if ended is not None:
                self.store.add_event(record.run_id, "run_finished", {"status": "cancelled"})
            raise
        finally:
            gate.leave(record.run_id)
            if acquired and slot is not None:
                slot.release()
            if record.depth == 0 and gate.working == 0:
                self._gates.pop(record.chain_id, None)
            self._slots.pop(record.run_id, None)
            self._live.pop(record.run_id, None)
            self._here.pop(record.run_id, None)

    async def _run(self, record: RunRecord, driver: Driver | None) -> RunRecord:
        store = self.store
        live = self._live.get(record.run_id)
        spec = live[1] if live else RunSpec.model_validate(record.options["spec"])
        if record.run_id in self._here:
            spec = spec.model_copy(update={"workdir": self._here[record.run_id]})
        assert spec.workspace is not None  # _admit resolved it
        definition = driver.definition if driver else self.catalog.agent(record.agent)
        pid, pid_start = me()
        store.update_run(
            record.run_id, status=RunStatus.RUNNING, started_at=now(), pid=pid,
            pid_start=pid_start, node=this_node(),
        )  # fmt: skip
        store.add_event(record.run_id, "run_started", record.started_event())
        wspec = WorkspaceSpec(
            run_id=record.run_id, chain_id=record.chain_id, agent=record.agent,
            description=record.description, base=spec.workdir, sink=store,
            options={"include": self.settings.worktree_include,
                     "sandbox": self.settings.sandbox.model_dump(),
                     "network": definition.network or self.settings.network,
                     "extra_env": self.settings.extra_env,
                     "commit_exclude": [*DEFAULT_COMMIT_EXCLUDE, *self.settings.commit_exclude],
                     "state_dir": str(self.state_dir(spec.workdir)),
                     "store_paths": store_paths(self.store, spec.workdir),
                     "parent_run_id": record.parent_run_id},
        )  # fmt: skip
        outcome = LoopOutcome(RunStatus.FAILED, "", "did not start")
        ctx: RunContext | None = None
        workspace: Workspace | None = None
        try:
            workspace = self.provision(spec.workspace, wspec)
            async with workspace as ws:
                record = store.update_run(record.run_id, workspace=ws.info())
                notifications: list[str] = []
                evidence = record.evidence.model_copy()
                spawner = ChildSpawner(self, record, ws.root, notifications, evidence)
                ctx = RunContext(
                    record=record,
                    definition=definition,
                    settings=self.settings,
                    store=store,
                    model=self.models.get(record.model),
                    tools=self.tools,
                    policy=Policy.for_run(
                        self.settings, record.allowed_tools, record.depth, record.max_depth
                    ),
                    catalog=self.catalog,
                    tool_ctx=ToolContext(
                        run_id=record.run_id,
                        runtime=ws.runtime(),
                        settings=self.settings,
                        env={
                            **self.child_env(),
                            "ORCH_CHAIN_ID": record.chain_id,
                            "ORCH_PARENT_RUN_ID": record.run_id,
                            "ORCH_DEPTH": str(record.depth),
                        },
                        evidence=evidence,
                        spawner=spawner,
                        skills=self.catalog.skills,
                    ),
                    notifications=notifications,
                    host_root=ws.root,
                )
                try:
                    outcome = await self._guarded(ctx, spawner, driver)
                except asyncio.CancelledError:
                    outcome = LoopOutcome(RunStatus.CANCELLED, outcome.text, "cancelled")
                    raise
                finally:
                    # Background children end before the workspace closes, so what they
                    # wrote is in the commit of a worktree, not lost after it.
                    await asyncio.shield(spawner.close())
                    ws.set_outcome(
                        RunOutcome(status=outcome.status.value, description=record.description)
                    )
        except asyncio.CancelledError:
            cancelled = LoopOutcome(RunStatus.CANCELLED, outcome.text, "cancelled")
            self._finish(record, ctx, cancelled, workspace)
            raise
        except OrchError as e:
            outcome = LoopOutcome(RunStatus.FAILED, outcome.text, str(e))
        except Exception as e:  # never leave a run `running` behind a crash of ours
            outcome = LoopOutcome(RunStatus.FAILED, outcome.text, f"{type(e).__name__}: {e}")
        finally:
            self._progress.pop(record.run_id, None)
        return self._finish(record, ctx, outcome, workspace)

    async def _guarded(
        self, ctx: RunContext, spawner: ChildSpawner, driver: Driver | None
    ) -> LoopOutcome:
        """The run under its limits: timeout, stall watchdog, hooks, and errors as outcomes."""
        record = ctx.record
        loop = AgentRun(
            ctx,
            max_turns=int(record.options["max_turns"]),
            before_finish=spawner.before_finish,
            on_progress=lambda: self._progress.__setitem__(record.run_id, time.monotonic()),
        )
        timeout_seconds: float | None = record.options.get("timeout_seconds")
        stall = asyncio.timeout(None)
        stalled: list[bool] = []
        watchdog = asyncio.create_task(self._watch_stall(ctx, stall, stalled))
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
            async with asyncio.timeout(timeout_seconds), stall:
                if driver is not None:
                    return await driver.drive(record, self)
                history = None
                if record.resumed_from is not None:
                    history = self.store.transcript(record.resumed_from)
                    if history is None:
                        raise OrchError(f"the conversation of {record.resumed_from} is gone")
                return await loop.run(record.prompt, history)
        except TimeoutError:
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
        run_id = ctx.run_id
        self._progress[run_id] = time.monotonic()
        while True:
            await asyncio.sleep(min(limit / 4, 5.0))
            if ctx.inflight > 0:
                self._progress[run_id] = time.monotonic()
                continue
            rec_bg = self.store.get_run(run_id)
            idle = time.monotonic() - self._progress.get(run_id, time.monotonic())
            if rec_bg is not None and rec_bg.background and idle > limit:
                stalled.append(True)
                stall.reschedule(asyncio.get_running_loop().time())
                return

    def _finish(
        self,
        record: RunRecord,
        ctx: RunContext | None,
        outcome: LoopOutcome,
        workspace: Workspace | None,
    ) -> RunRecord:
        """The one place a run's ending is written. A run adopted on a cluster node keeps
        its status ``running`` here (held in ``held``): its spawner ends it with
        :meth:`end_held` once the node's work is home, so an ended run's branch is there."""
        artifacts = [*(workspace.artifacts() if workspace is not None else []), *outcome.artifacts]
        fields: dict[str, object] = {"output": outcome.text, "summary": outcome.text[:2000],
                                     "error": outcome.error, "artifacts": artifacts}  # fmt: skip
        held = record.run_id in self._here
        if not held:
            fields.update(status=outcome.status, ended_at=now())
        if ctx is not None:
            fields["usage"] = ctx.usage
            fields["evidence"] = ctx.evidence
        try:
            done = self.store.update_run(record.run_id, **fields)
            self.store.save_output(record.run_id, outcome.text)
        except Exception as e:  # written all the same: failed, with the reason (``ending``)
            return announce(self.store, end_failed(self.store, record.run_id, outcome.status, e))
        if held:
            self.held[record.run_id] = outcome.status.value
            return done.model_copy(update={"status": outcome.status})
        return self._ended(done)

    def end_held(self, run_id: str, status: str) -> RunRecord:
        """Write the status a node's ``_finish`` held back (no-op if it ended meanwhile)."""
        done = self.store.end_if_active(run_id, status=RunStatus(status), ended_at=now())
        return self._ended(done) if done is not None else self.store.require_run(run_id)

    def _ended(self, done: RunRecord) -> RunRecord:
        return announce(self.store, done)

    # -- around root runs ---------------------------------------------------------------
    def warm_pool(self, record: RunRecord) -> contextlib.AbstractAsyncContextManager[object]:
        """Keep ``sandbox.pool_size`` containers started (a no-op at 0) around a root run."""
        if self.settings.sandbox.pool_size <= 0:
            return contextlib.nullcontext()
        from .workspaces.pool import ContainerPool

        workdir = RunSpec.model_validate(record.options["spec"]).workdir
        return ContainerPool(workdir, self.settings.sandbox)

    def supervised(self) -> contextlib.AbstractAsyncContextManager[None]:
        return supervised(self.store, lambda: self.jobs)
