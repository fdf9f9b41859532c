"""Teams: clients of the engine that spawn runs through ``Runner.spawn``.

- ``pair.py``: a writer and a reviewer taking turns on one branch (a ``Driver``);
- ``review.py``: what the reviewer sees and answers (the diff, the ``Verdict``).
"""
