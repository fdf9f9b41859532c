"""The node's side of a run sent to a Ray cluster: adopt, bring the branches back.

:func:`adopt` is what the node's warm orch (``warm.OrchNode``, which ``driver.py`` calls)
runs for each run, in a repository of this node made for it from the bundle cache
(``HEAD`` detached at the starting commit; a continued branch made at its tip). It gets the
run id, the spawner's resolved settings, agents and launch options; it

1. builds a Runner with those settings and agents, the store named by the node's
   environment (``ORCH_STORE``, set from the spawner's secrets; or the spawner's SQLite
   file when every node shares the machine) and the same model, and adopts the stored
   ``queued`` run with that repository as its working directory: its tier (a worktree of
   the temp repository, or a container of the node's own Docker engine) runs here,
   progress and events go to the shared store, cancel requests are watched, its children
   start here;
2. bundles every ``orch/*`` branch the run (and its children) left, past the starting
   commit, and returns it as bytes with the heads it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from ...catalog.definitions import Catalog
from ...config import Settings
from ...project.git import RepoPaths, git
from ...spec import Launch
from ...store import RunStore, SqliteStore, open_store
from ..rebuild import recipe

ORCH_PREFIX = "refs/heads/orch/"


class NodeTask(BaseModel):
    """What the spawner sends with a run (besides its agents and the bundle)."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    start: str  # the commit the run starts from (a continued branch's tip)
    bundle_ref: str  # the starting commit's ref name inside the bundle
    repo_key: str  # the repository's identity: its bundle cache on the node (``warm.py``)
    reservation: str | None = None  # its placement group (hex id): gone, the run ends
    branch: str | None = None  # a continued orch/* branch: made at ``start`` on the node
    settings: dict[str, Any]  # the spawner's resolved settings
    launch: Launch
    model_spec: str | None = None
    sqlite: str | None = None  # the spawner's SQLite file, when that is the store
    max_bundle: int


class NodeResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node: str
    status: str  # the run's ending, which the spawner writes once its work is home
    error: str | None = None  # why its work could not come back
    heads: dict[str, str]  # refs/heads/orch/... -> commit, all in ``bundle``
    bundle: bytes | None = None
    scripted: dict[str, Any] | None = None  # a scripted model's use, for the spawner's


def node_name() -> str:
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return f"{socket.gethostname()}/ray-{node_id[:8]}"


@contextlib.contextmanager
def spawner_env(secrets: dict[str, str]) -> Iterator[None]:
    """This process's environment holds the spawner's ``secrets`` while the block runs: a
    name the spawner does not set ("") is unset, so a node's own API base URL or
    token never pairs with the spawner's key; afterwards everything is as it was."""
    saved = set_env(secrets)
    try:
        yield
    finally:
        set_env(saved)


def set_env(values: Mapping[str, str | None]) -> dict[str, str | None]:
    """Set each name to its value in this process's environment ("" or None: unset it);
    returns what they were."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v:
            os.environ[k] = v
        else:
            os.environ.pop(k, None)
    return saved


def _store(spec: NodeTask, repo: Path) -> RunStore:
    """The spawner's store: its Postgres URL (in this process's environment, from the
    spawner's secrets), or its SQLite file when every node shares this machine."""
    if spec.sqlite and not os.environ.get("ORCH_STORE"):
        return SqliteStore(Path(spec.sqlite))
    return open_store(repo)


async def adopt(spec: NodeTask, catalog: Catalog, repo: RepoPaths, tmp: Path) -> NodeResult:
    """Adopt the stored run in ``repo`` (a repository of this node made for it, HEAD at the
    start) with the spawner's settings and agents, and bundle what it left."""
    path = repo.main_root
    settings = Settings.model_validate(spec.settings)
    store = _store(spec, path)
    # the spawner's launch names its model (``model_spec``, sent apart too)
    runner = recipe(path, spec.launch, settings=settings, catalog=catalog).runner(store)
    provider = runner.models
    try:
        async with provider:
            record = await runner.adopt(spec.run_id, workdir=path)
        heads, data = await _export(repo, tmp / "out.bundle", spec.start)
    finally:
        store.close()
    report = provider.scripted.report() if provider.scripted is not None else None
    # its ending was held back (Runner._finish): the spawner writes it once the work is home
    status = runner.held.get(spec.run_id, record.status.value)
    result = NodeResult(node=node_name(), status=status, heads=heads, scripted=report)
    if data is not None and len(data) > spec.max_bundle:
        result.error = (
            f"the run's work is {len(data):,} bytes, over sandbox.bundle_max_bytes "
            f"({spec.max_bundle:,}); it was not taken"
        )
    else:
        result.bundle = data
    return result


async def _export(repo: RepoPaths, out: Path, start: str) -> tuple[dict[str, str], bytes | None]:
    """The ``orch/*`` branches past ``start``, bundled (None: no work came back)."""
    listed = await git("for-each-ref", "--format=%(objectname) %(refname)", ORCH_PREFIX, repo=repo)
    heads: dict[str, str] = {}
    for line in listed.out.splitlines():
        sha, _, ref = line.partition(" ")
        if sha and ref and sha != start:
            heads[ref] = sha
    if not heads:
        return {}, None
    await git("bundle", "create", "-q", str(out), *heads, f"^{start}", repo=repo)
    return heads, await asyncio.to_thread(out.read_bytes)
