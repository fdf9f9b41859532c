"""The user's project on disk: its repository, its root, and orch's state in it.

- ``git.py`` / ``gitprocess.py``: hardened git (no config, hook or driver a repository
  or an agent planted runs on the host);
- ``repo.py``: finding the user's repository and a run's worktree;
- ``paths.py``: a project's root (its git toplevel, else the directory);
- ``statedir.py``: ``.orch/`` (or ``ORCH_HOME``), used only if this user's orch made it;
- ``orchignore.py``: ``.orch/.gitignore`` (orch's state ignored, definitions committable).
"""
