"""Agent and skill definitions: Markdown files with YAML frontmatter, Claude Code compatible.

An agent file is ``<name>.md``: frontmatter (name, description, tools, model, ...)
then the system prompt. A skill is ``<name>/SKILL.md``: frontmatter (name,
description) then the instructions ``load_skill`` hands out. Claude Code tool
names are mapped to ours; whatever orch cannot honour becomes a warning on the
definition, never a crash. A file that cannot be loaded at all becomes a
:class:`DefinitionError` in :attr:`Catalog.errors`, so one bad file hides no other.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from ..egress.rules import NetworkSetting, parse_setting
from ..errors import UsageError
from ..mcpclient.names import DENY, EVERY, NO_USERS, is_mcp, parts
from .frontmatter import DefinitionError as DefinitionError  # re-exported: loaders raise it
from .frontmatter import parse_frontmatter
from .owner import SKIP as _SKIP
from .owner import Owners, found_in
from .owner import read_text as _read

if TYPE_CHECKING:  # imported when a file or a catalog has MCP servers (startup time)
    from ..mcpclient.declared import Declared
    from ..trust import Trust

# Our own tool names pass through a ``tools`` list unchanged.
ORCH_TOOLS: tuple[str, ...] = tuple(
    "read_file write_file edit_file bash glob grep load_skill task task_output task_stop".split()
)
# Claude Code tool name (lower-cased) -> ours.
CLAUDE_TOOL_MAP: dict[str, str] = {
    "read": "read_file",
    "notebookread": "read_file",
    "write": "write_file",
    "edit": "edit_file",
    "multiedit": "edit_file",
    "bash": "bash",
    "glob": "glob",
    "ls": "glob",
    "grep": "grep",
    "task": "task",
    "agent": "task",
    "skill": "load_skill",
}
# Claude Code tools orch has no counterpart for, and why (shown in the warning).
UNSUPPORTED_TOOLS: dict[str, str] = {
    **dict.fromkeys(["todowrite", "todoread"], "orch has no todo list; plan in replies instead"),
    **dict.fromkeys(["webfetch", "websearch"], "orch has no web access"),
    **dict.fromkeys(["bashoutput", "killshell", "killbash"], "use task/task_output/task_stop"),
    "mcp__": "an MCP tool is mcp__SERVER or mcp__SERVER__TOOL",
    **dict.fromkeys(["notebookedit", "slashcommand", "exitplanmode", "askuserquestion"], ""),
}
_CAMEL = {
    c.lower(): c
    for c in ("disallowedTools", "permissionMode", "maxTurns", "mcpServers", "cacheTtl")
}
AGENT_FIELDS = frozenset(
    "name description tools model skills isolation background color network".split()
)
AGENT_FIELDS |= frozenset(_CAMEL.values())
SKILL_FIELDS = frozenset(
    "name description license allowed-tools metadata version compatibility".split()
)

_WITHOUT = "the agent loads without it"
_PATTERN_RE = re.compile(r"^([^()]+)\((.*)\)$")


class UnknownAgent(UsageError):
    pass


class UnknownSkill(UsageError):
    pass


class AgentDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str
    tools: list[str] | None = None  # None: every orch tool; else our tool names
    disallowed_tools: list[str] = Field(default_factory=list)
    model: str | None = None  # None: inherit
    cache_ttl: Literal["5m", "1h"] | None = None  # None: the ``cache_ttl`` setting
    permission_mode: str | None = None
    max_turns: int | None = None
    skills: list[str] = Field(default_factory=list)
    isolation: str | None = None  # a tier name from workspaces.registry
    agents: list[str] | None = None  # the agents it may start (``Task(a, b)``); None: any
    # its commands' network ("none", "host" or an allow-list); None: the settings' own
    network: NetworkSetting | None = None
    background: bool = False
    color: str | None = None
    # its ``mcpServers``: a server declared elsewhere (None) or its own inline declaration
    # (a ``mcpclient.declared.ServerDecl``, validated when parsed)
    mcp_servers: dict[str, Any] = Field(default_factory=dict)
    system_prompt: str = ""
    source: str = ""  # file path, or "bundled:<name>"
    warnings: list[str] = Field(default_factory=list)
    repository: bool = False  # the repository's (``owner.py``), set where it is loaded

    def allowed_tools(self, all_tools: list[str]) -> list[str]:
        """The tools of ``all_tools`` (in that order) this agent may use, then its MCP grants
        (``mcpclient.names``): those its ``tools`` lists (every MCP tool, ``mcp__*``, without
        a ``tools`` list) and a whole-server grant for each of its ``mcpServers``."""
        chosen = all_tools if self.tools is None else [t for t in all_tools if t in self.tools]
        grants = [EVERY] if self.tools is None else [t for t in self.tools if is_mcp(t)]
        grants += [f"mcp__{s}" for s in self.mcp_servers if f"mcp__{s}" not in grants]
        return [t for t in [*chosen, *grants] if t not in self.disallowed_tools]


class SkillDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str
    body: str
    source: str
    warnings: list[str] = Field(default_factory=list)
    repository: bool = False  # the repository's (``owner.py``), set where it is loaded


class ValidationReport(BaseModel):
    path: str
    ok: bool
    kind: Literal["agent", "skill"]
    name: str | None = None
    warnings: list[str] = Field(default_factory=list)
    error: str | None = None


def map_tool_names(entries: Iterable[str], *, deny: bool = False) -> tuple[list[str], list[str]]:
    """Claude Code / orch tool names -> (our names, deduplicated in order; warnings).
    With ``deny`` (disallowedTools) a permission pattern denies the whole tool."""
    out: list[str] = []
    warnings: list[str] = []
    for raw in entries:
        base, pattern = raw, None
        if m := _PATTERN_RE.match(raw):
            base, pattern = m.group(1).strip(), m.group(2)
        mapped = base if base in ORCH_TOOLS else CLAUDE_TOOL_MAP.get(base.lower())
        if pattern is None and parts(base) is not None and base != EVERY:
            mapped = base  # an MCP tool or server, as written
        if mapped is None:
            why = UNSUPPORTED_TOOLS.get("mcp__" if base.startswith("mcp__") else base.lower())
            note = f" ({why})" if why else ""
            if not deny:
                warnings.append(f"tool {raw!r} cannot be honoured by orch{note}; {_WITHOUT}")
            elif why is None:
                warnings.append(f"disallowedTools entry {raw!r} is not a known tool; ignored")
            continue
        if pattern is not None:
            effect = f"all of {mapped} is denied" if deny else f"the agent gets all of {mapped}"
            warnings.append(
                f"{raw!r}: the permission pattern {pattern!r} is not enforced; {effect}"
            )
        if mapped not in out:
            out.append(mapped)
    return out, warnings


def _agent_list(raw: list[str]) -> tuple[list[str], list[str] | None]:
    """``Task(a, b)`` / ``Agent(a, b)`` in ``tools``: the task tool, limited to those agents."""
    out: list[str] = []
    agents: list[str] | None = None
    for entry in raw:
        m = _PATTERN_RE.match(entry)
        if m and CLAUDE_TOOL_MAP.get(m.group(1).strip().lower()) == "task":
            names = [n.strip() for n in m.group(2).split(",") if n.strip()]
            agents = [*(agents or []), *names]
            entry = m.group(1).strip()
        out.append(entry)
    return out, agents


def parse_agent(text: str, path: Path | str, source: str | None = None) -> AgentDefinition:
    """Parse one agent file's text; raises :class:`DefinitionError`."""
    p = parse_frontmatter(text, str(path))
    for key in list(p.data):
        canon = _CAMEL.get(key.replace("-", "").replace("_", "").lower())
        if canon is not None and canon not in p.data:
            p.data[canon] = p.data.pop(key)
            p.key_lines.setdefault(canon, p.line(key))
    p.unsupported(AGENT_FIELDS)
    warnings = p.warnings

    name = p.check_name(p.req_str("name", "'name: my-agent'"), "agent")
    description = p.req_str("description", "'description: what it does and when to use it'")
    file = Path(path)
    if file.suffix == ".md" and file.stem != name:
        warnings.append(f"file name {file.name!r} differs from name {name!r}; using {name!r}")

    tools: list[str] | None = None
    agents: list[str] | None = None
    raw_tools = p.str_list("tools", "'tools: Read, Grep, Glob'")
    if raw_tools is not None:
        raw_tools, agents = _agent_list(raw_tools)
    if raw_tools is not None and "*" not in raw_tools:
        tools, more = map_tool_names(raw_tools)
        warnings += more
    raw_deny = p.str_list("disallowedTools", "'disallowedTools: Write, Bash'")
    disallowed, more = map_tool_names(raw_deny or [], deny=True)
    warnings += more

    model = p.opt_str("model", "'model: sonnet'")
    max_turns = p.data.get("maxTurns")
    if max_turns is not None and (type(max_turns) is not int or max_turns < 1):
        raise p.error("maxTurns", f"'maxTurns' must be a whole number >= 1, not {max_turns!r}")
    isolation = p.opt_str("isolation", "'isolation: worktree'")
    from ..workspaces.registry import TIER_NAMES

    if isolation is not None and isolation not in TIER_NAMES:
        one_of = ", ".join(TIER_NAMES)
        raise p.error("isolation", f"'isolation' must be one of {one_of}, not {isolation!r}")
    network = None
    if p.data.get("network") is not None:
        try:
            network = parse_setting(p.data["network"])
        except ValueError as e:
            raise p.error("network", str(e)) from None
    mcp_servers: dict[str, Any] = {}
    if p.data.get("mcpServers") is not None:
        from ..mcpclient.declared import agent_servers

        try:
            mcp_servers = agent_servers(p.data["mcpServers"], f"{path} mcpServers", warnings)
        except ValueError as e:
            raise p.error("mcpServers", str(e)) from None
    cache_ttl = p.opt_str("cacheTtl", "'cacheTtl: 1h'")
    if cache_ttl is not None and cache_ttl not in ("5m", "1h"):
        raise p.error("cacheTtl", f"'cacheTtl' must be 5m or 1h, not {cache_ttl!r}")
    background = p.data.get("background")
    if background is not None and not isinstance(background, bool):
        raise p.error("background", f"'background' must be true or false, not {background!r}")
    if not p.body:
        warnings.append("the body is empty: the agent has no system prompt of its own")

    return AgentDefinition(
        name=name,
        description=description,
        tools=tools,
        disallowed_tools=disallowed,
        model=None if model == "inherit" else model,
        permission_mode=p.opt_str("permissionMode", "'permissionMode: default'"),
        max_turns=max_turns,
        cache_ttl="1h" if cache_ttl == "1h" else "5m" if cache_ttl else None,
        skills=p.str_list("skills", "'skills: git-hygiene, code-review-checklist'") or [],
        isolation=isolation,
        agents=agents,
        network=network,
        background=bool(background),
        color=p.opt_str("color", "'color: blue'"),
        mcp_servers=mcp_servers,
        system_prompt=p.body,
        source=source or str(path),
        warnings=warnings,
    )


