"""Shared tier: the child works in its spawner's workspace (context isolation only)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from .base import ProcessResult, RunOutcome, Runtime, TierConfig, WorkspaceSpec
from .hiding import absolute_hidden, hidden_rels, inherited, mirrored
from .host import HostRuntime, confinement, os_sandbox_mode
from .lifetime import Shielded
from .saved import Confined
from .spare import Shell


class SharedState(Confined):
    isolation: Literal["shared"] = "shared"


class SharedConfig(TierConfig):
    """``isolation: shared``: the spawner's own directory; only the context is fresh."""

    type: Literal["shared"] = "shared"

    def provision(self, spec: WorkspaceSpec) -> SharedWorkspace:
        os_sandbox_mode(spec)  # fails closed here when bwrap cannot run
        return SharedWorkspace(spec)


class SharedWorkspace(Shielded):
    isolation = "shared"

    def __init__(self, spec: WorkspaceSpec) -> None:
        self.spec = spec
        self.root: Path = spec.base  # resolved: a root's at admission, a child's is its parent's
        # refused to every tool (``hiding``); a child in its spawner's directory takes its
        # spawner's (a hundred children do not each resolve the same fifty paths)
        self.hidden = inherited(spec, self.root) or hidden_rels(spec, mirrored(self.root))
        self._shell = Shell(
            spec,
            self.root,
            read_only_within=(self.root / ".git",),
            hidden_within=absolute_hidden(self.root, self.hidden),
        )

    async def _shut(self, exc_type: type[BaseException] | None) -> None:
        await self._shell.aclose()  # no sandbox made ahead outlives the run

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str]
    ) -> ProcessResult:
        return await self._shell.exec(command, timeout_s=timeout_s, env=env)

    def runtime(self) -> Runtime:
        return HostRuntime(self.root, self.exec, self.hidden, self._shell.expect, self._shell.start)

    def set_outcome(self, outcome: RunOutcome) -> None:
        return None

    def info(self) -> dict[str, Any]:
        return SharedState(root=str(self.root), **confinement(self.spec)).dump()

    def artifacts(self) -> list[dict[str, Any]]:
        return []
