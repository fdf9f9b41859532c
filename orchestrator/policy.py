"""The policy: the same checks for parent and child, before every tool call.

- tool allow-list (tools not allowed are left out of the schema AND refused
  at call time, so a forced call runs nothing);
- depth limit for ``task`` (an agent at ``depth == max_depth`` has no ``task``);
- path confinement of the file tools to the workspace root (resolved paths,
  compared by component, never by string prefix; no writes into ``.git``);
- a deny list for ``bash``, checked on every simple command of the line,
  including those after ``;``, ``&&``, ``||``, ``|``, newlines, inside
  ``bash -c '...'`` and ``$(...)``;
- the environment child processes get: secrets scrubbed by name pattern;
- PreToolUse / PostToolUse hooks (shell commands, event JSON on stdin).

The deny list is a guardrail against careless commands, not a sandbox:
the container tier is the boundary for untrusted ones.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import DenyRule, HookCommand, Settings

DELEGATION_TOOLS = frozenset({"task", "task_output", "task_stop"})


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str = ""


ALLOW = Decision(True)


class PathRefused(Exception):
    pass


@dataclass
class Policy:
    """Limits of one run. Travels with the run record (allowed_tools, depth, max_depth)."""

    allowed_tools: frozenset[str]
    depth: int
    max_depth: int
    deny: list[DenyRule] = field(default_factory=list)
    _compiled: list[tuple[re.Pattern[str], str]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self._compiled = [(re.compile(r.pattern), r.reason) for r in self.deny]

    @property
    def may_delegate(self) -> bool:
        return self.depth < self.max_depth

    def offered_tools(self) -> frozenset[str]:
        """The tools whose schema the model is sent."""
        if self.may_delegate:
            return self.allowed_tools
        return self.allowed_tools - DELEGATION_TOOLS

    def child_tools(self, requested: list[str]) -> frozenset[str]:
        """A child never has more tools than its parent."""
        return frozenset(t for t in requested if t in self.allowed_tools)

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
        if tool == "bash":
            command = args.get("command")
            if isinstance(command, str):
                return self.check_command(command)
        return ALLOW

    def check_command(self, command: str) -> Decision:
        for simple in simple_commands(command) + pipelines(command):
            for pattern, reason in self._compiled:
                if pattern.search(simple):
                    return Decision(False, f"command refused ({reason}): {simple[:200]}")
        return ALLOW

    @classmethod
    def for_run(
        cls, settings: Settings, allowed_tools: list[str], depth: int, max_depth: int
    ) -> Policy:
        tools = set(allowed_tools)
        if "task" in tools:  # who may delegate may also collect and stop what it delegated
            tools |= DELEGATION_TOOLS
        return cls(
            allowed_tools=frozenset(tools),
            depth=depth,
            max_depth=max_depth,
            deny=list(settings.bash_deny),
        )


# -- bash parsing ------------------------------------------------------------------
_SPLIT = re.compile(r"\|\||&&|[;&|\n]")
_SPLIT_PIPELINES = re.compile(r"\|\||&&|[;\n]|(?<![|>])&(?!&)")
_SUBST = re.compile(r"\$\(([^()]*)\)|`([^`]*)`")
_SHELLS = {"bash", "sh", "zsh", "dash", "ksh"}
_WRAPPERS = {"env", "nohup", "nice", "time", "timeout", "xargs", "exec", "command", "builtin"}


def simple_commands(line: str, _depth: int = 0) -> list[str]:
    """Every simple command in a shell line, normalised to single spaces.

    Conservative: operators inside quotes also split, which can only add
    candidates to check, never hide one.
    """
    out: list[str] = []
    if _depth > 4:
        return [line]
    for m in _SUBST.finditer(line):
        out.extend(simple_commands(m.group(1) or m.group(2) or "", _depth + 1))
    for part in _SPLIT.split(line.replace("\\\n", " ")):
        words = _words(part)
        if not words:
            continue
        out.append(" ".join(words))
        name = os.path.basename(words[0])
        if name in _SHELLS:
            for i, w in enumerate(words[1:], 1):
                if w.startswith("-") and "c" in w and i + 1 < len(words):
                    out.extend(simple_commands(words[i + 1], _depth + 1))
                    break
        if name == "eval" and len(words) > 1:
            out.extend(simple_commands(" ".join(words[1:]), _depth + 1))
    return out


def pipelines(line: str) -> list[str]:
    """Each pipeline of a line (``a | b`` kept whole), normalised like simple commands."""
    out = []
    for part in _SPLIT_PIPELINES.split(line.replace("\\\n", " ")):
        stages = [" ".join(_words(stage)) for stage in part.split("|")]
        joined = " | ".join(s for s in stages if s)
        if joined:
            out.append(joined)
    return out


def _words(part: str) -> list[str]:
    part = part.strip().lstrip("({").rstrip(")}").strip()
    try:
        words = shlex.split(part)
    except ValueError:  # an operator split a quoted string: drop the quotes, keep the words
        words = part.replace('"', " ").replace("'", " ").split()
    return _strip_wrappers(words)


def _strip_wrappers(words: list[str]) -> list[str]:
    while words:
        first = os.path.basename(words[0])
        if "=" in words[0] and not words[0].startswith("=") and first == words[0]:
            words = words[1:]  # VAR=value prefix
        elif first in _WRAPPERS:
            words = words[1:]
            while words and (words[0].startswith("-") or words[0][:1].isdigit()):
                words = words[1:]
        else:
            break
    if words:
        words = [os.path.basename(words[0]) if words[0].startswith("/") else words[0], *words[1:]]
    return words


# -- paths -------------------------------------------------------------------------
def confine(root: Path, path: str, *, write: bool) -> Path:
    """Resolve ``path`` inside ``root`` or raise PathRefused.

    Relative paths are taken from the root; absolute ones must resolve inside
    it. Symlinks are resolved first, then the result is compared to the root
    component by component (``/repo_evil`` is not inside ``/repo``).
    """
    root = root.resolve()
    if not path or "\x00" in path:
        raise PathRefused("empty or invalid path")
    raw = Path(path)
    candidate = raw if raw.is_absolute() else root / raw
    resolved = candidate.resolve()
    if not resolved.is_relative_to(root):
        raise PathRefused(f"path {path!r} resolves outside the workspace ({root})")
    rel = resolved.relative_to(root)
    if write and any(part.lower() == ".git" for part in rel.parts):
        raise PathRefused(f"path {path!r} is inside .git; writes there are refused")
    if write and resolved == root:
        raise PathRefused("cannot write to the workspace root itself")
    if resolved.is_file() and resolved.stat().st_nlink > 1:
        raise PathRefused(f"path {path!r} is a hard link (link count > 1); refused")
    return resolved


# -- environment -------------------------------------------------------------------
def scrubbed_env(settings: Settings, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The orchestrator's environment minus anything that looks like a secret."""
    env = dict(os.environ if base is None else base)
    patterns = [p.upper() for p in settings.secret_env_patterns + settings.extra_secret_env]
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
    and blocks, since its verdict is unknown.
    """
    for hook in hooks:
        if not re.search(hook.matcher, subject):
            continue
        data = json.dumps({"hook_event_name": event, **payload}, default=str).encode()
        proc = await asyncio.create_subprocess_shell(
            hook.command,
            cwd=cwd,
            env=dict(env),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            async with asyncio.timeout(hook.timeout_s):
                out, err = await proc.communicate(data)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return HookOutcome(True, f"{event} hook timed out after {hook.timeout_s:g}s")
        if proc.returncode == 2:
            text = (err or out).decode(errors="replace").strip()
            return HookOutcome(True, text or f"blocked by {event} hook")
    return HookOutcome()
