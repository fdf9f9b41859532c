"""What ``orch doctor`` finds: one :class:`Check` per thing looked at, and the report."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


class Check(BaseModel):
    """One finding; ``orch doctor --json`` prints a list of these."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    status: Status
    detail: str
    fix: str | None = None
    required: bool = False  # the default tiers need it: a failure makes doctor exit non-zero


class Report(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ok: bool  # no required check failed: the default tiers can run
    checks: list[Check]
