"""The tables of the SQL store, once, in each dialect's types (:func:`tables`).

``runs`` (one row per run, its record as JSON in ``data``; Postgres adds ``tokens`` and
``cost_usd``: the record's ``Usage.tokens`` and ``Usage.cost_usd`` for ``chain_usage``,
since a record's JSON may hold a ``\\u0000`` escape that Postgres's json functions refuse),
``events`` (append-only, ids increasing), ``resources``, ``outputs`` and ``transcripts``.
``CREATE … IF NOT EXISTS`` throughout: a store that has them already (an older orch's)
keeps them as they are; a column added since is added by the dialect's migration.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

_TABLES = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT{key_collation} PRIMARY KEY,
    chain_id TEXT NOT NULL,
    parent_run_id TEXT,
    depth INTEGER NOT NULL,
    status TEXT NOT NULL,
    created_at {real} NOT NULL,
    updated_at {real} NOT NULL,
    pid INTEGER,
    heartbeat_at {real},
    cancel_requested {boolean} NOT NULL DEFAULT {false},{usage}
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_chain ON runs(chain_id);
CREATE INDEX IF NOT EXISTS runs_parent ON runs(parent_run_id);
CREATE INDEX IF NOT EXISTS runs_status ON runs(status);
CREATE INDEX IF NOT EXISTS runs_created ON runs(created_at);
CREATE INDEX IF NOT EXISTS runs_updated ON runs(updated_at);
CREATE TABLE IF NOT EXISTS events (
    id {serial},
    run_id TEXT NOT NULL,
    at {real} NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_run ON events(run_id, id);
CREATE TABLE IF NOT EXISTS resources (
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    ref TEXT NOT NULL,
    owner_pid INTEGER NOT NULL,
    created_at {real} NOT NULL,
    PRIMARY KEY (kind, ref)
);
CREATE INDEX IF NOT EXISTS resources_run ON resources(run_id);
CREATE TABLE IF NOT EXISTS outputs (
    run_id TEXT PRIMARY KEY,
    text TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS transcripts (
    run_id TEXT PRIMARY KEY,
    saved_at {real} NOT NULL,
    truncated {boolean} NOT NULL DEFAULT {false},
    messages TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS transcripts_saved ON transcripts(saved_at);
"""


@dataclass(frozen=True)
class Types:
    """How a dialect spells what the tables need."""

    real: str  # a float column
    boolean: str
    false: str  # its default
    serial: str  # an id column that increases by itself, the primary key
    key_collation: str = ""  # of runs.run_id ("" for the default)
    usage: str = ""  # the runs.tokens, runs.cost_usd columns (each on a line of its own)


def tables(types: Types) -> str:
    """The statements that create the store's tables and indexes, in ``types``."""
    return _TABLES.format(**asdict(types))
