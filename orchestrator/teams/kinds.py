"""How a stored team run becomes its driver again (``Runner.drivers``): a team with a
``lead`` is a lead team (``lead.py``), any other one takes rounds (``driver.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..engine.runner import Runner
from .driver import KIND, TeamDriver
from .lead import LeadDriver
from .plan import TeamPlan

__all__ = ["KIND", "team_driver"]


def team_driver(runner: Runner, params: Mapping[str, Any]) -> TeamDriver:
    """The driver of a stored team run."""
    plan = TeamPlan.model_validate(dict(params))
    return LeadDriver(runner, plan) if plan.lead is not None else TeamDriver(runner, plan)
