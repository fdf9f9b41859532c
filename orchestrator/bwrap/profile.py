"""OS-level confinement of an agent's commands with bubblewrap (``bwrap``).

The host tiers (shared, worktree) run a command as ``OsSandbox.wrap(argv, cwd)``
instead of ``argv``. Inside, the whole filesystem is read-only except the
workspace (and ``extra_writable``); ``/tmp`` is a private tmpfs and ``/run``
(where the Docker, containerd, D-Bus and systemd sockets live) an empty one;
secrets (``hidden``) are covered; paths inside the workspace that steer the
host (``read_only_within``: a ``.git`` dir or gitfile) stay read-only. The
command gets fresh PID, IPC, UTS, cgroup (and, unless ``network``, network:
with ``egress``, only the egress proxy's socket, bound at ``SOCKET_INSIDE``)
namespaces, no capabilities, no further user namespaces, a new session, and
only the environment it is given: ``bwrap`` itself is started through
``/usr/bin/env -i`` so that nothing of the caller's environment is left in any
process of the sandbox (``/proc/1/environ`` would show it otherwise). Neither
``env`` nor ``bwrap`` is one an agent could have planted (``fs/hostprograms.py``):
``env`` is never looked up, and the system ``bwrap`` is looked up on a ``PATH``
without entries in a git checkout and refused in or through the workspace (a
``bwrap`` chosen by path, or the bundled one, is kept read-only inside: ``own_paths``).

Mounts are applied parents first (by path depth), so a deeper rule wins over a
shallower one whatever list it comes from: the private ``/tmp`` is mounted
before a workspace that lives under ``/tmp``, a hidden store dir before the
worktree inside it, the workspace before the ``.git`` inside it. A read-only
path is a mount point, so it cannot be renamed, replaced or deleted; the
directories between it and the workspace are bound onto themselves (still
writable) so that they cannot be renamed away with it either; so are those between
the workspace and a hidden path inside it (renaming a parent would carry the hidden
file out from under its cover).

Killing: ``bwrap --die-with-parent`` plus the caller's kill of bwrap's process
group ends everything, ``setsid``-detached grandchildren included: they live
in a PID namespace whose init dies with bwrap, and the kernel then kills the
rest of the namespace.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..egress.bridge import SOCKET_INSIDE
from ..errors import OrchError
from ..fs.hostprograms import ENV, passes_through, workspaces
from ..fs.realpath import resolved, resolved_lax
from ..models import secret_env_prefixes
from .find import FIX, BwrapChoice, bwrap_choice, chosen, own_paths

__all__ = [
    "ENV_WHITELIST",
    "BwrapChoice",
    "FIX",
    "HOME_SECRETS",
    "OsSandbox",
    "SandboxUnavailable",
    "available",
    "bwrap_choice",
    "default_hidden",
    "is_secret_name",
    "sandbox_env",
]

ENV_WHITELIST = frozenset(
    {
        "PATH",
        "HOME",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TERM",
        "TZ",
        "USER",
        "LOGNAME",
        "SHELL",
        "NO_COLOR",
    }
)
CHAIN_PREFIX = "ORCH_"
_SECRET_WORDS = ["KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL"]
_SECRET_WORDS += map(re.escape, secret_env_prefixes())  # the model providers' settings
_SECRET = re.compile("|".join(_SECRET_WORDS), re.IGNORECASE)

# Relative to the user's HOME: credentials and orch's own state, never shown to a command.
HOME_SECRETS = (
    ".ssh",
    ".aws",
    ".config/gcloud",
    ".docker",
    ".netrc",
    ".orch",
    ".gnupg",
    ".kube",
    ".azure",
    ".git-credentials",
    ".config/git/credentials",
    ".config/gh",
    ".npmrc",
    ".pypirc",
    ".cargo/credentials.toml",
    ".claude",
    ".pgpass",
    ".pg_service.conf",
)

PRIVATE_TMP = Path("/tmp")
PRIVATE_RUN = Path("/run")  # sockets that hand out root (docker.sock), D-Bus, systemd
RESOLV_CONF = Path("/etc/resolv.conf")


class SandboxUnavailable(OrchError):
    """bwrap is missing or cannot make namespaces here; the message names the fix."""


# -- environment -------------------------------------------------------------------


def is_secret_name(name: str) -> bool:
    """True for a variable name that looks like it holds a credential."""
    return _SECRET.search(name) is not None


def sandbox_env(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The environment a sandboxed command gets.

    From ``base`` (the host environment) only the names in :data:`ENV_WHITELIST`.
    ``extra`` (orch's chain variables) may add whitelisted or ``ORCH_*`` names;
    any other name, or one that looks like a secret, is a programming error.
    """
    env = {k: v for k, v in base.items() if k in ENV_WHITELIST}
    for name, value in extra.items():
        if is_secret_name(name):
            raise ValueError(f"environment variable {name} looks like a secret; not passed")
        if name not in ENV_WHITELIST and not name.startswith(CHAIN_PREFIX):
            raise ValueError(
                f"environment variable {name} is neither whitelisted nor an {CHAIN_PREFIX}* "
                "chain variable"
            )
        env[name] = value
    return env


