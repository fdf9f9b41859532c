"""Workspaces, one module per isolation tier, behind the protocol in ``base``."""

from __future__ import annotations

from ..errors import UsageError
from .base import ProcessResult, ResourceSink, RunOutcome, Workspace, WorkspaceSpec
from .shared import SharedWorkspace

__all__ = [
    "ProcessResult",
    "ResourceSink",
    "RunOutcome",
    "Workspace",
    "WorkspaceSpec",
    "open_workspace",
]


def open_workspace(isolation: str, spec: WorkspaceSpec) -> Workspace:
    """The workspace for one run; use it as ``async with open_workspace(...) as ws``."""
    if isolation == "shared":
        return SharedWorkspace(spec)
    if isolation == "worktree":
        from .worktree import WorktreeWorkspace

        return WorktreeWorkspace(spec)
    if isolation == "container":
        from .container import ContainerWorkspace

        return ContainerWorkspace(spec)
    raise UsageError(f"unknown isolation {isolation!r}; choose shared, worktree or container")
