"""MCP tool names and grants, as Claude Code spells them.

A tool of server ``s`` is ``mcp__s__tool``. In an agent's ``tools`` (and so in a run's
``allowed_tools``) a grant is one tool (``mcp__s__tool``), a whole server (``mcp__s``), or,
for an agent without a ``tools`` list (every tool), ``mcp__*``: whichever servers it is
given. A child's grants are those of its parent that it asks for, never wider
(:func:`narrowed`).
"""

from __future__ import annotations

PREFIX = "mcp__"
EVERY = "mcp__*"  # every MCP tool (an agent with no ``tools`` list)
DENY = "!"  # ``!mcp__s__t`` in a run's allowed_tools: denied to it and to its descendants
# in a run's allowed_tools: the user's servers (``~/.orch/mcp.json``, a user's agent's own
# ``mcpServers``) are offered neither to it nor to any run below it: a repository's agent
# (``catalog.owner``) and everything it starts. No grant is within it (no server is "@user").
NO_USERS = f"{DENY}{PREFIX}@user"
_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def server_name_ok(name: str) -> bool:
    """Letters, digits, ``-`` and single ``_`` (``__`` separates), a letter or digit first."""
    return bool(name) and name[0] not in "_-" and set(name) <= _WORD and "__" not in name


def tool_name_ok(name: str) -> bool:
    """What the Messages API accepts as a tool's whole name."""
    return 0 < len(name) <= 64 and set(name) <= _WORD


def is_mcp(name: str) -> bool:
    return name.startswith(PREFIX)


def tool_name(server: str, tool: str) -> str:
    return f"{PREFIX}{server}__{tool}"


def parts(grant: str) -> tuple[str, str | None] | None:
    """``(server, tool or None)`` of a grant (``mcp__*``: ``("*", None)``); None if it is
    not one (no server, or a server name with ``__`` or odd characters)."""
    if not is_mcp(grant):
        return None
    server, sep, tool = grant[len(PREFIX) :].partition("__")
    if server == "*" and not sep:
        return server, None
    if not server_name_ok(server) or (sep and not tool):
        return None
    return server, tool if sep else None


def within(grant: str, wider: str) -> bool:
    """Whether everything ``grant`` allows, ``wider`` allows too."""
    if wider == EVERY or grant == wider:
        return True
    g, w = parts(grant), parts(wider)
    return g is not None and w is not None and w[1] is None and g[0] == w[0] and g[0] != "*"


def covers(grants: list[str] | frozenset[str], server: str, tool: str) -> bool:
    """Whether ``grants`` allow tool ``tool`` of ``server``."""
    name = tool_name(server, tool)
    return any(within(name, g) for g in grants if is_mcp(g))


def narrowed(parent: list[str], asked: list[str]) -> list[str]:
    """A child's MCP grants: each asked one its parent's cover, else the parent's grants
    the asked one covers (a child asking ``mcp__*`` under a parent with ``mcp__s`` gets
    ``mcp__s``); in the order asked, each once."""
    mine = [g for g in parent if is_mcp(g)]
    out: list[str] = []
    for grant in asked:
        if not is_mcp(grant):
            continue
        if any(within(grant, p) for p in mine):
            chosen = [grant]
        else:
            chosen = [p for p in mine if within(p, grant)]
        out += [g for g in chosen if g not in out]
    return out


def denies(allowed_tools: list[str]) -> list[str]:
    """The MCP grants a run is denied (``!`` entries of its allowed_tools), without the ``!``."""
    return [t[len(DENY) :] for t in allowed_tools if t.startswith(DENY)]


def with_denies(allowed: list[str], *sources: list[str]) -> list[str]:
    """``allowed`` and, after it, each deny (``!mcp__…``) of ``sources`` once: a child keeps
    its parent's denies (``disallowedTools`` of MCP tools are inherited, as a missing builtin
    is)."""
    out = list(allowed)
    for source in sources:
        out += [d for d in source if d.startswith(DENY + PREFIX) and d not in out]
    return out


def servers(grants: list[str]) -> list[str]:
    """The servers ``grants`` name (``mcp__*`` names none), in order, each once."""
    out: list[str] = []
    for grant in grants:
        found = parts(grant)
        if found is not None and found[0] != "*" and found[0] not in out:
            out.append(found[0])
    return out
