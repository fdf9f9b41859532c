"""What a real model is told about delegation: the ``task`` tool's text and the agent catalog.

Also the environment section of every agent's system prompt: what its tier allows.

A model that is not told which agents exist guesses ``subagent_type``; one that is
not told when *not* to delegate spends a child on a file it could read itself.
The ``task`` description says, compactly: when to delegate and when not, that the
child sees only the prompt, which tier fits what, how background runs report
back, and to check a child's evidence before trusting it; then the catalog of
the agents this caller may start. Claude Code's built-in agent names map to
their bundled equivalents, so a Claude model's habits work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..egress.rules import Reach
from .definitions import AgentDefinition, Catalog, UnknownAgent

DEFAULT_AGENT = "general"
# Claude Code's built-in agent types -> the bundled agent that does the same job.
ALIASES: dict[str, str] = {
    "general-purpose": "general",
    "Explore": "explorer",
    "explore": "explorer",
}
CATALOG_CHARS = 6_000  # the agent list in the task description is cut past this
DESCRIPTION_CHARS = 240  # one agent's description in the list

TASK_GUIDANCE = """\
Start a child agent on a task of its own. It works on a fresh conversation with \
its own tools and returns only its final answer, as this tool's result (the user \
does not see it: report what matters yourself).

When to delegate: independent pieces of work that can run in parallel (several \
task calls in one reply run at once), broad searches whose details you do not \
need to keep, or work that belongs in another workspace. When not to: a file or \
symbol you can name (read it directly), a one-line check, or work that needs \
this conversation's context.

The child sees ONLY the prompt you write, none of this conversation. Make it \
self-contained: the goal, the context it needs (paths, names, constraints, what \
you already ruled out), and the form of the answer you want back.

isolation: shared (default: your own tier) works in your workspace; worktree: \
its own checkout on a new branch that orch commits at the end, for you to review \
and merge; container: the strongest isolation (Docker, no host directory shared; \
work comes back as a branch), for untrusted code. A child never runs in a weaker \
tier than yours, nor with a wider network (none by default: installs fail).

run_in_background returns a task_id at once; you get a <task-notification> when \
it ends and collect the result with task_output. Do not poll it; do other work. \
A foreground child that runs long is moved to the background the same way.

resume: a task_id of an ended child of yours continues it (its conversation, \
workspace and branch kept) with prompt as the next message, instead of starting over.

Trust but verify: the result's status line lists the files the child really \
read and wrote, the commands it ran with their exit codes, and for worktree or \
container children the branch and diffstat. Check the evidence (read the diff, \
rerun a test) before you report a child's claimed change as done."""

TASK_OUTPUT_GUIDANCE = (
    "Collect a background task's result by its task_id. With block (the default) it waits "
    "for the task to end and returns the result as task returns it; with block false it "
    "returns the progress record at once (status, tool uses, last activity, running "
    "summary). Prefer waiting for the <task-notification> over polling."
)

TASK_STOP_GUIDANCE = (
    "Cancel a task you started (and every task it started). Its work so far is kept: a "
    "worktree or container child's changes are committed to its branch."
)


def resolve_agent(catalog: Catalog, name: str | None) -> AgentDefinition:
    """The agent called ``name`` (default: general), or its bundled equivalent for a
    Claude Code built-in name; an unknown name's error lists the valid ones."""
    name = name or DEFAULT_AGENT
    if name in catalog.agents:
        return catalog.agents[name]
    alias = ALIASES.get(name)
    if alias is not None and alias in catalog.agents:
        return catalog.agents[alias]
    names = ", ".join(sorted(catalog.agents)) or "(none)"
    known = ", ".join(f"{a} → {b}" for a, b in ALIASES.items() if b in catalog.agents)
    raise UnknownAgent(
        f"unknown agent {name!r}; valid subagent_type values: {names}"
        + (f" (Claude Code names map: {known})" if known else "")
    )


def spawnable(catalog: Catalog, caller: AgentDefinition) -> list[AgentDefinition]:
    """The agents ``caller`` may start, sorted by name (its ``Task(a, b)`` list, if any)."""
    allowed = caller.agents
    return sorted(
        (a for a in catalog.agents.values() if allowed is None or a.name in allowed),
        key=lambda a: a.name,
    )


