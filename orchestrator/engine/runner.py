"""The Runner: where every run, root or child, starts and ends.

``Runner.spawn(spec)`` is the one way in. It resolves the spec (agent
definition, model, tools never more than the parent's, chain position, tier
never weaker than the parent's), stores the run ``queued`` and starts it: as a
task of this process, or, for a root run asked for in the background, only stores it:
the CLI detaches it (``process/detach.py``) to a process that picks it up with
:meth:`Runner.adopt`. With an ``Executor`` (``--executor ray``), a worktree or container
run that got its place is executed on a cluster node instead (``process/cluster/``),
which adopts it there.

The Runner keeps one :class:`~orchestrator.engine.execution.LiveRun` per run of this
process that has not ended. A started run waits for its place (``gate.Places``:
the per-parent slots, the chain's gate), then executes
(:class:`~orchestrator.engine.execution.Execution`: its workspace, a fresh ``AgentRun``
or a :class:`Driver` under its limits). Every ending is written by
``store.end`` (``store/base.py``), with its one ``run_finished`` event.

The path of a ``task`` call: ``TaskTool.run`` → ``ChildSpawner.spawn``
(delegation.py) → ``Runner.spawn`` → ``Runner._execute`` → ``Execution.run`` →
``AgentRun.run``;
the child's record comes back to ``ChildSpawner``, which formats the one
tool_result the parent sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..catalog.definitions import AgentDefinition, Catalog
from ..config import Settings
from ..egress.proxy import Egress
from ..errors import OrchError
from ..models import ModelProvider
from ..policy.checks import scrubbed_env
from ..project.paths import project_root
from ..run import RunRecord, RunStatus
from ..spec import Launch, RunSpec
from ..store import ChainFull, RunStore, store_paths
from ..store.journal import outlast
from ..tools import builtin_tools
from ..tools.base import BoardSeat, Tool, ToolRegistry
from ..tools.boardtools import board_tools
from ..tools.delegate import delegation_tools
from ..workspaces.base import Runtime
from .admission import Admission
from .agent import LoopOutcome
from .creations import Creations
from .delegation import Executor, RunHandle, spawned_event
from .execution import Drive, Execution, LiveRun, Provision
from .gate import Places
from .memory import MemorySource, memory_source
from .owner import supervised


@dataclass
class Driven:
    """What a driver's run gives its driver: its record, the runner (to start children),
    and its workspace's runtime with the environment of its commands."""

    record: RunRecord
    runner: Runner
    runtime: Runtime
    env: dict[str, str]


class Driver(Protocol):
    """Orchestration code run as a run of its own (a team's root, a team's test gate)
    instead of a model."""

    definition: AgentDefinition

    async def drive(self, run: Driven) -> LoopOutcome: ...


# How a stored ``RunSpec.driver`` (a kind and its parameters) becomes its driver again: in
# the process that starts it, a detached worker that adopts it, or ``orch resume``. Made
# outside the engine (``process/rebuild.py``): the drivers import the engine, not the reverse.
DriverFactory = Callable[["Runner", Mapping[str, Any]], Driver]


