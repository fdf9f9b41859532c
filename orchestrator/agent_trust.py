"""Workspace trust for agent files, and the loader every command uses.

``trust.py`` decides on a repository's ``orch.toml``; it sits under ``config.py`` and cannot
read agent files (that needs ``definitions`` and the tier order, which sit above ``config``).
This module can: :func:`agent_floors` finds the repository's agent files that replace one of
the user's or a bundled agent with a weaker isolation, :func:`load_trusted` hands them to
``load_settings_with_trust`` so they join the same decision and hash, and :func:`guard` keeps
an untrusted one at the isolation of the agent it replaces.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import Settings, load_settings_with_trust
from .errors import OrchError
from .trust import AgentFloor, Trust, TrustCap

if TYPE_CHECKING:
    from .definitions import AgentDefinition, Catalog


def load_trusted(
    root: Path | None, overrides: dict[str, Any] | None = None, *, cap: TrustCap | None = None
) -> tuple[Settings, Trust]:
    """The settings and the whole trust decision (orch.toml and agent files) for ``root``."""
    return load_settings_with_trust(root, overrides, cap=cap, agent_floors=agent_floors)


def agent_floors(root: Path, repo: dict[str, Any]) -> list[AgentFloor]:
    """The repository's agent files (the ``agents_dirs`` of its orch.toml ``repo``, then
    ``.orch/agents``, ``.claude/agents``; first found wins, as in the catalog) that replace
    one of the user's (``~/.orch/agents``) or a bundled agent of the same name with a weaker
    isolation (none written counts as the weakest, ``shared``)."""
    named = repo.get("agents_dirs")
    dirs = [root / Path(str(d)).expanduser() for d in (named if isinstance(named, list) else [])]
    dirs = [d for d in [*dirs, root / ".orch/agents", root / ".claude/agents"] if d.is_dir()]
    if not dirs:  # the usual case: nothing to parse, nothing imported
        return []
    from .definitions import bundled_dir
    from .workspaces.registry import TIER_NAMES, rank

    theirs = _first_by_name(dirs)
    if not theirs:
        return []
    bundled = bundled_dir("agents")
    ours = _first_by_name([Path.home() / ".orch/agents", *([bundled] if bundled else [])])
    floors = []
    for name, (path, d) in sorted(theirs.items()):
        if d.network == "host":  # the machine's network for this agent's commands
            floors.append(AgentFloor(name, path, d.isolation, "", "", network=d.network))
        if name not in ours:
            continue
        replaced_path, replaced = ours[name]
        floor = replaced.isolation or TIER_NAMES[0]
        if rank(d.isolation or TIER_NAMES[0]) < rank(floor):
            floors.append(AgentFloor(name, path, d.isolation, floor, str(replaced_path)))
    return floors


def _first_by_name(dirs: list[Path]) -> dict[str, tuple[Path, AgentDefinition]]:
    """Like the catalog: each directory in turn; a name already found is kept."""
    from .definitions import agent_files, load_agent_file

    found: dict[str, tuple[Path, AgentDefinition]] = {}
    seen: set[Path] = set()
    for directory in dirs:
        if not directory.is_dir() or directory.resolve() in seen:
            continue
        seen.add(directory.resolve())
        here: set[str] = set()
        for path in agent_files(directory):
            try:
                d = load_agent_file(path)
            except (OrchError, OSError):
                continue  # the catalog reports it
            if d.name not in here:
                here.add(d.name)
                found.setdefault(d.name, (path, d))
    return found


def guard(trust: Trust, catalog: Catalog) -> Catalog:
    """``catalog`` with each untrusted weakening agent file kept at the replaced isolation."""
    if trust.honoured:
        return catalog
    for f in trust.floors:
        d = catalog.agents.get(f.name)
        if d is not None and f.network and _same_file(d.source, f.path):
            note = "network 'host' left out: the repository is not trusted; see `orch trust --show`"
            catalog.agents[f.name] = d.model_copy(
                update={"network": None, "warnings": [*d.warnings, note]}
            )
        elif d is not None and _same_file(d.source, f.path):
            note = (
                f"isolation {d.isolation or 'shared'!r} raised to {f.floor!r} (that of "
                f"{f.replaces}): the repository is not trusted; see `orch trust --show`"
            )
            catalog.agents[f.name] = d.model_copy(
                update={"isolation": f.floor, "warnings": [*d.warnings, note]}
            )
    return catalog


def _same_file(source: str, path: Path) -> bool:
    if not source or source.startswith("bundled:"):
        return False
    try:
        return Path(source).resolve() == path.resolve()
    except OSError:
        return False
