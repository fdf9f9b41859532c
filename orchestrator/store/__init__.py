"""The run store: :class:`RunStore` is the contract, :func:`open_store` picks the backend.

Today the only backend is SQLite (:class:`SqliteStore`, ``.orch/orch.db`` or
``$ORCH_HOME/orch.db``). ``ORCH_STORE`` is reserved for choosing another one:
a ``postgresql://`` URL there is refused until the Postgres backend exists.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UsageError
from .base import ChainUsage, RunStore, state_dir
from .sqlite import SqliteStore

__all__ = ["ChainUsage", "RunStore", "SqliteStore", "open_store", "state_dir"]

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def open_store(project_root: Path) -> RunStore:
    """The run store of a project: SQLite in its state dir unless ``ORCH_STORE`` says otherwise.

    The value of ``ORCH_STORE`` is never echoed: a URL may hold a password.
    """
    url = os.environ.get("ORCH_STORE", "").strip()
    if url.startswith(POSTGRES_SCHEMES):
        raise UsageError(
            "ORCH_STORE is a Postgres URL but the Postgres store is not available yet; "
            "unset ORCH_STORE to use the SQLite store in .orch/ (or $ORCH_HOME)"
        )
    if url:
        raise UsageError(
            "ORCH_STORE is set but names no store orch has (only SQLite is available for now); "
            "unset ORCH_STORE to use the SQLite store in .orch/ (or $ORCH_HOME)"
        )
    return SqliteStore.for_project(project_root)
