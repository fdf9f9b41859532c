"""What a tier saves about a run: one typed model per tier, discriminated by ``isolation``.

A workspace's ``info()`` is its model, dumped; the runner stores it as the run record's
``workspace`` when the workspace opens. Everything that reads it back (a crash salvage,
resume, ``orch worktrees``, ``orch ps``) reads it through :func:`saved_state`, so a key is
named in one place. Older records may lack a key (its default) or carry one no longer
written (ignored). The record is the host's own, written by the owner process; a salvage
still checks what it uses before acting on it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


class Saved(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    isolation: str
    root: str = ""  # where the run works (a host path; ``/workspace`` in a container)

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class BwrapUsed(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    path: str | None = None
    version: str | None = None
    source: str = ""


class Confined(Saved):
    """A host tier's: how its commands ran (``os_sandbox`` "bwrap" or "off", which bwrap)."""

    os_sandbox: str = "bwrap"
    bwrap: BwrapUsed | None = None
    network: str = "none"


class SharedState(Confined):
    isolation: Literal["shared"] = "shared"


class BranchState(Saved):
    """A tier whose work comes back as a branch of the user's repository."""

    branch: str = ""
    base: str = ""  # the commit the run's artifact is measured from
    repo: str | None = None  # the user's main checkout


class WorktreeState(BranchState, Confined):
    isolation: Literal["worktree"] = "worktree"


class ContainerState(BranchState):
    """Also what a salvage after a crash needs: the starting commit, the container, the
    sandbox user and the bundle cap."""

    isolation: Literal["container"] = "container"
    start: str = ""  # the commit the container started from
    continued: bool = False  # the branch was continued (it is never deleted)
    container: str = ""  # the container id's first 12 characters
    image: str = ""
    user: str = ""  # "uid:gid"
    pooled: bool = False
    bundle_max_bytes: int | None = None


WorkspaceState = Annotated[
    SharedState | WorktreeState | ContainerState, Field(discriminator="isolation")
]
_ADAPTER: TypeAdapter[WorkspaceState] = TypeAdapter(WorkspaceState)


def saved_state(data: object) -> WorkspaceState | None:
    """A run record's ``workspace`` as its tier's model; None when the run never opened its
    workspace (an empty record) or the record is not one a tier wrote."""
    if isinstance(data, BaseModel):
        data = data.model_dump()
    if not isinstance(data, dict) or not data:
        return None
    try:
        state: WorkspaceState = _ADAPTER.validate_python(data)
    except ValidationError:
        return None
    return state