def parse_skill(text: str, path: Path | str, source: str | None = None) -> SkillDefinition:
    """Parse one SKILL.md's text (name defaults to its folder); raises DefinitionError."""
    p = parse_frontmatter(text, str(path))
    p.unsupported(SKILL_FIELDS)
    warnings = p.warnings
    folder = Path(path).parent.name
    name = p.check_name(p.opt_str("name", "'name: my-skill'") or folder, "skill")
    if Path(path).name == "SKILL.md" and folder != name:
        warnings.append(f"folder {folder!r} differs from name {name!r}; using {name!r}")
    description = p.opt_str("description", "'description: what the skill is for'")
    if description is None:
        first = next((ln.strip("# \t") for ln in p.body.splitlines() if ln.strip("# \t")), "")
        if not first:
            raise p.error("description", "missing 'description'; add 'description: ...'")
        description = first[:200]
        warnings.append("no 'description'; using the body's first line (add a description)")
    source = source or str(path)
    return SkillDefinition(
        name=name, description=description, body=p.body, source=source, warnings=warnings
    )


def load_agent_file(path: Path, source: str | None = None) -> AgentDefinition:
    return parse_agent(_read(path), path, source)


def load_skill_file(path: Path, source: str | None = None) -> SkillDefinition:
    return parse_skill(_read(path), path, source)


