"""Where a project lives: the git toplevel of a directory, or the directory itself."""

from __future__ import annotations

from pathlib import Path

from ..errors import OrchError, UsageError
from .repo import discover_sync


def project_root(start: Path | None = None) -> Path:
    start = (start or Path.cwd()).resolve()
    if not start.is_dir():
        raise UsageError(f"{start} is not a directory; pass an existing --workdir")
    try:
        top = discover_sync(start).work_tree  # hardened git (orchestrator.project.git)
    except OrchError:  # not in a repository, or no git
        return start
    return top.resolve() if top else start
