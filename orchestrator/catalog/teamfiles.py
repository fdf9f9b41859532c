"""Team files as a repository commits them, ``.orch/teams/NAME.toml``: their names and
their text, read beneath the project root (no symlink followed, capped). What a team file
may say is ``teams/plan.py``'s; what of it needs trust, ``agent_trust.py``'s (which reads
them here: it sits below ``teams``)."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import UsageError
from ..fs.safefs import Beneath, TooManyEntries, UnsafePath

TEAMS_DIR = ".orch/teams"
MAX_FILE_BYTES = 64 * 1024
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # whole names only (fullmatch)


def team_names(root: Path) -> list[str]:
    """The names of the team files under ``root/.orch/teams`` (sorted)."""
    try:
        with Beneath(root) as fs:
            if not fs.is_dir(TEAMS_DIR):
                return []
            found = list(fs.walk(TEAMS_DIR, max_entries=1000))
    except (OSError, UnsafePath):
        return []
    except TooManyEntries:
        raise UsageError(
            f"{TEAMS_DIR} holds over 1,000 entries; keep only team files (NAME.toml) there"
        ) from None
    names = [Path(p).stem for p in found if p.count("/") == 2 and p.endswith(".toml")]
    return sorted(n for n in names if _NAME.fullmatch(n))


def read_team(root: Path, name: str) -> tuple[str, str]:
    """The text of ``root/.orch/teams/NAME.toml`` and its path as shown; UsageError with
    one line when it cannot be read."""
    if not _NAME.fullmatch(name):
        raise UsageError(
            f"{name!r} is not a team name (letters, digits, '.', '_' and '-'); see `orch team list`"
        )
    rel = f"{TEAMS_DIR}/{name}.toml"
    try:
        with Beneath(root) as fs:
            data, size = fs.read(rel, MAX_FILE_BYTES)
    except FileNotFoundError:
        known = ", ".join(team_names(root)) or "none"
        raise UsageError(
            f"no team {name!r}: {rel} does not exist (teams here: {known}); see `orch team list`"
        ) from None
    except (OSError, UnsafePath) as e:
        raise UsageError(f"{rel}: cannot read it ({e})") from None
    if size > MAX_FILE_BYTES:
        raise UsageError(f"{rel}: {size:,} bytes, over the {MAX_FILE_BYTES:,} a team file may be")
    try:
        return data.decode("utf-8"), rel
    except UnicodeDecodeError:
        raise UsageError(f"{rel}: not UTF-8 text; fix the file") from None
