"""Where the warm process of this environment lives (``orchestrator/warm/`` is the process):
its directory, its key, its idle time and its "could not start" marker. Standard library
only: the ``orch`` entry point reads it before anything else is imported, and ``orch
doctor`` reads it without importing the warm process."""

from __future__ import annotations

import os
from pathlib import Path

from .inherit import VOLATILE_ENV, caller_flags, inheritance, key
from .unixsock import connect, peer

__all__ = ["VOLATILE_ENV", "caller_flags", "idle_seconds", "owner", "warm_dir", "warm_key"]

IDLE_DEFAULT_S = 60.0
FAILED_FOR_S = 24 * 3600.0  # one that could not start is not tried again for a day


def idle_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get("ORCH_WARM_IDLE", IDLE_DEFAULT_S)))
    except ValueError:
        return IDLE_DEFAULT_S


SERVED: list[str] = []  # in the warm process (and the commands it forks): the key it serves


def warm_key() -> str:
    """The digest of everything a command inherits from the process that runs it. A
    command forked by the warm process answers the key that warm process serves: its own
    interpreter was started isolated (``-I``, orch's path), which is not what a caller has."""
    if SERVED:
        return SERVED[0]
    return key(inheritance(os.environ), 20)


def warm_dir() -> Path | None:
    """``~/.orch/warm``, ours and closed to others; None when it cannot be made so."""
    home = os.environ.get("HOME")
    if not home:
        return None
    path = Path(home) / ".orch" / "warm"
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)  # (parents=True would make it 0755)
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return None
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
        return None
    return path if st.st_mode & 0o077 == 0 else None


def owner(sock_path: Path) -> int | None:
    """The pid of the process of our uid listening on ``sock_path``, if one does."""
    try:
        sock = connect(sock_path)
    except OSError:
        return None
    with sock:
        return peer(sock)[0]