def agent_catalog(agents: Iterable[AgentDefinition], default: str = DEFAULT_AGENT) -> str:
    """``- name: description`` lines, the default named, cut with a note past a size."""
    lines: list[str] = []
    size = 0
    listed = list(agents)
    for i, a in enumerate(listed):
        text = " ".join(a.description.split())
        if len(text) > DESCRIPTION_CHARS:
            text = text[: DESCRIPTION_CHARS - 1] + "…"
        mark = " (default)" if a.name == default else ""
        if a.network is not None:
            mark += f" [network: {_short(Reach.of(a.network))}]"
        line = f"- {a.name}{mark}: {text}"
        if size + len(line) > CATALOG_CHARS:
            lines.append(
                f"[{len(listed) - i} more agents not listed; `orch agents list` shows them all]"
            )
            break
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def task_description(catalog: Catalog, caller: AgentDefinition) -> str:
    """The ``task`` tool's description for one caller: the guidance, then its catalog."""
    agents = spawnable(catalog, caller)
    if not agents:
        return TASK_GUIDANCE
    default = DEFAULT_AGENT if any(a.name == DEFAULT_AGENT for a in agents) else agents[0].name
    return (
        f"{TASK_GUIDANCE}\n\nsubagent_type: one of these agents (default: {default}):\n"
        f"{agent_catalog(agents, default)}"
    )


def _short(reach: Reach) -> str:
    if reach.mode != "allow":
        return reach.mode
    return ", ".join(r.text for r in reach.layers[0])


def _network(saved: object) -> str:
    """The Environment line on a run's network (``saved``: its record's ``network``)."""
    reach = Reach.from_info(saved)
    if reach.mode == "none":
        return "- Network: none (package installs fail)."
    if reach.mode == "host":
        return "- Network: the machine's network (allowed by the user)."
    return (
        f"- Network: {reach.describe()}. HTTP_PROXY and HTTPS_PROXY are set (pip, npm, "
        "git over https, curl use them); anything else gets 403 with the reason, and a "
        "direct connection fails."
    )


def environment_section(
    *,
    root: Path | str,
    isolation: str,
    agent: str,
    depth: int,
    max_depth: int,
    workspace: Mapping[str, Any],
) -> str:
    """The system prompt's facts about the run's tier: where the work goes, what ``.git``
    and the network allow, and who commits (``workspace``: the workspace's ``info()``)."""
    lines = [
        "\n# Environment",
        f"- Workspace root: {root} (isolation: {isolation}). File tool paths are relative to it.",
        f"- You are agent '{agent}' at delegation depth {depth} (limit {max_depth}).",
    ]
    branch = workspace.get("branch") or "a branch of its own"
    sandboxed = workspace.get("os_sandbox", "bwrap") != "off"
    read_only = "- .git is read-only: git status/diff/log work; commit/checkout/branch fail."
    if isolation == "container":
        lines += [
            f"- A Docker container: {root} is its own git repository on branch {branch} "
            "(nothing of the host is mounted). You may commit; when you end, orch commits "
            f"the rest (build artefacts aside) and brings {branch} out for review.",
            _network(workspace.get("network", "none")),
        ]
    elif isolation == "worktree":
        lines.append(
            f"- Your own git worktree on branch {branch}. When you end, orch commits every "
            f"change (build artefacts aside) to {branch} for review: do not commit yourself."
        )
        lines += [read_only] if sandboxed else []
        lines.append(_network(workspace.get("network", "none")))
    else:
        lines.append(
            "- Shared workspace: your caller's directory (the user's for a root run), not a "
            "copy; your edits land there, uncommitted."
        )
        lines += [read_only] if sandboxed else []
        lines.append(_network(workspace.get("network", "none")))
    if not sandboxed and isolation != "container":
        lines.append("- Commands run on the host without an OS sandbox (sandbox.os = off).")
    lines.append(
        "- When the task is done, answer with your final result as plain text and no tool "
        "call; that text is all your caller will see."
    )
    return "\n".join(lines)
