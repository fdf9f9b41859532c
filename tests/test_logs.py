"""`orch logs` as a user runs it: real CLI processes, a scripted parent that delegates to a
child, the real SQLite store, background runs on the real worker host.

The runs are unsandboxed (``sandbox.os = "off"`` in the user's own config) and call no
shell: what is tested is what `orch logs` shows, on any machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from orchestrator.cli.logview import line
from orchestrator.process.events import Feed, when
from orchestrator.run import RunRecord, RunStatus, new_run_id, now
from orchestrator.store import SqliteStore
from tests.support import orch, wait_for, write_script
from tests.test_terminal_safety import HOSTILE, UNSAFE

PLAIN = {"NO_COLOR": "1", "COLUMNS": "400", "FORCE_COLOR": "", "TTY_COMPATIBLE": ""}
LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) ( *)(r-[0-9a-f]{6})/(\S+)\s+(\w+)\s+(.*)$")
REQUEST = r"turn \d+: [\d,]+ in / [\d,]+ out · (n/a|\$0)( · [\d,]+ ms)?"  # a model_usage line
LONG = "word " * 1000  # 5,000 characters: over the 4,096 an assistant_text event keeps


@pytest.fixture
def project(project: Path) -> Path:
    config = Path(os.environ["HOME"]) / ".orch" / "config.toml"  # the user's own: no trust
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('[sandbox]\nos = "off"\n')
    return project


def delegating(project: Path, *, child_latency: float = 0.0, first_latency: float = 0.0) -> Path:
    return write_script(
        project,
        {
            "conversations": [
                {
                    "depth": 0,
                    "runs": "*",
                    "turns": [
                        {
                            "text": "PARENT-PLAN: I will ask\nan explorer.",
                            "latency_s": first_latency,
                            "tool_calls": [
                                {
                                    "tool": "task",
                                    "input": {
                                        "description": "find framework",
                                        "subagent_type": "explorer",
                                        "prompt": "Which test framework?",
                                    },
                                }
                            ],
                        },
                        {"text": "PARENT-ANSWER pytest"},
                    ],
                },
                {
                    "agent": "explorer",
                    "runs": "*",
                    "latency_s": child_latency,
                    "turns": [
                        {
                            "text": "CHILD-LOOKS " + LONG,
                            "tool_calls": [
                                {"tool": "read_file", "input": {"path": "pyproject.toml"}}
                            ],
                        },
                        {"expect_result": "pytest", "text": "CHILD-ANSWER pytest"},
                    ],
                },
            ]
        },
    )


def run_task(project: Path, *extra: str, script: Path | None = None) -> str:
    script = script or delegating(project)
    model = f"scripted:{script}"
    r = orch("task", "which framework?", "--json", "--model", model, *extra, cwd=project)
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["run_id"])


def logs(project: Path, *args: str, code: int = 0, **env: str) -> str:
    r = orch("logs", *args, cwd=project, env={**PLAIN, **env}, timeout=60)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    return r.stdout


def parsed(text: str) -> list[tuple[str, int, str, str, str, str]]:
    """(time, indent, short run id, agent, event, summary) of each line."""
    rows = []
    for raw in text.splitlines():
        m = LINE.match(raw)
        assert m, raw
        t, indent, rid, agent, kind, said = m.groups()
        rows.append((t, len(indent), rid, agent, kind, said))
    return rows


def test_lines_say_time_agent_event_and_the_models_text(project: Path) -> None:
    run_id = run_task(project)
    every = parsed(logs(project, run_id[:7]))  # a prefix is enough
    requests = [r[5] for r in every if r[4] == "model_usage"]  # one a request, its tokens
    assert all(re.fullmatch(REQUEST, said) for said in requests), requests
    rows = [r for r in every if r[4] != "model_usage"]
    assert [r[4] for r in rows] == [
        "run_started",
        "assistant_text",
        "tool_call",
        "child_spawned",
        "tool_result",
        "assistant_text",
        "run_finished",
    ]
    assert {(r[1], r[2], r[3]) for r in rows} == {(0, run_id[:8], "general")}
    said = {r[4]: r[5] for r in rows}
    assert said["run_started"].startswith("general · scripted · depth 0/")
    assert "PARENT-PLAN: I will ask an explorer." in [r[5] for r in rows]  # one line
    assert rows[-2][5] == "PARENT-ANSWER pytest"
    assert said["tool_call"] == "task → explorer: find framework"
    child = json.loads(orch("tree", run_id, "--json", cwd=project).stdout)[1]["run_id"]
    assert said["child_spawned"] == f"{child[:8]}/explorer (shared): find framework"
    ended = f"task ok: {child[:8]} (find framework) succeeded · agent explorer · turns 2"
    assert said["tool_result"].startswith(ended)  # a child's end: what it was, how it went
    usage = r"succeeded · turns 2 · tools 1 · tokens [\d,]+ in / [\d,]+ out · n/a"
    assert re.fullmatch(usage, said["run_finished"])  # a scripted model has no price
    assert "CHILD" not in "\n".join(r[5] for r in rows)  # without --tree: its own events only

    events = json.loads(logs(project, run_id, "--json"))  # the times are the events' own
    assert [r[0] for r in every] == [
        datetime.fromtimestamp(e["at"]).strftime("%H:%M:%S.%f")[:-3] for e in events
    ]


def test_tree_merges_the_childs_events_in_time_order(project: Path) -> None:
    run_id = run_task(project)
    rows = [r for r in parsed(logs(project, run_id, "--tree")) if r[4] != "model_usage"]
    kinds = [(r[3], r[4]) for r in rows]
    spawned = kinds.index(("general", "child_spawned"))
    returned = kinds.index(("general", "tool_result"))
    child = [k for k in kinds[spawned + 1 : returned]]
    assert child == [
        ("explorer", "run_started"),
        ("explorer", "assistant_text"),
        ("explorer", "tool_call"),
        ("explorer", "tool_result"),
        ("explorer", "assistant_text"),
        ("explorer", "run_finished"),
    ]
    assert {r[1] for r in rows if r[3] == "explorer"} == {2}  # indented by its depth
    text = {(r[3], r[4], r[5]) for r in rows}
    assert ("explorer", "tool_call", "read_file: pyproject.toml") in text
    assert ("explorer", "assistant_text", "CHILD-ANSWER pytest") in text
    assert any(r[5].startswith("read_file ok (") for r in rows if r[4] == "tool_result")
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)

    # A child's own log with --tree is its subtree: itself only, at no indent.
    child_id = rows[spawned + 1][2]
    own = [r for r in parsed(logs(project, child_id, "--tree")) if r[4] != "model_usage"]
    assert {(r[1], r[3]) for r in own} == {(0, "explorer")} and len(own) == 6


def test_json_is_the_raw_events_whole(project: Path) -> None:
    run_id = run_task(project)
    store = SqliteStore.for_project(project)
    child = store.descendants(run_id)[0].run_id
    own = json.loads(logs(project, run_id, "--json"))
    assert own == json.loads(json.dumps(store.events(run_id)))
    both = json.loads(logs(project, run_id, "--json", "--tree"))
    assert sorted(e["id"] for e in both) == sorted(
        e["id"] for e in [*store.events(run_id), *store.events(child)]
    )
    [looks] = [e for e in both if e["kind"] == "assistant_text" and e["run_id"] == child][:1]
    text = "CHILD-LOOKS " + LONG.strip()
    assert looks["data"] == {"turn": 1, "text": text[:4096], "chars": len(text), "cut": True}
    [plan] = [e for e in own if e["kind"] == "assistant_text"][:1]
    assert plan["data"]["text"] == "PARENT-PLAN: I will ask\nan explorer."
    store.close()

    # The readable line notes the cut; without a width it is kept to 1,000 characters.
    long_line = next(
        ln for ln in logs(project, child, COLUMNS="").splitlines() if "CHILD-LOOKS" in ln
    )
    assert long_line.endswith("…") and 1000 < len(long_line) < 1100
    wide = next(
        ln for ln in logs(project, child, COLUMNS="5000").splitlines() if "CHILD-LOOKS" in ln
    )
    assert wide.endswith(f"[stored cut at 4,096 of {len(text):,} chars]")


def test_lines_are_cut_to_the_width_never_wrapped(project: Path) -> None:
    run_id = run_task(project)
    lines = logs(project, run_id, "--tree", COLUMNS="60").splitlines()
    assert len([ln for ln in lines if " model_usage " not in ln]) == 13
    assert all(len(ln) <= 60 for ln in lines)
    assert any(ln.endswith("…") for ln in lines)
    assert all(LINE.match(ln) for ln in lines)


class Reader:
    """Lines of a process's stdout as they come, each wait with a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        assert proc.stdout is not None
        self.thread = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        self.thread.start()

    def _pump(self, stream: Any) -> None:
        for raw in stream:
            self.lines.put(raw.rstrip("\n"))
        self.lines.put(None)

    def next(self, timeout: float = 30) -> str | None:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no line within {timeout} s") from None


