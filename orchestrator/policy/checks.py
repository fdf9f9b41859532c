"""The policy: the same checks for parent and child, before every tool call.

- tool allow-list (tools not allowed are left out of the schema AND refused
  at call time, so a forced call runs nothing);
- depth limit for ``task`` (an agent at ``depth == max_depth`` has no ``task``);
- orch's control files (``.orch/``, ``.claude/``, ``orch.toml``,
  ``.worktreeinclude``), which the file tools never write (``tools/files.py``;
  the runtime opens every path race-free beneath the workspace);
- a deny list for ``bash``, checked on every simple command of the line,
  including those after ``;``, ``&&``, ``||``, ``|``, newlines, inside
  ``bash -c '...'``, ``$(...)``, subshells and after shell keywords
  (``then``, ``do``, ``!``, ``{``…); its rules are regexes or built-in token
  checks (``rm`` and ``git`` options in any spelling);
- the environment child processes get: secrets scrubbed by name pattern;
- PreToolUse / PostToolUse hooks (shell commands, event JSON on stdin; a hook
  that times out or is cancelled loses its whole process group); a hook that would run
  a file an agent could have written is refused and its run fails (``hookguard.py``), the
  others run from a private empty directory, never the workspace.

The deny list is a guardrail against careless commands and documents intent,
not a sandbox: bubblewrap (host tiers) and the container are the boundaries.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import DenyRule, HookCommand, Settings
from ..mcpclient.names import is_mcp, narrowed
from ..pgroups import kill_tree, reap, spawn
from .commands import BUILTIN_CHECKS, command_words, pipelines
from .hookguard import HookRefused, hook_env, interpreter_refusal, private_cwd, refusal

DELEGATION_TOOLS = frozenset({"task", "task_output", "task_stop"})


def tool_set(allowed_tools: list[str]) -> frozenset[str]:
    """The tools a run may call: its allow-list, and who may delegate may also collect and
    stop what it delegated."""
    tools = frozenset(allowed_tools)
    return tools | DELEGATION_TOOLS if "task" in tools else tools


def child_tools(parent_tools: list[str], requested: list[str]) -> list[str]:
    """A child's tools: those it asks for that its parent has (in the order asked), then its
    MCP grants, each within one of its parent's (``mcpclient.names.narrowed``)."""
    allowed = tool_set(parent_tools)
    own = [t for t in requested if t in allowed and not is_mcp(t)]
    return own + narrowed(parent_tools, requested)


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str = ""


ALLOW = Decision(True)


