"""A reply that asks for container children has their containers starting as soon as it is
seen (``pool.ahead``, hooked in by ``Execution._ahead``), within ``sandbox.max_per_chain``;
the children claim them, and what is not claimed is removed."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import SandboxSettings
from orchestrator.run import RunStatus, new_run_id
from orchestrator.workspaces.base import ChainTally, WorkspaceSpec
from orchestrator.workspaces.container import pool as pool_mod
from orchestrator.workspaces.container.docker import remove_container
from tests.support import harness
from tests.test_container import engine, labelled, leftovers, repo, sandbox_image, sh

__all__ = ["engine", "repo", "sandbox_image"]  # fixtures shared with test_container

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("hermetic_git")]


def _child(i: int) -> dict[str, Any]:
    return {"depth": 1, "turns": [
        {"tool_calls": [{"tool": "bash", "input": {"command": f"echo {i} > c{i}.txt"}}]},
        {"text": f"child {i} done"},
    ]}  # fmt: skip


def test_a_fan_out_reply_starts_its_containers(
    repo: Path, sandbox_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[pool_mod.ContainerPool] = []
    real = pool_mod.ahead

    def ahead(spec: WorkspaceSpec, count: int) -> pool_mod.ContainerPool:
        seen.append(real(spec, count))
        return seen[-1]

    monkeypatch.setattr(pool_mod, "ahead", ahead)
    calls = [
        {"tool": "task", "input": {"description": f"c{i}", "prompt": f"child {i}",
                                   "isolation": "container"}}
        for i in range(3)
    ] + [
        {"tool": "task", "input": {"description": "s", "prompt": "shared", "isolation": "shared"}},
    ]  # fmt: skip
    script = {"conversations": [
        {"depth": 0, "turns": [{"tool_calls": calls}, {"text": "parent done"}]},
        *(_child(i) for i in range(4)),
    ]}  # fmt: skip
    sandbox = SandboxSettings(image=sandbox_image, max_per_chain=3)
    h = harness(repo, script, sandbox=sandbox, max_parallel_children=4, max_chain_running=5)
    root = h.run("fan out")
    assert root.status == RunStatus.SUCCEEDED, root.error
    [pool] = seen  # one reply with task calls: one pool, for its three container children
    assert (pool.size, pool.claimed, pool.chain) == (
        3,
        3,
        (pool_mod._pool_key(sandbox), root.chain_id),
    )
    children = h.store.children(root.run_id)
    boxed = [c for c in children if c.isolation == "container"]
    assert len(boxed) == 3 and all(c.workspace["pooled"] for c in boxed)
    for c in boxed:
        [art] = c.artifacts
        assert sh(repo, "ls-tree", "--name-only", art["branch"]).count("c") >= 1
    assert pool_mod._AHEAD == {} and leftovers(repo) == []
    assert not labelled(f"orch.owner_pid={os.getpid()}")  # nothing outlives the run


def _spec(repo: Path, image: str, running: int, cap: int) -> WorkspaceSpec:
    chain = ChainTally(containers=running)
    sandbox = SandboxSettings(image=image, max_per_chain=cap)
    return WorkspaceSpec(new_run_id(), "chain-x", "a", "d", repo, sandbox=sandbox, chain=chain)


def test_ahead_stays_within_the_chains_cap(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert pool_mod.ahead(_spec(repo, "img", 1, 3), 5).size == 2
    assert pool_mod.ahead(_spec(repo, "img", 3, 3), 5).size == 0
    assert pool_mod.ahead(_spec(repo, "img", 0, 8), 2).size == 2
    # an open pool's ready containers serve first: only the rest start ahead
    spec = _spec(repo, "img", 0, 8)
    general = pool_mod.ContainerPool(repo, spec.sandbox, size=2)
    general.ready = [pool_mod.Warm("a"), pool_mod.Warm("b")]
    monkeypatch.setitem(pool_mod._POOLS, pool_mod._pool_key(spec.sandbox), general)
    assert pool_mod.ahead(spec, 5).size == 3
    assert pool_mod.ahead(spec, 2).size == 0


def test_unclaimed_containers_are_removed(repo: Path, sandbox_image: str) -> None:
    spec = _spec(repo, sandbox_image, 0, 8)

    async def body() -> str:
        async with pool_mod.ahead(spec, 3) as pool:
            # a claim of this chain waits for one still starting; another chain gets none
            warm = await pool_mod.claim_warm(spec.sandbox, "chain-x")
            assert warm is not None and pool.claimed == 1
            assert await pool_mod.claim_warm(spec.sandbox, "other-chain") is None
            assert pool._task is not None
            await asyncio.wait({pool._task}, timeout=120)  # all three started
            assert pool.started.qsize() == 2
            mine = labelled(f"orch.owner_pid={os.getpid()}")
            assert len(mine) == 3 and sorted(labelled("orch.chain_id=chain-x")) == sorted(mine)
            if warm.server is not None:  # the claimer's to close
                warm.server.close()
        return warm.container_id

    claimed = asyncio.run(body())
    try:  # the two never claimed went with the pool; the claimed one is its claimer's
        assert labelled(f"orch.owner_pid={os.getpid()}") == [claimed]
    finally:
        remove_container(claimed)
    assert pool_mod._AHEAD == {}


def test_ahead_without_an_engine_is_a_no_op(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{repo}/no-such.sock")
    spec = _spec(repo, "img", 0, 8)

    async def body() -> None:
        async with pool_mod.ahead(spec, 2) as pool:  # the reply's calls go on; children say why
            assert pool.error is not None and "not reachable" in str(pool.error)
            assert pool_mod._AHEAD == {}
            assert await pool_mod.claim_warm(spec.sandbox, spec.chain_id) is None

    asyncio.run(body())
