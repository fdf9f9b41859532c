"""The run's branch, for the tiers whose work comes back as one (worktree, container).

A run's own branch is ``orch/<agent>/<short id>``. A run may instead continue an existing
``orch/*`` branch (``branch`` on its tier config: a writer going on after a review): it
starts from its tip, commits on it, and never deletes it; ``base`` is the commit its
artifact is measured from (default: the tip, i.e. only what this run adds). A ``discard``
checkout (a team's test gate, its reviewers) commits nothing: its changes are thrown away.
"""

from __future__ import annotations

import re
from dataclasses import replace

from ..errors import UsageError
from ..project.git import RepoPaths
from ..project.repo import rev, short_run_id
from .base import WorkspaceSpec


def ref_component(name: str) -> str:
    """``name`` made safe as one component of a branch name."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip(".-")
    safe = re.sub(r"\.{2,}", ".", safe).removesuffix(".lock")
    return safe or "agent"


def branch_name(agent: str, run_id: str) -> str:
    return f"orch/{ref_component(agent)}/{short_run_id(run_id)}"


def with_branch(
    spec: WorkspaceSpec, branch: str | None, base: str | None, discard: bool = False
) -> WorkspaceSpec:
    """The spec with the tier config's branch to continue (and its base), when it names one,
    and whether the checkout is thrown away at the end (``discard``)."""
    if not branch and not base and not discard:
        return spec
    return replace(
        spec,
        branch=branch or spec.branch,
        branch_base=base or spec.branch_base,
        discard=discard or spec.discard,
    )


async def continued_start(main: RepoPaths, branch: str, base: str | None) -> tuple[str, str]:
    """A continued branch checked: ``(its tip, the commit its work is measured from)``."""
    if not branch.startswith("orch/") or ".." in branch:
        raise UsageError(f"can only continue an orch/* branch, not {branch!r}")
    tip = await rev(f"refs/heads/{branch}", main)
    if tip is None:
        raise UsageError(f"branch {branch} does not exist; see `orch worktrees list`")
    if not base:
        return tip, tip
    commit = await rev(base, main)
    if commit is None:
        raise UsageError(f"base {base!r} for branch {branch} is not a commit")
    return tip, commit
