"""The agent loop: concurrency within a response, ordering, cuts, turns, errors, usage."""

from __future__ import annotations

from pathlib import Path

from orchestrator.run import RunStatus
from tests.support import harness, none_left, tool_results


def test_tool_calls_of_one_response_run_concurrently_in_call_order(project: Path) -> None:
    # call 1 can only finish once call 3 has run: sequential execution would time out.
    script = {
        "conversations": [
            {
                "turns": [
                    {
                        "tool_calls": [
                            {
                                "tool": "bash",
                                "id": "c1",
                                "input": {
                                    "command": "for i in $(seq 100); do [ -f flag ] && break;"
                                    " sleep 0.05; done; [ -f flag ] && echo FIRST",
                                    "timeout_s": 10,
                                },
                            },
                            {"tool": "bash", "id": "c2", "input": {"command": "echo SECOND"}},
                            {
                                "tool": "bash",
                                "id": "c3",
                                "input": {"command": "touch flag; echo THIRD"},
                            },
                        ]
                    },
                    {"text": "done"},
                ]
            }
        ]
    }
    h = harness(project, script)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    results = tool_results(h.requests_of(root.run_id)[1])
    assert [r["tool_use_id"] for r in results] == ["c1", "c2", "c3"]
    assert "FIRST" in results[0]["content"] and not results[0].get("is_error")
    assert "SECOND" in results[1]["content"] and "THIRD" in results[2]["content"]


def test_long_tool_output_is_cut_with_a_note(project: Path) -> None:
    script = {
        "conversations": [
            {
                "turns": [
                    {
                        "tool_calls": [
                            {
                                "tool": "bash",
                                "input": {"command": "head -c 60000 /dev/zero | tr '\\0' x"},
                            }
                        ]
                    },
                    {"expect_result": "output cut at 50,000 of", "text": "ok"},
                ]
            }
        ]
    }
    h = harness(project, script)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    content = tool_results(h.requests_of(root.run_id)[1])[0]["content"]
    assert content.startswith("x" * 50_000)
    assert len(content) < 50_200


def test_max_turns_ends_a_run_that_never_stops(project: Path) -> None:
    call = {"tool_calls": [{"tool": "glob", "input": {"pattern": "*"}}], "text": "still going"}
    script = {"conversations": [{"turns": [call] * 10}]}
    h = harness(project, script, max_turns=3)
    root = h.run()
    assert root.status == RunStatus.FAILED
    assert root.error == "max_turns (3) reached before a final answer"
    assert root.usage.turns == 3 and root.output == "still going"


def test_tool_error_comes_back_as_is_error_and_the_loop_goes_on(project: Path) -> None:
    script = {
        "conversations": [
            {
                "turns": [
                    {
                        "tool_calls": [
                            {"tool": "read_file", "input": {"path": "missing.txt"}},
                            {
                                "tool": "edit_file",
                                "input": {"path": "src/app.py", "old_text": "zzz", "new_text": "y"},
                            },
                            {"tool": "read_file", "input": {"path": 42}},
                            {"tool": "no_such_tool", "input": {}},
                        ]
                    },
                    {"expect_result": "no such file", "text": "recovered"},
                ]
            }
        ]
    }
    h = harness(project, script)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED
    r = tool_results(h.requests_of(root.run_id)[1])
    assert all(x["is_error"] for x in r)
    assert "no such file: missing.txt" in r[0]["content"]
    assert "occurs 0 times" in r[1]["content"]
    assert "invalid input for read_file" in r[2]["content"]
    assert r[3]["content"].startswith("unknown tool 'no_such_tool'; your tools: ")


