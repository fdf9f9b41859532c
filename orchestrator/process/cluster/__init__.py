"""Executors: where a run executes when it does not execute in the spawner's process.

The default is none: every run is an asyncio task of the process that spawned it (or of
the detached worker a background root is handed to). ``executor = "ray"`` (or
``orch task --executor ray``) sends worktree- and container-tier runs to the nodes of a
Ray cluster:

- ``driver.py`` is the spawner's side (:class:`RayExecutor`, the Runner's
  ``Executor``): it bundles the run's starting commit, submits one Ray task per run with
  its resource request, awaits it like a local child, forwards cancellation, and imports
  the work that comes back onto ``orch/<agent>/<id>`` with hardened git;
- ``node.py`` is the node's side: it clones the bundle into a temp repository of the node,
  adopts the stored run there with the spawner's settings and agents, and returns the
  ``orch/*`` branches it made as one bundle.

Both sides write the same store, which must be one every node reaches (Postgres; SQLite
only where all nodes share the machine). Shared-tier runs never leave their parent: they
share its directory by definition.
"""

from __future__ import annotations

REMOTE_TIERS = ("worktree", "container")
