"""Workspace trust for agent files, and the loader every command uses.

``trust.py`` decides on a repository's ``orch.toml``; it sits under ``config.py`` and cannot
read agent files (that needs ``definitions`` and the tier order, which sit above ``config``).
This module can: :func:`agent_floors` finds the repository's agent files that replace one of
the user's or a bundled agent with a weaker isolation, :func:`load_trusted` hands them to
``load_settings_with_trust`` so they join the same decision and hash, and :func:`guard` leaves
an untrusted one out for the user's agent it would weaken.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Settings, load_settings_with_trust
from ..egress.rules import AllowList, NetworkSetting, Reach, parse_setting
from ..errors import OrchError
from ..trust import AgentFloor, Trust, TrustCap, theirs_dirs
from .owner import Owners, first_of_each_name

if TYPE_CHECKING:
    from .definitions import AgentDefinition, Catalog


def load_trusted(
    root: Path | None, overrides: dict[str, Any] | None = None, *, cap: TrustCap | None = None
) -> tuple[Settings, Trust]:
    """The settings and the whole trust decision (orch.toml and agent files) for ``root``."""
    return load_settings_with_trust(root, overrides, cap=cap, agent_floors=agent_floors)


def agent_floors(root: Path, user: dict[str, Any], repo: dict[str, Any]) -> list[AgentFloor]:
    """The repository's agent files that would weaken an agent of the user's, or ask for the
    host's network.

    The directories are taken in the catalog's order (the user's ``agents_dirs`` from
    ``user``, the repository's from ``repo``, ``.orch/agents``, ``.claude/agents``,
    ``~/.orch/agents``, bundled; the first file of a name wins). Whose each file is, and
    how the repository's are read, is ``owner.py``'s one rule (a directory the repository's
    settings name is the repository's wherever it points; one in the project is, whoever
    named it). A repository agent that wins over a user's (or bundled)
    agent of the same name must not have a weaker isolation (none written is ``shared``),
    a tool (or an agent it may start) the user's lacks, more turns, or another network."""

    def named(settings: dict[str, Any]) -> list[Path]:
        dirs = settings.get("agents_dirs")
        return [root / Path(str(d)).expanduser() for d in (dirs if isinstance(dirs, list) else [])]

    theirs = [Path(d) for d in theirs_dirs(user, repo)]
    owners = Owners.of(root, theirs)
    repo_dirs = [*(root / d.expanduser() for d in theirs), root / ".orch/agents"]
    repo_dirs.append(root / ".claude/agents")
    from .shadow import mcp_floors

    teams = [*team_floors(root, user), *skill_floors(root, Path.home())]
    teams += mcp_floors(root, Path.home())  # a skill or server taking a name of the user's
    if not any(d.is_dir() for d in [*repo_dirs, *named(user)] if owners.repository_dir(d)):
        return teams  # the usual case: no agent file to parse, nothing imported
    from ..workspaces.registry import TIER_NAMES, rank
    from .definitions import ORCH_TOOLS, bundled_dir

    bundled = bundled_dir("agents")
    order = [*named(user), *repo_dirs, Path.home() / ".orch/agents"]
    order += [bundled] if bundled else []
    found = _by_name(order, owners, bundled)
    settings_turns = float("inf")  # an agent without maxTurns gets the settings' (any)
    users_net = _network(user)
    users = Reach.of(users_net)
    floors: list[AgentFloor] = []
    for name, entries in sorted(found.items()):
        path, d = entries[0]
        if not d.repository:
            continue  # the user's (or bundled) agent wins
        wider = d.network is not None and not users.covers(Reach.of(d.network))
        if wider:  # a network the user's settings do not reach
            floors.append(AgentFloor(name, path, "network", _shown(d.network)))
        mine = next(((p, u) for p, u in entries[1:] if not u.repository), None)
        if mine is None:
            continue
        theirs_path, u = mine
        of_bundled = bundled is not None and theirs_path.parent == bundled
        if rank(d.isolation or TIER_NAMES[0]) < rank(u.isolation or TIER_NAMES[0]):
            floors.append(AgentFloor(name, path, "isolation", d.isolation, theirs_path, of_bundled))
        if _more_tools(d, u):
            tools = sorted(d.allowed_tools(list(ORCH_TOOLS)))
            floors.append(AgentFloor(name, path, "tools", tools, theirs_path, of_bundled))
        if (d.max_turns or settings_turns) > (u.max_turns or settings_turns):
            floors.append(AgentFloor(name, path, "max_turns", d.max_turns, theirs_path, of_bundled))
        mine_net = Reach.of(u.network or users_net)
        # none written, where the user's pins one: whatever the settings will say
        theirs_net = Reach.of(d.network or ("host" if u.network else users_net))
        if not wider and not mine_net.covers(theirs_net):
            shown = _shown(d.network or users_net)
            floors.append(AgentFloor(name, path, "network", shown, theirs_path, of_bundled))
    return floors + teams


