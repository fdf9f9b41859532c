"""The warm orch of a Ray node: one long-lived actor per node and spawner identity.

:class:`OrchNode` is what ``driver.py`` sends runs to. Made once per node for one
*identity* (a slow hash of the spawner's user and forwarded environment: API key, base
URL, store URL; ``place.identity``), it

- imports orch, the store and the model SDKs once, when it starts; every run after that
  is a coroutine of its event loop, as a child is in its spawner's process;
- holds that identity's environment for its whole life (set once, when it starts; a call
  with other secrets is refused), so runs of two users or two keys never share a process
  or an environment;
- keeps a **bundle cache** per repository: a bare repository of the node's, in a 0700
  directory of its own, keyed by the repository's identity (``NodeTask.repo_key``: the
  spawner's host, its repository's git directory and root commits). The first run of a
  repository on the node brings the history of its start; later runs bring only the
  commits the cache lacks (the spawner asks :meth:`OrchNode.have` first), or nothing.
  Bundles are checked before they are taken (``git bundle verify`` against the cache, then
  the starting commit by name). A run gets a fresh repository of its own with a copy of
  the cache's packs: no run writes the cache, and no run reaches another repository's;
- ends itself once idle (no run for ``idle_s``, ``ORCH_RAY_IDLE_S``, default 600 s; its
  cache goes with it), and with the cluster. It is ``detached`` (it outlives the ``orch``
  command that made it, which is the point), never restarted;
- ends a run whose reservation is gone (``NodeTask.reservation``: the placement group
  its spawner owns, removed by Ray when the spawner dies), as a cancel does.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import re
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from ...catalog.definitions import Catalog
from ...project.git import RepoPaths, git
from .node import NodeTask, adopt, node_name, set_env

IDLE_S = 600.0
_KEY = re.compile(r"^[0-9a-f]{64}$")
_SHA = re.compile(r"^[0-9a-f]{40,64}$")
WARM_MODULES = (
    "orchestrator.process.rebuild",
    "orchestrator.engine.runner",
    "orchestrator.store",
    "orchestrator.workspaces.registry",
)


def _bare(path: Path) -> RepoPaths:
    return RepoPaths(path, None, path, path)


class BundleCache:
    """One repository's history on this node (a bare repository only this actor writes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.repo = _bare(path)
        self.lock = asyncio.Lock()
        self.made = False
        self.known: set[str] = set()  # commits checked present

    async def has(self, commit: str) -> bool:
        if commit in self.known:
            return True
        if not self.made:
            return False
        got = await git("cat-file", "-e", f"{commit}^{{commit}}", repo=self.repo, check=False)
        if got.code == 0:
            self.known.add(commit)
        return got.code == 0

    async def take(self, bundle: bytes, start: str, ref: str) -> int:
        """Verify ``bundle`` against the cache and add its objects; it must hold ``start``
        as ``ref``. Returns how many commits of the cache it built on (0: a whole history)."""
        if not self.made:
            self.path.mkdir(mode=0o700, exist_ok=True)  # a first take that failed made it
            await git("init", "-q", "--bare", repo=self.repo, cwd=self.path)
            self.made = True
        file = self.path / "in.bundle"
        await asyncio.to_thread(file.write_bytes, bundle)
        try:
            verified = await git("bundle", "verify", "-q", str(file), repo=self.repo, check=False)
            if verified.code != 0:
                raise RuntimeError(f"the bundle does not fit this node's cache: {verified.err}")
            got = await git("bundle", "unbundle", str(file), repo=self.repo)
        finally:
            file.unlink(missing_ok=True)
        if f"{start} {ref}" not in got.out.splitlines() or not await self.has(start):
            raise RuntimeError(f"the bundle does not hold {ref} at {start}")
        header = bundle.split(b"\n\n", 1)[0].splitlines()
        return sum(1 for line in header if line.startswith(b"-"))

    def packs(self) -> list[Path]:
        pack = self.path / "objects" / "pack"
        return sorted(p for p in pack.iterdir() if p.suffix in (".pack", ".idx", ".rev"))


