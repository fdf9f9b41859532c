"""The tables of the Postgres run store (:mod:`orchestrator.store.postgres`).

Those of the SQLite store, in Postgres types, plus ``runs.tokens`` (input + output tokens,
for ``chain_usage``: a record's JSON may hold a ``\\u0000`` escape that Postgres's json
functions refuse) and ``orch_schema`` (its version; its presence says the schema is there).
``CREATE … IF NOT EXISTS`` throughout, run under the advisory lock ``SCHEMA_LOCK``: several
processes connecting for the first time at once neither fail nor race.
"""

from __future__ import annotations

SCHEMA_LOCK = 0x6F72636873746F72  # "orchstor"
SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT COLLATE "C" PRIMARY KEY,
    chain_id TEXT NOT NULL,
    parent_run_id TEXT,
    depth INTEGER NOT NULL,
    status TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    pid INTEGER,
    heartbeat_at DOUBLE PRECISION,
    cancel_requested BOOLEAN NOT NULL DEFAULT FALSE,
    tokens BIGINT NOT NULL DEFAULT 0,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_chain ON runs(chain_id);
CREATE INDEX IF NOT EXISTS runs_parent ON runs(parent_run_id);
CREATE INDEX IF NOT EXISTS runs_status ON runs(status);
CREATE INDEX IF NOT EXISTS runs_created ON runs(created_at);
CREATE INDEX IF NOT EXISTS runs_updated ON runs(updated_at);
CREATE TABLE IF NOT EXISTS events (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id TEXT NOT NULL,
    at DOUBLE PRECISION NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_run ON events(run_id, id);
CREATE TABLE IF NOT EXISTS resources (
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    ref TEXT NOT NULL,
    owner_pid INTEGER NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (kind, ref)
);
CREATE INDEX IF NOT EXISTS resources_run ON resources(run_id);
CREATE TABLE IF NOT EXISTS outputs (
    run_id TEXT PRIMARY KEY,
    text TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS transcripts (
    run_id TEXT PRIMARY KEY,
    saved_at DOUBLE PRECISION NOT NULL,
    truncated BOOLEAN NOT NULL DEFAULT FALSE,
    messages TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS transcripts_saved ON transcripts(saved_at);
CREATE TABLE IF NOT EXISTS orch_schema (version INTEGER NOT NULL);
"""