@contextlib.contextmanager
def following(project: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], Reader]]:
    """``orch logs ARGS --follow`` running; killed (if still running) and reaped after."""
    with subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "logs", *args, "--follow"],
        cwd=project,
        env={**os.environ, **PLAIN},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        reader = Reader(proc)
        try:
            yield proc, reader
        finally:
            proc.kill()
            proc.wait(timeout=10)
            reader.thread.join(timeout=10)


def background(project: Path, script: Path, *extra: str) -> str:
    model = f"scripted:{script}"
    r = orch("task", "x", "--background", "--json", "--model", model, *extra, cwd=project)
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["run_id"])


def test_follow_tree_streams_a_background_run_and_ends_with_it(project: Path) -> None:
    script = delegating(project, first_latency=2.0, child_latency=0.3)
    run_id = background(project, script)
    store = SqliteStore.for_project(project)
    with following(project, run_id, "--tree") as (proc, reader):
        first = reader.next()
        assert first is not None and "run_started" in first
        # streamed: the first line came while the run was still going
        assert not store.require_run(run_id).status.ended
        assert not store.descendants(run_id)  # the child starts after the follow did
        got = [first]
        while (ln := reader.next()) is not None:
            got.append(ln)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr is not None and proc.stderr.read() == ""
    store.close()
    rows = parsed("\n".join(got))
    assert ("explorer", "run_started") in [(r[3], r[4]) for r in rows]
    assert ("explorer", "assistant_text", "CHILD-ANSWER pytest") in [
        (r[3], r[4], r[5]) for r in rows
    ]
    assert rows[-1][3:5] == ("general", "run_finished")


