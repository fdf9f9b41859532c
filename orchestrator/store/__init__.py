"""The run store: :class:`RunStore` is the contract, :func:`open_store` picks the backend.

SQLite is the default (:class:`SqliteStore`, ``.orch/orch.db`` or ``$ORCH_HOME/orch.db``).
A URL in ``ORCH_STORE``, or as ``store`` in the settings (``orch.toml``,
``~/.orch/config.toml``), selects the backend its scheme names in the registry
:data:`orchestrator.storeurl.BACKENDS` (``postgresql://`` or ``postgres://``: the Postgres
store, :mod:`orchestrator.store.postgres`, the ``postgres`` extra); the environment wins.
A backend's module, and its driver (psycopg), are imported only then.

The SQL backends share one store (:mod:`.sql`: every query) over a dialect each
(:mod:`.sqlite`, :mod:`.postgres`: connections, transactions, the SQL that differs).
"""

from __future__ import annotations

import importlib
import os
from contextlib import suppress
from pathlib import Path
from typing import cast

from ..errors import OrchError, UsageError
from ..project.paths import project_root
from ..storeurl import SCHEMES, backend, local_paths
from .base import ChainFull, ChainRoom, ChainUsage, RunStore, StoreError, state_dir
from .sqlite import SqliteStore

__all__ = [
    "ChainFull",
    "ChainRoom",
    "ChainUsage",
    "RunStore",
    "SqliteStore",
    "StoreError",
    "open_store",
    "state_dir",
    "store_paths",
    "store_url",
]


def store_url(setting: str | None = None) -> str | None:
    """The URL the run store lives at (``ORCH_STORE`` first, then ``setting``), or None for
    the SQLite store. The value is never echoed: a URL may hold a password."""
    url = os.environ.get("ORCH_STORE", "").strip() or (setting or "").strip()
    if not url:
        return None
    if backend(url) is None:
        raise UsageError(
            "ORCH_STORE (or `store` in the settings) names no store orch has: give a "
            f"{' or '.join(SCHEMES)} URL, or unset it to use the SQLite store "
            "in .orch/ (or $ORCH_HOME)"
        )
    return url


def open_store(project_root: Path, setting: str | None = None) -> RunStore:
    """The run store of a project: the backend ``ORCH_STORE`` or ``setting`` (the ``store``
    of its settings) names by its URL's scheme, else SQLite in its state dir."""
    url = store_url(setting)
    if url is None:
        return SqliteStore.for_project(project_root)
    return open_url(url)


def open_url(url: str) -> RunStore:
    """The store at a URL of a registered scheme (its module imported only now)."""
    where = backend(url)
    if where is None:
        raise UsageError(f"no store orch has is at that URL: give a {' or '.join(SCHEMES)} URL")
    module, _, name = where.partition(":")
    return cast(RunStore, getattr(importlib.import_module(module), name)(url))


def store_paths(store: RunStore, workdir: Path) -> list[str]:
    """Every path through which a run in ``workdir`` could reach a run store, absolute: the
    store in use (``store.paths()``: on a cluster node, the spawner's), the state dir of
    ``workdir``'s project (its ``.orch``), and any store the environment names
    (``$ORCH_HOME``; the Unix sockets and key files of ``ORCH_STORE``, ``$PGHOST``, libpq's
    password and service files). The OS sandbox hides them all (``workspaces/host.py``),
    whatever runtime runs the run."""
    found = list(store.paths())
    with suppress(OrchError):  # a workdir that is no directory (yet) has no state dir
        found.append(project_root(workdir) / ".orch")
    if home := os.environ.get("ORCH_HOME", "").strip():
        found.append(Path(home).expanduser())
    if url := os.environ.get("ORCH_STORE", "").strip():
        found += [Path(d) for d in local_paths(url)]
    found += [Path(h) for h in os.environ.get("PGHOST", "").split(",") if h.startswith("/")]
    found += [Path(os.environ[v]) for v in ("PGPASSFILE", "PGSERVICEFILE") if os.environ.get(v)]
    unique = list(dict.fromkeys(os.path.abspath(p) for p in found))
    # a path inside another is hidden with it (a mount on it would show as an entry)
    return [p for p in unique if not any(p.startswith(q + os.sep) for q in unique)]
