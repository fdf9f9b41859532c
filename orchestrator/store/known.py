"""The live runs' records as this process last committed them: progress without a read.

A progress write changes a run this process is running, several times a turn (its
usage, its activity, its workspace). Reading the record back for each (a ``SELECT``
and a validation) was most of such a write's cost. :class:`Known` keeps each live
run's record as this process last committed it; a progress write starts from that
copy, and its ``UPDATE`` names the version it started from (``updated_at``). When
another process wrote the run meanwhile (a forced cancel, reconcile), no row matches:
the copy is dropped, :class:`Stale` is raised, and the write-behind queue makes the
write again from a fresh read (``batch.Again``).

A record enters when the transaction that wrote it commits (a rolled-back write is
never remembered), leaves when its run ends, and at most ``limit`` are kept (the
oldest go first). Used under the write-behind queue's lock, like every write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from ..run import RunRecord
from .batch import Again

LIMIT = 4096  # live records kept; a process rarely runs more at once


class Stale(Again):
    """A run changed in the store since this process last wrote it: read it again."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id} was changed by another writer; read again")
        self.run_id = run_id


class Known:
    """Live runs' records, by run id, as committed by this process (see the module doc)."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._records: dict[str, RunRecord] = {}
        self._staged: dict[str, RunRecord] = {}

    def get(self, run_id: str) -> RunRecord | None:
        """A copy of the run's record as last committed here, or None."""
        known = self._records.get(run_id)
        return known.model_copy() if known is not None else None

    def stage(self, record: RunRecord) -> None:
        """``record`` as just written: remembered if its transaction commits."""
        self._staged[record.run_id] = record.model_copy()

    def forget(self, run_id: str) -> None:
        self._records.pop(run_id, None)
        self._staged.pop(run_id, None)

    @contextmanager
    def transaction(self, begin: Callable[[], AbstractContextManager[Any]]) -> Iterator[Any]:
        """``begin()``'s transaction; what it staged is remembered once it commits."""
        try:
            with begin() as q:
                yield q
        except BaseException:
            self._staged.clear()
            raise
        staged, self._staged = self._staged, {}
        for run_id, record in staged.items():
            self._records.pop(run_id, None)  # re-entered last: the newest at the end
            if not record.status.ended:
                self._records[run_id] = record
        while len(self._records) > self.limit:
            del self._records[next(iter(self._records))]
