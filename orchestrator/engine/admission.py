"""Admission: how a RunSpec becomes a run record, and the rules it is held to.

Everything a spec may ask for is checked here, once, before anything runs: the
agent (Claude Code names mapped), the chain position (a child: same chain,
depth + 1, refused at ``max_depth``), the caller's allow-list of agents, the
tools (never more than the parent's), the model, the chain's budgets (runs and
tokens in total; a child past them is refused naming the budget) and the tier
(never weaker than the parent's). The Runner stores what comes out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..catalog.definitions import AgentDefinition, Catalog
from ..catalog.guidance import ALIASES, resolve_agent
from ..config import Settings
from ..errors import OrchError
from ..mcpclient.names import with_denies
from ..models import ModelProvider
from ..policy.checks import child_tools
from ..run import RunRecord, first_line, new_chain_id, new_run_id
from ..spec import Budgets, Launch, RunPlan, RunSpec
from ..store import ChainFull, ChainRoom, RunStore
from ..tools.base import ToolRegistry
from ..workspaces.registry import choose_tier, saved_state, tier_config
from ..workspaces.saved import BranchState
from .budget import more, used_up
from .owner import me, this_node

MAX_RESUMES = 100  # how far back a resumed run's lineage is followed


def branch_exists(workdir: Path, branch: str) -> bool:
    """Whether the repository of ``workdir`` has ``refs/heads/<branch>`` (a run that
    changed nothing left no branch: its continuation starts a new one)."""
    from ..project.git import git_sync
    from ..project.repo import discover_sync

    try:
        repo = discover_sync(workdir)
        found = git_sync(
            "rev-parse", "--verify", "-q", f"refs/heads/{branch}", repo=repo, check=False
        )
    except OrchError:
        return False
    return found.code == 0


@dataclass
class Admission:
    """The rules a spec is held to, over the runner's settings, store, agents, models and
    tools."""

    settings: Settings
    store: RunStore
    catalog: Catalog
    models: ModelProvider
    tools: ToolRegistry

    def admit(
        self,
        spec: RunSpec,
        driving: AgentDefinition | None,
        parent: RunRecord | None,
        *,
        launch: Launch,
    ) -> tuple[RunRecord, RunSpec]:
        """The record of a new run (not yet stored) and its resolved spec; refusals raise
        OrchError with a message the caller (often a model) can act on."""
        resumed = self.resumable(spec, parent) if spec.resume else None
        if resumed is not None:
            spec = self.continuation(spec, resumed)
        definition = driving or resolve_agent(self.catalog, spec.agent)
        granted = self.tools.granted()  # never from a definition, only a driver's grant
        requested = [t for t in definition.allowed_tools(self.tools.names()) if t not in granted]
        requested += [t for t in dict.fromkeys(spec.grants) if t in granted]
        own_denies = self.catalog.denies(definition)  # a repository agent: no user server
        if resumed is not None and parent is None:  # a root goes on in its own chain
            chain_id, depth, max_depth = resumed.chain_id, resumed.depth, resumed.max_depth
            allowed = with_denies(requested, own_denies)
            model = self.models.resolve(spec.model or resumed.model)
        elif parent is None:
            spec = spec.model_copy(update={"workdir": spec.workdir.resolve()})
            chain_id, depth = new_chain_id(), 0
            max_depth = self.settings.max_depth
            if spec.limits.max_depth is not None:
                max_depth = spec.limits.max_depth
            allowed = with_denies(requested, own_denies)
            model = self.models.resolve(spec.model or definition.model)
        else:
            if parent.depth >= parent.max_depth:
                raise OrchError(
                    f"depth limit reached: run {parent.run_id} is at depth {parent.depth} and "
                    f"max_depth is {parent.max_depth}; do the work yourself"
                )
            chain_id, depth, max_depth = parent.chain_id, parent.depth + 1, parent.max_depth
            caller = self.catalog.agents.get(parent.agent)
            if caller is not None and caller.agents is not None and driving is None:
                if definition.name not in caller.agents:
                    raise OrchError(
                        f"agent {parent.agent!r} may start only {', '.join(caller.agents)}; "
                        f"not {definition.name!r}"
                    )
            allowed = child_tools(parent.allowed_tools, requested)  # never more than its parent
            allowed = with_denies(allowed, parent.allowed_tools, own_denies)
            model = self.models.resolve(spec.model or definition.model or parent.model or None)
        budgets = self.budgets(parent or resumed)
        tier = choose_tier(
            spec.workspace, definition.isolation, parent.isolation if parent else None
        )
        resolved = spec.model_copy(update={"workspace": tier, "agent": definition.name})
        pid, pid_start = me()
        record = RunRecord(
            run_id=new_run_id(),
            chain_id=chain_id,
            parent_run_id=parent.run_id if parent else None,
            depth=depth,
            max_depth=max_depth,
            resumed_from=resumed.run_id if resumed else None,
            agent=definition.name,
            description=spec.description
            or (resumed.description if resumed else "")
            or (first_line(spec.prompt)[:80] if parent is None else ""),
            isolation=tier.type,
            background=spec.background or (definition.background and parent is not None),
            model=model,
            prompt=spec.prompt,
            allowed_tools=allowed,
            pid=pid,
            pid_start=pid_start,
            node=this_node(),
            plan=RunPlan(
                spec=resolved,
                max_turns=spec.limits.max_turns or definition.max_turns or self.settings.max_turns,
                timeout_seconds=spec.limits.timeout_seconds or self.settings.timeout_seconds,
                budgets=budgets,
            ),
            launch=launch if spec.background and parent is None else Launch(),
        )
        return record, resolved

    def resumable(self, spec: RunSpec, parent: RunRecord | None) -> RunRecord:
        """The run ``spec.resume`` names, if it may be continued by this caller: it exists,
        was started by the same parent (a root: is a root), has ended, and has a transcript."""
        rid = spec.resume or ""
        old = self.store.get_run(rid)
        if old is None or old.parent_run_id not in self.callers(parent):
            whose = "by this agent" if parent else "as a root run (resume a child through task)"
            raise OrchError(f"cannot resume {rid!r}: no such task was started {whose}")
        if not old.status.ended:
            raise OrchError(
                f"cannot resume {rid}: it is still {old.status.value}; wait for it "
                "(task_output) or stop it (task_stop) first"
            )
        driven = old.plan is not None and old.plan.spec.driver is not None
        if not driven and self.store.transcript(rid) is None:  # a driver keeps its own state
            raise OrchError(
                f"cannot resume {rid}: its conversation was not kept (transcript_retention_days); "
                "start a new task"
            )
        return old

    def callers(self, parent: RunRecord | None) -> set[str | None]:
        """Whose children ``parent`` may resume: its own, and those of the runs it continues
        (a resumed run's conversation holds their task_ids)."""
        if parent is None:
            return {None}
        mine: set[str | None] = {parent.run_id}
        before = parent.resumed_from
        while before is not None and before not in mine and len(mine) < MAX_RESUMES:
            mine.add(before)
            prior = self.store.get_run(before)
            before = prior.resumed_from if prior else None
        return mine

    def continuation(self, spec: RunSpec, old: RunRecord) -> RunSpec:
        """The spec of a resumed run: the old run's agent, model, base directory and tier,
        going on with its branch when it left one (worktree, container)."""
        if spec.agent is not None and old.agent not in (spec.agent, ALIASES.get(spec.agent)):
            raise OrchError(f"cannot resume {old.run_id} as {spec.agent!r}: it is {old.agent!r}")
        before = old.planned().spec
        tier = before.workspace or tier_config(old.isolation)
        saved = saved_state(old.workspace)
        branch = saved.branch if isinstance(saved, BranchState) and saved.branch else None
        if "branch" in type(tier).model_fields:
            kept = branch is not None and branch_exists(before.workdir, branch)
            tier = tier.model_copy(update={"branch": branch if kept else None})
        if spec.workspace is not None and spec.workspace.type != tier.type:
            raise OrchError(
                f"cannot resume {old.run_id} in {spec.workspace.type!r}: it ran in {tier.type!r}"
            )
        return spec.model_copy(
            update={
                "agent": old.agent,
                "model": spec.model or old.model,
                "workdir": before.workdir,
                "workspace": tier,
                "driver": spec.driver or before.driver,
                "grants": spec.grants or before.grants,
                "network": spec.network or before.network,
            }
        )

    def budgets(self, parent: RunRecord | None) -> Budgets:
        """The chain's budgets: set by its root, kept by every run of it."""
        s = self.settings
        mine = Budgets(
            running=s.max_chain_running,
            runs=s.max_chain_runs,
            tokens=s.max_chain_tokens,
            usd=s.max_chain_usd,
        )
        if parent is None:
            return mine
        return (parent.plan.budgets if parent.plan else None) or mine

    def room(self, record: RunRecord) -> ChainRoom | None:
        """What the chain must still have for ``record`` (a child, or a resumed root): the
        store checks it in the transaction that stores the run. A new root: nothing."""
        if record.parent_run_id is None and record.resumed_from is None:
            return None
        budgets = record.planned().budgets or self.budgets(None)
        return ChainRoom(runs=budgets.runs, tokens=budgets.tokens, usd=budgets.usd)

    @staticmethod
    def refusal(full: ChainFull) -> OrchError:
        """The refusal of a run its chain had no room for, naming the budget and what the
        chain used of it."""
        used, room = full.used, full.room
        found = used_up(used, room.tokens, room.usd)
        if used.runs >= room.runs or found is None:
            return OrchError(
                f"chain budget max_chain_runs ({room.runs}) is used up: this chain has "
                f"{used.runs} runs; finish with what you have"
            )
        setting, said = found
        return OrchError(f"{said}; finish with what you have ({more(setting)})")
