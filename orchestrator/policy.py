"""The policy: the same checks for parent and child, before every tool call.

- tool allow-list (tools not allowed are left out of the schema AND refused
  at call time, so a forced call runs nothing);
- depth limit for ``task`` (an agent at ``depth == max_depth`` has no ``task``);
- path confinement of the file tools to the workspace root (resolved paths,
  compared by component, never by string prefix; symlink loops refused; no
  writes into ``.git`` nor into orch's control files: ``.orch/``, ``.claude/``,
  ``orch.toml``, ``.worktreeinclude``);
- a deny list for ``bash``, checked on every simple command of the line,
  including those after ``;``, ``&&``, ``||``, ``|``, newlines, inside
  ``bash -c '...'``, ``$(...)``, subshells and after shell keywords
  (``then``, ``do``, ``!``, ``{``…); its rules are regexes or built-in token
  checks (``rm`` and ``git`` options in any spelling);
- the environment child processes get: secrets scrubbed by name pattern;
- PreToolUse / PostToolUse hooks (shell commands, event JSON on stdin; a hook
  that times out or is cancelled loses its whole process group).

The deny list is a guardrail against careless commands, not a sandbox:
the container tier is the boundary for untrusted ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import os
import posixpath
import re
import shlex
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from .config import BuiltinCheck, DenyRule, HookCommand, Settings

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
    _regexes: list[tuple[re.Pattern[str], str]] = field(default_factory=list, init=False)
    _checks: list[tuple[Callable[[list[str]], bool], str]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        for rule in self.deny:
            if rule.check is not None:
                self._checks.append((BUILTIN_CHECKS[rule.check], rule.reason))
            elif rule.pattern is not None:
                self._regexes.append((re.compile(rule.pattern), rule.reason))

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
        commands = command_words(command)
        for words in commands:
            for check, reason in self._checks:
                if check(words):
                    return Decision(False, f"command refused ({reason}): {' '.join(words)[:200]}")
        for simple in [" ".join(words) for words in commands] + pipelines(command):
            for pattern, reason in self._regexes:
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
            deny=[*settings.bash_deny, *settings.extra_bash_deny],
        )


# -- bash parsing ------------------------------------------------------------------
# Operators split a line into simple commands; so do ( ) and backquotes, which start
# subshells, command and process substitutions, case patterns and function bodies.
_SPLIT = re.compile(r"\|\||&&|[;&|\n()`]")
_SPLIT_PIPELINES = re.compile(r"\|\||&&|[;\n]|(?<![|>])&(?!&)")
_SUBST = re.compile(r"\$\(([^()]*)\)|`([^`]*)`")
_SHELLS = {"bash", "sh", "zsh", "dash", "ksh"}
# Words that may come before the command itself: stripped, so ^-anchored rules see it.
_KEYWORDS = {"if", "then", "do", "else", "elif", "while", "until", "!", "{", "}", "coproc"}
_WRAPPERS = {
    "env", "nohup", "nice", "time", "timeout", "xargs", "exec", "command", "builtin",
    "setsid", "stdbuf", "ionice", "chrt", "taskset", "busybox", "unbuffer",
}  # fmt: skip
_WRAPPER_ARG_OPTS = {  # options of a wrapper that take the next word as their value
    "env": {"-u", "-C", "--unset", "--chdir"},
    "timeout": {"-s", "-k", "--signal", "--kill-after"},
    "xargs": {"-I", "-n", "-P", "-d", "-a", "-E", "-L", "-s"},
    "stdbuf": {"-i", "-o", "-e"},
    "nice": {"-n"},
    "ionice": {"-c", "-n", "-p", "-P", "-u"},
    "taskset": {"-c"},
    "exec": {"-a"},
}
_PRIVILEGED = {"sudo", "doas"}
_SUDO_ARG_OPTS = {"-u", "-g", "-C", "-h", "-p", "-D", "-r", "-t", "-U"}


def simple_commands(line: str) -> list[str]:
    """Every simple command in a shell line, normalised to single spaces.

    Conservative: operators inside quotes also split, which can only add
    candidates to check, never hide one.
    """
    return [" ".join(words) for words in command_words(line)]


def command_words(line: str, _depth: int = 0) -> list[list[str]]:
    """The words of every simple command in a line, wrappers and shell keywords stripped."""
    out: list[list[str]] = []
    if _depth > 4:
        return [line.split()]
    for m in _SUBST.finditer(line):
        out.extend(command_words(m.group(1) or m.group(2) or "", _depth + 1))
    for part in _SPLIT.split(line.replace("\\\n", " ")):
        words = _words(part)
        if not words:
            continue
        out.append(words)
        name = os.path.basename(words[0])
        if name in _SHELLS:
            for i, w in enumerate(words[1:], 1):
                if (w == "<<<" or (w.startswith("-") and "c" in w)) and i + 1 < len(words):
                    out.extend(command_words(words[i + 1], _depth + 1))
                    break
        if name == "eval" and len(words) > 1:
            out.extend(command_words(" ".join(words[1:]), _depth + 1))
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
    part = part.strip().lstrip("(").rstrip(")").strip()
    try:
        words = shlex.split(part)
    except ValueError:  # an operator split a quoted string: drop the quotes, keep the words
        words = part.replace('"', " ").replace("'", " ").replace("\\", "").split()
    return _strip_wrappers(words)


def _strip_wrappers(words: list[str]) -> list[str]:
    """Drop what comes before the command: VAR=value, shell keywords, wrappers and their options."""
    while words:
        first = os.path.basename(words[0])
        if len(words[0].split()) > 1:  # one quoted word holding a command (env -S '...')
            words = words[0].split() + words[1:]
        elif "=" in words[0] and not words[0].startswith("=") and first == words[0]:
            words = words[1:]  # VAR=value prefix
        elif words[0] in _KEYWORDS:
            words = words[1:]
        elif words[0] == "function":
            words = words[2:]  # function NAME { ...
        elif first in _WRAPPERS:
            words = _skip_options(words[1:], _WRAPPER_ARG_OPTS.get(first, set()))
        else:
            break
    if words:
        words = [os.path.basename(words[0]) if words[0].startswith("/") else words[0], *words[1:]]
    return words


def _skip_options(words: list[str], takes_value: set[str]) -> list[str]:
    while words and (words[0].startswith("-") or words[0][:1].isdigit()):
        words = words[2:] if words[0] in takes_value else words[1:]
    return words


def _unprivileged(words: list[str]) -> list[str]:
    """The command ``sudo``/``doas`` would run (``sudo`` itself is refused by its own rule)."""
    while words and words[0] in _PRIVILEGED:
        words = _strip_wrappers(_skip_options(words[1:], _SUDO_ARG_OPTS))
    return words


def _long_option(word: str, full: str) -> bool:
    """``word`` is ``--full``, an abbreviation (``--har`` for ``--hard``) or ``--full…``."""
    name = word[2:].split("=", 1)[0] if word.startswith("--") else ""
    return bool(name) and (full.startswith(name) or name.startswith(full))


def _short_flags(word: str, takes_value: str = "") -> str:
    """The letters of a short option cluster (``-xdf``), up to one that takes a value."""
    if not word.startswith("-") or word.startswith("--"):
        return ""
    letters = ""
    for ch in word[1:]:
        letters += ch
        if ch in takes_value:
            break
    return letters


_GLOB_ONLY = re.compile(r"[.*?]*")  # "", ".", "..", "*", ".*": every entry of the directory
_HOME_VAR = re.compile(r"\$(HOME|PWD|\{(HOME|PWD)([:?=+-][^}]*)?\})")
_SYSTEM_DIRS = frozenset(
    "bin boot dev etc home lib lib32 lib64 libx32 media mnt opt proc root run sbin srv sys tmp "
    "usr var".split()
)


def _dangerous_rm_target(target: str) -> bool:
    """``/``, ``/*``, a top-level system dir, ``~``, ``$HOME``, ``.``, ``..``, ``*``, ``.git``."""
    if not target:
        return False
    parts = posixpath.normpath(target).split("/")  # a/.. and // collapsed, trailing / dropped
    while len(parts) > 1 and _GLOB_ONLY.fullmatch(parts[-1]):
        parts.pop()  # dir/* and dir/.* empty dir: as bad as dir itself
    if len(parts) == 1:
        head = parts[0]
        return bool(
            _GLOB_ONLY.fullmatch(head)
            or head.startswith("~")
            or _HOME_VAR.fullmatch(head)
            or head.lower() == ".git"
        )
    path = "/".join(parts)
    home = os.path.expanduser("~").rstrip("/")
    return (len(parts) == 2 and parts[0] == "" and parts[1] in _SYSTEM_DIRS) or path == home


def rm_dangerous(words: list[str]) -> bool:
    """``rm`` with a recursive flag in any spelling and a target that deletes too much."""
    words = _unprivileged(words)
    if not words or words[0] != "rm":
        return False
    recursive = no_preserve_root = False
    targets: list[str] = []
    options_done = False
    for w in words[1:]:
        if options_done or w == "-" or not w.startswith("-"):
            targets.append(w)
        elif w == "--":
            options_done = True
        elif w.startswith("--"):
            recursive |= _long_option(w, "recursive")
            no_preserve_root |= _long_option(w, "no-preserve-root")
        else:
            recursive |= "r" in w or "R" in w
    return recursive and (no_preserve_root or any(_dangerous_rm_target(t) for t in targets))


_GIT_GLOBAL_ARG_OPTS = {"-C", "-c", "--git-dir", "--work-tree", "--namespace", "--config-env"}


def _git(words: list[str], subcommand: str) -> list[str] | None:
    """The arguments of ``git [global options] <subcommand> …``, or None for another command."""
    words = _unprivileged(words)
    if not words or words[0] != "git":
        return None
    i = 1
    while i < len(words) and words[i].startswith("-"):
        i += 2 if words[i] in _GIT_GLOBAL_ARG_OPTS else 1
    return words[i + 1 :] if i < len(words) and words[i] == subcommand else None


def git_push_force(words: list[str]) -> bool:
    """``--force`` in any spelling (``-uf``, ``--forc``, ``--force-with-lease``), ``+ref``,
    ``--mirror``."""
    args = _git(words, "push")
    return args is not None and any(
        "f" in _short_flags(a, "o")
        or _long_option(a, "force")
        or _long_option(a, "mirror")
        or a.startswith("+")
        for a in args
    )


def git_reset_hard(words: list[str]) -> bool:
    args = _git(words, "reset")
    return args is not None and any(_long_option(a, "hard") for a in args)


def git_clean_force(words: list[str]) -> bool:
    args = _git(words, "clean")
    return args is not None and any(
        "f" in _short_flags(a, "e") or _long_option(a, "force") for a in args
    )


BUILTIN_CHECKS: dict[str, Callable[[list[str]], bool]] = {
    "rm_dangerous": rm_dangerous,
    "git_push_force": git_push_force,
    "git_reset_hard": git_reset_hard,
    "git_clean_force": git_clean_force,
}
if set(BUILTIN_CHECKS) != set(get_args(BuiltinCheck)):  # config names them, policy runs them
    raise ImportError("config.BuiltinCheck and policy.BUILTIN_CHECKS disagree")


# -- paths -------------------------------------------------------------------------
# Files that steer orch's future runs (settings, hooks, agents, skills, the store, what a
# worktree copies in): an agent may read them, never write them.
CONTROL_DIRS = frozenset({".orch", ".claude"})
CONTROL_FILES = frozenset({"orch.toml", ".worktreeinclude"})


def confine(root: Path, path: str, *, write: bool) -> Path:
    """Resolve ``path`` inside ``root`` or raise PathRefused.

    Relative paths are taken from the root; absolute ones must resolve inside
    it. Symlinks are resolved first, then the result is compared to the root
    component by component (``/repo_evil`` is not inside ``/repo``). Writes are
    refused into ``.git`` and into orch's own control files at the root.
    """
    root = root.resolve()
    if not path or "\x00" in path:
        raise PathRefused("empty or invalid path")
    raw = Path(path)
    candidate = raw if raw.is_absolute() else root / raw
    try:
        resolved = candidate.resolve()
    except RuntimeError as e:  # Python 3.11: "Symlink loop from ..."
        raise PathRefused(f"path {path!r} goes through a symlink loop; refused") from e
    except OSError as e:
        raise PathRefused(f"path {path!r} cannot be resolved ({e.strerror or e})") from e
    if not resolved.is_relative_to(root):
        raise PathRefused(f"path {path!r} resolves outside the workspace ({root})")
    rel = resolved.relative_to(root)
    if write and any(part.lower() == ".git" for part in rel.parts):
        raise PathRefused(f"path {path!r} is inside .git; writes there are refused")
    if write and resolved == root:
        raise PathRefused("cannot write to the workspace root itself")
    if write and rel.parts and _is_control(rel):
        raise PathRefused(
            f"path {path!r} is an orch control file (settings, hooks, agents, skills or "
            "run state) that steers future runs; writes are refused; edit it yourself"
        )
    if resolved.is_file() and resolved.stat().st_nlink > 1:
        raise PathRefused(f"path {path!r} is a hard link (link count > 1); refused")
    return resolved


def _is_control(rel: Path) -> bool:
    first = rel.parts[0].lower()
    return first in CONTROL_DIRS or (len(rel.parts) == 1 and first in CONTROL_FILES)


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
        finished = False
        try:
            async with asyncio.timeout(hook.timeout_s):
                out, err = await proc.communicate(data)
            finished = True
        except TimeoutError:
            return HookOutcome(True, f"{event} hook timed out after {hook.timeout_s:g}s")
        finally:
            if not finished:  # timed out or cancelled: the hook's whole process group goes
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                # wait() also waits for the pipes, which a process that left the group
                # (setsid) may hold open: bounded, so a hook never hangs the run.
                try:
                    async with asyncio.timeout(2):
                        await proc.wait()
                except TimeoutError:
                    transport = getattr(proc, "_transport", None)  # close the pipes ourselves
                    if transport is not None:
                        transport.close()
        if proc.returncode == 2:
            text = (err or out).decode(errors="replace").strip()
            return HookOutcome(True, text or f"blocked by {event} hook")
    return HookOutcome()
