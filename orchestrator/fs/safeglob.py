"""The walking half of :mod:`orchestrator.fs.safefs`: listing a tree from a directory fd
without following links, and matching glob patterns by path components."""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable, Collection, Generator
from functools import lru_cache

LIST_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# why a normalized root-relative path may not be used (None: it may); see ``safefs.Beneath``
Refuse = Callable[[str], str | None]
_Parts = tuple[str, ...]
_Gen = Generator[str, None, None]


class UnsafePath(Exception):
    """The path escapes the workspace, goes through a symlink, or names a hard-linked or
    special file; the message says which, in words a model can act on."""


class TooManyEntries(Exception):
    """``walk`` reached its entry limit; what it yielded so far is valid but incomplete."""


class Walk:
    """One walk's rules: names skipped, the entry budget, the ``refuse`` rule."""

    def __init__(self, skip: Collection[str], budget: list[int], refuse: Refuse | None) -> None:
        self.skip, self.budget, self.refuse = skip, budget, refuse

    def _refused(self, rel: str) -> bool:
        return self.refuse is not None and self.refuse(rel) is not None

    def files(self, fd: int, prefix: str, depth: int) -> _Gen:
        """Files below directory ``fd`` (closed when done), then its subdirectories'."""
        budget = self.budget
        try:
            files: list[str] = []
            dirs: list[str] = []
            with os.scandir(fd) as it:
                for entry in it:
                    budget[0] -= 1
                    if budget[0] < 0:
                        raise TooManyEntries(f"stopped after {budget[1]} entries; narrow the path")
                    if self._refused(prefix + entry.name):
                        continue  # neither listed nor entered: its name is not shown either
                    if entry.is_dir(follow_symlinks=False):
                        if depth > 0 and entry.name not in self.skip:
                            dirs.append(entry.name)
                    elif entry.is_file(follow_symlinks=False):
                        files.append(entry.name)
            for name in sorted(files):
                yield prefix + name
            for name in sorted(dirs):
                try:  # swapped for a symlink, vanished, unreadable: skip it
                    sub = os.open(name, LIST_FLAGS, dir_fd=fd)
                except OSError:
                    continue
                yield from self.files(sub, f"{prefix}{name}/", depth - 1)
        finally:
            os.close(fd)


def pattern_parts(pattern: str) -> _Parts:
    if "\x00" in pattern:
        raise ValueError("invalid glob pattern (NUL byte)")
    if pattern.startswith("/") or ".." in pattern.split("/"):
        raise UnsafePath("glob patterns must be relative to the workspace, without '..'")
    out: list[str] = []
    for part in pattern.split("/"):
        if part not in ("", ".") and not (part == "**" and out and out[-1] == "**"):
            out.append(part)
    if not out:
        raise ValueError(f"empty glob pattern {pattern!r}")
    return tuple(out)


@lru_cache(maxsize=256)
def _component(part: str) -> re.Pattern[str]:
    return re.compile(fnmatch.translate(part))


def match_parts(pat: _Parts, names: _Parts) -> bool:
    """Whether path components ``names`` match glob components ``pat``."""
    memo: dict[tuple[int, int], bool] = {}
    n = len(names)

    def go(i: int, j: int) -> bool:
        if (i, j) not in memo:
            if i == len(pat):
                ok = j == n
            elif pat[i] == "**" and i == len(pat) - 1:
                ok = j < n  # a trailing ** matches any file below
            elif pat[i] == "**":
                ok = any(go(i + 1, k) for k in range(j, n))
            else:
                ok = j < n and bool(_component(pat[i]).match(names[j])) and go(i + 1, j + 1)
            memo[i, j] = ok
        return memo[i, j]

    return go(0, 0)
