"""orch's own processes, below the CLI and above the engine (whose ``owner.py`` says who
owns a run). Standard library only here: the ``orch`` entry point imports ``unixsock``,
``inherit`` and ``warmhome`` first.

- ``reconcile.py``: runs whose owner is gone become ``interrupted``; what they left is reaped;
- ``detach.py``: the CLI's side of a background root: the worker host, else a worker of
  its own;
- ``workerhost.py``: the worker host, many detached runs in one process;
- ``opened.py``: a project as a command opens it, and a run named by a prefix;
  ``command.py``: the runner of a command that runs agents (CLI or MCP);
- ``rebuild.py``: the one runner factory (a ``Recipe`` from a run's launch);
  ``executor.py``: the executor a runner's settings choose;
- ``cluster/``: Ray (``driver.py`` the spawner's side, ``node.py`` the node's);
- ``unixsock.py``: the one Unix-socket module (addresses, peer uid, locks, JSON lines);
- ``inherit.py``: what a process inherits, one digest for the warm and the host keys;
- ``warmhome.py``: where the warm process (``orchestrator/warm/``, above the CLI) lives.
"""
