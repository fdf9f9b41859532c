"""The lifecycle of one run, root or child: from ``queued`` to an end.

``execute`` waits for a slot (the per-parent concurrency cap), opens the run's
workspace (``async with``: shared / worktree / container), runs a fresh
``AgentRun`` under its limits (timeout, stall watchdog for background runs,
SubagentStart hooks), turns every way of ending into a status, and writes the
outcome (status, text, usage, evidence, artifacts) to the store. Cancelling a
run cancels the background children it started, and still records what its
workspace kept. ``Delegator`` (``delegation.py``) builds on this class.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from .agent import AgentRun, LoopOutcome, RunContext
from .background import me
from .config import Settings
from .definitions import AgentDefinition, Catalog
from .errors import OrchError
from .models import ModelProvider
from .policy import Policy, run_hooks, scrubbed_env
from .run import RunRecord, RunStatus, now
from .store import Store
from .tools.base import ToolRegistry
from .workspaces import RunOutcome, Workspace, WorkspaceSpec, open_workspace

if TYPE_CHECKING:
    from .delegation import Delegator


class RunLifecycle:
    settings: Settings
    store: Store
    catalog: Catalog
    models: ModelProvider
    tools: ToolRegistry
    jobs: dict[str, asyncio.Task[RunRecord]]  # live runs of this process
    background: dict[str, set[str]]  # parent run id -> its background children
    _slots: dict[str, asyncio.Semaphore]
    _progress: dict[str, float]  # run id -> monotonic time of its last progress

    _env: dict[str, str] | None = None

    def child_env(self) -> dict[str, str]:
        """The scrubbed environment for child processes, computed once per delegator."""
        if self._env is None:
            self._env = scrubbed_env(self.settings)
        return dict(self._env)

    async def _before_finish(self, ctx: RunContext) -> bool:
        """True sends a run that would end back to work (see Delegator)."""
        return False

    async def _cancel_jobs(self, run_ids: list[str]) -> None:
        jobs = [self.jobs[r] for r in run_ids if r in self.jobs and not self.jobs[r].done()]
        for job in jobs:
            job.cancel()
        if jobs:
            await asyncio.gather(*jobs, return_exceptions=True)

    async def execute(
        self,
        record: RunRecord,
        definition: AgentDefinition,
        *,
        base: Path,
        max_turns: int,
        timeout_seconds: float | None,
        slot_owner: str | None = None,
    ) -> RunRecord:
        slot = None
        if slot_owner is not None:
            slot = self._slots.setdefault(
                slot_owner, asyncio.Semaphore(self.settings.max_parallel_children)
            )
        acquired = False
        try:
            if slot is not None:
                await slot.acquire()
                acquired = True
            return await self._run(record, definition, base, max_turns, timeout_seconds)
        except asyncio.CancelledError:
            current = self.store.get_run(record.run_id)
            if current is not None and not current.status.ended:
                self.store.update_run(
                    record.run_id,
                    status=RunStatus.CANCELLED,
                    ended_at=now(),
                    error="cancelled before it started",
                )
                self.store.add_event(record.run_id, "run_finished", {"status": "cancelled"})
            raise
        finally:
            if acquired and slot is not None:
                slot.release()
            # Cascade: whatever this run left in the background ends with it.
            await asyncio.shield(self._cancel_jobs(list(self.background.pop(record.run_id, ()))))
            self._slots.pop(record.run_id, None)

    async def _run(
        self,
        record: RunRecord,
        definition: AgentDefinition,
        base: Path,
        max_turns: int,
        timeout_seconds: float | None,
    ) -> RunRecord:
        store = self.store
        pid, pid_start = me()
        store.update_run(
            record.run_id, status=RunStatus.RUNNING, started_at=now(), pid=pid, pid_start=pid_start
        )
        store.add_event(
            record.run_id,
            "run_started",
            {
                "agent": record.agent,
                "model": record.model,
                "depth": record.depth,
                "max_depth": record.max_depth,
                "chain_id": record.chain_id,
                "parent_run_id": record.parent_run_id,
                "allowed_tools": record.allowed_tools,
                "isolation": record.isolation,
            },
        )
        spec = WorkspaceSpec(
            run_id=record.run_id,
            chain_id=record.chain_id,
            agent=record.agent,
            description=record.description,
            base=base,
            sink=store,
            options={
                "include": self.settings.worktree_include,
                "sandbox": self.settings.sandbox.model_dump(),
                **record.options.get("workspace", {}),
            },
        )
        outcome = LoopOutcome(RunStatus.FAILED, "", "did not start")
        ctx: RunContext | None = None
        workspace: Workspace | None = None
        artifacts: list[dict[str, Any]] = []
        try:
            policy = Policy.for_run(
                self.settings, record.allowed_tools, record.depth, record.max_depth
            )
            workspace = open_workspace(record.isolation, spec)
            async with workspace as ws:
                ctx = RunContext(
                    record=record,
                    definition=definition,
                    settings=self.settings,
                    store=store,
                    model=self.models.get(record.model),
                    model_name=record.model,
                    tools=self.tools,
                    policy=policy,
                    workspace=ws,
                    env=self.child_env(),
                    catalog=self.catalog,
                    delegator=cast("Delegator", self),  # the only subclass
                )
                store.update_run(record.run_id, workspace=ws.info())
                loop = AgentRun(
                    ctx,
                    max_turns=max_turns,
                    before_finish=self._before_finish,
                    on_progress=lambda: self._progress.__setitem__(record.run_id, time.monotonic()),
                )
                try:
                    outcome = await self._guarded(loop, record, timeout_seconds)
                except asyncio.CancelledError:
                    outcome = LoopOutcome(RunStatus.CANCELLED, loop.last_text, "cancelled")
                    raise
                finally:
                    # Background children end before the workspace closes, so what they
                    # wrote is in the commit of a worktree, not lost after it.
                    await asyncio.shield(
                        self._cancel_jobs(list(self.background.pop(record.run_id, ())))
                    )
                    ws.set_outcome(
                        RunOutcome(status=outcome.status.value, description=record.description)
                    )
            artifacts = ws.artifacts()
        except asyncio.CancelledError:
            # Record what the workspace kept (e.g. a branch with the work) before going on.
            artifacts = workspace.artifacts() if workspace is not None else []
            cancelled = LoopOutcome(RunStatus.CANCELLED, outcome.text, "cancelled")
            self._finish(record, ctx, cancelled, artifacts)
            raise
        except OrchError as e:
            outcome = LoopOutcome(RunStatus.FAILED, outcome.text, str(e))
        except Exception as e:  # never leave a run `running` behind a crash of ours
            outcome = LoopOutcome(RunStatus.FAILED, outcome.text, f"{type(e).__name__}: {e}")
        finally:
            self._progress.pop(record.run_id, None)
        return self._finish(record, ctx, outcome, artifacts)

    async def _guarded(
        self, loop: AgentRun, record: RunRecord, timeout_seconds: float | None
    ) -> LoopOutcome:
        """The loop under its limits: timeout, stall watchdog, hooks, and errors as outcomes."""
        ctx = loop.ctx
        if record.depth > 0 and self.settings.hooks.subagent_start:
            started = await run_hooks(
                self.settings.hooks.subagent_start,
                "SubagentStart",
                record.agent,
                {"run_id": record.run_id, "agent": record.agent, "prompt": record.prompt},
                cwd=ctx.workspace.root,
                env=ctx.env,
            )
            if started.blocked:
                return LoopOutcome(RunStatus.FAILED, "", f"SubagentStart hook: {started.message}")
        stall = asyncio.timeout(None)
        stalled: list[bool] = []
        watchdog = asyncio.create_task(self._watch_stall(ctx, stall, stalled))
        try:
            async with asyncio.timeout(timeout_seconds), stall:
                return await loop.run(record.prompt)
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
        artifacts: list[dict[str, Any]],
    ) -> RunRecord:
        fields: dict[str, object] = {
            "status": outcome.status,
            "output": outcome.text,
            "summary": outcome.text[:2000],
            "error": outcome.error,
            "artifacts": artifacts,
            "ended_at": now(),
        }
        if ctx is not None:
            fields["usage"] = ctx.usage
            fields["evidence"] = ctx.evidence
        done = self.store.update_run(record.run_id, **fields)
        self.store.save_output(record.run_id, outcome.text)
        self.store.add_event(
            record.run_id,
            "run_finished",
            {
                "status": outcome.status.value,
                "error": outcome.error,
                "usage": done.usage.model_dump(),
                "evidence": done.evidence.model_dump(),
                "artifacts": artifacts,
            },
        )
        return done
