"""The executor a runner's settings choose, by the type of its config (as SWE-ReX picks a
deployment from its config's type): :meth:`Settings.execution` gives the chosen config
(``LocalExecution``, or the ``[ray]`` table for ``executor = "ray"``), :data:`EXECUTORS`
maps its ``type`` to the class that executes runs there (imported only when chosen).

Adding an executor: one module with a class built as ``Class(runner, config)`` that has
``connect()`` and the ``Executor`` methods (``engine/delegation.py``: ``takes``, ``run``),
its config model in ``config.py`` (a ``type`` and its settings, a member of
``ExecutionConfig``), and one line here."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config import ExecutionConfig
    from ..engine.delegation import Executor
    from ..engine.runner import Runner

# config type -> "module:class" of its executor; None: runs execute in this process
EXECUTORS: dict[str, str | None] = {
    "local": None,
    "ray": "orchestrator.process.cluster.driver:RayExecutor",
}


def executor_for(runner: Runner, config: ExecutionConfig) -> Executor | None:
    """The executor of ``config``'s type for ``runner``, connected (a cluster that cannot
    be reached is an OrchError here, before any run is stored); None for ``local``."""
    where = EXECUTORS[config.type]
    if where is None:
        return None
    module, _, name = where.partition(":")
    made: Any = getattr(importlib.import_module(module), name)(runner, config)
    made.connect()
    executor: Executor = made
    return executor


def attach(runner: Runner) -> Runner:
    """``runner`` with the executor its settings choose."""
    runner.executor = executor_for(runner, runner.settings.execution())
    return runner
