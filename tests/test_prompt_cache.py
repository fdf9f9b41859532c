"""orch's prompt caching, end to end: the real engine through the real `anthropic` SDK against
the fake Messages API on loopback, which reports cache reads and writes by the documented
prefix rules (orchestrator/testing/messages.py)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from orchestrator.catalog.definitions import load_catalog
from orchestrator.config import Settings
from orchestrator.engine.runner import Runner
from orchestrator.models import ModelProvider
from orchestrator.models.base import ModelUsage
from orchestrator.models.pricing import cost
from orchestrator.run import RunRecord, RunStatus
from orchestrator.spec import RunSpec
from orchestrator.store import open_store
from orchestrator.testing.messages import tokens
from tests.fakeapi import served, system_text, text_reply, tool_reply
from tests.support import init_repo

pytestmark = pytest.mark.usefixtures("hermetic_git")

FILES = 12
CHILD_PROMPT = f"Read data/part01.txt to data/part{FILES:02}.txt, one at a time, and sum up."
FIELDS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository with twelve 6 KB files under data/."""
    files = {}
    for i in range(1, FILES + 1):
        lines = [f"part {i} line {n}: value {i * 1000 + n} of the ledger." for n in range(200)]
        files[f"data/part{i:02}.txt"] = "\n".join(lines)[:6144] + "\n"
    return init_repo(tmp_path / "proj", files)


def _agent_of(body: dict[str, Any]) -> tuple[str, int]:
    m = re.search(r"You are agent '([^']+)' at delegation depth (\d+)", system_text(body))
    assert m, "every request names its agent and depth in the system prompt"
    return m.group(1), int(m.group(2))


def _turns(body: dict[str, Any]) -> int:
    return sum(1 for m in body["messages"] if m["role"] == "assistant")


def _run(root: Path, prompt: str, **settings: Any) -> tuple[RunRecord, Any]:
    cfg = Settings(model="sonnet", **settings)
    store = open_store(root)
    provider = ModelProvider(cfg)
    runner = Runner(settings=cfg, store=store, catalog=load_catalog(root), models=provider)

    async def go() -> RunRecord:
        async with provider:
            return await asyncio.wait_for(runner.run(RunSpec(prompt=prompt, workdir=root)), 300)

    record = asyncio.run(go())
    assert record.status == RunStatus.SUCCEEDED, record.error
    return record, store


def _prefix(body: dict[str, Any]) -> str:
    """What comes before the system prompt's breakpoint: the tools and the first system
    block, as sent (markers included)."""
    return json.dumps([body["tools"], body["system"][0]], sort_keys=True)


def _markers(value: Any) -> list[Any]:
    if isinstance(value, dict):
        own = [value["cache_control"]] if "cache_control" in value else []
        return own + [m for v in value.values() for m in _markers(v)]
    if isinstance(value, list):
        return [m for v in value for m in _markers(v)]
    return []


def _usage(reported: dict[str, Any], *, cached: bool = True) -> ModelUsage:
    """What the fake reported as orch's ModelUsage (``cached=False``: as if nothing were)."""
    if not cached:
        whole = sum(reported[f] for f in FIELDS)
        return ModelUsage(input_tokens=whole, output_tokens=reported["output_tokens"])
    return ModelUsage(**{k: reported[k] for k in (*FIELDS, "output_tokens")})


def scenario(body: dict[str, Any]) -> dict[str, Any]:
    """The issue's run: the root delegates once; the child reads the twelve files, one a
    turn, then sums up; the root answers."""
    _, depth = _agent_of(body)
    done = _turns(body)
    if depth == 0:
        if done == 0:
            return tool_reply(("task", {"description": "read the data", "prompt": CHILD_PROMPT}))
        return text_reply("ROOT: the child read the twelve parts; the ledger adds up.")
    if done < FILES:
        return tool_reply(("read_file", {"path": f"data/part{done + 1:02}.txt"}))
    return text_reply("CHILD: twelve parts read, 2400 lines, every value checked.")


