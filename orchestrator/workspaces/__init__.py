"""Isolation tiers: one module per tier behind the seams in ``base``, listed in ``registry``."""

from __future__ import annotations

from .base import (
    FileRead,
    ProcessResult,
    ResourceSink,
    RunOutcome,
    Runtime,
    TierConfig,
    Workspace,
    WorkspaceSpec,
)

__all__ = [
    "FileRead",
    "ProcessResult",
    "ResourceSink",
    "RunOutcome",
    "Runtime",
    "TierConfig",
    "Workspace",
    "WorkspaceSpec",
]