def test_follow_exits_with_the_runs_exit_code(project: Path) -> None:
    script = write_script(
        project,
        {
            "conversations": [
                {
                    "turns": [
                        {
                            "text": "looking",
                            "latency_s": 0.5,
                            "tool_calls": [{"tool": "glob", "input": {"pattern": "*"}}],
                        }
                    ]
                }
            ]
        },
        "fails.yaml",
    )
    run_id = background(project, script, "--max-turns", "1")
    out = orch("logs", run_id, "--follow", cwd=project, env=PLAIN, timeout=60)
    assert out.returncode == 1, out.stderr  # failed: max_turns
    assert "max_turns (1) reached" in out.stdout.splitlines()[-1]
    assert logs(project, run_id)  # without --follow: printing it is a success


def test_ctrl_c_ends_follow_quietly_with_130(project: Path) -> None:
    script = write_script(
        project, {"conversations": [{"turns": [{"text": "slow", "latency_s": 60}]}]}, "slow.yaml"
    )
    run_id = background(project, script)
    try:
        with following(project, run_id) as (proc, reader):
            line1 = reader.next()
            assert line1 is not None and "run_started" in line1
            time.sleep(0.3)  # in its polling loop
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=20) == 130
            assert proc.stderr is not None and proc.stderr.read() == ""
    finally:
        assert orch("cancel", run_id, cwd=project).returncode == 0
    store = SqliteStore.for_project(project)
    wait_for(lambda: store.require_run(run_id).status.ended, 30, "the cancelled run to end")
    store.close()


# -- the formatting ------------------------------------------------------------------------
def test_time_is_local_with_the_date_when_not_today() -> None:
    t = datetime(2024, 2, 29, 13, 5, 7, 89_000).timestamp()
    assert when(t, today="2024-02-29") == "13:05:07.089"
    assert when(t, today="2024-03-01") == "2024-02-29 13:05:07.089"
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3}", when(time.time()))


def _event(kind: str, data: Any, run_id: str = "r-0123456789ab") -> dict[str, Any]:
    return {"id": 1, "run_id": run_id, "at": time.time(), "kind": kind, "data": data}


