"""The one factory of the engine for every command that runs agents (foreground, worker, team).

Same flags, same run: the catalog always takes ``--agents-dir`` flags first, then
``agents_dirs`` from the settings, so a detached worker finds the agents the
foreground would.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import Project

if TYPE_CHECKING:
    from ..definitions import Catalog
    from ..models import ModelProvider
    from ..runner import Runner
    from ..store import RunStore
    from ..workerhost import Engine


def all_agents_dirs(project: Project, flags: list[Path]) -> list[Path]:
    """``--agents-dir`` flags first, then ``agents_dirs`` from the settings (project-relative)."""
    return [*flags, *(project.root / Path(d).expanduser() for d in project.settings.agents_dirs)]


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
    from ..agent_trust import guard
    from ..definitions import load_catalog
    from ..runner import Runner
    from ..spec import Launch

    not_dumpable()
    if catalog is None:
        catalog = load_catalog(project.root, agents_dirs=all_agents_dirs(project, agents_dirs))
        catalog = guard(project.trust, catalog)  # untrusted agent files: isolation kept
    launch = Launch(
        model_spec=model_spec,
        agents_dirs=[str(p.resolve()) for p in agents_dirs],
        overrides={k: v for k, v in (overrides or {}).items() if v is not None},
        trust=project.trust.honoured_digest,  # a worker never honours more than this
    )
    runner = Runner(
        settings=project.settings,
        store=project.store,
        catalog=catalog,
        models=provider,
        launch=launch,
    )
    if project.settings.executor == "ray":  # worktree and container runs go to the cluster
        from ..executors.raycluster import RayExecutor

        executor = RayExecutor(runner)
        executor.connect()
        runner.executor = executor
    return runner


def worker_runner(project_dir: Path, run_id: str) -> tuple[Runner, Project]:
    """The runner a detached worker builds for a queued run, from what the run keeps."""
    from ..models import ModelProvider
    from ..trust import TrustCap
    from .common import open_project

    probe = open_project(project_dir, quiet=True)
    launch: dict[str, Any] = probe.store.require_run(run_id).launch.model_dump()
    # The same trust decision as the launcher's, never more: its honoured digest is the cap.
    cap = TrustCap(launch.get("trust"))
    project = open_project(project_dir, trust_cap=cap, **launch.get("overrides", {}))
    provider = ModelProvider(project.settings, launch.get("model_spec"))
    dirs = [Path(p) for p in launch.get("agents_dirs", [])]
    return make_runner(project, provider, dirs), project


def host_engine(store: RunStore, project_dir: Path, launch: dict[str, Any]) -> Engine:
    """What a worker host needs to run a handed-over run: the same settings, trust cap and
    catalog as :func:`worker_runner` (read afresh for every run, as a worker would), over
    the host's store; runs with equal keys and catalogs share one runner."""
    import json

    from ..agent_trust import guard, load_trusted
    from ..definitions import load_catalog
    from ..models import ModelProvider
    from ..paths import project_root
    from ..trust import TrustCap
    from ..workerhost import Engine

    root = project_root(project_dir)
    overrides = dict(launch.get("overrides") or {})
    settings, trust = load_trusted(root, overrides, cap=TrustCap(launch.get("trust")))
    project = Project(root, project_dir.resolve(), settings, store, trust)
    dirs = [Path(p) for p in launch.get("agents_dirs") or []]
    catalog = guard(trust, load_catalog(root, agents_dirs=all_agents_dirs(project, dirs)))
    spec: str | None = launch.get("model_spec")
    scripted = (spec or settings.model).startswith("scripted:")
    key = json.dumps(
        [str(root), launch, settings.model_dump(mode="json"), trust.honoured_digest],
        sort_keys=True,
        default=str,
    )

    def make() -> Runner:
        provider = ModelProvider(settings, spec)
        return make_runner(
            project, provider, dirs, model_spec=spec, overrides=overrides, catalog=catalog
        )

    return Engine(
        key=key,
        catalog=catalog,
        make=make,
        per_run=scripted,
        needs_sdk=not scripted,
        idle_seconds=settings.host_idle_seconds,
    )
