"""What a run may do: its tools, its depth, its commands, its hooks.

- ``checks.py``: the :class:`Policy` of one run (allow-lists, depth), env scrubbing,
  control files and hooks;
- ``commands.py``: the bash deny list (lines parsed in linear time);
- ``hookguard.py``: hooks run only from files no agent could have written.
"""
