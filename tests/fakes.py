"""An in-memory workspace for engine tests: no bash, no git, no Docker.

``FakeRuntime`` keeps files in a dict and answers commands from a table; the
``provisioner`` hands every run (whatever its tier) a ``FakeWorkspace`` over one
shared runtime, injected into the Runner as its ``provision`` seam.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from orchestrator.errors import OrchError
from orchestrator.workspaces.base import (
    FileRead,
    ProcessResult,
    RunOutcome,
    Runtime,
    TierConfig,
    Workspace,
    WorkspaceSpec,
)
from orchestrator.workspaces.piped import Piped

Command = Callable[[str], ProcessResult]


class FakeRuntime:
    def __init__(
        self,
        files: Mapping[str, str] | None = None,
        commands: Mapping[str, ProcessResult | Command] | None = None,
    ) -> None:
        self.root = Path("/fake/workspace")
        self.files: dict[str, bytes] = {k: v.encode() for k, v in (files or {}).items()}
        self.commands = dict(commands or {})
        self.ran: list[tuple[str, dict[str, str]]] = []
        self.expected: list[dict[str, str]] = []  # what ``expect`` was told

    def expect(self, env: Mapping[str, str]) -> None:
        self.expected.append(dict(env))

    async def start(
        self, argv: list[str], *, env: Mapping[str, str], more: Mapping[str, str]
    ) -> Piped:
        raise OrchError("the fake workspace starts no process")

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str]
    ) -> ProcessResult:
        self.ran.append((command, dict(env)))
        answer = self.commands.get(command)
        if answer is None:
            return ProcessResult(127, f"fake: {command}: command not found\n")
        return answer(command) if callable(answer) else answer

    async def read_file(self, path: str, *, max_bytes: int) -> FileRead:
        if path not in self.files:
            if any(k.startswith(path.rstrip("/") + "/") for k in self.files):
                raise IsADirectoryError(path)
            raise FileNotFoundError(path)
        data = self.files[path]
        return FileRead(data[:max_bytes], len(data))

    async def write_file(self, path: str, data: bytes) -> None:
        self.files[path] = data

    async def glob(self, pattern: str, *, limit: int) -> tuple[list[str], bool]:
        found = sorted(p for p in self.files if fnmatch.fnmatchcase(p, pattern.replace("**/", "")))
        return found[:limit], len(found) > limit

    async def grep(
        self, pattern: str, *, path: str | None, glob: str | None, limit: int
    ) -> list[str]:
        regex = re.compile(pattern)
        hits: list[str] = []
        for name in sorted(self.files):
            if path and not (name == path or name.startswith(path.rstrip("/") + "/")):
                continue
            if glob and not fnmatch.fnmatchcase(name.rsplit("/", 1)[-1], glob):
                continue
            for n, line in enumerate(self.files[name].decode().splitlines(), 1):
                if regex.search(line):
                    hits.append(f"{name}:{n}: {line}")
        return hits[:limit]


class FakeWorkspace:
    def __init__(self, config: TierConfig, spec: WorkspaceSpec, runtime: FakeRuntime) -> None:
        self.isolation = config.type
        self.root = runtime.root
        self.spec = spec
        self._runtime = runtime
        self.outcome: RunOutcome | None = None

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
        return await self._runtime.exec(command, timeout_s=timeout_s, env=env)

    def runtime(self) -> Runtime:
        return self._runtime

    def set_outcome(self, outcome: RunOutcome) -> None:
        self.outcome = outcome

    def info(self) -> dict[str, Any]:
        return {"isolation": self.isolation, "root": str(self.root), "fake": True}

    def artifacts(self) -> list[dict[str, Any]]:
        return []


def provisioner(
    runtime: FakeRuntime, opened: list[FakeWorkspace] | None = None
) -> Callable[[TierConfig, WorkspaceSpec], Workspace]:
    """Every run gets a FakeWorkspace over ``runtime``; ``opened`` collects them."""

    def provision(config: TierConfig, spec: WorkspaceSpec) -> Workspace:
        ws = FakeWorkspace(config, spec, runtime)
        if opened is not None:
            opened.append(ws)
        return ws

    return provision
