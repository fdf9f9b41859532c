"""The one runner factory: a Runner built from what a command resolved, or, for a detached
run, from (project dir, store, the record's launch).

Every runner is made by :func:`assemble` (the command's own, ``command.py``), so the
launch it records is the one a detached run is rebuilt from; ``executor.py`` then gives it
the executor its settings choose (not on a Ray node: its runs execute there). A detached
run's runner (a worker of its own, the worker host, a Ray node) comes from a
:class:`Recipe`: the launcher's settings (its overrides, under its trust cap: never more
than it honoured), its agents (``--agents-dir`` flags first, then ``agents_dirs`` from
the settings) and its model, read afresh on this machine, or, on a Ray node, the
spawner's resolved settings and catalog as they were sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..catalog.definitions import Catalog
    from ..config import Settings
    from ..engine.runner import Runner
    from ..models import ModelProvider
    from ..spec import Launch
    from ..store import RunStore
    from ..trust import Trust


def agents_dirs(root: Path, settings: Settings, flags: list[Path]) -> list[Path]:
    """``--agents-dir`` flags first, then ``agents_dirs`` from the settings (project-relative)."""
    return [*flags, *(root / Path(d).expanduser() for d in settings.agents_dirs)]


def assemble(
    settings: Settings,
    store: RunStore,
    catalog: Catalog,
    provider: ModelProvider,
    launch: Launch,
) -> Runner:
    """A Runner whose runs execute in this process (``executor.py`` gives it the executor
    its settings choose), with the drivers a stored run may name (a team's root)."""
    from ..engine.runner import Runner
    from ..teams.kinds import KIND, team_driver

    return Runner(
        settings=settings,
        store=store,
        catalog=catalog,
        models=provider,
        launch=launch,
        drivers={KIND: team_driver},
    )


@dataclass(frozen=True)
class Recipe:
    """How to build the runner of a detached run here; runs with equal :attr:`key` (and
    equal catalogs) may share one runner (one model client)."""

    root: Path
    settings: Settings
    catalog: Catalog
    launch: Launch
    trust: Trust | None = None  # the trust decision made here (None: the spawner's, sent)

    @property
    def model_spec(self) -> str | None:
        return self.launch.model_spec

    @property
    def scripted(self) -> bool:
        """A model that plays a whole run (a script) plays it once: a runner per run."""
        from ..models import whole_run

        return whole_run(self.settings.resolve_model(self.model_spec or self.settings.model))

    @property
    def key(self) -> str:
        settings = self.settings.model_dump(mode="json")
        return json.dumps(
            [str(self.root), self.launch.model_dump(mode="json"), settings],
            sort_keys=True,
            default=str,
        )

    def runner(self, store: RunStore) -> Runner:
        from ..models import ModelProvider

        provider = ModelProvider(self.settings, self.model_spec)
        return assemble(self.settings, store, self.catalog, provider, self.launch)


def recipe(
    project_dir: Path,
    launch: Launch,
    *,
    settings: Settings | None = None,
    catalog: Catalog | None = None,
) -> Recipe:
    """The recipe of a detached run of ``project_dir`` from its launch; ``settings`` and
    ``catalog`` given (a Ray node's, resolved by the spawner): those, as they are."""
    from ..project.paths import project_root

    root = project_root(project_dir)
    if settings is not None and catalog is not None:
        return Recipe(root, settings, catalog, launch)
    from ..catalog.agent_trust import guard, load_trusted
    from ..catalog.definitions import load_catalog
    from ..trust import TrustCap

    # the same trust decision as the launcher's, never more: its honoured digest is the cap
    settings, trust = load_trusted(root, dict(launch.overrides), cap=TrustCap(launch.trust))
    flags = [Path(p) for p in launch.agents_dirs]
    dirs = agents_dirs(root, settings, flags)
    found = load_catalog(root, agents_dirs=dirs, trust=trust, hidden=settings.sandbox.hidden)
    catalog = guard(trust, found)  # untrusted: isolation kept
    return Recipe(root, settings, catalog, launch, trust)
