"""Teams: clients of the engine that spawn runs through ``Runner.spawn``.

- ``plan.py``: the committed team file ``.orch/teams/NAME.toml`` and the plan a run follows;
- ``driver.py``: the rounds (writers, the gate, the reviewers): where a team run happens;
- ``gate.py``: the test gate, a run of its own in the writer's sandbox;
- ``review.py``: what the reviewers see and answer, and what the team makes of it;
- ``progress.py``: where a team run stands (``orch team status``, ``orch resume``);
- ``summary.py``: a team run in words.
"""
