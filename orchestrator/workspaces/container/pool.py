"""The warm pool of started containers.

A sandbox container shares no host directory: its ``/workspace`` is a tmpfs of its own,
filled with data (a git bundle, ``.worktreeinclude`` copies) when a run
claims it (``workspace.py``). So a container can be started before its run is known:
:class:`ContainerPool` keeps ``pool_size`` of them started, and a ``ContainerWorkspace``
opened while the pool is open claims one in milliseconds instead of starting one
(``async with ContainerPool(repo, settings):``). Pooled containers carry
``orch.pool=true`` and an empty ``orch.run_id`` (labels are fixed at creation); a claim
registers the container with its run. Unclaimed containers are removed when the pool
closes; if orch dies they go at their TTL or with ``orch sandbox prune`` (their owner pid
is dead). The engine helpers are in ``docker.py``.

A fan-out seen coming: when a reply asks for N container children, :func:`ahead` opens a
pool of this chain's own around the reply's calls and starts their containers at once, in
parallel (within ``sandbox.max_per_chain``, counting what the chain runs); a child of the
chain claims one (waiting for it if it is still starting) before any other. What is not
claimed when the reply's calls end is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...config import SandboxSettings
from ...errors import OrchError, UsageError
from ..base import WorkspaceSpec
from ..lifetime import Shielded, await_shielded, stopped
from . import docker as engine
from .channel import Server, start_server

REFILL_DELAY_S = 0.25


@dataclass
class Warm:
    """A started container with an empty ``/workspace`` (its own anonymous volume), and
    its program server, greeted, when it started."""

    container_id: str
    created: float = field(default_factory=time.monotonic)
    server: Server | None = None
    token: str = ""


# -- the warm pool ----------------------------------------------------------------------

_POOLS: dict[str, ContainerPool] = {}


def _pool_key(cfg: SandboxSettings) -> str:
    return cfg.model_dump_json(exclude={"pool_size"})


_AHEAD: dict[tuple[str, str], list[ContainerPool]] = {}  # (settings, chain): its own pools
CLAIM_WAIT_S = 120.0  # a claim waits this long at most for a container still starting


async def claim_warm(cfg: SandboxSettings, chain_id: str = "") -> Warm | None:
    """A started container for a run of ``chain_id``: one started for its chain's fan-out
    (waited for while it starts), else one of an open pool with these settings if one is
    ready, else None."""
    for own in _AHEAD.get((_pool_key(cfg), chain_id), []):
        if own.promised < own.size:
            own.promised += 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLAIM_WAIT_S):
                    warm = await own.started.get()
                    if warm is not None:
                        own.claimed += 1
                        return warm
    pool = _POOLS.get(_pool_key(cfg))
    return pool.take() if pool is not None else None


def ahead(spec: WorkspaceSpec, count: int) -> ContainerPool:
    """``async with`` around a reply's calls that start ``count`` container children of the
    chain of ``spec``: their containers start now (as many as ``sandbox.max_per_chain``
    leaves the chain, less those the open pool has ready)."""
    key = (_pool_key(spec.sandbox), spec.chain_id)
    reserved = sum(p.size - p.claimed for p in _AHEAD.get(key, []))
    room = spec.sandbox.max_per_chain - spec.chain.containers - reserved
    general = _POOLS.get(key[0])  # what it holds ready serves first
    count -= len(general.ready) if general is not None else 0
    return ContainerPool(spec.base, spec.sandbox, size=max(0, min(count, room)), chain=key)


class ContainerPool(Shielded):
    """``size`` (default ``sandbox.pool_size``) started containers, each with an empty
    ``/workspace``.

    ``async with ContainerPool(project_root, settings.sandbox):`` around a run is a no-op at
    ``pool_size`` 0; otherwise container workspaces opened inside it (with the same sandbox
    settings) claim a started container instead of starting one. ``repo`` only names the
    project in messages: a warm container holds nothing of any repository until claimed.
    """

    def __init__(
        self,
        repo: Path,
        settings: SandboxSettings | None = None,
        *,
        size: int | None = None,
        chain: tuple[str, str] | None = None,
    ) -> None:
        self.repo = repo.resolve()
        self.cfg = settings or SandboxSettings()
        self.size = self.cfg.pool_size if size is None else size
        self.ready: list[Warm] = []
        self.claimed = 0
        self.error: OrchError | None = None  # the last failure to start a container
        self._stale: list[Warm] = []
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._client: Any = None
        self._key: str | None = None
        # a chain's own pool (``ahead``): started once, in parallel, into ``started``
        self.chain = chain
        self.started: asyncio.Queue[Warm | None] = asyncio.Queue()
        self.promised = 0  # claims made of it (waiting, or served)
        self.making = 0  # containers being made

    async def _open(self) -> None:
        if self.size <= 0:
            return  # pool_size 0: nothing to keep warm (and no engine needed)
        if self.chain is not None:
            try:  # a head start only: without it each child starts its own (or says why)
                self.uid, self.gid = engine.sandbox_user(self.cfg)
                self._client = await asyncio.to_thread(engine.docker_client)
            except OrchError as e:
                self.error = e
                return
            _AHEAD.setdefault(self.chain, []).append(self)
            self._task = asyncio.create_task(self._start_all(), name="orch-containers-ahead")
            return
        self.uid, self.gid = engine.sandbox_user(self.cfg)
        key = _pool_key(self.cfg)
        if key in _POOLS:
            raise UsageError(f"a container pool with these settings is already open ({self.repo})")
        self._client = await asyncio.to_thread(engine.docker_client)
        self._key = key
        _POOLS[key] = self
        self._task = asyncio.create_task(self._refill(), name="orch-container-pool")

    async def _undo(self) -> None:
        await self._close()

    async def _shut(self, exc_type: type[BaseException] | None) -> None:
        await self._close()

    async def _close(self) -> None:
        if self._key is not None:
            _POOLS.pop(self._key, None)
        if self.chain is not None and self in _AHEAD.get(self.chain, []):
            _AHEAD[self.chain].remove(self)
            if not _AHEAD[self.chain]:
                del _AHEAD[self.chain]
        if self._task is not None:
            await stopped(self._task)
        while not self.started.empty():  # started for a claim that never came
            if (left := self.started.get_nowait()) is not None:
                self.ready.append(left)
        for _ in range(self.promised):  # a claim still waiting starts its own
            self.started.put_nowait(None)
        warm, self.ready, self._stale = [*self.ready, *self._stale], [], []
        await asyncio.gather(*(asyncio.to_thread(self._discard, w) for w in warm))
        if self._client is not None:
            self._client.close()
            self._client = None

    def take(self) -> Warm | None:
        """A ready container (never one past half its TTL), or None; the pool refills behind
        it, a moment later, so starting the next container does not slow this claim down."""
        asyncio.get_running_loop().call_later(REFILL_DELAY_S, self._wake.set)
        while self.ready:
            warm = self.ready.pop(0)
            if time.monotonic() - warm.created < self.cfg.ttl_s / 2:
                self.claimed += 1
                return warm
            self._stale.append(warm)
        return None

    async def wait_ready(self, count: int | None = None) -> None:
        """Wait until ``count`` (default: all) containers are ready; raise the pool's start
        error. Bound it with ``asyncio.timeout``."""
        want = self.size if count is None else count
        while len(self.ready) < want:
            if self.error is not None:
                raise self.error
            self._changed.clear()
            await self._changed.wait()

    async def _refill(self) -> None:
        while True:
            self._wake.clear()
            stale, self._stale = self._stale, []
            await asyncio.gather(*(asyncio.to_thread(self._discard, w) for w in stale))
            missing = self.size - len(self.ready)
            made = await asyncio.gather(*(self._made() for _ in range(missing)))
            for warm in made:
                if warm is not None:
                    self.ready.append(warm)
            self._changed.set()
            if None in made:
                await asyncio.sleep(5)  # the engine or the image may come back (at a take)
            await self._wake.wait()

    async def _start_all(self) -> None:
        """A chain's own pool: its containers start at once, each to its claim as it is."""

        async def one() -> None:
            self.started.put_nowait(await self._made())

        await asyncio.gather(*(one() for _ in range(self.size)))

    async def _made(self) -> Warm | None:
        """A container started (never a half-made one left behind), or None (``error``)."""
        self.making += 1
        making = asyncio.ensure_future(asyncio.to_thread(self._make))
        try:
            warm = await await_shielded(making)
        except OrchError as e:
            self.error = e
            return None
        except asyncio.CancelledError:  # the pool closes: what was made meanwhile goes
            if not making.cancelled() and making.exception() is None:
                await await_shielded(asyncio.to_thread(self._discard, making.result()))
            raise
        finally:
            self.making -= 1
        self.error = None
        return warm

    def _make(self) -> Warm:
        chain_id = self.chain[1] if self.chain is not None else ""  # a chain's own: its id
        labels = {**engine.owner_labels(chain_id=chain_id), "orch.pool": "true"}
        cid = engine.create_container(
            self._client, self.cfg, self.uid, self.gid, labels, network_mode=self.cfg.network_mode
        )
        try:
            engine.start_container(self._client, cid)
        except BaseException:
            self._discard(Warm(cid))
            raise
        user = f"{self.uid}:{self.gid}"
        server = start_server(self._client, cid, user, engine.WORKSPACE, wait=True)
        return Warm(cid, server=server, token=labels[engine.TOKEN])

    def _discard(self, warm: Warm) -> None:
        if warm.server is not None:
            warm.server.close()
        with contextlib.suppress(OrchError):
            engine.remove_by_id(self._client, warm.container_id)