@dataclass
class Catalog:
    """Every agent and skill found, by name, plus the files that failed to load."""

    agents: dict[str, AgentDefinition] = field(default_factory=dict)
    skills: dict[str, SkillDefinition] = field(default_factory=dict)
    errors: list[DefinitionError] = field(default_factory=list)
    mcp: Declared | None = None  # the MCP servers declared for the project (load_catalog)
    root: Path | None = None  # the project it was loaded for: its agent files are the repo's
    owners: Owners = field(default_factory=Owners)  # whose each file is (``owner.py``)

    def from_repository(self, agent: AgentDefinition) -> bool:
        """Whether ``agent`` is the repository's (``owner.py``): as it was loaded, or by the
        file it came from (by the path it was loaded from, or where a link in it leads)."""
        if agent.repository:
            return True
        if self.root is None or "/" not in agent.source or agent.source.startswith("bundled:"):
            return False  # orch's own (a team's, a gate's: "orch team"), or bundled
        owners = self.owners if self.owners.root is not None else Owners.of(self.root)
        return owners.inside(agent.source)

    def denies(self, agent: AgentDefinition) -> list[str]:
        """``agent``'s MCP denies as its run's allowed_tools keep them, for every run below
        it too (``names.with_denies``): its ``disallowedTools`` of MCP tools and, for the
        repository's agent, the user's servers (``names.NO_USERS``)."""
        own = [DENY + t for t in agent.disallowed_tools if is_mcp(t)]
        return [*own, NO_USERS] if self.from_repository(agent) else own

    def agent(self, name: str) -> AgentDefinition:
        return _named(self.agents, "agent", name, UnknownAgent)

    def skill(self, name: str) -> SkillDefinition:
        return _named(self.skills, "skill", name, UnknownSkill)

    def skill_catalog_text(self, names: list[str] | None = None) -> str:
        """``- name: description`` lines for a system prompt; bodies come via ``skill()``."""
        chosen = [self.skill(n) for n in names] if names is not None else self.skills.values()
        return "\n".join(f"- {s.name}: {' '.join(s.description.split())}" for s in chosen)


