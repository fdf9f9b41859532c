"""Writing a run's ending so that it is written: a run never stays ``running`` because
the write of its ending failed.

:meth:`Runner._finish <orchestrator.runner.Runner._finish>` writes the whole ending (status,
output, usage, evidence, artifacts) in one update. When that write fails (the store
refuses a value, a disk or server error, a serialization error), :func:`end_failed`
writes the smallest ending there is: ``failed``, the time, and the reason in one line.
When even that fails, a :class:`~orchestrator.store.StoreError` says so in one line (the
run is then ended by reconcile: ``orch ps``).
"""

from __future__ import annotations

import contextlib

from .models.base import clean_text
from .run import RunRecord, RunStatus, now
from .store import RunStore, StoreError

MAX_REASON = 500


def _one_line(error: BaseException) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return clean_text(text)[:MAX_REASON]


def end_failed(store: RunStore, run_id: str, status: RunStatus, error: Exception) -> RunRecord:
    """End ``run_id`` ``failed`` after the write of its ``status`` ending raised ``error``."""
    why = _one_line(error)
    reason = f"the run ended {status.value}, but its ending could not be stored ({why})"
    try:
        return store.update_run(run_id, status=RunStatus.FAILED, ended_at=now(), error=reason)
    except Exception as again:
        raise StoreError(
            f"run {run_id} could not be recorded as ended ({_one_line(again)}); "
            "`orch ps` ends it once the store works again"
        ) from None


def announce(store: RunStore, done: RunRecord) -> RunRecord:
    """The ``run_finished`` event of an ended run (a failed write of it ends nothing)."""
    data = {
        "status": done.status.value,
        "error": done.error,
        "usage": done.usage.model_dump(),
        "evidence": done.evidence.model_dump(),
        "artifacts": done.artifacts,
    }
    with contextlib.suppress(Exception):
        store.add_event(done.run_id, "run_finished", data)
    return done
