"""A hostile model server cannot leave runs without an ending (issue 20, class 9).

Through the real CLI and the real ``anthropic`` SDK against the fake Messages API on
loopback: lone UTF-16 surrogates in the model's text, tool names, tool input (keys and
values, nested) and stop reason. The run ends (never ``running``), ``orch ps`` and
``orch result`` work, nothing prints a traceback. And a store whose write fails while
the run's ending is written (injected at the store seam) still ends the run ``failed``
with the reason, in one line and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.models.base import ModelResponse, clean
from orchestrator.store import SqliteStore
from tests.fakeapi import FakeAPI, serve, text_reply, tool_reply
from tests.support import init_repo, orch

LONE = "\ud800"
LOW = "\udfff"


def _hostile(body: dict[str, Any]) -> dict[str, Any]:
    turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
    if turn == 0:
        reply = tool_reply(
            ("glob", {"pattern": f"*{LONE}.py"}),
            (f"read{LOW}_file", {"path": "a.txt"}),
            ("grep", {"pattern": "x", f"k{LONE}": [{"deep": [LOW, {"a": LONE}]}]}),
            text=f"looking {LONE} around",
        )
        reply["stop_reason"] = f"tool_use{LOW}"  # unknown: the loop still answers the tools
        return reply
    return text_reply(f"done {LOW}{LONE} with \U0001f600 intact")


@pytest.fixture
def hostile() -> Iterator[FakeAPI]:
    with serve(FakeAPI(_hostile)) as api:
        yield api


def _env(api: FakeAPI) -> dict[str, str]:
    return {"ANTHROPIC_BASE_URL": api.base_url, "ANTHROPIC_API_KEY": "sk-test-fake"}


def _no_traceback(*outputs: str) -> None:
    for out in outputs:
        assert "Traceback" not in out and "PydanticSerializationError" not in out, out


def test_lone_surrogates_from_the_server_end_the_run(hostile: FakeAPI, tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "repo", {"a.txt": "hello\n"})
    r = orch("task", "look around", "--json", cwd=repo, env=_env(hostile), timeout=120)
    _no_traceback(r.stdout, r.stderr)
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert record["status"] == "succeeded", record
    assert record["summary"] == "done \ufffd\ufffd with \U0001f600 intact"
    # the model got its tool results (the unknown tool answered with an error) and no
    # request carried a surrogate back to it
    assert len(hostile.requests) == 2
    results = hostile.requests[1]["messages"][-1]["content"]
    assert [b.get("is_error", False) for b in results] == [False, True, True]
    sent = json.dumps(hostile.requests, ensure_ascii=False)
    assert LONE not in sent and LOW not in sent
    ps = orch("ps", "--all", cwd=repo)
    _no_traceback(ps.stdout, ps.stderr)
    assert ps.returncode == 0 and "running" not in ps.stdout, ps.stdout
    res = orch("result", record["run_id"], "--json", cwd=repo)
    _no_traceback(res.stdout, res.stderr)
    assert res.returncode == 0 and json.loads(res.stdout)["status"] == "succeeded"


def test_surrogates_in_a_tool_input_reach_no_store_write(hostile: FakeAPI, tmp_path: Path) -> None:
    """The input is cleaned before the tool, the transcript and the events see it."""
    repo = init_repo(tmp_path / "repo", {"a.txt": "hello\n"})
    r = orch("task", "look around", "--json", cwd=repo, env=_env(hostile), timeout=120)
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    store = SqliteStore(repo / ".orch" / "orch.db")
    try:
        transcript = json.dumps(store.transcript(run_id), ensure_ascii=False)
        events = json.dumps(store.events(run_id), ensure_ascii=False)
    finally:
        store.close()
    assert "*\ufffd.py" in transcript and "k\ufffd" in transcript
    assert LONE not in transcript + events and LOW not in transcript + events


def test_clean_replaces_every_lone_surrogate() -> None:
    shared = [LONE]
    value = {f"k{LONE}": [LOW, {"n": 1, "s": f"a{LONE}b"}, shared, shared], "ok": "\U0001f600"}
    assert clean(value) == {
        "k\ufffd": ["\ufffd", {"n": 1, "s": "a\ufffdb"}, ["\ufffd"], ["\ufffd"]],
        "ok": "\U0001f600",
    }
    deep: Any = LONE
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = [deep]
    out = clean(deep)
    for _ in range(5000):
        out = out[0]
    assert out == "\ufffd"
    response = ModelResponse(
        content=[{"type": "tool_use", "id": LONE, "name": LOW, "input": {LONE: LOW}}],
        stop_reason=LONE,
    )
    assert response.content == [
        {"type": "tool_use", "id": "\ufffd", "name": "\ufffd", "input": {"\ufffd": "\ufffd"}}
    ]
    assert response.stop_reason == "\ufffd"


# -- a store that fails while the ending is written -------------------------------------

FAILING_STORE = """
import sys
from orchestrator.store.sqlite import SqliteStore
from orchestrator.store.base import StoreError

real_update = SqliteStore.update_run
failed = []

def update_run(self, run_id, **fields):
    if "ended_at" in fields and not failed:  # the ending, once
        failed.append(run_id)
        raise StoreError("disk I/O error (injected)")
    return real_update(self, run_id, **fields)

SqliteStore.update_run = update_run
from orchestrator.cli.main import main
sys.argv = ["orch", *sys.argv[1:]]
main()
"""


def test_a_failed_ending_write_still_ends_the_run(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "repo", {"a.txt": "hello\n"})
    script = tmp_path / "s.yaml"
    script.write_text("conversations:\n  - turns:\n      - text: all done\n")
    wrapper = tmp_path / "failing_orch.py"
    wrapper.write_text(FAILING_STORE)
    argv = [sys.executable, str(wrapper), "task", "x", "--model", f"scripted:{script}"]
    r = subprocess.run(argv, cwd=repo, capture_output=True, text=True, timeout=120, check=False)
    _no_traceback(r.stdout, r.stderr)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "injected" in lines[0], r.stderr
    store = SqliteStore(repo / ".orch" / "orch.db")
    try:
        (record,) = store.list_runs()
    finally:
        store.close()
    assert record.status.value == "failed"
    assert record.error and "injected" in record.error and record.ended_at
    ps = orch("ps", "--all", cwd=repo)
    assert ps.returncode == 0 and "running" not in ps.stdout, ps.stdout


def test_an_undecodable_file_name_reaches_the_model_cleaned(tmp_path: Path) -> None:
    """A name a sandbox made of bytes that are not UTF-8 comes back from ``os`` with lone
    surrogates; the tool result carries U+FFFD instead (to the store and the server)."""
    repo = init_repo(tmp_path / "repo", {"a.txt": "hello\n"})
    (repo / os.fsdecode(b"bad\xff.txt")).write_text("x\n")

    def glob_then_done(body: dict[str, Any]) -> dict[str, Any]:
        if any(m["role"] == "assistant" for m in body["messages"]):
            return text_reply("done")
        return tool_reply(("glob", {"pattern": "*.txt"}))

    with serve(FakeAPI(glob_then_done)) as api:
        r = orch("task", "list", "--json", cwd=repo, env=_env(api), timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "succeeded", r.stderr
    (result,) = api.requests[1]["messages"][-1]["content"]
    assert result["content"] == "a.txt\nbad\ufffd.txt"
    assert not re.search("[\ud800-\udfff]", json.dumps(api.requests, ensure_ascii=False))
