"""Transcripts: every run's conversation kept, bounded and pruned (for resume)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from orchestrator.cli.common import open_project
from orchestrator.store import SqliteStore
from orchestrator.store.base import bound_transcript
from tests.support import harness


def test_retention_prunes_old_transcripts(project: Path) -> None:
    store = SqliteStore.for_project(project)
    for rid in ("r-old", "r-new"):
        store.save_transcript(rid, [{"role": "user", "content": rid}])
    with sqlite3.connect(store.path) as db:
        db.execute("UPDATE transcripts SET saved_at = saved_at - 31 * 86400 WHERE run_id = 'r-old'")
    open_project(project, quiet=True)  # every command prunes (30 days by default)
    assert store.transcript("r-old") is None
    assert store.transcript("r-new") == [{"role": "user", "content": "r-new"}]
    open_project(project, quiet=True, transcript_retention_days=0)  # 0 keeps none
    assert store.transcript("r-new") is None
    h = harness(
        project, {"conversations": [{"turns": [{"text": "hi"}]}]}, transcript_retention_days=0
    )
    assert h.store.transcript(h.run("x").run_id) is None  # and none is saved


def test_transcript_size_bound() -> None:
    big = "x" * 1000
    messages: list[dict[str, Any]] = [{"role": "user", "content": "the task"}]
    for i in range(40):
        messages.append({"role": "assistant", "content": [{"type": "text", "text": f"a{i}{big}"}]})
        messages.append({"role": "user", "content": f"u{i}{big}"})
    text, cut = bound_transcript(messages, limit=10_000)
    kept = json.loads(text)
    assert cut and len(text) <= 10_000
    assert kept[0]["content"][0] == {"type": "text", "text": "the task"}
    assert "transcript cut" in kept[0]["content"][1]["text"]
    assert kept[1]["role"] == "assistant" and kept[-1] == messages[-1]
    assert [m["role"] for m in kept[1:]] == ["assistant", "user"] * (len(kept[1:]) // 2)
    assert bound_transcript(messages[:3], limit=10_000) == (
        json.dumps(messages[:3], separators=(",", ":")),
        False,
    )


def test_store_keeps_a_huge_transcript_bounded(project: Path) -> None:
    store = SqliteStore.for_project(project)
    turn = "y" * 100_000
    messages: list[dict[str, Any]] = [{"role": "user", "content": "task"}]
    for _ in range(30):  # ~6 MB
        messages += [{"role": "assistant", "content": turn}, {"role": "user", "content": turn}]
    store.save_transcript("r-big", messages)
    kept = store.transcript("r-big")
    assert kept is not None and len(json.dumps(kept)) <= 2 * 1024 * 1024
    assert kept[-1] == messages[-1] and "transcript cut" in json.dumps(kept[0])
