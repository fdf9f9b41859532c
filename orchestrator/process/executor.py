"""The executor a runner's settings choose: none (every run is a task of this process) or
``executor = "ray"`` (worktree and container runs go to a Ray cluster, ``cluster/``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine.runner import Runner


def attach(runner: Runner) -> Runner:
    """``runner`` with the executor of its settings (connected: a cluster that cannot be
    reached is an OrchError here, before any run is stored)."""
    if runner.settings.executor == "ray":
        from .cluster.driver import RayExecutor

        executor = RayExecutor(runner)
        executor.connect()
        runner.executor = executor
    return runner
