"""What a process inherits from the one that starts it, as one digest.

A long-lived process (the warm process, the worker host) runs commands or runs on behalf
of callers; it may serve a caller only if what it would pass on is what the caller would
have: the environment, the umask, the interpreter and its paths, orch's own code (every
source file's size and mtime: an edit gives a new key, so a running process never serves
old code), what is installed, and what the kernel passes on (:func:`inherited`). Both keys
are :func:`key` over :func:`inheritance`; the worker host adds its store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

VOLATILE_ENV = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})  # differ per shell, unused by runs
CODE = Path(__file__).resolve().parent.parent  # the orchestrator package
INHERITED_STATUS = frozenset(
    ("Uid", "Gid", "Groups", "Umask", "NoNewPrivs", "Seccomp", "Seccomp_filters", "CapInh")
    + ("CapPrm", "CapEff", "CapBnd", "CapAmb", "Cpus_allowed_list", "Mems_allowed_list")
)
_INSTALLED = (".dist-info", ".egg-info", ".egg-link", ".pth")


def comparable_env(env: Mapping[str, str]) -> dict[str, str]:
    """An environment as these processes compare it: without the shell's volatile names."""
    return {k: v for k, v in env.items() if k not in VOLATILE_ENV}


def umask() -> str:
    with contextlib.suppress(OSError):
        for entry in Path("/proc/self/status").read_text().splitlines():
            if entry.startswith("Umask:"):
                return entry.split()[1]
    return "?"


def inherited(pid: int | str) -> list[object]:
    """What process ``pid`` (or ``"self"``) passes on to a command besides its environment,
    as the kernel tells it: ids, groups, umask, capabilities, ``no_new_privs``, seccomp,
    CPUs and memory nodes, limits, cgroup, OOM score, priority and scheduling policy.
    OSError when it cannot be read."""
    status = {}
    for entry in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = entry.partition(":")
        if name in INHERITED_STATUS:
            status[name] = value.split()
    limits = Path(f"/proc/{pid}/limits").read_text()
    cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    oom = Path(f"/proc/{pid}/oom_score_adj").read_text()
    number = 0 if pid == "self" else int(pid)
    scheduling = [os.getpriority(os.PRIO_PROCESS, number), os.sched_getscheduler(number)]
    return [sorted(status.items()), limits, cgroup, oom, scheduling]


def _stamp(path: str, out: list[tuple[str, int, int]], depth: int = 0) -> None:
    """(path, size, mtime) of every source file under ``path``."""
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        for e in entries:
            if e.is_dir(follow_symlinks=False) and depth < 4 and e.name != "__pycache__":
                _stamp(e.path, out, depth + 1)
            elif e.name.endswith(".py"):
                st = e.stat()
                out.append((e.path, st.st_size, st.st_mtime_ns))


def code(root: Path | None = None) -> list[tuple[str, int, int]]:
    """orch's own sources as they are now (an edit changes this)."""
    found: list[tuple[str, int, int]] = []
    _stamp(str(root or CODE), found)
    return sorted(found)


def installed() -> list[str]:
    """What is installed beside orch (an install, upgrade or removal changes these)."""
    names: list[str] = []
    for entry in sys.path:
        if entry.endswith(("site-packages", "dist-packages")):
            with contextlib.suppress(OSError):
                names += sorted(n for n in os.listdir(entry) if n.endswith(_INSTALLED))
    return names


def _kernel() -> list[object]:
    try:
        return inherited("self")
    except OSError:
        return ["?"]


# The flags orch starts its own helpers with (``-I``: process/interpreter.py): a helper's
# are orch's choice, not something its caller passes on (the search path, which they
# change, is a part of the key of its own)
HELPER_FLAGS = ("isolated", "ignore_environment", "no_user_site", "safe_path")


CALLER_FLAGS: list[list[object]] = []  # in the warm process: its callers' flags


def _flags() -> list[object]:
    """The interpreter's flags as a caller's key counts them: in the warm process (and what
    it forks), the flags of the callers it serves, whose ``-I``-less interpreter read the
    environment's ``PYTHON*`` variables that the warm process's did not."""
    if CALLER_FLAGS:
        return CALLER_FLAGS[0]
    return [
        getattr(sys.flags, name)
        for name in dir(sys.flags)
        if not name.startswith("_") and name not in HELPER_FLAGS and name not in ("count", "index")
    ]


def caller_flags() -> str:
    """This interpreter's flags as :func:`_flags` counts them, for the warm process."""
    return json.dumps(_flags())


def inheritance(env: Mapping[str, str], *, search_path: bool = True) -> list[object]:
    """Everything a process started with ``env`` from this one inherits: the environment
    (less the volatile names), the umask, the interpreter and its flags, its module search
    path (``search_path``: a warm process takes its caller's; a worker host, started in
    any project, imports orch from its code alone), orch's code, what is installed and
    what the kernel passes on."""
    flags = [_flags(), sorted(map(str, sys._xoptions.items()))]
    interpreter = [sys.executable, sys.path if search_path else None, flags]
    env_items = sorted(comparable_env(env).items())
    return [env_items, umask(), interpreter, code(), installed(), _kernel()]


def key(parts: list[object], length: int) -> str:
    """The digest of ``parts`` (what :func:`inheritance` gives, and what else a key covers)."""
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:length]
