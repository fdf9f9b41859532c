"""Where a run sent to the cluster goes: a reservation of its resources on one node, and
that node's warm orch (``warm.OrchNode``).

A run's resource request (``[ray]``: CPUs, memory, ``orch_slots``) is a one-bundle
placement group, made when the run is sent and removed when it comes back (or its
spawner dies: the group is the driver's): Ray admits it where the resources are free and
queues it while none are, as it did for a task per run. Runs are spread over the nodes
that could hold them (round robin from a random node: the group's soft target), and the
run goes to the warm orch of the node its group landed on, made there the first time
(named by node and identity, ``detached``, no CPU of its own: its runs hold the group's).
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import hashlib
import json
import os
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from .warm import IDLE_S, OrchNode

if TYPE_CHECKING:
    from ...config import RaySettings

IDLE_ENV = "ORCH_RAY_IDLE_S"  # how long a node's warm orch outlives its last run
NODES_TTL_S = 5.0


def identity(env: dict[str, str]) -> str:
    """Which warm orch of a node serves this spawner: a slow hash of its user and the
    environment it forwards (key, base URL, store URL), so the name an actor is listed by
    gives none of them away."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = ""
    text = json.dumps([os.getuid(), user, sorted(env.items())])
    return hashlib.pbkdf2_hmac("sha256", text.encode(), b"orch-ray-node", 50_000)[:8].hex()


def idle_s() -> float:
    try:
        return max(1.0, float(os.environ.get(IDLE_ENV) or IDLE_S))
    except ValueError:
        return IDLE_S


class Placement:
    """The nodes of one driver's runs, their reservations and warm orchs."""

    def __init__(self, cfg: RaySettings, secrets: Any, ident: str) -> None:
        import ray

        self.cfg = cfg
        self._secrets = secrets  # ObjectRef: the actor gets it through the object store
        self._ident = ident
        self._cls: Any = ray.remote(OrchNode)
        self._actors: dict[str, Any] = {}
        self._nodes: list[str] = []
        self._nodes_at = 0.0
        self._turn = random.randrange(1 << 16)

    def request(self) -> dict[str, float]:
        """One run's resources, as a placement group's bundle."""
        cfg = self.cfg
        want = {"CPU": cfg.num_cpus, "orch_slots": cfg.slots}
        if cfg.memory_mb:
            want["memory"] = float(cfg.memory_mb * 1024 * 1024)
        return {k: v for k, v in want.items() if v > 0}

    @asynccontextmanager
    async def placed(self) -> AsyncIterator[tuple[str, str]]:
        """A reservation of one run's resources, held for the block: its node's id and its
        own (the placement group's, hex; it goes with this driver, and the run with it)."""
        from ray.util import placement_group, placement_group_table, remove_placement_group

        target = await self._target()
        group = placement_group([self.request()], "STRICT_PACK", _soft_target_node_id=target)
        try:
            await group.ready()
            table = await asyncio.to_thread(placement_group_table, group)
            yield str(table["bundles_to_node_id"][0]), group.id.hex()
        finally:  # off the loop; a failure here must not hide the block's own
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.to_thread(remove_placement_group, group))

    async def actor(self, node: str) -> Any:
        """The warm orch of ``node`` for this identity (made there the first time)."""
        found = self._actors.get(node)
        if found is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            made = self._cls.options(
                name=f"orch-node-{node[:16]}-{self._ident}",
                namespace="orch",
                lifetime="detached",
                get_if_exists=True,
                num_cpus=0,
                max_restarts=0,
                max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            )
            found = await asyncio.to_thread(made.remote, self._secrets, idle_s())
            self._actors[node] = found
        return found

    def forget(self, node: str) -> None:
        """``node``'s warm orch ended (idle, or lost): the next run makes or finds it anew."""
        self._actors.pop(node, None)
        self._nodes_at = 0.0

    async def _target(self) -> str | None:
        """The next node, in turn, of those whose resources could hold a run."""
        if time.monotonic() - self._nodes_at > NODES_TTL_S:
            import ray

            want = self.request()
            nodes = await asyncio.to_thread(ray.nodes)
            self._nodes = sorted(
                n["NodeID"]
                for n in nodes
                if n.get("Alive") and all(n["Resources"].get(k, 0) >= v for k, v in want.items())
            )
            self._nodes_at = time.monotonic()
        if not self._nodes:
            return None
        self._turn += 1
        return self._nodes[self._turn % len(self._nodes)]