class OrchNode:
    """The Ray actor (see the module doc); ``driver.py`` makes it with ``ray.remote``."""

    def __init__(self, secrets: dict[str, str], idle_s: float = IDLE_S) -> None:
        self._secrets = dict(secrets)
        set_env(dict(self._secrets))  # for this process's life: it serves this identity only
        self._idle_s = idle_s
        self._root = Path(tempfile.mkdtemp(prefix="orch-warm-"))  # 0700
        self._caches: dict[str, BundleCache] = {}
        self._active = 0
        self._last = time.monotonic()
        self._watch: asyncio.Task[None] | None = None
        self._reserved: dict[asyncio.Task[Any], str] = {}  # a run's call -> its reservation
        self.counts = {"started": 1, "runs": 0, "unbundled": 0, "thin": 0, "have": 0}
        self._node = node_name()
        from ...engine.owner import set_node
        from ...models.registry import preload_modules

        set_node(self._node)
        for name in (*WARM_MODULES, *preload_modules()):
            with contextlib.suppress(ImportError):
                importlib.import_module(name)

    # -- the calls -------------------------------------------------------------------
    async def have(self, secrets: dict[str, str], repo_key: str, start: str) -> dict[str, Any]:
        """Whether the cache of ``repo_key`` holds ``start``, and the commits it was given
        (what a bundle for it may leave out)."""
        self._check(secrets, repo_key, start)
        self._touch()
        self.counts["have"] += 1
        cache = self._cache(repo_key)
        async with cache.lock:
            return {"has": await cache.has(start), "tips": sorted(cache.known)[-64:]}

    async def run(
        self,
        task: dict[str, Any],
        catalog: Catalog,
        bundle: bytes | None,
        secrets: dict[str, str],
    ) -> dict[str, Any]:
        """One run, adopted here (``node.adopt``) in a fresh repository made from the cache
        (after taking ``bundle``, when the spawner sent one)."""
        spec = NodeTask.model_validate(task)
        self._check(secrets, spec.repo_key, spec.start)
        self._active += 1
        self._touch()
        if (me := asyncio.current_task()) is not None and spec.reservation:
            self._reserved[me] = spec.reservation
        tmp = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="orch-node-", dir=self._root))
        try:
            cache = self._cache(spec.repo_key)
            async with cache.lock:
                if bundle is not None and not await cache.has(spec.start):
                    built_on = await cache.take(bundle, spec.start, spec.bundle_ref)
                    self.counts["unbundled"] += 1
                    self.counts["thin"] += built_on > 0
                if not await cache.has(spec.start):
                    raise RuntimeError(f"this node has no commit {spec.start} of the repository")
                packs = cache.packs()
            repo = await _checkout(spec, packs, tmp / "repo")
            self.counts["runs"] += 1
            result = await adopt(spec, catalog, repo, tmp)
            return result.model_dump()
        finally:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, tmp, True))
            if me is not None:
                self._reserved.pop(me, None)
            self._active -= 1
            self._touch()

    def stats(self) -> dict[str, Any]:
        """What this actor did (for tests and ``bench/scale.py``): its pid, node, counts."""
        return {
            "pid": os.getpid(),
            "node": self._node,
            **self.counts,
            "repositories": len(self._caches),
            "active": self._active,
        }

    # -- internals -------------------------------------------------------------------
    def _check(self, secrets: dict[str, str], repo_key: str, start: str) -> None:
        if secrets != self._secrets:
            raise RuntimeError("this node's orch serves another identity")
        if not _KEY.match(repo_key) or not _SHA.match(start):
            raise RuntimeError("a malformed repository key or commit")

    def _cache(self, key: str) -> BundleCache:
        found = self._caches.get(key)
        if found is None:
            found = self._caches[key] = BundleCache(self._root / f"{key}.git")
        return found

    def _touch(self) -> None:
        self._last = time.monotonic()
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._idle())

    async def _idle(self) -> None:
        """Every tick: end the runs whose reservation is gone (their spawner died: Ray
        removed the placement group it owned), and end this actor (its cache with it) once
        no run came for ``idle_s``."""
        tick = max(0.5, min(2.0, self._idle_s / 4))
        while True:
            await asyncio.sleep(tick)
            if self._reserved:
                await self._end_orphans()
            if self._active == 0 and time.monotonic() - self._last >= self._idle_s:
                break
        import ray

        await asyncio.to_thread(shutil.rmtree, self._root, True)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def _end_orphans(self) -> None:
        gone = await asyncio.to_thread(_removed, set(self._reserved.values()))
        for call, reservation in list(self._reserved.items()):
            if reservation in gone:
                self.counts["orphaned"] = self.counts.get("orphaned", 0) + 1
                call.cancel()  # its runner ends the run the way a cancel does