def bundled_dir(kind: Literal["agents", "skills", "sandboxes"]) -> Path | None:
    """``_bundled/<kind>`` inside an installed wheel, else ``<repo>/<kind>`` in a checkout
    (``sandboxes``: the image build that ``orch sandbox build`` runs)."""
    package = Path(__file__).resolve().parents[1]  # orchestrator/
    found = [d for d in (package / "_bundled" / kind, package.parent / kind) if d.is_dir()]
    return found[0] if found else None


def agent_files(directory: Path) -> list[Path]:
    """``*.md`` directly in ``directory``, except README.md, LICENSE* and hidden files."""
    return sorted(p for p in directory.glob("*.md") if p.is_file() and not _SKIP.match(p.name))


def skill_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*/SKILL.md") if p.is_file())


_D = TypeVar("_D", bound=AgentDefinition | SkillDefinition)


def _named(found: dict[str, _D], kind: str, name: str, unknown: type[UsageError]) -> _D:
    """The definition called ``name``; else ``unknown`` lists the names there are."""
    if name not in found:
        names = ", ".join(sorted(found)) or "(none)"
        see = f"(see `orch {kind}s list`)"
        raise unknown(f"unknown {kind} {name!r}; available {kind}s: {names} {see}")
    return found[name]


def _load_dirs(
    kind: Literal["agents", "skills"],
    dirs: list[Path],
    parse: Callable[[str, Path, str | None], _D],
    errors: list[DefinitionError],
    owners: Owners,
    every: list[tuple[Path, _D]] | None = None,
) -> dict[str, _D]:
    """Load each directory in turn; a name already found in an earlier one is kept
    (``every``: each directory's, in order)."""
    found: dict[str, _D] = {}
    seen: set[Path] = set()
    bundled = bundled_dir(kind)
    for directory in [*dirs, bundled] if bundled is not None else dirs:
        if directory.resolve() in seen or not directory.is_dir():
            continue
        loaded = found_in(kind, directory, owners, parse, errors, bundled)  # (owner.py)
        if loaded is None:
            continue  # refused: the same directory may still be the user's, named by them
        seen.add(directory.resolve())
        here: dict[str, Path] = {}
        for path, d in loaded:
            if d.name in here:
                msg = f"name {d.name!r} is already used by {here[d.name]}; rename one of them"
                errors.append(DefinitionError(path, 1, msg))
                continue
            here[d.name] = path
            found.setdefault(d.name, d)
            if every is not None:
                every.append((path, d))
    return found


