"""A run's ending kept while the store is away (issue 45): queued behind the run's
progress in the write-behind queue, written when the store answers, journaled by a
process that must exit first (:mod:`.journal`), and written from the journal by the
next command (:meth:`KeptEndings.end_kept`)."""

from __future__ import annotations

import json
from typing import Any, Protocol, cast

from pydantic import TypeAdapter

from ..run import RunRecord, now
from .batch import Unit, WriteBehind
from .dialect import Dialect
from .journal import KeptEnding
from .known import Known

_JSON: TypeAdapter[Any] = TypeAdapter(Any)  # a field's value as JSON (models, enums)
OUTPUT_UPSERT = (
    "INSERT INTO outputs (run_id, text) VALUES (?, ?)"
    " ON CONFLICT (run_id) DO UPDATE SET text = excluded.text"
)


class _Store(Protocol):
    dialect: Dialect
    _behind: WriteBehind
    _known: Known

    def update_run(self, run_id: str, **fields: Any) -> RunRecord: ...

    def end_if_active(self, run_id: str, **fields: Any) -> RunRecord | None: ...

    def get_run(self, run_id: str) -> RunRecord | None: ...

    def save_output(self, run_id: str, text: str) -> None: ...

    def add_event(self, run_id: str, kind: str, data: dict[str, Any] | None = None) -> None: ...


class KeptEndings:
    """The SQL store's side of kept endings (a mixin of ``SqlStore``)."""

    def transient(self, error: BaseException) -> bool:
        """Whether ``error`` says the store is away for now (its dialect's word)."""
        return cast(_Store, self).dialect.transient(error)

    def keep_ending(
        self, run_id: str, fields: dict[str, Any], *, output: str | None, owner: bool
    ) -> RunRecord | None:
        """Queue ``run_id``'s ending (``fields``: status, ended_at, ...) behind its progress
        for when the store answers; the record as it will be (None if this process does not
        know the run)."""
        store = cast(_Store, self)
        ended_at = fields.get("ended_at")
        dump = store.dialect.dump_output
        insert_event = store.dialect.insert_event

        def step(unit: Unit) -> None:
            record = unit.run(run_id)
            if record is None or (
                not owner and record.status.ended and record.ended_at != ended_at
            ):
                return  # another ending stands (``end_if_active``)
            for key, value in fields.items():
                setattr(record, key, value)
            if output is not None:
                unit.q(OUTPUT_UPSERT, (run_id, dump(output)))
            event = json.dumps(record.finished_event(), default=str)
            unit.q(insert_event, (run_id, now(), "run_finished", event))

        plain = {k: _JSON.dump_python(v, mode="json") for k, v in fields.items() if k != "output"}
        kept = KeptEnding(run_id=run_id, fields=plain, output=output, owner=owner, at=now())
        store._behind.keep(step, run_id, kept)
        record = store._known.get(run_id)
        if record is not None:
            for key, value in fields.items():
                setattr(record, key, value)
        return record

    def away_since(self) -> float | None:
        """Since when (epoch seconds) this process has found the store away, else None."""
        outage = cast(_Store, self)._behind.outage
        return outage.since if outage is not None else None

    def unwritten(self) -> list[KeptEnding]:
        """The endings still waiting for the store."""
        return [e for e in cast(_Store, self)._behind.endings() if isinstance(e, KeptEnding)]

    def forget_unwritten(self) -> None:
        """Drop the waiting endings from the queue (they were journaled)."""
        cast(_Store, self)._behind.forget_endings()

    def end_kept(self, ending: KeptEnding) -> RunRecord | None:
        """Write a journaled ending: its fields over the run as it is now (as its owner's
        ending, or only if the run is still live), its output, its ``run_finished``."""
        store = cast(_Store, self)
        current = store.get_run(ending.run_id)
        if current is None:
            return None
        merged = RunRecord.model_validate({**current.model_dump(mode="json"), **ending.fields})
        typed = {k: getattr(merged, k) for k in ending.fields}
        if ending.output is not None:
            typed["output"] = ending.output
        write = store.update_run if ending.owner else store.end_if_active
        done = write(ending.run_id, **typed)
        if done is not None:
            if ending.output is not None:
                store.save_output(ending.run_id, ending.output)
            store.add_event(ending.run_id, "run_finished", done.finished_event())
        return done