def default_hidden(home: Path | None = None, *more: Path) -> tuple[Path, ...]:
    """The usual secret paths under ``home`` (default: ``$HOME``), plus ``more``
    (orch's store dir, for one)."""
    if home is None:
        env_home = os.environ.get("HOME")
        home = Path(env_home) if env_home else Path.home()
    return tuple(home / rel for rel in HOME_SECRETS) + tuple(more)


# -- availability ------------------------------------------------------------------


def available(setting: str = "auto") -> str | None:
    """None when the bwrap ``setting`` picks works here, else a one-line reason naming the
    cause and the fixes (probed once per setting: ``bwrapfind``)."""
    return bwrap_choice(setting).reason


# -- the sandbox -------------------------------------------------------------------


def _absolute(path: Path) -> Path:
    """``path`` absolute with symlinks resolved (a mount follows them anyway)."""
    return resolved_lax(path)


def _depth(path: Path) -> int:
    return len(path.parts)


# At one path, the more restrictive kind is mounted last so it wins.
_PRIVATE, _WRITABLE, _READ_ONLY, _HIDDEN = range(4)


@dataclass(frozen=True)
class OsSandbox:
    """One run's confinement. Paths are resolved at :meth:`wrap` time; a
    ``read_only_within`` or ``hidden`` path that does not exist then is skipped."""

    workspace: Path
    extra_writable: tuple[Path, ...] = ()
    read_only_within: tuple[Path, ...] = ()
    hidden: tuple[Path, ...] = ()
    network: bool = False
    egress: Path | None = None  # the egress proxy's socket, seen at ``SOCKET_INSIDE``
    env: Mapping[str, str] = field(default_factory=dict)
    bwrap: str = "auto"  # sandbox.bwrap: which bwrap runs it (``bwrapfind``)

    def __post_init__(self) -> None:
        for name in self.env:
            if is_secret_name(name) or not name or "=" in name:
                raise ValueError(f"environment variable {name!r} may not enter the sandbox")

    def mounts(self) -> list[str]:
        """The bwrap filesystem arguments, parents before children."""
        ops: list[tuple[int, int, str, list[str]]] = []

        def add(path: Path, kind: int, args: list[str]) -> None:
            ops.append((_depth(path), kind, str(path), args))

        remount_ro: list[Path] = [PRIVATE_RUN]
        add(PRIVATE_TMP, _PRIVATE, ["--tmpfs", str(PRIVATE_TMP)])
        add(PRIVATE_RUN, _PRIVATE, ["--tmpfs", str(PRIVATE_RUN)])
        writable = self._writable()
        pinned: set[Path] = set()
        # the bwrap that runs, where a command could replace it for the next run's sandbox
        itself = self._existing(own_paths(chosen(self.bwrap).choice))
        itself = [p for p in itself if any(p.is_relative_to(root) for root in writable)]
        for path in [*self._existing(self.read_only_within), *itself]:
            add(path, _READ_ONLY, ["--ro-bind", str(path), str(path)])
            for root in writable:  # a mount point cannot be renamed: pin the way to it
                if path.is_relative_to(root):
                    pinned.update(a for a in path.parents if a.is_relative_to(root) and a != root)
        hidden = self._existing(self.hidden)
        for path in hidden:  # renaming a parent would unhide it
            for root in writable:
                if path.is_relative_to(root):
                    pinned.update(a for a in path.parents if a.is_relative_to(root) and a != root)
        for path in [*writable, *sorted(pinned - set(writable))]:
            add(path, _WRITABLE, ["--bind", str(path), str(path)])
        if self.egress is not None and not self.network:
            add(Path(SOCKET_INSIDE), _READ_ONLY, ["--bind", str(self.egress), SOCKET_INSIDE])
        if self.network:  # name resolution may live under the hidden /run
            resolv = _absolute(RESOLV_CONF)
            if resolv.is_relative_to(PRIVATE_RUN) and resolv.exists():
                add(resolv, _READ_ONLY, ["--ro-bind", str(resolv), str(resolv)])
        for path in hidden:
            if path.is_dir():
                add(path, _HIDDEN, ["--tmpfs", str(path)])
                remount_ro.append(path)
            else:  # a file or socket: /dev/null on a nodev mount, so reads get EACCES
                add(path, _HIDDEN, ["--ro-bind", "/dev/null", str(path)])
        args = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        for *_order, op in sorted(ops, key=lambda o: o[:3]):
            args += op
        for path in remount_ro:  # last: deeper mounts needed their mount points first
            args += ["--remount-ro", str(path)]
        return args

    def _writable(self) -> list[Path]:
        workspace = _absolute(self.workspace)
        if not workspace.is_dir():
            raise SandboxUnavailable(f"workspace {workspace} is not a directory")
        return [workspace, *self._existing(self.extra_writable)]

    @staticmethod
    def _existing(paths: Iterable[Path]) -> list[Path]:
        """The paths that exist, resolved, each once (three names of one store directory
        are one mount)."""
        return list(dict.fromkeys(p for p in map(resolved, paths) if p is not None))

    def wrap(self, argv: Sequence[str], cwd: Path) -> list[str]:
        """The argv that runs ``argv`` in ``cwd`` inside this sandbox.

        Start it in a session of its own and stop it with ``pgroups.kill_tree``
        (``run_process`` does both). Raises :class:`SandboxUnavailable`
        when bwrap does not work here.
        """
        found = chosen(self.bwrap)
        if found.choice.path is None:
            raise SandboxUnavailable(found.choice.reason or FIX)
        if not argv:
            raise ValueError("nothing to run")
        if found.choice.source == "system" and _writable(found.choice.path, self.workspace):
            raise SandboxUnavailable(
                f"{found.choice.path} is in a workspace an agent can write: install bubblewrap "
                'outside it (apt-get install bubblewrap) or set sandbox.bwrap = "bundled"'
            )
        out = [ENV, "-i", found.choice.path, *self.mounts()]
        out += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        out += [*found.userns, "--cap-drop", "ALL"]
        if not self.network:
            out.append("--unshare-net")
        out += ["--die-with-parent", "--new-session", "--chdir", str(_absolute(cwd))]
        out.append("--clearenv")
        for name, value in self.env.items():
            out += ["--setenv", name, value]
        return [*out, "--", *argv]


@functools.lru_cache(maxsize=64)
def _writable(program: str, workspace: Path) -> bool:
    """``program`` lies in or passes through a workspace of ``workspace``'s project (a
    sandbox there could replace it)."""
    return passes_through(program, workspaces(workspace), Path("/")) is not None
