"""The OS sandbox of host runs: bubblewrap.

- ``find.py``: which ``bwrap`` runs (``bundled``, ``system`` or a path) and that it works;
- ``profile.py``: what a sandboxed command sees (mounts, hidden paths, secrets kept out,
  the network namespace).
"""
