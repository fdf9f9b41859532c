"""Executors: where a run executes when it does not execute in the spawner's process.

The default is none: every run is an asyncio task of the process that spawned it (or of
the detached worker a background root is handed to). ``executor = "ray"`` (or
``orch task --executor ray``) sends worktree- and container-tier runs (roots and
children) to the nodes of a Ray cluster:

- ``driver.py`` is the spawner's side (:class:`RayExecutor`, the Runner's
  ``Executor``): it reserves the run's resources on a node (``place.py``), sends the node
  what its bundle cache lacks of the starting commit, calls the node's warm orch, awaits
  it like a local child, forwards cancellation, and imports the work that comes back onto
  ``orch/<agent>/<id>`` with hardened git;
- ``warm.py`` is the node's long-lived orch (one Ray actor per node and identity): imports
  done, a bundle cache per repository, an idle timeout;
- ``node.py`` is what it runs per run: adopts the stored run in a repository of the node
  made for it, with the spawner's settings and agents, and returns the ``orch/*``
  branches it made as one bundle.

Both sides write the same store, which must be one every node reaches (Postgres; SQLite
only where all nodes share the machine). Shared-tier runs never leave their parent: they
share its directory by definition.
"""

from __future__ import annotations

REMOTE_TIERS = ("worktree", "container")
