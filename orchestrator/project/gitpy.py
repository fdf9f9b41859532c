"""GitPython, imported so that its import runs no git an agent could have planted.

``import git`` runs ``git version`` at once (GitPython's ``refresh``), found on ``PATH`` as
it is, unless ``GIT_PYTHON_GIT_EXECUTABLE`` names it: that variable is set here to the git
orch itself runs (``fs/hostprograms.py``: none in a git checkout or a workspace) before
GitPython is first imported. Import GitPython from here, never directly. (Every git
GitPython starts afterwards goes through ``project/git.py``: ``branches._HardenedGit``.)
"""

from __future__ import annotations

import os

from ..fs.hostprograms import host_program

_GIT = host_program("git")
if _GIT is not None:
    os.environ["GIT_PYTHON_GIT_EXECUTABLE"] = _GIT
else:  # no git: the tiers that need one say so when they run it
    os.environ["GIT_PYTHON_GIT_EXECUTABLE"] = os.devnull
    os.environ["GIT_PYTHON_REFRESH"] = "quiet"

import git as gitpython  # noqa: E402
from git.exc import GitCommandError  # noqa: E402

__all__ = ["GitCommandError", "gitpython"]