def test_a_delegated_twelve_file_read_is_mostly_read_from_the_cache(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with served(scenario, monkeypatch) as api:
        root, store = _run(repo, "Check the ledger in data/ with a child agent.")
    assert root.output.startswith("ROOT:")
    usages = api.answered()
    assert len(usages) == len(api.requests) == 2 + FILES + 1  # root 2, child 13
    rest = usages[1:]  # after the run's first request
    read = sum(u["cache_read_input_tokens"] for u in rest)
    prompt = sum(u[f] for u in rest for f in FIELDS)
    assert read / prompt >= 0.85, (read, prompt)
    # every request after the root's first reads something: the tools at least
    assert all(u["cache_read_input_tokens"] > 0 for u in rest)
    # cheaper than the same tokens uncached
    model = api.requests[0]["model"]
    dollars = sum(cost(model, _usage(u)) for u in usages)
    uncached = sum(cost(model, _usage(u, cached=False)) for u in usages)
    assert 0 < dollars < uncached

    # the run records carry what the fake reported, root and child apart
    child = store.children(root.run_id)[0]
    for record, depth in ((root, 0), (child, 1)):
        mine = [u for b, u in zip(api.requests, usages, strict=True) if _agent_of(b)[1] == depth]
        stored = store.get_run(record.run_id)
        assert stored is not None
        for name in (*FIELDS, "output_tokens"):
            assert getattr(stored.usage, name) == sum(u[name] for u in mine), name


def _siblings(body: dict[str, Any]) -> dict[str, Any]:
    """The root starts three children at once (two in worktrees of their own, one in the
    shared checkout); each reads a file, then answers."""
    _, depth = _agent_of(body)
    done = _turns(body)
    if depth == 0:
        if done == 0:
            places = ("worktree", "worktree", "shared")
            calls = [
                ("task", {"description": f"part {i}", "prompt": f"Read part {i}.", "isolation": p})
                for i, p in enumerate(places, 1)
            ]
            return tool_reply(*calls)
        return text_reply("ROOT: done")
    if done == 0:
        part = re.search(r"Read part (\d+)", json.dumps(body["messages"][0]))
        assert part
        return tool_reply(("read_file", {"path": f"data/part{int(part.group(1)):02}.txt"}))
    return text_reply("CHILD: read")


def test_the_stable_prefix_is_the_same_for_every_turn_and_every_sibling(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with served(_siblings, monkeypatch) as api:
        root, store = _run(repo, "Read three parts with three children.")
    children = store.children(root.run_id)
    assert len(children) == 3
    branches = [c.workspace.get("branch") for c in children if c.workspace.get("branch")]
    assert len(branches) == 2  # the worktree siblings: branches (and roots) of their own
    by_depth: dict[int, list[dict[str, Any]]] = {}
    for body in api.requests:
        by_depth.setdefault(_agent_of(body)[1], []).append(body)
        # breakpoints: the last tool, the system prompt's stable block, the conversation
        assert "cache_control" in body["tools"][-1]
        assert "cache_control" in body["system"][0] and "cache_control" not in body["system"][1]
        assert 3 <= len(_markers(body)) <= 4
    assert len(by_depth[0]) == 2 and len(by_depth[1]) == 6
    # byte-identical before the breakpoint: every turn of the root, every turn of every child
    assert len({_prefix(b) for b in by_depth[0]}) == 1
    assert len({_prefix(b) for b in by_depth[1]}) == 1
    # and nothing of a run's own before it: no id, path or branch
    stable = _prefix(by_depth[1][0]) + _prefix(by_depth[0][0])
    for run in (root, *children):
        assert run.run_id not in stable
    for name in (*branches, str(repo), str(repo.parent), ".orch/worktrees"):
        assert name not in stable, name
    # the run's own facts come after it, and differ between siblings
    facts = {b["system"][1]["text"] for b in by_depth[1]}
    assert len(facts) == 3 and all(any(br in f for f in facts) for br in branches)
    # so the siblings, started together, each read the tools and stable system prompt
    # the root's first request wrote (the root and its children offer the same tools)
    assert _prefix(by_depth[0][0]) == _prefix(by_depth[1][0])
    head = tokens(by_depth[1][0]["system"][0]) + sum(tokens(t) for t in by_depth[1][0]["tools"])
    pairs = zip(api.requests, api.answered(), strict=True)
    firsts = [u for b, u in pairs if _agent_of(b)[1] == 1 and _turns(b) == 0]
    assert len(firsts) == 3
    assert all(u["cache_read_input_tokens"] >= head * 0.95 for u in firsts), (head, firsts)


def _once(body: dict[str, Any]) -> dict[str, Any]:
    _, depth = _agent_of(body)
    if depth == 0 and _turns(body) == 0:
        return tool_reply(("task", {"description": "look", "prompt": "Read part 1."}))
    if depth == 1 and _turns(body) == 0:
        return tool_reply(("read_file", {"path": "data/part01.txt"}))
    return text_reply("done")


@pytest.mark.parametrize(
    ("ttl", "marker"),
    [("5m", {"type": "ephemeral"}), ("1h", {"type": "ephemeral", "ttl": "1h"})],
)
def test_cache_ttl_puts_its_marker_on_every_breakpoint(
    repo: Path, monkeypatch: pytest.MonkeyPatch, ttl: str, marker: dict[str, str]
) -> None:
    with served(_once, monkeypatch) as api:
        _run(repo, "Look at part 1 with a child.", cache_ttl=ttl)
    assert len(api.requests) == 4  # root 2, child 2
    for body, usage in zip(api.requests, api.answered(), strict=True):
        found = _markers(body)
        assert len(found) >= 3 and all(m == marker for m in found), found
        split = usage["cache_creation"]
        own = split["ephemeral_1h_input_tokens" if ttl == "1h" else "ephemeral_5m_input_tokens"]
        assert own == usage["cache_creation_input_tokens"]
