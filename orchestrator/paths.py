"""Where a project lives: the git toplevel of a directory, or the directory itself."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .errors import UsageError


def project_root(start: Path | None = None) -> Path:
    start = (start or Path.cwd()).resolve()
    if not start.is_dir():
        raise UsageError(f"{start} is not a directory; pass an existing --workdir")
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"],
            cwd=start,
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        return start
    if out.returncode == 0 and out.stdout.strip():
        return Path(out.stdout.strip()).resolve()
    return start
