"""``.orch/.gitignore``: orch's state stays out of git, a project's configuration does not.

``.orch/`` holds both. orch writes state there: the SQLite run store (``orch.db`` and
its ``-wal``/``-shm``/``-journal`` files), ``logs/`` (detached workers and the worker
host), ``worktrees/`` (the checkouts of worktree runs) with ``worktrees.lock``, the
worker host's ``host-KEY.sock`` and ``host-KEY.lock``, and the temp files of atomic
writes (``*.orch-tmp``), and ``owner`` (``statedir.py``: the mark that it is ours). A
project commits its configuration there: ``agents/``,
``skills/`` and ``teams/``. So the ``.gitignore`` orch writes names the state only (and
itself, so the first orch command leaves ``git status`` clean); everything else stays
addable.

An older orch wrote ``*`` (everything ignored): such a file is upgraded. Any other
content is the user's and is left alone. The file is written through
:mod:`orchestrator.fs.safefs`: a symlink in its place (a repository may ship one) is
replaced, never written through, and ``.orch`` itself must not be a symlink.
"""

from __future__ import annotations

import contextlib
import stat
from pathlib import Path

from ..fs.safefs import Beneath, UnsafePath

STATE_IGNORE = """\
# Written by orch: its state stays out of git. agents/, skills/ and teams/ are
# configuration: commit them. orch leaves this file alone once you edit it.
/.gitignore
/owner
/orch.db
/orch.db-*
/logs/
/worktrees/
/tmp/
/*.sock
/*.lock
/*.tmp
*.orch-tmp
"""
_BEFORE_OWNER = STATE_IGNORE.replace("/owner\n", "")  # before statedir.py's mark
# What orch wrote before (ignoring everything, configuration included): upgraded. When
# STATE_IGNORE changes, add its previous text here, or it counts as the user's.
OLD_IGNORES = frozenset({"*\n", "*", _BEFORE_OWNER})
MAX_READ = 64 * 1024


def ensure_state_ignore(state: Path) -> None:
    """Give the state directory ``state`` orch's ``.gitignore`` unless it has one of the
    user's. Best effort: a directory that cannot be written is left as it is."""
    rel = f"{state.name}/.gitignore"
    with contextlib.suppress(OSError, UnsafePath), Beneath(state.parent) as fs:
        try:
            st = fs.stat(rel)
        except FileNotFoundError:
            fs.write(rel, STATE_IGNORE.encode(), make_parents=False)
            return
        if stat.S_ISLNK(st.st_mode):  # not a file anyone edits here; git does not follow it
            fs.remove(rel)
            fs.write(rel, STATE_IGNORE.encode(), make_parents=False)
            return
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_READ:
            return
        data, _ = fs.read(rel, MAX_READ)
        if data.decode("utf-8", "replace") in OLD_IGNORES:
            fs.write(rel, STATE_IGNORE.encode(), make_parents=False)