def team_floors(root: Path, user: dict[str, Any]) -> list[AgentFloor]:
    """The repository's team files that ask a network the user's settings do not reach,
    or a model that reads a file of this machine (``scripted:``). A file that cannot be
    read or parsed gives none here (``orch team validate`` says what is wrong with it)."""
    import tomllib

    from ..models.registry import reads_host
    from .teamfiles import TEAMS_DIR, read_team, team_names

    if not (root / TEAMS_DIR).is_dir():
        return []
    users = Reach.of(_network(user))
    floors: list[AgentFloor] = []
    for name in team_names(root):
        try:
            data = tomllib.loads(read_team(root, name)[0])
            network = parse_setting(data["network"]) if "network" in data else None
        except (OrchError, ValueError, RecursionError):
            continue
        path = root / TEAMS_DIR / f"{name}.toml"
        if network is not None and not users.covers(Reach.of(network)):
            floors.append(AgentFloor(name, path, "network", _shown(network), kind="teams"))
        models = data.get("models")
        asked = models if isinstance(models, dict) else {}
        scripted = {k: v for k, v in asked.items() if isinstance(v, str) and reads_host(v)}
        if scripted:
            floors.append(AgentFloor(name, path, "models", scripted, kind="teams"))
    return floors


def skill_floors(root: Path, home: Path) -> list[AgentFloor]:
    """The repository's skills that take the name (ignoring case) of one of the user's
    (``~/.orch/skills``) or a bundled one (``shadow.py``)."""
    dirs = [root / ".orch/skills", root / ".claude/skills"]
    if not any(d.is_dir() for d in dirs):
        return []
    from .definitions import bundled_dir, parse_skill
    from .shadow import every_skill, skill_clashes

    bundled = bundled_dir("skills")
    order = [*dirs, home / ".orch/skills", *([bundled] if bundled else [])]
    every = every_skill(order, Owners.of(root), bundled, parse_skill)
    return [floor for floor, _, _ in skill_clashes(every)]


def _network(user: dict[str, Any]) -> NetworkSetting:
    """The user's own ``network`` setting (unreadable: none; the settings loader says why)."""
    try:
        return parse_setting(user.get("network", "none"))
    except ValueError:
        return "none"


def _shown(network: NetworkSetting | None) -> Any:
    return network if not isinstance(network, AllowList) else network.model_dump(mode="json")


def _more_tools(d: AgentDefinition, u: AgentDefinition) -> bool:
    """``d`` may use a tool, or start an agent, that ``u`` may not."""
    from .definitions import ORCH_TOOLS

    if not set(d.allowed_tools(list(ORCH_TOOLS))) <= set(u.allowed_tools(list(ORCH_TOOLS))):
        return True
    return u.agents is not None and (d.agents is None or not set(d.agents) <= set(u.agents))


def _by_name(
    dirs: list[Path], owners: Owners, bundled: Path | None
) -> dict[str, list[tuple[Path, AgentDefinition]]]:
    """Like the catalog, each directory in turn, but every file of a name, first the winner
    (a file that does not load: the catalog reports it)."""
    from .definitions import parse_agent

    found: dict[str, list[tuple[Path, AgentDefinition]]] = {}
    for path, d in first_of_each_name("agents", dirs, owners, parse_agent, bundled):
        found.setdefault(d.name, []).append((path, d))
    return found


def guard(trust: Trust, catalog: Catalog) -> Catalog:
    """``catalog`` without what an untrusted repository's agent files would weaken: an agent
    that weakens one of the user's is left out for the user's, one asking the host's network
    loses it. Each says why in its warnings."""
    if trust.honoured:
        return catalog
    from .definitions import load_agent_file

    for f in trust.floors:
        if f.kind != "agents":
            continue  # a team file's: refused where the team is run (teams/plan.py)
        d = catalog.agents.get(f.name)
        if d is None or not _same_file(d.source, f.path):
            continue  # already replaced, or a --agents-dir of the user's wins
        if f.replaces is None:
            note = (
                f"network {_shown(d.network)!r} left out (wider than the user's settings): "
                "the repository is not trusted; see `orch trust --show`"
            )
            catalog.agents[f.name] = d.model_copy(
                update={"network": None, "warnings": [*d.warnings, note]}
            )
            continue
        source = f"bundled:{f.replaces.stem}" if f.bundled else None
        try:
            mine = load_agent_file(f.replaces, source)
        except (OrchError, OSError):
            del catalog.agents[f.name]  # it changed since: neither is used
            continue
        note = (
            f"{f.path} left out: it would weaken this agent's {f.key} and the repository is not "
            "trusted; see `orch trust --show`"
        )
        catalog.agents[f.name] = mine.model_copy(update={"warnings": [*mine.warnings, note]})
    return catalog


def _same_file(source: str, path: Path) -> bool:
    if not source or source.startswith("bundled:"):
        return False
    try:
        return Path(source).resolve() == path.resolve()
    except OSError:
        return False
