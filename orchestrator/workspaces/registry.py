"""The isolation tiers, weakest first: the only list of them.

Adding a tier is one new module (a :class:`~.base.TierConfig` subclass whose
``provision`` makes its :class:`~.base.Workspace`, and the model of what it saves about a
run, from :mod:`.saved`) plus its entries here: in ``TIERS``, in the ``WorkspaceConfig``
union and in the ``WorkspaceState`` union. The order of ``TIERS`` is the
trust order: a child may run in its parent's tier or a stronger one, never a
weaker one.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, TypeAdapter, ValidationError

from ..errors import OrchError, UsageError
from .base import TierConfig
from .container.export import ContainerState
from .container.workspace import ContainerConfig
from .shared import SharedConfig, SharedState
from .worktree import WorktreeConfig, WorktreeState

TIERS: tuple[type[TierConfig], ...] = (SharedConfig, WorktreeConfig, ContainerConfig)

WorkspaceConfig = Annotated[
    SharedConfig | WorktreeConfig | ContainerConfig, Field(discriminator="type")
]

WorkspaceState = Annotated[
    SharedState | WorktreeState | ContainerState, Field(discriminator="isolation")
]

_BY_NAME: dict[str, type[TierConfig]] = {
    str(cls.model_fields["type"].default): cls for cls in TIERS
}
TIER_NAMES: tuple[str, ...] = tuple(_BY_NAME)
BRANCH_TIERS: tuple[str, ...] = tuple(n for n, c in _BY_NAME.items() if c.needs_git)
_ADAPTER: TypeAdapter[WorkspaceConfig] = TypeAdapter(WorkspaceConfig)
_SAVED: TypeAdapter[WorkspaceState] = TypeAdapter(WorkspaceState)


def unknown_tier(name: str) -> UsageError:
    return UsageError(f"unknown isolation {name!r}; choose {', '.join(TIER_NAMES)}")


def tier_config(name: str) -> TierConfig:
    """The default config of the tier called ``name``."""
    cls = _BY_NAME.get(name)
    if cls is None:
        raise unknown_tier(name)
    return cls.model_validate({})


def parse_config(data: object) -> TierConfig:
    """A stored or given config (a dict with ``type``) as its tier's config class."""
    config: TierConfig = _ADAPTER.validate_python(data)
    return config


def rank(name: str) -> int:
    """A tier's place in the trust order (0 is the weakest)."""
    if name not in _BY_NAME:
        raise unknown_tier(name)
    return TIER_NAMES.index(name)


def choose_tier(asked: TierConfig | None, agents: str | None, parents: str | None) -> TierConfig:
    """A run's tier: asked for, else the agent definition's, else the parent's; never weaker
    than the parent's. A weaker one asked for is refused; an agent's weaker default is raised."""
    floor = rank(parents) if parents is not None else 0
    if asked is not None:
        if rank(asked.type) < floor:
            allowed = ", ".join(TIER_NAMES[floor:])
            raise OrchError(
                f"isolation {asked.type!r} is weaker than this agent's own {parents!r}; a child "
                f"runs in its parent's tier or a stronger one ({allowed})"
            )
        return asked
    if agents and rank(agents) >= floor:
        return tier_config(agents)
    return tier_config(parents or TIER_NAMES[0])


def saved_state(data: object) -> WorkspaceState | None:
    """A run record's ``workspace`` as its tier's model; None when the run never opened its
    workspace (an empty record) or no tier wrote it."""
    if not isinstance(data, dict) or not data:
        return None
    try:
        state: WorkspaceState = _SAVED.validate_python(data)
    except ValidationError:
        return None
    return state
