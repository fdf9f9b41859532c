"""The runner of every command that runs agents (foreground, background, team, and the
MCP server's task calls).

Same flags, same run: the catalog always takes ``--agents-dir`` flags first, then
``agents_dirs`` from the settings, and the launch the runner records is what a detached
run is rebuilt from (``process/rebuild.py``, the one runner factory).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .opened import Project

if TYPE_CHECKING:
    from ..catalog.definitions import Catalog
    from ..egress.rules import NetworkSetting
    from ..engine.runner import Runner
    from ..models import ModelProvider
    from ..spec import RunSpec


def not_dumpable() -> None:
    """A second layer under the OS sandbox: orch's own process stops being dumpable, so its
    /proc entries (environ with the API key, memory) are closed to processes of its user."""
    import ctypes
    import sys

    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):  # no libc prctl: the sandbox is the boundary
        return


def make_runner(
    project: Project,
    provider: ModelProvider,
    agents_dirs: list[Path],
    *,
    model_spec: str | None = None,
    overrides: dict[str, Any] | None = None,
    catalog: Catalog | None = None,
) -> Runner:
    """The runner for a command; ``model_spec`` and ``overrides`` (the flags that made the
    settings) are kept with detached runs so their worker builds the same engine."""
    from ..catalog.agent_trust import guard
    from ..catalog.definitions import load_catalog
    from ..spec import Launch
    from .executor import attach
    from .rebuild import agents_dirs as all_dirs
    from .rebuild import assemble

    not_dumpable()
    if catalog is None:
        catalog = load_catalog(
            project.root,
            agents_dirs=all_dirs(project.root, project.settings, agents_dirs),
            trust=project.trust,  # whose each agent is (catalog/owner.py)
            hidden=project.settings.sandbox.hidden,
        )
        catalog = guard(project.trust, catalog)  # untrusted agent files: isolation kept
    launch = Launch(
        model_spec=model_spec,
        agents_dirs=[str(p.resolve()) for p in agents_dirs],
        overrides={k: v for k, v in (overrides or {}).items() if v is not None},
        trust=project.trust.honoured_digest,  # a worker never honours more than this
    )
    return attach(assemble(project.settings, project.store, catalog, provider, launch))


def root_spec(
    project: Project,
    prompt: str,
    *,
    agent: str,
    isolation: str | None,
    max_depth: int | None = None,
    max_turns: int | None = None,
    timeout: float | None = None,
    background: bool = False,
    description: str = "",
    network: NetworkSetting | None = None,
) -> RunSpec:
    """The spec of a root run a command asks for (``network``: the flag's, over its
    agent's)."""
    from ..spec import Limits, RunSpec
    from ..workspaces.registry import tier_config

    # An `orch task` started by an agent's command joins that agent's chain as its child
    # (depth + 1, the chain's limits), never a fresh chain at depth 0.
    parent = os.environ.get("ORCH_PARENT_RUN_ID") or None
    return RunSpec(
        prompt=prompt,
        agent=agent,
        description=description,
        parent_run_id=parent,
        workdir=project.workdir,
        workspace=tier_config(isolation) if isolation else None,
        limits=Limits(max_turns=max_turns, timeout_seconds=timeout, max_depth=max_depth),
        background=background,
        network=network,
    )
