"""What a SQL backend owns (:class:`Dialect`): its connections, its transactions, how its
errors read, and the few statements whose SQL differs; :mod:`.sql` holds the queries."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

Row = tuple[Any, ...]
Query = Callable[[str, Sequence[Any]], list[Row]]  # a statement in an open transaction


@dataclass(frozen=True)
class Written:
    rows: list[Row]  # what a RETURNING clause gave
    count: int  # rows the statement changed


class Dialect(Protocol):
    """What differs between SQL backends (see the module doc). SQL is written with ``?``."""

    holds_nul: bool  # can a text column hold "\x00" (else no id with one is in the store)
    usage_columns: bool  # runs.tokens and runs.cost_usd kept (the record's usage)
    chain_tokens: str  # SQL: the sum of a chain's tokens (Usage.tokens), over its rows of runs
    chain_usd: str  # SQL: the sum of a chain's dollars (Usage.cost_usd), over its rows of runs
    insert_event: str  # (run_id, at, kind, data) -> one row: the new id, in order within a run
    heartbeat: str  # (at, *run_ids) with ``{ids}`` for their marks: a progress write
    progress_commit: str  # first in a transaction of progress only: it may commit async ("")
    off_loop: bool  # a loop's progress written by a thread (a write may wait on a lock)
    lock_chain: str  # (chain_id,) -> held to the commit ("": a write holds the database's)

    def describe(self) -> str: ...

    def transient(self, error: BaseException) -> bool:
        """Whether ``error`` says the store is away for now (unreachable, restarting,
        locked by another process, a disk error), not that it refused the write."""
        ...

    def paths(self) -> tuple[Path, ...]: ...

    def close(self) -> None: ...

    def read(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        """The rows of one query (committed data)."""
        ...

    def write(self, sql: str, args: Sequence[Any] = ()) -> Written:
        """One statement, in a transaction of its own."""
        ...

    def transaction(self) -> AbstractContextManager[Query]:
        """One transaction for a read-modify-write (rolled back on any exception)."""
        ...

    def lock_run(self) -> str:
        """SQL: ``data`` of run ``?``, its row held to the end of the transaction."""
        ...

    def dump_output(self, text: str) -> str: ...

    def load_output(self, stored: str) -> str: ...