class Runner:
    def __init__(
        self,
        *,
        settings: Settings,
        store: RunStore,
        catalog: Catalog,
        models: ModelProvider,
        tools: list[Tool] | None = None,
        launch: Launch | None = None,
        provision: Provision | None = None,
        executor: Executor | None = None,
        drivers: Mapping[str, DriverFactory] | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.catalog = catalog
        self.models = models
        self.tools = ToolRegistry(tools if tools is not None else builtin_tools())
        if tools is None:
            for tool in [*delegation_tools(), *board_tools()]:
                self.tools.add(tool)
        # How another process rebuilds this runner (kept with detached runs for their worker).
        self.launch = launch or Launch()
        # How a tier config becomes a workspace (tests inject a fake runtime here).
        self.provision: Provision = provision or (lambda config, spec: config.provision(spec))
        self.executor = executor  # None: every run executes in this process
        self.drivers: dict[str, DriverFactory] = dict(drivers or {})
        self.egress = Egress()  # one egress proxy for the process's runs, while any needs it
        self.seats: dict[str, BoardSeat] = {}  # run id -> its seat on a lead team's board
        self.live: dict[str, LiveRun] = {}  # runs admitted or adopted here, not yet ended
        self.held: dict[str, str] = {}  # run id -> the status its ending held back (on a node)
        self.places = Places(settings.max_parallel_children, settings.max_chain_running)
        self._env: dict[str, str] | None = None
        self._state_dir: Path | None = None
        self._store_paths: dict[Path, list[str]] = {}
        self._memory: dict[Path, asyncio.Future[MemorySource]] = {}
        self.rules = Admission(settings, store, catalog, models, self.tools)
        self.creations = Creations(store, patience_s=settings.store_outage_s)

    @property
    def jobs(self) -> dict[str, asyncio.Task[RunRecord]]:
        """The jobs of the live runs of this process, by run id."""
        return {rid: live.job for rid, live in self.live.items() if live.job is not None}

    # -- starting runs ------------------------------------------------------------------
    async def spawn(self, spec: RunSpec, *, driver: Driver | None = None) -> RunHandle:
        """Store the run ``queued`` and start it (a background root: only stored, for the
        caller to detach, ``process/detach.py``); refusals raise OrchError, nothing stored.

        ``driver``: code that runs as the run (a team's gate); a spec's ``driver`` (a team's
        root) is built from ``drivers``, and again by whichever process adopts the run."""
        if driver is None and spec.driver is None and spec.resume:  # a driven run goes on
            old = self.store.get_run(spec.resume)
            if old is not None and old.plan is not None and old.plan.spec.driver is not None:
                spec = spec.model_copy(update={"driver": old.plan.spec.driver})
        if driver is None and spec.driver is not None:
            driver = self.driver_for(spec)
        record = await self._admit(spec, driver)
        if record.parent_run_id is None and record.background:
            self.live.pop(record.run_id, None)
            return RunHandle(record, None)  # stored, unstarted: the CLI detaches it
        return RunHandle(record, self._start(self.live[record.run_id], driver))

    def driver_for(self, spec: RunSpec) -> Driver | None:
        """The driver a spec names (None: a model runs it); OrchError if none is known."""
        call = spec.driver
        if call is None:
            return None
        factory = self.drivers.get(call.kind)
        if factory is None:
            raise OrchError(f"this orch cannot run a {call.kind!r} run (no such driver)")
        return factory(self, call.params)

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
        try:
            spec = record.planned().spec
            driver = self.driver_for(spec)
        except OrchError as e:
            ended = self.store.end(run_id, RunStatus.FAILED, error=str(e))
            return RunHandle(ended or self.store.require_run(run_id), None)
        live = LiveRun(record, spec, here=workdir)
        self.live[run_id] = live
        return RunHandle(record, self._start(live, driver))

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
            finally:
                self.store.flush()  # the tree's last progress: no loop turn may come
                if self.store.unwritten() and self._state_dir is not None:
                    # the store is away: its endings wait for it, then are journaled
                    await outlast(self.store, self._state_dir, self.settings.store_outage_s)

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
        live = self.jobs
        jobs = [live[r] for r in run_ids if r in live and not live[r].done()]
        for job in jobs:
            job.cancel()
        if jobs:
            await asyncio.gather(*jobs, return_exceptions=True)

    def notify(self, run_id: str, text: str) -> bool:
        """Hand ``text`` to a live run of this process at its next turn (False: not live)."""
        live = self.live.get(run_id)
        if live is None or live.notifications is None:
            return False
        live.notifications.append(text)
        return True

    def describe(self, run_id: str, text: str) -> None:
        """A live run's new description (a teammate's task): shown by `orch ps`, and the
        subject of the commit its workspace makes at close."""
        self.store.patch_run(run_id, description=text)
        if (live := self.live.get(run_id)) is not None:
            live.said = text

    def progress(self, run_id: str, state: dict[str, Any]) -> None:
        """A driver's state, replacing the last (``RunRecord.progress``)."""
        self.store.patch_run(run_id, progress=state)

    def event(self, run_id: str, kind: str, data: dict[str, Any]) -> None:
        """An event in a run's stream (for drivers: they never write the store)."""
        self.store.add_event(run_id, kind, data)

    def _start(self, live: LiveRun, driver: Driver | None) -> asyncio.Task[RunRecord]:
        run_id = live.record.run_id
        job = asyncio.create_task(self._execute(live, driver), name=f"orch-run-{run_id}")
        live.job = job
        job.add_done_callback(lambda _: self.live.pop(run_id, None))
        job.add_done_callback(lambda done: self._never_started(run_id, done))
        return job

    def _never_started(self, run_id: str, job: asyncio.Task[RunRecord]) -> None:
        """A job cancelled before its first step never ran ``_execute`` (nor its ``except``):
        its run, still queued, ends ``cancelled`` here (a run that ended keeps its ending)."""
        if job.cancelled():
            self.store.end(run_id, RunStatus.CANCELLED, error="cancelled before it started")

    # -- admission: resolve a spec into a stored record ----------------------------------
    async def _admit(self, spec: RunSpec, driver: Driver | None) -> RunRecord:
        parent = None
        if spec.parent_run_id is not None:  # a live parent of this process: no store read
            live = self.live.get(spec.parent_run_id)
            parent = live.record if live else self.store.require_run(spec.parent_run_id)
        record, resolved = self.rules.admit(
            spec, driver.definition if driver else None, parent, launch=self.launch
        )
        try:  # stored with the turn's others; its chain's budgets checked in that commit
            await self.creations.store_run(record, self.rules.room(record))
        except ChainFull as full:
            raise self.rules.refusal(full) from None
        self.live[record.run_id] = LiveRun(record, resolved)
        if parent is not None:
            self.store.add_event(parent.run_id, "child_spawned", spawned_event(record))
        return record

    # -- running ------------------------------------------------------------------------
    def child_env(self) -> dict[str, str]:
        """The scrubbed environment for child processes, computed once per runner."""
        if self._env is None:
            self._env = scrubbed_env(self.settings)
        return dict(self._env)

    @contextlib.asynccontextmanager
    async def waiting(self, run_id: str) -> AsyncIterator[None]:
        """While a run waits for its children, its place in the chain's gate is theirs."""
        live = self.live.get(run_id)
        if live is None:
            yield
            return
        async with self.places.gate(live.record).waiting(run_id):
            yield

    def state_dir(self, workdir: Path) -> Path:
        """Where the store lives (hidden from sandboxed commands); found once per runner."""
        if self._state_dir is None:
            home = os.environ.get("ORCH_HOME")
            self._state_dir = Path(home) if home else project_root(workdir) / ".orch"
        return self._state_dir

    def store_paths(self, workdir: Path) -> list[str]:
        """Every path through which a run in ``workdir`` reaches a store (``store_paths``),
        found once per workdir: what an agent later plants there (a ``.git`` that makes
        its directory a project of its own) cannot move the store out of the hidden set."""
        if (found := self._store_paths.get(workdir)) is None:
            found = self._store_paths[workdir] = store_paths(self.store, workdir)
        return found

    async def memory(self, workdir: Path) -> MemorySource:
        """Where the memory files (CLAUDE.md, AGENTS.md) of a run spawned from ``workdir``
        come from, found once per workdir (one ``git rev-parse`` and the hidden paths, in a
        thread): a hundred children of one directory search once, and what an agent later
        plants there (a ``.git`` file) cannot move it."""
        if (found := self._memory.get(workdir)) is None:  # one search, many waiters
            stores = [str(p) for p in self.store.paths()]
            hidden = self.settings.sandbox.hidden
            search = asyncio.to_thread(memory_source, workdir, hidden, stores)
            found = self._memory[workdir] = asyncio.ensure_future(search)
        return await asyncio.shield(found)

    async def _execute(self, live: LiveRun, driver: Driver | None) -> RunRecord:
        record = live.record
        try:
            async with self.places.taken(record):  # queued until the chain has a place
                executor = self.executor
                # a run a driver granted tools to stays with its driver (its board is here)
                local = driver is not None or live.held or bool(live.spec.grants)
                if not local and executor is not None:
                    if executor.takes(record):
                        try:
                            return await executor.run(record)
                        except OrchError as e:  # its work could not come home: it failed
                            text = self.store.require_run(record.run_id).output
                            ended = self.store.end(
                                record.run_id,
                                RunStatus.FAILED,
                                output=text,
                                owner=True,
                                summary=text[:2000],
                                error=str(e),
                                artifacts=[],
                            )
                            return ended or self.store.require_run(record.run_id)
                definition = driver.definition if driver else self.catalog.agent(record.agent)
                return await Execution(self, live, definition, self._body(driver)).run()
        except asyncio.CancelledError:
            self.store.end(record.run_id, RunStatus.CANCELLED, error="cancelled before it started")
            raise

    def _body(self, driver: Driver | None) -> Drive | None:
        """A driver as the body of its run's execution (None: a model's loop)."""
        if driver is None:
            return None
        code = driver

        async def body(record: RunRecord, runtime: Runtime, env: dict[str, str]) -> LoopOutcome:
            return await code.drive(Driven(record, self, runtime, env))

        return body

    def end_held(self, run_id: str, status: str) -> RunRecord:
        """Write the status a node's run held back (no-op if it ended meanwhile)."""
        done = self.store.end(run_id, RunStatus(status))
        return done if done is not None else self.store.require_run(run_id)

    # -- around root runs ---------------------------------------------------------------
    def warm_pool(self, record: RunRecord) -> contextlib.AbstractAsyncContextManager[object]:
        """Keep ``sandbox.pool_size`` containers started (a no-op at 0) around a root run."""
        if self.settings.sandbox.pool_size <= 0:
            return contextlib.nullcontext()
        from ..workspaces.container.pool import ContainerPool

        return ContainerPool(record.planned().spec.workdir, self.settings.sandbox)

    def supervised(self) -> contextlib.AbstractAsyncContextManager[None]:
        return supervised(self.store, lambda: self.jobs)
