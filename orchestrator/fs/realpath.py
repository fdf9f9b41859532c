"""Symlink resolution by the kernel, for the many paths a sandbox start names.

``Path.resolve`` walks a path one component at a time in Python (an ``lstat`` and maybe
a ``readlink`` each, ≈ 0.1 ms a path); a run's OS sandbox names some fifty paths (the
usual secrets, the store, orch itself, the workspace's hidden entries) and a fan-out
starts a hundred sandboxes. Here the kernel resolves an existing path in one
``open(O_PATH)``, and the descriptor's ``/proc/self/fd`` link names where it landed.
"""

from __future__ import annotations

import os
from pathlib import Path


def resolved(path: Path | str) -> Path | None:
    """``path`` absolute with every symlink followed, or None when nothing is there."""
    absolute = os.path.abspath(path)
    try:
        fd = os.open(absolute, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc: the slow walk
        real = ""
    finally:
        os.close(fd)
    if real.startswith("/") and not real.endswith(" (deleted)"):
        return Path(real)
    full = Path(absolute).resolve()
    return full if full.exists() else None


def resolved_lax(path: Path | str) -> Path:
    """``path`` as ``Path.resolve()`` (not strict) gives it, missing paths too: a missing
    path under an existing directory costs one ``open`` of that directory."""
    if (found := resolved(path)) is not None:
        return found
    absolute = Path(os.path.abspath(path))
    if not os.path.islink(absolute) and (parent := resolved(absolute.parent)) is not None:
        return parent / absolute.name
    return absolute.resolve()
