"""What a tier saves about a run: the parts its typed model is made of.

Each tier defines its model beside its config (``isolation: Literal["<name>"]``); a
workspace's ``info()`` is that model, dumped, and the runner stores it as the run record's
``workspace`` when the workspace opens. Everything that reads it back (a crash salvage,
resume, ``orch worktrees``, ``orch ps``) reads it through ``registry.saved_state`` (the
union of the tiers' models) or the tier's own model, so a key is named in one place.
Older records may lack a key (its default) or carry one no longer written (ignored). The
record is the host's own, written by the owner process; a salvage still checks what it
uses before acting on it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Saved(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    isolation: str
    root: str = ""  # where the run works (a host path; ``/workspace`` in a container)
    network: str | dict[str, Any] = "none"  # what its commands reach (``Reach.info``)

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


class BranchState(Saved):
    """A tier whose work comes back as a branch of the user's repository."""

    branch: str = ""
    base: str = ""  # the commit the run's artifact is measured from
    repo: str | None = None  # the user's main checkout