def _removed(reservations: set[str]) -> set[str]:
    """Those of the placement groups (hex ids) that Ray no longer holds."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table

    gone = set()
    for hex_id in reservations:
        try:
            group = PlacementGroup(PlacementGroupID(bytes.fromhex(hex_id)))
            state = placement_group_table(group).get("state")
        except Exception:  # Ray's own errors: judged again next tick
            continue
        if state == "REMOVED":
            gone.add(hex_id)
    return gone


async def _checkout(spec: NodeTask, packs: list[Path], path: Path) -> RepoPaths:
    """A repository of this run's own: the cache's packs copied in, HEAD detached at the
    start (a continued branch made at its tip)."""
    await asyncio.to_thread(path.mkdir)
    repo = RepoPaths(path / ".git", path, path / ".git", path)
    await git("init", "-q", "-b", "orch-node", repo=repo, cwd=path)
    dest = path / ".git" / "objects" / "pack"
    for pack in packs:
        await asyncio.to_thread(shutil.copyfile, pack, dest / pack.name)
    await git("update-ref", "--no-deref", "HEAD", spec.start, repo=repo)
    await git("reset", "-q", "--hard", spec.start, repo=repo)
    if spec.branch:
        await git("update-ref", f"refs/heads/{spec.branch}", spec.start, repo=repo)
    return repo


def list_stats(address: str) -> list[dict[str, Any]]:
    """Every live warm orch of the cluster at ``address``: its name and
    :meth:`OrchNode.stats` (joins the cluster: for a process of its own, e.g. a test's)."""
    import ray

    ray.init(address=address, namespace="orch", log_to_driver=False)
    try:
        found: list[dict[str, Any]] = []
        for a in ray.util.list_named_actors(all_namespaces=True):
            if not a["name"].startswith("orch-node-"):
                continue
            try:  # one that ends meanwhile is not listed
                handle = ray.get_actor(a["name"], namespace=a["namespace"])
                stats: Any = ray.get(handle.stats.remote(), timeout=30)
                found.append({"name": a["name"], **stats})
            except (ValueError, ray.exceptions.RayError):
                continue
        return found
    finally:
        ray.shutdown()


# the refs being bundled, per event loop: two children sent to two nodes at once make
# their bundles of one commit one after the other (the ref is made, bundled, deleted)
_bundling: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


async def thin_bundle(repo: RepoPaths, commit: str, dest: Path, ref: str, have: list[str]) -> None:
    """``dest``: a bundle of ``commit`` under the name ``ref`` without what ``have`` (commits
    a node's cache holds) reaches (the spawner's side)."""
    from ...workspaces.container.transfer import drop_stale_lock

    locks = _bundling.setdefault(asyncio.get_running_loop(), {})
    async with locks.setdefault(f"{repo.common_dir}\0{ref}", asyncio.Lock()):
        drop_stale_lock(repo, ref)
        try:  # the ref goes whatever happens, also when cancelled while it is being made
            await git("update-ref", ref, commit, repo=repo)
            await git("bundle", "create", "-q", str(dest), ref, "--not", *have, repo=repo)
        finally:
            await asyncio.shield(git("update-ref", "-d", ref, repo=repo, check=False))