@dataclass
class Policy:
    """Limits of one run. Travels with the run record (allowed_tools, depth, max_depth)."""

    allowed_tools: frozenset[str]
    depth: int
    max_depth: int
    deny: list[DenyRule] = field(default_factory=list)
    max_command_bytes: int = 100_000  # Settings.max_command_bytes
    # Built once, never changed: check_call may run in several threads at once.
    _regexes: tuple[tuple[re.Pattern[str], str], ...] = field(default=(), init=False)
    _checks: tuple[tuple[Callable[[list[str]], bool], str], ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        self._checks = tuple(
            (BUILTIN_CHECKS[rule.check], rule.reason) for rule in self.deny if rule.check
        )
        self._regexes = tuple(
            (re.compile(rule.pattern), rule.reason)
            for rule in self.deny
            if rule.check is None and rule.pattern is not None
        )

    @property
    def may_delegate(self) -> bool:
        return self.depth < self.max_depth

    def offered_tools(self) -> frozenset[str]:
        """The tools whose schema the model is sent."""
        if self.may_delegate:
            return self.allowed_tools
        return self.allowed_tools - DELEGATION_TOOLS

    def check_call(self, tool: str, args: Mapping[str, Any]) -> Decision:
        if tool in DELEGATION_TOOLS and tool == "task" and not self.may_delegate:
            return Decision(
                False,
                f"task refused: depth limit reached (this agent is at depth {self.depth}, "
                f"max_depth is {self.max_depth}); do the work yourself",
            )
        if tool not in self.allowed_tools:
            return Decision(
                False,
                f"tool {tool!r} is not allowed for this agent; allowed: "
                + ", ".join(sorted(self.offered_tools())),
            )
        if tool == "bash" and isinstance(args, Mapping):  # a malformed input fails validation
            command = args.get("command")
            if isinstance(command, str):
                return self.check_command(command)
        return ALLOW

    def check_command(self, command: str) -> Decision:
        """The deny list on every simple command and pipeline; linear in the command's length.

        A command over ``max_command_bytes`` is refused before it is parsed. (A
        ``bash_deny`` pattern from the settings is searched as written: one that
        backtracks badly is slow on long commands, so keep them simple.)
        """
        size = len(command.encode("utf-8", "surrogatepass"))
        if size > self.max_command_bytes:
            return Decision(
                False,
                f"command refused: it is {size:,} bytes, over the limit of "
                f"{self.max_command_bytes:,} (max_command_bytes); write long content to a file "
                "with write_file and run a short command that uses the file",
            )
        memo: dict[str, list[str]] = {}
        commands = command_words(command, memo=memo)
        for words in commands:
            for check, reason in self._checks:
                if check(words):
                    return Decision(False, f"command refused ({reason}): {' '.join(words)[:200]}")
        # The same text often comes out of both splits: each distinct one is searched once.
        candidates = dict.fromkeys(
            [*(" ".join(words) for words in commands), *pipelines(command, memo)]
        )
        for simple in candidates:
            for pattern, reason in self._regexes:
                if pattern.search(simple):
                    return Decision(False, f"command refused ({reason}): {simple[:200]}")
        return ALLOW

    @classmethod
    def for_run(
        cls, settings: Settings, allowed_tools: list[str], depth: int, max_depth: int
    ) -> Policy:
        return cls(
            allowed_tools=tool_set(allowed_tools),
            depth=depth,
            max_depth=max_depth,
            deny=[*settings.bash_deny, *settings.extra_bash_deny],
            max_command_bytes=settings.max_command_bytes,
        )


# -- paths -------------------------------------------------------------------------
# Files that steer orch's future runs (settings, hooks, agents, skills, the store, what a
# worktree copies in): an agent may read them, never write them.
CONTROL_DIRS = frozenset({".orch", ".claude"})
CONTROL_FILES = frozenset({"orch.toml", ".worktreeinclude"})


def is_control(parts: tuple[str, ...]) -> bool:
    """True for a workspace-relative path (its parts) that is one of orch's control files."""
    if not parts:
        return False
    first = parts[0].lower()
    return first in CONTROL_DIRS or (len(parts) == 1 and first in CONTROL_FILES)


# -- environment -------------------------------------------------------------------
def scrubbed_env(settings: Settings, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The orchestrator's environment minus anything that looks like a secret, and minus
    the key variable of each named model endpoint (``[endpoints.NAME] key_env``)."""
    env = dict(os.environ if base is None else base)
    patterns = [p.upper() for p in settings.secret_env_patterns + settings.extra_secret_env]
    patterns += [e.key_env.upper() for e in settings.endpoints.values() if e.key_env]
    return {
        k: v for k, v in env.items() if not any(fnmatch.fnmatchcase(k.upper(), p) for p in patterns)
    }


# -- hooks -------------------------------------------------------------------------
@dataclass
class HookOutcome:
    blocked: bool = False
    message: str = ""


async def run_hooks(
    hooks: list[HookCommand],
    event: str,
    subject: str,
    payload: dict[str, Any],
    *,
    cwd: Path,
    env: Mapping[str, str],
) -> HookOutcome:
    """Run matching hook commands with the event as JSON on stdin.

    Exit code 2 blocks (stderr, or stdout, is the reason). Any other non-zero
    exit is reported but does not block. A hook that hangs is killed at its timeout
    and blocks, since its verdict is unknown. ``cwd`` is the run's workspace: the hook
    runs from a private empty directory, and one that names a file in a workspace raises
    :class:`HookRefused` (the run fails: a hook that cannot run never lets a call through).
    """
    for hook in hooks:
        if not re.search(hook.matcher, subject):
            continue
        with private_cwd(cwd) as here:
            outcome = await _run_hook(hook, event, payload, cwd, here, env)
        if outcome is not None:
            return outcome
    return HookOutcome()


async def _run_hook(
    hook: HookCommand,
    event: str,
    payload: dict[str, Any],
    workspace: Path,
    here: Path,
    env: Mapping[str, str],
) -> HookOutcome | None:
    """One hook run from ``here``: its outcome when it blocks, else None."""
    environ = hook_env(env, workspace, here)
    if (why := refusal(hook.command, workspace, environ)) is not None:
        raise HookRefused(f"{event} {why}")
    loads = interpreter_refusal  # what its interpreters import by themselves (asks them)
    if (why := await asyncio.to_thread(loads, hook.command, workspace, environ, here)) is not None:
        raise HookRefused(f"{event} {why}")
    data = json.dumps({"hook_event_name": event, **payload}, default=str).encode()
    proc = await spawn(
        "/bin/sh",
        "-c",
        hook.command,
        cwd=here,
        env=environ,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    finished = False
    try:
        async with asyncio.timeout(hook.timeout_s):
            out, err = await proc.communicate(data)
        finished = True
    except TimeoutError:
        return HookOutcome(True, f"{event} hook timed out after {hook.timeout_s:g}s")
    finally:
        if not finished:  # timed out or cancelled: the hook and all it started go
            kill_tree(proc.pid)
            await reap(proc, 2.0)  # (bounded: a hook never hangs the run)
    if proc.returncode == 2:
        text = (err or out).decode(errors="replace").strip()
        return HookOutcome(True, text or f"blocked by {event} hook")
    return None
