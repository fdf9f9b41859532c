"""A repository's definition never silently takes the name of one of the user's.

A skill or an MCP server declaration is *used by* an agent: the user's agent (with the user's
tools and MCP servers) reads a skill's text as its own instructions, and calls the server its
``mcpServers`` or ``tools`` name. So a repository's skill (``.orch/skills``,
``.claude/skills``) or server (``.mcp.json``) that has the name of one of the user's
(``~/.orch/skills``, a skills directory the user names, ``~/.orch/mcp.json``) or of a bundled
skill, compared ignoring case, is **left out for the user's until the repository is
trusted**: it is a trust floor (``kind`` ``skills`` / ``mcp_servers``, key ``replaces``,
value the SHA-256 of its definition), so ``orch trust --show`` lists it, the notice names
it, the user's one carries a warning saying why (``orch skills list`` counts it), and once
trusted it applies as it was when trusted (a change to it is untrusted again). This is the
agents' rule (``agent_trust.agent_floors``): a repository definition that would give whoever
uses the name more than the user's gave them waits for trust. An agent is *run*, as the
repository's (never offered the user's servers: ``owner.py``), so only a weaker isolation,
more tools or turns, or a wider network is more; a skill's or a server's every other word is.
Whose a definition is: ``owner.py``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self, TypeVar

from ..trust import AgentFloor, Trust
from .owner import Owners, first_of_each_name

if TYPE_CHECKING:
    from ..mcpclient.declared import Declared, ServerDecl

Kind = Literal["skills", "mcp_servers"]


class Skill(Protocol):
    """``definitions.SkillDefinition`` (which sits above this module) as used here."""

    name: str
    description: str
    body: str
    source: str
    warnings: list[str]
    repository: bool

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> Self: ...


S = TypeVar("S", bound=Skill)
KEY = "replaces"
MCP_FILE = ".mcp.json"


def skill_digest(d: Skill) -> str:
    text = "\0".join([d.name, d.description, d.body])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def server_digest(d: ServerDecl) -> str:
    text = d.model_dump_json(exclude={"source", "user"})
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _floor(kind: Kind, name: str, path: Path, digest: str, yours: str) -> AgentFloor:
    value = {"sha256": digest, "yours": yours}
    return AgentFloor(name, path, KEY, value, kind=kind, bundled=yours.startswith("bundled:"))


def _trusted(trust: Trust | None, want: AgentFloor) -> bool:
    """The repository's definition ``want`` was part of what the user trusted, as it is now."""
    if trust is None or not trust.honoured:
        return False
    for f in trust.floors:
        if (f.kind, f.name, f.key) != (want.kind, want.name, want.key):
            continue
        same = isinstance(f.value, dict) and f.value.get("sha256") == want.value["sha256"]
        if same and _same_path(f.path, want.path):
            return True
    return False


def _same_path(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


# -- skills ---------------------------------------------------------------------------------


def every_skill(
    dirs: Iterable[Path],
    owners: Owners,
    bundled: Path | None,
    parse: Callable[[str, Path, str | None], S],
) -> list[tuple[Path, S]]:
    """Each directory's skills in the catalog's order (the first file of a name in a
    directory; a file that does not load: the catalog reports it)."""
    return first_of_each_name("skills", dirs, owners, parse, bundled)


def skill_clashes(
    every: Sequence[tuple[Path, S]],
) -> list[tuple[AgentFloor, S, tuple[Path, S]]]:
    """The repository's skills the catalog would use (the first of their name) that take the
    name (ignoring case) of a skill of the user's or a bundled one: (floor, it, the user's)."""
    users: dict[str, tuple[Path, S]] = {}
    for path, d in every:
        if not d.repository:
            users.setdefault(d.name.casefold(), (path, d))
    out = []
    used: set[str] = set()
    for path, d in every:
        if d.name in used:
            continue
        used.add(d.name)
        mine = users.get(d.name.casefold())
        if d.repository and mine is not None:
            yours = mine[1].source if mine[1].source.startswith("bundled:") else str(mine[0])
            out.append((_floor("skills", d.name, path, skill_digest(d), yours), d, mine))
    return out


def keep_users_skills(
    skills: dict[str, S],
    every: Sequence[tuple[Path, S]],
    trust: Trust | None,
) -> None:
    """Leave out of ``skills`` (the catalog's) each repository skill that takes the name of
    one of the user's, unless trusted as it is; the user's is used, saying why."""
    for floor, theirs, (_, mine) in skill_clashes(every):
        if _trusted(trust, floor) or skills.get(theirs.name) is not theirs:
            continue
        del skills[theirs.name]
        note = (
            f"{floor.path} left out: a repository's skill may not take the name of yours "
            "until the repository is trusted; see `orch trust --show`"
        )
        kept = skills.get(mine.name, mine)
        skills[mine.name] = kept.model_copy(update={"warnings": [*kept.warnings, note]})


# -- MCP server declarations ----------------------------------------------------------------


def _users_servers(home: Path) -> Declared:
    from ..mcpclient.declared import USER_FILE, Declared, read_file

    found = Declared()
    if home.is_dir():
        read_file(home, USER_FILE, found, user=True)
    return found


def _server_clashes(
    root: Path, declared: Declared, home: Path
) -> list[tuple[AgentFloor, str, str, ServerDecl]]:
    """The repository's servers (``.mcp.json``) that take the name (ignoring case) of one of
    ``~/.orch/mcp.json``'s: (floor, its name, the user's name, the user's declaration)."""
    theirs = {n: d for n, d in declared.servers.items() if not d.user}
    if not theirs:
        return []
    users = _users_servers(home)
    folded = {n.casefold(): (n, d) for n, d in reversed(users.servers.items())}
    out = []
    for name, d in theirs.items():
        if (mine := folded.get(name.casefold())) is not None:
            floor = _floor("mcp_servers", name, root / MCP_FILE, server_digest(d), mine[1].source)
            out.append((floor, name, mine[0], mine[1]))
    return out


def mcp_floors(root: Path, home: Path) -> list[AgentFloor]:
    """The repository's MCP servers that take the name of one of the user's."""
    if not os.path.lexists(root / MCP_FILE):
        return []  # the usual case: nothing imported
    from ..mcpclient.declared import load_declared

    return [f for f, _, _, _ in _server_clashes(root, load_declared(root, home), home)]


def keep_users_servers(
    root: Path | None, declared: Declared, home: Path, trust: Trust | None
) -> Declared:
    """``declared`` with each repository server that takes the name of one of the user's left
    out for the user's, unless trusted as it is (a warning says why)."""
    if root is None:
        return declared
    for floor, name, mine, decl in _server_clashes(root, declared, home):
        if _trusted(trust, floor):
            continue
        del declared.servers[name]
        declared.servers[mine] = decl
        declared.warnings.append(
            f"{floor.path}: server {name!r} left out: a repository's server may not take the "
            f"name of yours ({decl.source}) until the repository is trusted; "
            "see `orch trust --show`"
        )
    return declared
