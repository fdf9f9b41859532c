"""What a bash line runs: its simple commands and pipelines, and the built-in deny checks.

The policy (``policy.py``) checks every simple command of a line against the deny
list; this module finds them, in linear time, without shared state.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import get_args

from ..config import BuiltinCheck

# -- bash parsing ------------------------------------------------------------------
# Everything below is linear in the length of the line (the model picks the line, and a
# check that went quadratic on a long one would stall the run) and keeps no state: every
# table is immutable and every function works on its own locals, so check_command may run
# in several threads at once (the agent loop calls it off the event loop).
#
# Operators split a line into simple commands; so do ( ) and backquotes, which start
# subshells, command and process substitutions, case patterns and function bodies.
_SPLIT = re.compile(r"\|\||&&|[;&|\n()`]")
_SPLIT_PIPELINES = re.compile(r"\|\||&&|[;\n]|(?<![|>])&(?!&)")
# One piece of a shell word, POSIX shlex rules: a plain run, '...', "..." (in which only \"
# and \\ are escapes), \x, or the blanks between words. Possessive: no backtracking.
_TOKEN = re.compile(
    r"(?P<plain>[^ \t\r\n'\"\\]++)"
    r"|'(?P<sq>[^']*+)'"
    r'|"(?P<dq>(?:[^"\\]++|\\.)*+)"'
    r"|\\(?P<esc>.)"
    r"|(?P<ws>[ \t\r\n]++)",
    re.S,
)
_DQ_ESCAPE = re.compile(r'\\([\\"])')
_BLANKS = re.compile(r"[ \t\r\n]+")
_SHELLS = frozenset({"bash", "sh", "zsh", "dash", "ksh"})
# Words that may come before the command itself: stripped, so ^-anchored rules see it.
_KEYWORDS = frozenset(
    {"if", "then", "do", "else", "elif", "while", "until", "!", "{", "}", "coproc"}
)
_WRAPPERS = frozenset(
    {
        "env",
        "nohup",
        "nice",
        "time",
        "timeout",
        "xargs",
        "exec",
        "command",
        "builtin",
        "setsid",
        "stdbuf",
        "ionice",
        "chrt",
        "taskset",
        "busybox",
        "unbuffer",
    }
)
_WRAPPER_ARG_OPTS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        # options of a wrapper that take the next word as their value
        "env": frozenset({"-u", "-C", "--unset", "--chdir"}),
        "timeout": frozenset({"-s", "-k", "--signal", "--kill-after"}),
        "xargs": frozenset({"-I", "-n", "-P", "-d", "-a", "-E", "-L", "-s"}),
        "stdbuf": frozenset({"-i", "-o", "-e"}),
        "nice": frozenset({"-n"}),
        "ionice": frozenset({"-c", "-n", "-p", "-P", "-u"}),
        "taskset": frozenset({"-c"}),
        "exec": frozenset({"-a"}),
    }
)
_NO_OPTS: frozenset[str] = frozenset()
_PRIVILEGED = frozenset({"sudo", "doas"})
_SUDO_ARG_OPTS = frozenset({"-u", "-g", "-C", "-h", "-p", "-D", "-r", "-t", "-U"})


def simple_commands(line: str) -> list[str]:
    """Every simple command in a shell line, normalised to single spaces.

    Conservative: operators inside quotes also split, which can only add
    candidates to check, never hide one.
    """
    return [" ".join(words) for words in command_words(line)]


def command_words(
    line: str, _depth: int = 0, memo: dict[str, list[str]] | None = None
) -> list[list[str]]:
    """The words of every simple command in a line, wrappers and shell keywords stripped.

    ``$(...)``, backquotes and ``<(...)`` need no pass of their own: ( ) and ` split
    the line, so what they hold is already a part of it. The arguments of ``bash -c``,
    ``<<<`` and ``eval`` are parsed again, at most 5 levels deep, each level reading
    each character a bounded number of times. ``memo`` (one per check, never shared
    between threads) parses a part that comes up again only once.
    """
    if _depth > 4:
        return [line.split()]
    memo = {} if memo is None else memo
    out: list[list[str]] = []
    for part in _SPLIT.split(line.replace("\\\n", " ")):
        words = _words(part, memo)
        if not words:
            continue
        out.append(words)
        name = _basename(words[0])
        if name in _SHELLS:
            for i in range(1, len(words) - 1):
                w = words[i]
                if w == "<<<" or (w.startswith("-") and "c" in w):
                    out.extend(command_words(words[i + 1], _depth + 1, memo))
                    break
        elif name == "eval" and len(words) > 1:
            out.extend(command_words(" ".join(words[1:]), _depth + 1, memo))
    return out


def pipelines(line: str, memo: dict[str, list[str]] | None = None) -> list[str]:
    """Each pipeline of a line (``a | b`` kept whole), normalised like simple commands."""
    memo = {} if memo is None else memo
    out = []
    for part in _SPLIT_PIPELINES.split(line.replace("\\\n", " ")):
        stages = [" ".join(_words(stage, memo)) for stage in part.split("|")]
        joined = " | ".join(s for s in stages if s)
        if joined:
            out.append(joined)
    return out


def shell_split(s: str) -> list[str] | None:
    """``shlex.split(s)`` in linear time; None where shlex raises (unclosed quote, ending ``\\``).

    shlex grows each word one character at a time on an attribute (``self.token += c``),
    which is quadratic in the length of the word: minutes for a 2 MB one.
    """
    if "'" not in s and '"' not in s and "\\" not in s:
        return [w for w in _BLANKS.split(s) if w]
    words: list[str] = []
    pieces: list[str] = []
    in_word = False
    pos, end = 0, len(s)
    match = _TOKEN.match
    while pos < end:
        m = match(s, pos)
        if m is None:
            return None
        pos = m.end()
        kind = m.lastgroup
        if kind == "ws":
            if in_word:
                words.append("".join(pieces))
                pieces = []
                in_word = False
        elif kind == "dq":
            text = m["dq"]
            pieces.append(_DQ_ESCAPE.sub(r"\1", text) if "\\" in text else text)
            in_word = True
        else:  # plain, sq, esc
            pieces.append(m[kind or "plain"])
            in_word = True
    if in_word:
        words.append("".join(pieces))
    return words


def _words(part: str, memo: dict[str, list[str]]) -> list[str]:
    """The words of one simple command (the list may be shared: never change it)."""
    known = memo.get(part)
    if known is not None:
        return known
    text = part.strip().lstrip("(").rstrip(")").strip()
    words = shell_split(text)
    if words is None:  # an operator split a quoted string: drop the quotes, keep the words
        words = text.replace('"', " ").replace("'", " ").replace("\\", "").split()
    memo[part] = words = _strip_wrappers(words)
    return words


# The word lists below are handled as stacks (reversed, first word last): dropping a word
# is a pop, where ``words = words[1:]`` in a loop would copy the list once per word.
def _strip_wrappers(words: list[str]) -> list[str]:
    """Drop what comes before the command: VAR=value, shell keywords, wrappers and their options."""
    if words and _plain_command(words[0]):  # the common case: nothing to strip
        return [_basename(words[0]), *words[1:]] if words[0].startswith("/") else words
    stack = words[::-1]
    _strip_stack(stack)
    return stack[::-1]


def _basename(word: str) -> str:
    return word[word.rfind("/") + 1 :]


def _plain_command(word: str) -> bool:
    """A first word that _strip_stack keeps as it is."""
    return (
        word not in _KEYWORDS
        and word != "function"
        and "=" not in word
        and _basename(word) not in _WRAPPERS
        and len(word.split(maxsplit=1)) == 1
    )


def _strip_stack(stack: list[str]) -> None:
    while stack:
        word = stack[-1]
        first = _basename(word)
        if len(word.split()) > 1:  # one quoted word holding a command (env -S '...')
            stack.pop()
            stack.extend(reversed(word.split()))
        elif "=" in word and not word.startswith("=") and first == word:
            stack.pop()  # VAR=value prefix
        elif word in _KEYWORDS:
            stack.pop()
        elif word == "function":
            del stack[-2:]  # function NAME { ...
        elif first in _WRAPPERS:
            stack.pop()
            _skip_options_stack(stack, _WRAPPER_ARG_OPTS.get(first, _NO_OPTS))
        else:
            break
    if stack and stack[-1].startswith("/"):
        stack[-1] = _basename(stack[-1])


def _skip_options_stack(stack: list[str], takes_value: frozenset[str]) -> None:
    while stack and (stack[-1].startswith("-") or stack[-1][:1].isdigit()):
        if stack.pop() in takes_value and stack:
            stack.pop()


def _unprivileged(words: list[str]) -> list[str]:
    """The command ``sudo``/``doas`` would run (``sudo`` itself is refused by its own rule)."""
    if not words or words[0] not in _PRIVILEGED:
        return words
    stack = words[::-1]
    while stack and stack[-1] in _PRIVILEGED:
        stack.pop()
        _skip_options_stack(stack, _SUDO_ARG_OPTS)
        _strip_stack(stack)
    return stack[::-1]


def _long_option(word: str, full: str) -> bool:
    """``word`` is ``--full``, an abbreviation (``--har`` for ``--hard``) or ``--full…``."""
    name = word[2:].split("=", 1)[0] if word.startswith("--") else ""
    return bool(name) and (full.startswith(name) or name.startswith(full))


def _short_flags(word: str, takes_value: str = "") -> str:
    """The letters of a short option cluster (``-xdf``), up to one that takes a value."""
    if not word.startswith("-") or word.startswith("--"):
        return ""
    letters = word[1:]
    cuts = [i for i in (letters.find(ch) for ch in takes_value) if i >= 0]
    return letters[: min(cuts) + 1] if cuts else letters


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
if set(BUILTIN_CHECKS) != set(get_args(BuiltinCheck)):  # config names them, commands runs them
    raise ImportError("config.BuiltinCheck and commands.BUILTIN_CHECKS disagree")