def load_catalog(
    project_root: Path | None,
    agents_dirs: Sequence[Path] = (),
    home: Path | None = None,
    *,
    skills_dirs: Sequence[Path] = (),
    trust: Trust | None = None,
    hidden: Sequence[str] = (),
) -> Catalog:
    """Agents from each of ``agents_dirs``, ``<project>/.orch/agents``, ``.claude/agents``,
    ``~/.orch/agents``, bundled; skills likewise. On a name clash the earlier one wins, but
    a repository's skill or MCP server never takes the name of the user's untrusted
    (``shadow.py``).
    Whose each is (``owner.py``) follows ``trust`` (the directories the repository's
    settings name); ``hidden``: ``sandbox.hidden``, never read from the repository."""
    for d in [*agents_dirs, *skills_dirs]:
        if not d.is_dir():
            raise UsageError(f"directory {d} does not exist; check the --agents-dir path")
    home = home if home is not None else Path.home()

    def search(kind: str, extra: Sequence[Path]) -> list[Path]:
        roots = [project_root / ".orch", project_root / ".claude"] if project_root else []
        return [*extra, *(r / kind for r in roots), home / ".orch" / kind]

    owners = Owners.for_trust(project_root, trust, hidden)
    cat = Catalog(root=project_root, owners=owners)
    cat.agents = _load_dirs(
        "agents", search("agents", agents_dirs), parse_agent, cat.errors, owners
    )
    every: list[tuple[Path, SkillDefinition]] = []
    cat.skills = _load_dirs(
        "skills", search("skills", skills_dirs), parse_skill, cat.errors, owners, every
    )
    from ..mcpclient.declared import load_declared
    from .shadow import keep_users_servers, keep_users_skills

    keep_users_skills(cat.skills, every, trust)  # untrusted, the user's names stay the user's
    cat.mcp = keep_users_servers(project_root, load_declared(project_root, home), home, trust)
    return cat


def validate_files(paths: list[Path]) -> list[ValidationReport]:
    """Check agent files, SKILL.md files or directories of them (``orch agents validate``)."""
    files: list[Path] = []
    for path in paths:
        found = agent_files(path) + skill_files(path) if path.is_dir() else []
        files += found or [path]
    reports: list[ValidationReport] = []
    for path in files:
        kind: Literal["agent", "skill"] = "skill" if path.name == "SKILL.md" else "agent"
        report = ValidationReport(path=str(path), ok=False, kind=kind)
        if not path.is_file():
            report.error = f"{path}:1: no such file, or a directory with no definitions in it"
        else:
            try:
                d: AgentDefinition | SkillDefinition = (
                    load_skill_file(path) if kind == "skill" else load_agent_file(path)
                )
                report.ok, report.name, report.warnings = True, d.name, d.warnings
            except DefinitionError as e:
                report.error = str(e)
        reports.append(report)
    return reports
