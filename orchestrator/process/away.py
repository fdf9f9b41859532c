"""A reader while the run store is away (issue 45): which errors say so, in one line, and
:class:`Patience`, which a waiting reader (``orch watch``, ``logs --follow``, ``result
--wait``, the dashboard's stream) calls the store through: it says "store unreachable,
retrying" once an outage, waits with backoff, and says when the store answers again."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from typing import TypeVar

from ..store.base import StoreUnreachable
from ..store.sqlite import AWAY

T = TypeVar("T")
FIRST_S = 0.2  # the first wait before trying again, doubling to LAST_S
LAST_S = 2.0
RETRYING = "store unreachable, retrying"


def away(error: BaseException, where: str = "") -> str | None:
    """One line naming the store and what to do, if ``error`` says the store is away for
    now (a server down or restarting, a SQLite file held locked); None for any other."""
    if isinstance(error, StoreUnreachable):
        return str(error)
    if isinstance(error, sqlite3.OperationalError):
        text = str(error)
        if any(w in text.lower() for w in AWAY):
            at = f" at {where}" if where else ""
            return (
                f"the SQLite run store{at} cannot be used for now ({text}); check that no "
                "other process holds it and that its disk is writable"
            )
    return None


class Patience:
    """Calls to a store that may be away, tried again until it answers (see the module).

    ``say`` gets ``store unreachable, retrying (<the one line>)`` once an outage and
    ``store answers again`` when it ends; ``sleep`` is how to wait (a test's, a loop's)."""

    def __init__(
        self,
        say: Callable[[str], None],
        where: str = "",
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.say = say
        self.where = where
        self.sleep = sleep
        self.since: float | None = None  # when the outage began (None: the store answers)
        self.delay = FIRST_S

    def failed(self, error: BaseException) -> bool:
        """Note a failed call: True (said once, and waited) if the store is away, else
        False (the caller raises ``error``)."""
        line = away(error, self.where)
        if line is None:
            return False
        if self.since is None:
            self.since = time.time()
            self.delay = FIRST_S
            self.say(f"{RETRYING} ({line})")
        self.sleep(self.delay)
        self.delay = min(self.delay * 2, LAST_S)
        return True

    def answered(self) -> None:
        """Note a call that worked: the outage, if any, is over."""
        if self.since is not None:
            self.since = None
            self.say("store answers again")

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()``, called again while the store is away."""
        while True:
            try:
                got = fn()
            except Exception as e:
                if not self.failed(e):
                    raise
                continue
            self.answered()
            return got
