"""Shared tier: the child works in its spawner's workspace (context isolation only)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from .base import ProcessResult, RunOutcome, WorkspaceSpec, run_process


class SharedWorkspace:
    isolation = "shared"

    def __init__(self, spec: WorkspaceSpec) -> None:
        self.spec = spec
        self.root: Path = spec.base.resolve()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str]
    ) -> ProcessResult:
        return await run_process(
            ["bash", "-c", command],
            cwd=self.root,
            env=env,
            timeout_s=timeout_s,
            sink=self.spec.sink,
            run_id=self.spec.run_id,
        )

    def set_outcome(self, outcome: RunOutcome) -> None:
        return None

    def info(self) -> dict[str, Any]:
        return {"isolation": self.isolation, "root": str(self.root)}

    def artifacts(self) -> list[dict[str, Any]]:
        return []
