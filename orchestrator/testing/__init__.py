"""What orch's fakes share (standard library only): the Messages API's accounting, so a fake
server reports usage, prompt-cache reads and writes and the context window's refusal the way
the real API does. Tests (``tests/fakeapi.py``) and benchmarks (``bench/fakeserver.py``)
serve it on loopback; nothing here reaches a network."""

from __future__ import annotations

from .messages import (
    DEFAULT_WINDOW,
    LOOKBACK,
    MAX_BREAKPOINTS,
    TURN_TOKENS,
    Admitted,
    Messages,
    Refused,
    Unit,
    api_error,
    min_cacheable,
    tokens,
    units,
)

__all__ = [
    "DEFAULT_WINDOW",
    "LOOKBACK",
    "MAX_BREAKPOINTS",
    "TURN_TOKENS",
    "Admitted",
    "Messages",
    "Refused",
    "Unit",
    "api_error",
    "min_cacheable",
    "tokens",
    "units",
]
