"""What an MCP client may start: the user sets it when they start the server; the client,
a model, picks within it.

- The tier: a client's runs get a branch of their own (``worktree``, or ``container``),
  never the user's checkout, unless the user started the server with ``--allow-shared``;
  never weaker than the agent's own definition (``isolation:``).
- How many at once: at most ``max_live`` runs this server started are unfinished
  (foreground and background); budgets count per chain, and each ``task`` is a chain.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..catalog.definitions import AgentDefinition
from ..errors import UsageError
from ..workspaces.registry import rank

DEFAULT_TIER = "worktree"


@dataclass(frozen=True)
class ServerLimits:
    allow_shared: bool = False
    max_live: int = 8


def tier_for(asked: str | None, agent: AgentDefinition, limits: ServerLimits) -> str:
    """The tier of a client's run: what it asked, else the agent's, else a worktree; refused
    when weaker than the agent's own, or ``shared`` without ``--allow-shared``."""
    own = agent.isolation
    if asked is None:
        asked = own if own is not None and (own != "shared" or limits.allow_shared) else None
        asked = asked or DEFAULT_TIER
    if own is not None and rank(asked) < rank(own):
        raise UsageError(
            f"agent {agent.name!r} runs with isolation {own}; ask for {own} or a stronger one"
        )
    if asked == "shared" and not limits.allow_shared:
        raise UsageError(
            "isolation shared is off for MCP clients (their agents would write your checkout "
            "directly); use worktree or container, or start the server with `orch mcp "
            "--allow-shared`"
        )
    return asked


def check_room(live: int, limits: ServerLimits) -> None:
    if live >= limits.max_live:
        raise UsageError(
            f"{live} runs this server started are still running (at most {limits.max_live}: "
            "`orch mcp --max-live`); collect one with task_output or stop one with task_stop"
        )