def test_edit_requires_exactly_one_match(project: Path) -> None:
    (project / "d.txt").write_text("a a\n")
    script = {
        "conversations": [
            {
                "turns": [
                    {
                        "tool_calls": [
                            {
                                "tool": "edit_file",
                                "input": {"path": "d.txt", "old_text": "a", "new_text": "b"},
                            }
                        ]
                    },
                    {
                        "expect_result": "occurs 2 times",
                        "tool_calls": [
                            {
                                "tool": "edit_file",
                                "input": {"path": "d.txt", "old_text": "a a", "new_text": "b b"},
                            }
                        ],
                    },
                    {"text": "ok"},
                ]
            }
        ]
    }
    h = harness(project, script)
    assert h.run().status == RunStatus.SUCCEEDED
    assert (project / "d.txt").read_text() == "b b\n"


def test_usage_is_reported(project: Path) -> None:
    script = {
        "conversations": [
            {
                "turns": [
                    {
                        "tool_calls": [
                            {"tool": "glob", "input": {"pattern": "**/*.py"}},
                            {"tool": "grep", "input": {"pattern": "return 42"}},
                        ]
                    },
                    {"expect_result": "src/app.py:2", "text": "found it"},
                ]
            }
        ]
    }
    h = harness(project, script)
    root = h.run()
    assert root.usage.turns == 2 and root.usage.tool_uses == 2
    assert root.usage.input_tokens > 0 and root.usage.output_tokens > 0
    finished = [e for e in h.store.events(root.run_id) if e["kind"] == "run_finished"][0]
    assert finished["data"]["usage"]["tool_uses"] == 2


def test_bash_timeout_kills_the_process_group(project: Path) -> None:
    script = {
        "conversations": [
            {
                "turns": [
                    {
                        "tool_calls": [
                            {
                                "tool": "bash",
                                "input": {
                                    "command": "(sleep 30.101 & echo $! > bg.pid; wait)",
                                    "timeout_s": 1,
                                },
                            }
                        ]
                    },
                    {"expect_result": "killed: command still running after 1s", "text": "ok"},
                ]
            }
        ]
    }
    h = harness(project, script)
    assert h.run().status == RunStatus.SUCCEEDED
    assert none_left("sleep 30.101")


def test_bash_env_has_no_secrets(project: Path, monkeypatch: object) -> None:
    import pytest

    assert isinstance(monkeypatch, pytest.MonkeyPatch)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-should-not-leak")
    monkeypatch.setenv("DEPLOY_TOKEN", "tok-should-not-leak")
    script = {
        "conversations": [
            {
                "turns": [
                    {"tool_calls": [{"tool": "bash", "input": {"command": "env"}}]},
                    {"text": "ok"},
                ]
            }
        ]
    }
    h = harness(project, script)
    root = h.run()
    out = tool_results(h.requests_of(root.run_id)[1])[0]["content"]
    assert "PATH=" in out
    assert "should-not-leak" not in out


def test_an_answer_cut_at_max_tokens_is_continued(project: Path) -> None:
    script = {
        "conversations": [
            {
                "turns": [
                    {"text": "The first half, ", "stop_reason": "max_tokens"},
                    {
                        "expect_result": "cut off at the output token limit",
                        "text": "and the second half.",
                    },
                ]
            }
        ]
    }
    h = harness(project, script)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED
    assert root.output == "The first half, and the second half."
    assert root.usage.turns == 2


def test_a_command_leaving_a_background_process_returns_at_once(project: Path) -> None:
    script = {
        "conversations": [
            {
                "turns": [
                    {
                        "tool_calls": [
                            {
                                "tool": "bash",
                                "input": {
                                    "command": "sleep 30.102 & echo $! > bg.pid; echo started",
                                    "timeout_s": 20,
                                },
                            }
                        ]
                    },
                    {"expect_result": r"started\s+\[exit code 0\]", "text": "ok"},
                ]
            }
        ]
    }
    h = harness(project, script)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    finished = [e for e in h.store.events(root.run_id) if e["kind"] == "tool_result"][0]
    started = [e for e in h.store.events(root.run_id) if e["kind"] == "tool_call"][0]
    assert finished["at"] - started["at"] < 5  # not the 20 s timeout
    assert none_left("sleep 30.102")  # and the leftover is stopped
