"""The user's trust store, ``~/.orch/trusted.json``: which repositories are trusted, with
the digest of the gated settings they were trusted with (``trust.py`` decides what is
gated; this keeps the record). The file is the user's own (mode 0600, not writable by
another user, else refused), changed under a lock and replaced atomically."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import UsageError

TRUST_FILE = "trusted.json"
VERSION = 1
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def trust_file() -> Path:
    """The user's trust store: ``~/.orch/trusted.json``."""
    return Path.home() / ".orch" / TRUST_FILE


def _corrupt(path: Path, why: str) -> UsageError:
    return UsageError(
        f"{path} is not a valid trust file ({why}); remove it (rm {path}) and trust your "
        "repositories again with `orch trust`"
    )


def read_store(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """Trusted repositories by resolved root: ``{"sha256", "settings", "trusted_at"}``."""
    path = path or trust_file()
    try:
        st = path.lstat()
    except FileNotFoundError:
        return {}
    if not stat.S_ISREG(st.st_mode):
        raise _corrupt(path, "not a regular file")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise UsageError(
            f"{path} can be changed by another user (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}); make it yours with mode 600, or remove it and "
            "trust your repositories again with `orch trust`"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise _corrupt(path, f"not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise _corrupt(path, f'no "version": {VERSION}')
    trusted = data.get("trusted")
    if not isinstance(trusted, dict):
        raise _corrupt(path, 'no "trusted" object')
    for root, entry in trusted.items():
        if not isinstance(entry, dict) or not _DIGEST.match(str(entry.get("sha256"))):
            raise _corrupt(path, f"the entry for {root!r} has no valid sha256")
    return trusted


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    fd = os.open(directory / ".trusted.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write_store(path: Path, trusted: dict[str, dict[str, Any]]) -> None:
    """Atomically: a temporary file (0600) in the same directory, fsynced, renamed over."""
    text = json.dumps({"version": VERSION, "trusted": trusted}, indent=2, sort_keys=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".trusted.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fchmod(f.fileno(), 0o600)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def remember(root: Path, digest: str, names: list[str]) -> None:
    """Trust ``root`` with the gated settings ``names`` as they hash to ``digest``."""
    path = trust_file()
    with _locked(path.parent):
        trusted = read_store(path)
        trusted[str(root)] = {
            "sha256": digest,
            "settings": names,
            "trusted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        _write_store(path, trusted)


def revoke(root: Path) -> bool:
    """Forget ``root``; False if it was not in the store."""
    path = trust_file()
    if not path.exists():
        return False
    with _locked(path.parent):
        trusted = read_store(path)
        if trusted.pop(str(root), None) is None:
            return False
        _write_store(path, trusted)
    return True
