"""The settings tables of models (``config.Settings`` holds them): prices, named endpoints,
and how a conversation is kept inside its model's window."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# trust.py and tests/test_trust_limits.py read this mark: no budget, so a repository's value
# needs no trust (``config.not_limit``)
NOT_A_LIMIT: dict[str, Any] = {"not_limit": "how a conversation is kept in its window"}
A_PRICE: dict[str, Any] = {"not_limit": "a price: a repository's [prices] entry needs trust"}


class Price(BaseModel):
    """A model's price in USD per million tokens (``[prices."MODEL"]``), over the price table
    orch ships (``pricing.py``). A cache write or read left out costs what the Messages API
    charges in proportion to ``input``: 1.25x (5 minutes), 2x (an hour), 0.1x (a read)."""

    model_config = ConfigDict(extra="forbid")

    input: float = Field(ge=0, json_schema_extra=A_PRICE)
    output: float = Field(ge=0, json_schema_extra=A_PRICE)
    cache_write: float | None = Field(
        default=None, ge=0, json_schema_extra=A_PRICE
    )  # a 5-minute cache write
    cache_write_1h: float | None = Field(default=None, ge=0, json_schema_extra=A_PRICE)
    cache_read: float | None = Field(default=None, ge=0, json_schema_extra=A_PRICE)


class Endpoint(BaseModel):
    """A named model endpoint (``[endpoints.NAME]``): a model spec ``NAME/MODEL`` is sent to
    ``base_url`` over ``wire``, with the key in the variable ``key_env`` (never another's)."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(min_length=1)
    wire: Literal["openai", "anthropic"] = "openai"
    key_env: str | None = None  # the variable holding its key; None: it needs none

    @field_validator("base_url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not re.match(r"^https?://[^\s/]+", v):
            raise ValueError("give an http:// or https:// URL")
        return v.rstrip("/")

    @field_validator("key_env")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError("give the name of an environment variable")
        return v


class ContextSettings(BaseModel):
    """How a run's conversation stays inside its model's window (``[context]``)."""

    model_config = ConfigDict(extra="forbid")

    # A request over this share of the window first clears old tool results, then has the
    # model compact the conversation into a summary (engine/context.py).
    compact_at: float = Field(default=0.8, ge=0.2, le=0.98, json_schema_extra=NOT_A_LIMIT)
    # Tool results of the latest turns that clearing never touches.
    keep_tool_results: int = Field(default=4, ge=0, json_schema_extra=NOT_A_LIMIT)
    # Model id -> window in tokens, over the price table's (a private model's, a smaller one).
    windows: dict[str, int] = Field(default_factory=dict, json_schema_extra=NOT_A_LIMIT)
