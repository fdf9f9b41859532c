"""The spawner's side of ``executor = "ray"``: runs sent to a Ray cluster, awaited here.

:class:`RayExecutor` is the Runner's ``Executor``. A worktree- or container-tier run (a
child, or a root, foreground or background) that got its slot and its place in the chain
is sent, not started: its resource request (``[ray]``: CPUs, memory, ``orch_slots``) is
reserved on a node (``place.py``: a placement group, spread over the nodes), and the
node's warm orch (``warm.OrchNode``, a long-lived actor) adopts the stored run there. Its
starting commit (the spawner's HEAD, or a continued branch's tip) reaches the node's bundle
cache once: the spawner asks what it holds and sends nothing, the commits past what it
holds, or (first time) a bundle of the whole history, made with hardened git and put in
Ray's object store. The call is awaited like a local child, so foreground, background,
auto-background, ``task_output``, ``task_stop`` and resume are the local machinery
unchanged. A warm orch that was gone before the run began there (ended idle, node lost)
gets the run again, on a fresh one (``ATTEMPTS``).

What comes back is data: a bundle of the ``orch/*`` branches the run made, unbundled into
the spawner's repository with hardened git and moved onto their branches by
compare-and-swap of the container tier (``boxout.land``: a branch moved meanwhile keeps
both, ``<branch>-head``).

Cancel: a cancelled wait asks the store to cancel the run (the node's supervisor ends it
the normal way, work committed) and gives it ``ray.cancel_grace_s`` before
``ray.cancel`` (the run's coroutine on the node is cancelled: its runner ends it and cleans
up; the node's other runs go on). A node that dies leaves the run ``interrupted`` with its
partial output; the store keeps all it wrote.

Secrets: the model provider's key and base URL and a Postgres URL reach the nodes as one
object in Ray's object store (``ray.put`` once per driver, passed by reference: in the
memory of this process and of the node, over Ray's own connections), set in the
environment of the node's warm orch, which serves that identity only (``place.identity``).
Not as Ray runtime-env variables: Ray's runtime-env agent writes those, values included,
to its log files. Never in the store or any log (``tests/test_ray.py`` greps the store,
orch's and Ray's logs).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import OrchError, UsageError
from ...models import endpoint_keys, env_names
from ...project.git import RepoPaths, first_line, git
from ...project.repo import locate, rev
from ...run import RunRecord, RunStatus
from ...store import SqliteStore, store_url
from ...workspaces.container.export import land
from ...workspaces.container.transfer import Staging, base_bundle, bundle_ref
from . import REMOTE_TIERS
from .node import NodeResult, NodeTask
from .place import Placement, identity
from .warm import thin_bundle

HAVE_TIMEOUT_S = 60.0  # a node's warm orch saying which commits its cache holds

if TYPE_CHECKING:
    from ...config import RaySettings
    from ...engine.runner import Runner

# What a node's environment gets from the spawner's (through the object store, never stored).
FORWARDED_ENV = (*env_names(), "ORCH_STORE")  # the model providers' settings, the store
_SAFE_REF = re.compile(r"^refs/heads/orch/[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")
_SHA = re.compile(r"^[0-9a-f]{40,64}$")
ATTEMPTS = 3  # a run whose node's warm orch was gone before it began is sent again
NO_CLUSTER = (
    "cannot reach the Ray cluster at {where}: {why}; start one (`ray start --head "
    "--resources '{{\"orch_slots\": 4}}'`) and set RAY_ADDRESS, or drop --executor ray"
)


def shared_store(runner: Runner) -> str | None:
    """The URL of the store every node reaches (Postgres: ``ORCH_STORE``, else the
    ``store`` setting), or None for SQLite."""
    return store_url(runner.settings.store)


class RayExecutor:
    """Worktree and container runs executed on a node of a Ray cluster (``[ray]``)."""

    def __init__(self, runner: Runner, config: RaySettings | None = None) -> None:
        self.runner = runner
        self.cfg = config if config is not None else runner.settings.ray
        self._bundles: dict[Path, Any] = {}  # bundle file -> its ObjectRef
        self._remote: Placement | None = None
        self._known: set[tuple[str, str, str]] = set()  # (node, repo key, commit) it holds
        self._keys: dict[tuple[str, str], str] = {}  # (git dir, commit) -> repository key
        self._secrets: Any = None  # ObjectRef of the forwarded environment
        self._lock = asyncio.Lock()

    # -- Executor --------------------------------------------------------------------
    def takes(self, record: RunRecord) -> bool:
        """Worktree and container runs, roots (foreground or background) and children; a
        container child of a container run stays with its parent (it starts from the
        parent's live checkpoint)."""
        if record.isolation not in REMOTE_TIERS:
            return False
        if record.parent_run_id is None:
            return True
        parent = self.runner.store.get_run(record.parent_run_id)
        return parent is None or parent.isolation != "container"

    async def run(self, record: RunRecord) -> RunRecord:
        await self._connect()
        spec = record.planned().spec
        located = await locate(spec.workdir)
        main = located.main()
        branch = getattr(spec.workspace, "branch", None)
        start = await rev(f"refs/heads/{branch}", main) if branch else await rev("HEAD", located)
        if start is None:
            raise UsageError(
                f"the git repository at {main.main_root} has no commits yet"
                + (f" (or no branch {branch})" if branch else "")
                + "; make a first commit or use isolation 'shared'"
            )
        key = await self._repo_key(main, start)
        task = self._task(record, start, branch, key)
        for attempt in range(1, ATTEMPTS + 1):
            async with self._placed() as (node, reservation):
                try:
                    actor = await self._actor(node)
                    data = await self._bundle_for(actor, node, main, start, key)
                    sent = task.model_copy(update={"reservation": reservation})
                    ref = actor.run.remote(
                        sent.model_dump(), self.runner.catalog, data, self._secrets
                    )
                    waited = asyncio.wrap_future(ref.future())
                except Exception as e:
                    if attempt < ATTEMPTS and self._unstarted(record, node, e):
                        continue
                    return self._failed(record, e)
                try:
                    raw = await asyncio.shield(waited)
                except asyncio.CancelledError:
                    got = await self._stop(record, ref, waited)
                    if got is not None:
                        await self._take(main, record, got, branch)
                        self._end(record, got)
                    raise
                except Exception as e:
                    if attempt < ATTEMPTS and self._unstarted(record, node, e):
                        continue
                    return self._failed(record, e)
            result = NodeResult.model_validate(raw)
            await self._take(main, record, result, branch)
            return self._end(record, result)
        raise AssertionError("unreachable")  # the last attempt returns

    # -- internals -------------------------------------------------------------------
    def _task(self, record: RunRecord, start: str, branch: str | None, key: str) -> NodeTask:
        runner = self.runner
        sqlite = None
        if shared_store(runner) is None and isinstance(runner.store, SqliteStore):
            sqlite = runner.store.describe()  # its file: only nodes of this machine share it
        return NodeTask(
            run_id=record.run_id,
            start=start,
            bundle_ref=bundle_ref(start),
            repo_key=key,
            branch=branch,
            # the store's URL (it may hold a password) travels with the secrets only
            settings=runner.settings.model_dump(mode="json", by_alias=True, exclude={"store"}),
            launch=runner.launch,
            model_spec=runner.launch.model_spec,
            sqlite=sqlite,
            max_bundle=runner.settings.sandbox.bundle_max_bytes,
        )

    def connect(self) -> None:
        """Join the cluster now (a command fails at once, in one line, without one)."""
        if self._remote is None:
            self._remote = self._connect_sync()

    async def _connect(self) -> None:
        async with self._lock:
            if self._remote is None:
                self._remote = await asyncio.to_thread(self._connect_sync)

    def _connect_sync(self) -> Placement:
        # Ray's `uv run` hook walks this process's parents at init, and fails when one exits
        # meanwhile (a worker host outlives its launcher); orch's nodes never need it.
        os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
        import ray

        if not ray.is_initialized():
            where = self.cfg.address or os.environ.get("RAY_ADDRESS") or "auto"
            _probe(where)
            try:
                ray.init(
                    address=where,
                    namespace="orch",
                    log_to_driver=False,
                    logging_level=logging.ERROR,
                )
            except Exception as e:  # whatever Ray raises: one line, never a crash of ours
                why = first_line(str(e)) or type(e).__name__
                raise UsageError(NO_CLUSTER.format(where=where, why=why)) from e
        names = (*FORWARDED_ENV, *endpoint_keys(self.runner.settings.endpoints))
        env = {k: os.environ.get(k, "") for k in names}  # "": unset on the node
        if (url := shared_store(self.runner)) is not None:
            env["ORCH_STORE"] = url
        self._secrets = ray.put(env)
        slots = ray.cluster_resources().get("orch_slots", 0)  # type: ignore[no-untyped-call]
        if slots < self.cfg.slots:
            raise UsageError(
                f"the Ray cluster has {slots:g} orch_slots, a run asks for {self.cfg.slots:g}: "
                "start its nodes with --resources '{\"orch_slots\": N}'"
            )
        return Placement(self.cfg, self._secrets, identity(env))

    def _placed(self) -> contextlib.AbstractAsyncContextManager[tuple[str, str]]:
        assert self._remote is not None
        return self._remote.placed()

    async def _actor(self, node: str) -> Any:
        assert self._remote is not None
        return await self._remote.actor(node)

    async def _repo_key(self, main: RepoPaths, start: str) -> str:
        """The repository's identity on the nodes (its bundle cache there): this host, its
        git directory and its root commits; found once per commit."""
        found = self._keys.get((str(main.common_dir), start))
        if found is None:
            roots = await git("rev-list", "--max-parents=0", start, repo=main)
            text = "\0".join([socket.gethostname(), str(main.common_dir), *roots.out.split()])
            found = hashlib.sha256(text.encode()).hexdigest()
            self._keys[str(main.common_dir), start] = found
        return found

    async def _bundle_for(
        self, actor: Any, node: str, main: RepoPaths, start: str, key: str
    ) -> Any:
        """What the node's cache lacks of ``start``: None (it holds it), the commits past
        what it holds, or (a first run there) its whole history; an ObjectRef."""
        if (node, key, start) in self._known:
            return None
        try:  # a node's answer is data: bounded in time, its shape checked
            async with asyncio.timeout(HAVE_TIMEOUT_S):
                have = await actor.have.remote(self._secrets, key, start)
        except TimeoutError:
            why = f"node {node} did not say what it holds in {HAVE_TIMEOUT_S:.0f} s"
            raise OrchError(why) from None
        if not isinstance(have, dict) or not isinstance(have.get("tips"), list):
            raise OrchError(f"node {node} answered what it holds with something malformed")
        if have.get("has") is True:
            self._known.add((node, key, start))
            return None
        tips = [t for t in have["tips"] if isinstance(t, str) and _SHA.match(t)]
        if tips:  # the ones this repository holds: the bundle's prerequisites
            held = await git("rev-list", "--no-walk", "--ignore-missing", *tips, repo=main)
            tips = held.out.split()
        if not tips:
            return await self._put(await base_bundle(main, start))
        import ray

        staging = await asyncio.to_thread(Staging)
        try:
            path = staging.path("thin.bundle")
            await thin_bundle(main, start, path, bundle_ref(start), tips)
            data = await asyncio.to_thread(path.read_bytes)
        finally:
            await asyncio.to_thread(staging.remove)
        return await asyncio.to_thread(ray.put, data)

    def _unstarted(self, record: RunRecord, node: str, error: Exception) -> bool:
        """The node's warm orch was gone (it ended idle, or its node was lost) before the
        run began there: worth another try on a fresh one."""
        from ray.exceptions import RayActorError

        if not isinstance(error, RayActorError):
            return False
        assert self._remote is not None
        self._remote.forget(node)
        self._known = {k for k in self._known if k[0] != node}
        return self.runner.store.require_run(record.run_id).status == RunStatus.QUEUED

    async def _put(self, bundle: Path) -> Any:
        found = self._bundles.get(bundle)
        if found is None:
            import ray

            data = await asyncio.to_thread(bundle.read_bytes)
            found = self._bundles[bundle] = await asyncio.to_thread(ray.put, data)
        return found

    async def _stop(
        self, record: RunRecord, ref: Any, waited: asyncio.Future[Any]
    ) -> NodeResult | None:
        """A cancelled wait: the node ends the run itself if it can, else it is killed."""
        import ray

        self.runner.store.request_cancel([record.run_id])
        try:
            async with asyncio.timeout(self.cfg.cancel_grace_s):
                raw = await asyncio.shield(waited)
            return NodeResult.model_validate(raw)
        except (asyncio.CancelledError, Exception):
            with contextlib.suppress(Exception):
                ray.cancel(ref)  # the node's coroutine: its runner ends the run, cleaned up
            return None

    def _end(self, record: RunRecord, result: NodeResult) -> RunRecord:
        """The node held the run's ending back until its work was home: write it now."""
        if result.status not in {s.value for s in RunStatus if s.ended}:
            raise OrchError(f"{result.node} returned without ending the run ({result.status!r})")
        return self.runner.end_held(record.run_id, result.status)

    def _failed(self, record: RunRecord, error: Exception) -> RunRecord:
        """The task did not come back: its node died (interrupted), or our code on it
        raised (failed); every run of it still active ends so."""
        from ray.exceptions import RayTaskError

        store = self.runner.store
        crashed = isinstance(error, RayTaskError)
        status = RunStatus.FAILED if crashed else RunStatus.INTERRUPTED
        current = store.require_run(record.run_id)
        where = current.node or "its node"
        cause = getattr(error, "cause", None) or error
        why = f"{type(cause).__name__}: {first_line(str(cause))}"[:300]
        text = f"failed on {where}: {why}" if crashed else f"interrupted: {where} was lost ({why})"
        for run in [current, *store.descendants(record.run_id)]:
            store.end(run.run_id, status, error=text, output=run.output or run.summary)
        return store.require_run(record.run_id)

    async def _take(
        self, main: RepoPaths, record: RunRecord, result: NodeResult, branch: str | None
    ) -> None:
        """Bring the node's branches home: names checked first, then a hardened unbundle and
        the container tier's compare-and-swap (``boxout.land``; ``branch``: the one the run
        continues, moved only forward)."""
        scripted = getattr(self.runner.models, "scripted", None)
        if result.scripted is not None and scripted is not None:
            scripted.absorb(result.scripted)
        if result.error is not None:
            raise OrchError(result.error)
        if not result.bundle or not result.heads:
            return
        for ref, sha in result.heads.items():
            if not _SAFE_REF.match(ref) or ".." in ref or not _SHA.match(sha):
                raise OrchError(f"the work from {result.node} names a bad ref: {ref[:120]!r}")
        staging = await asyncio.to_thread(Staging)
        try:
            path = staging.path("out.bundle")
            await asyncio.to_thread(path.write_bytes, result.bundle)
            got = await git("bundle", "unbundle", str(path), repo=main, check=False)
        finally:
            await asyncio.to_thread(staging.remove)
        if got.code != 0:
            raise OrchError(
                f"the work from {result.node} is not a valid bundle: {first_line(got.err)}"
            )
        held = {ref: sha for sha, _, ref in (ln.partition(" ") for ln in got.out.splitlines())}
        if bad := [ref for ref, sha in result.heads.items() if held.get(ref) != sha]:
            raise OrchError(f"the work from {result.node} names a bad ref: {bad[0][:120]!r}")
        renamed: dict[str, str] = {}
        for ref, sha in result.heads.items():
            name = ref.removeprefix("refs/heads/")
            kept = await land(main, name, sha, continued=name == branch)
            if kept != name:
                renamed[name] = kept
        if renamed:
            done = self.runner.store.require_run(record.run_id)
            arts = [
                {**a, "branch": renamed.get(a.get("branch", ""), a.get("branch"))}
                for a in done.artifacts
            ]
            self.runner.store.update_run(record.run_id, artifacts=arts)


def _probe(where: str) -> None:
    """A cluster address that answers nothing fails now, not after Ray's minutes of retries."""
    host, _, port = where.removeprefix("ray://").rpartition(":")
    if where == "auto" or not port.isdigit():
        return  # Ray finds (or refuses) a cluster of this machine itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise UsageError(NO_CLUSTER.format(where=where, why=e.strerror or str(e))) from e
