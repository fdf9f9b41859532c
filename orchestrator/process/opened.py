"""A project as a command opens it: its root, settings (with what its trust honours), and
store, settled first; and a run named by its id or any unique prefix of it.

Every way in opens a project here: the CLI (``cli/common.py`` adds its rendering) and the
MCP server (``mcpserver/``), so both see the same settings, trust and runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..catalog.agent_trust import load_trusted
from ..config import Settings
from ..errors import NotFound, UsageError
from ..project.paths import project_root
from ..project.statedir import state_path
from ..run import RunRecord
from ..store import RunStore, open_store, state_dir
from ..store.journal import JOURNAL, replay
from ..trust import Trust, TrustCap
from .reconcile import reconcile


@dataclass
class Project:
    root: Path
    workdir: Path
    settings: Settings
    store: RunStore
    trust: Trust = field(default_factory=Trust)  # what of the repository's settings applies


def root_of(workdir: Path | None) -> Path:
    """The project of ``-C DIR`` (default: the current directory): its git top level, or it."""
    wd = (workdir or Path.cwd()).expanduser()
    if not wd.is_dir():
        raise UsageError(f"--workdir {wd} is not a directory; pass an existing directory")
    return project_root(wd)


def open_project(
    workdir: Path | None = None,
    *,
    trust_cap: TrustCap | None = None,
    notice: Callable[[Trust], None] | None = None,
    **overrides: Any,
) -> Project:
    """Open the project of ``workdir``; ``notice`` is shown what its trust left out."""
    wd = (workdir or Path.cwd()).expanduser()
    root = root_of(wd)
    settings, trust = load_trusted(root, overrides, cap=trust_cap)
    if notice is not None:
        notice(trust)
    store = open_store(root, settings.store)
    store.keep_at_most(settings.store_outage_queue)  # writes kept while it is away
    if (state_path(root) / JOURNAL).exists():  # endings kept while the store was away
        replay(store, state_dir(root))  # first: their owners are gone, their endings not
    reconcile(store)  # every command first settles runs whose owner is gone
    days = settings.transcript_retention_days  # and drops conversations kept too long
    store.prune_transcripts(time.time() - days * 86_400)
    return Project(root=root, workdir=wd.resolve(), settings=settings, store=store, trust=trust)


AMBIGUOUS_SHOWN = 4  # candidates an ambiguous prefix lists


def find_run(store: RunStore, ref: str) -> RunRecord:
    """The run ``ref`` names: its id, or any unique prefix of it (with or without ``r-``, as
    branch names show it). Every command that takes a run resolves it here."""
    ref = ref.strip()
    if not ref:
        raise UsageError(
            "no run given; pass a run id or its first characters (`orch ps` lists them)"
        )
    record = store.get_run(ref)
    if record is not None:
        return record
    matches = store.find_runs(ref)
    if not matches and not ref.startswith("r-"):
        matches = store.find_runs("r-" + ref)
    if len(matches) == 1:
        return matches[0]
    if matches:
        shown_ids = ", ".join(m.run_id for m in matches[:AMBIGUOUS_SHOWN])
        more = (
            f" and {len(matches) - AMBIGUOUS_SHOWN} more" if len(matches) > AMBIGUOUS_SHOWN else ""
        )
        raise UsageError(
            f"{ref!r} matches {len(matches)} runs ({shown_ids}{more}); "
            "type more characters of the id"
        )
    raise NotFound(f"no run {ref!r} in {store.describe()}; `orch ps --all` lists the runs it holds")
