"""Endings the store could not take before their process exited, kept on local disk.

A run's ending is never lost to a store that is away (issue 45): the store keeps it in
its write-behind queue (``SqlStore.keep_ending``) and writes it when the store answers.
A process that must exit first waits for that, up to ``store_outage_s`` (:func:`outlast`),
then appends what is still unwritten to ``endings.jsonl`` in the project's state directory
(0600, opened through ``statedir.open_file``: no link followed); the next command that
reaches the store writes them (:func:`replay`, before ``reconcile`` would call the run's
owner gone and end it ``interrupted``), each as its owner's ending, then empties the file.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import OrchError
from ..project.statedir import checked_dir, open_file
from ..run import RunRecord

log = logging.getLogger(__name__)

JOURNAL = "endings.jsonl"
JOURNAL_MODE = 0o600
POLL_S = 0.1


class KeptEnding(BaseModel):
    """One run's ending as its process meant to write it (the journal's line)."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    fields: dict[str, Any]  # the record's fields the ending sets, as JSON (status, ended_at...)
    output: str | None = None  # the whole output, kept apart (``save_output``)
    owner: bool = True
    at: float  # when it was kept


class Keeper(Protocol):
    """What :func:`outlast` and :func:`replay` need of a store."""

    def unwritten(self) -> list[KeptEnding]: ...

    def forget_unwritten(self) -> None: ...

    def end_kept(self, ending: KeptEnding) -> RunRecord | None: ...

    def transient(self, error: BaseException) -> bool: ...


async def outlast(store: Keeper, state: Path, limit_s: float) -> list[str]:
    """Wait up to ``limit_s`` for the store to take the endings it keeps; journal the
    rest under ``state`` (the ids of the runs journaled)."""
    deadline = time.monotonic() + limit_s
    try:
        for _ in range(int(limit_s / POLL_S) + 1):  # the store's retries run on this loop
            if not store.unwritten() or time.monotonic() >= deadline:
                break
            await asyncio.sleep(POLL_S)
    finally:  # cancelled too: what is unwritten is journaled
        ids = journal_unwritten(store, state)
    return ids


def journal_unwritten(store: Keeper, state: Path) -> list[str]:
    """Append the endings the store still keeps to the journal, and forget them here."""
    kept = store.unwritten()
    if not kept:
        return []
    ids = [k.run_id for k in kept]
    try:
        state = checked_dir(state)  # made if missing (a Postgres store's project)
        fd = open_file(state, JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT, JOURNAL_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, "".join(k.model_dump_json() + "\n" for k in kept).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except (OSError, OrchError) as e:  # said in one line; `orch ps` ends them interrupted
        log.warning("orch: the endings of %s could not be kept in %s: %s", ", ".join(ids), state, e)
        return []
    store.forget_unwritten()
    log.warning(
        "orch: the store is still unreachable; the endings of %s are kept in %s and written "
        "by the next orch command",
        ", ".join(ids),
        state / JOURNAL,
    )
    return ids


def replay(store: Keeper, state: Path) -> list[str]:
    """Write the journal's endings into the store (one command at a time: the file is
    locked), then empty it; an ending the store refuses stays for the next command."""
    try:
        fd = open_file(state, JOURNAL, os.O_RDWR, JOURNAL_MODE)
    except FileNotFoundError:
        return []
    written: list[str] = []
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with os.fdopen(os.dup(fd), "r", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
        left: list[str] = []
        for i, line in enumerate(lines):
            try:
                ending = KeptEnding.model_validate_json(line)
            except ValidationError:
                log.warning("orch: a line of %s is no ending; it was dropped", state / JOURNAL)
                continue
            try:
                store.end_kept(ending)
            except Exception as e:
                if store.transient(e):  # away again: the rest waits for the next command
                    left = lines[i:]
                    break
                log.warning("orch: the kept ending of %s was refused: %s", ending.run_id, e)
                continue
            written.append(ending.run_id)
        os.ftruncate(fd, 0)
        if left:
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, "".join(ln + "\n" for ln in left).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return written