BASH_FAILED = {"tool": "bash", "is_error": True, "chars": 30, "preview": "\nboom\nx\n[exit code 2]"}
BASH_SILENT = {"tool": "bash", "is_error": False, "chars": 13, "preview": "[exit code 0]"}
SUMMARIES = [
    ("tool_call", {"tool": "bash", "input": {"command": "ls\nrm x"}}, "bash: ls\\nrm x"),
    ("tool_call", {"tool": "read_file", "input": {"path": "src/a.py"}}, "read_file: src/a.py"),
    ("tool_call", {"tool": "grep", "input": {"pattern": "x", "path": "s"}}, "grep: x in s"),
    ("tool_call", {"tool": "odd", "input": [1]}, "odd: [1]"),
    ("tool_result", BASH_FAILED, "bash exit 2 (30 chars): boom"),
    ("tool_result", BASH_SILENT, "bash exit 0 (13 chars)"),
    ("tool_result", {"tool": "glob", "chars": 4, "preview": "a.py"}, "glob ok: a.py"),
    ("tool_refused", {"tool": "bash", "reason": "no\nway"}, "bash refused: no way"),
    ("run_finished", {"status": "cancelled"}, "cancelled"),
    (
        "run_finished",
        {
            "status": "succeeded",
            "usage": {
                "turns": 2,
                "tool_uses": 1,
                "input_tokens": 1200,
                "output_tokens": 80,
                "cache_read_input_tokens": 9000,
                "cost_usd": 0.0123,
            },
        },
        "succeeded · turns 2 · tools 1 · tokens 1,200 in / 80 out"
        " · cache 9,000 read / 0 written (88% of input read) · $0.0123",
    ),  # fmt: skip
    (
        "model_usage",
        {"turn": 3, "input_tokens": 5, "output_tokens": 7, "cost_usd": 0, "ms": 812.4},
        "turn 3: 5 in / 7 out · n/a · 812 ms",
    ),
    (
        "context_compacted",
        {
            "turn": 12,
            "how": "cleared",
            "reason": "threshold",
            "before_tokens": 162_000,
            "after_tokens": 21_000,
            "cleared_results": 9,
            "window": 200_000,
        },
        "context cleared (threshold) at turn 12: 162,000 → 21,000 tokens of 200,000,"
        " 9 tool results cleared",
    ),  # fmt: skip
    (
        "context_compacted",
        {
            "how": "compacted",
            "reason": "refused",
            "before_tokens": 210_000,
            "after_tokens": "x",
            "cleared_results": 0,
            "window": None,
        },
        "context compacted (refused): 210,000 → ? tokens",
    ),  # fmt: skip
    (
        "team_verdict",
        {"round": 2, "reviewer": "sec", "verdict": "approve", "summary": "ok"},
        "round 2: [sec] approve: ok",
    ),
    (
        "team_gate",
        {"round": 1, "candidate": 2, "passed": False, "exit_code": 3, "command": "t"},
        "round 1 candidate 2: gate failed (exit 3): t",
    ),
    (
        "team_decision",
        {"round": 1, "chosen": 2, "approvals": 1, "approved": False},
        "round 1: not approved, candidate 2, 1 approval(s)",
    ),
    ("team_other", {"round": 1}, '{"round": 1}'),
    ("assistant_text", "not a dict", '"not a dict"'),
]


@pytest.mark.parametrize(("kind", "data", "said"), SUMMARIES)
def test_summaries(kind: str, data: Any, said: str) -> None:
    text = line(_event(kind, data), "general", width=None).plain
    m = LINE.match(text)
    assert m and m.group(5) == kind and m.group(6) == said, text


def test_feed_of_an_ended_run_without_run_finished_is_done(project: Path) -> None:
    store = SqliteStore.for_project(project)
    t = now() - 60
    rid = new_run_id()
    store.create_run(
        RunRecord(
            run_id=rid,
            chain_id="c-" + rid[2:],
            agent="general",
            status=RunStatus.INTERRUPTED,
            created_at=t,
            started_at=t,
            updated_at=t,
            ended_at=t,
        )
    )
    store.add_event(rid, "run_started", {"agent": "general"})
    feed = Feed(store, store.require_run(rid), tree=True)
    assert [e["kind"] for e in feed.poll()] == ["run_started"]
    assert feed.done and feed.exit_code() == 1
    store.close()


def test_what_the_model_wrote_is_shown_never_obeyed(project: Path) -> None:
    hostile = " ".join(raw for raw, _ in HOSTILE.values())
    script = write_script(
        project,
        {
            "conversations": [
                {
                    "depth": 0,
                    "turns": [
                        {
                            "text": "plan\n" + hostile,
                            "tool_calls": [
                                {"tool": "task", "input": {"description": hostile, "prompt": "go"}}
                            ],
                        },
                        {"text": "done\r\n" + hostile},
                    ],
                },
                {
                    "depth": 1,
                    "turns": [
                        {"tool_calls": [{"tool": "read_file", "input": {"path": hostile}}]},
                        {"text": "child says " + hostile},
                    ],
                },
            ]
        },
        "hostile.yaml",
    )
    run_id = run_task(project, script=script)
    r = orch("logs", run_id, "--tree", cwd=project, env={**PLAIN, "COLUMNS": "2000"})
    assert r.returncode == 0 and "Traceback" not in r.stderr and "MarkupError" not in r.stderr
    bad = UNSAFE.search(r.stdout + r.stderr)
    assert bad is None, repr(r.stdout[max(0, bad.start() - 80) : bad.end() + 80])
    said = [ln.split(maxsplit=2)[2] for ln in r.stdout.splitlines()]
    every = " ".join(shown for _, shown in HOSTILE.values())
    assert f"assistant_text plan {every}" in said  # the text, its newline a space
    assert f"assistant_text done {every}" in said  # \r\n too: no line is overwritten
    assert f"assistant_text child says {every}" in said
    assert f"tool_call      read_file: {every}" in said
    assert any(s.startswith("child_spawned") and s.endswith(f"(shared): {every}") for s in said)
    events = json.loads(logs(project, run_id, "--tree", "--json"))
    texts = [e["data"]["text"] for e in events if e["kind"] == "assistant_text"]
    assert texts == ["plan\n" + hostile, "child says " + hostile, "done\r\n" + hostile]
