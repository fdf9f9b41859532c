"""Hooks end to end: shell commands from the project config, event JSON on stdin, exit 2 blocks.

Each test runs a scripted parent that delegates to a child, so every check is made for both.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

from orchestrator.config import load_settings, load_settings_with_trust
from orchestrator.run import RunStatus
from orchestrator.trust import record
from tests.support import Harness, harness, host_pids, none_left, task_call, tool_results

HOOK = textwrap.dedent(
    """
    import json, sys
    mode, log, message = sys.argv[1], sys.argv[2], sys.argv[3]
    data = sys.stdin.read()
    json.loads(data)  # the event must be one JSON document
    with open(log, "a") as f:
        f.write(data.replace("\\n", " ") + "\\n")
    with open(log) as f:
        calls = len(f.readlines())
    if mode == "block" or (mode.startswith("block-first-") and calls <= int(mode[12:])):
        print(message, file=sys.stderr)
        sys.exit(2)
    sys.exit(0)
    """
)


def hook_command(tmp_path: Path, mode: str, log: str, message: str = "") -> str:
    """A hook that logs its stdin to ``tmp_path/log`` and blocks as ``mode`` says."""
    script = tmp_path / "hook.py"
    script.write_text(HOOK)
    args = [sys.executable, str(script), mode, str(tmp_path / log), message]
    return " ".join(shlex.quote(a) for a in args)


def events(tmp_path: Path, log: str) -> list[dict[str, Any]]:
    path = tmp_path / log
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def with_config(project: Path, toml: str, script: dict[str, Any]) -> Harness:
    """A harness whose hooks come from ``orch.toml`` in the project, as a user writes them
    (and trusts them: ``orch trust``, see test_trust.py)."""
    (project / "orch.toml").write_text(toml)
    record(load_settings_with_trust(project)[1])
    return harness(project, script, hooks=load_settings(project).hooks)


def bash(command: str) -> dict[str, Any]:
    return {"tool": "bash", "input": {"command": command}}


def test_pre_tool_use_exit_2_refuses_bash_for_parent_and_child(
    project: Path, tmp_path: Path
) -> None:
    command = hook_command(tmp_path, "block", "pre.log", "no shell here")
    toml = f'[[hooks.PreToolUse]]\nmatcher = "^bash$"\ncommand = {json.dumps(command)}\n'
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {
                        "tool_calls": [
                            bash("touch parent_made.txt"),
                            {"tool": "read_file", "input": {"path": "pyproject.toml"}},
                        ]
                    },
                    {
                        "expect_result": "blocked by PreToolUse hook: no shell here",
                        "tool_calls": [task_call("make a file")],
                    },
                    {"expect_result": "child says: refused", "text": "done"},
                ],
            },
            {
                "depth": 1,
                "turns": [
                    {"tool_calls": [bash("touch child_made.txt")]},
                    {
                        "expect_result": "blocked by PreToolUse hook: no shell here",
                        "text": "child says: refused",
                    },
                ],
            },
        ]
    }
    h = with_config(project, toml, script)
    root = h.run()
    h.model.verify()
    assert root.status == RunStatus.SUCCEEDED, root.error
    [child] = h.store.children(root.run_id)
    assert not (project / "parent_made.txt").exists()
    assert not (project / "child_made.txt").exists()

    for run_id in (root.run_id, child.run_id):
        first_results = tool_results(h.requests_of(run_id)[1])
        blocked = first_results[0]
        assert blocked["is_error"] is True
        assert blocked["content"] == "blocked by PreToolUse hook: no shell here"
        refused = [e["data"] for e in h.store.events(run_id) if e["kind"] == "tool_refused"]
        assert refused == [{"tool": "bash", "reason": "no shell here"}]
    read = tool_results(h.requests_of(root.run_id)[1])[1]
    assert "is_error" not in read and "[project]" in read["content"]  # the matcher spares it

    seen = events(tmp_path, "pre.log")
    assert [(e["run_id"], e["depth"]) for e in seen] == [(root.run_id, 0), (child.run_id, 1)]
    for e, cmd in zip(seen, ["touch parent_made.txt", "touch child_made.txt"], strict=True):
        assert e["hook_event_name"] == "PreToolUse" and e["tool_name"] == "bash"
        assert e["tool_input"] == {"command": cmd}
        assert e["chain_id"] == root.chain_id and e["cwd"] == str(project.resolve())


def test_post_tool_use_sees_the_response_and_exit_2_flags_it(project: Path, tmp_path: Path) -> None:
    log = hook_command(tmp_path, "log", "post.log")
    veto = hook_command(tmp_path, "block", "veto.log", "post says no")
    toml = (
        f"[[hooks.PostToolUse]]\ncommand = {json.dumps(log)}\n"
        f'[[hooks.PostToolUse]]\nmatcher = "^read_file$"\ncommand = {json.dumps(veto)}\n'
    )
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [bash("echo post-marker-parent")]},
                    {"tool_calls": [task_call("echo something")]},
                    {"expect_result": "child done", "text": "done"},
                ],
            },
            {
                "depth": 1,
                "turns": [
                    {
                        "tool_calls": [
                            bash("echo post-marker-child"),
                            {"tool": "read_file", "input": {"path": "pyproject.toml"}},
                        ]
                    },
                    {"expect_result": r"\[PostToolUse hook: post says no\]", "text": "child done"},
                ],
            },
        ]
    }
    h = with_config(project, toml, script)
    root = h.run()
    h.model.verify()
    assert root.status == RunStatus.SUCCEEDED, root.error
    [child] = h.store.children(root.run_id)

    seen = events(tmp_path, "post.log")
    assert all(e["hook_event_name"] == "PostToolUse" for e in seen)
    by_tool = {(e["run_id"], e["tool_name"]): e for e in seen}
    parent_bash, child_bash = by_tool[(root.run_id, "bash")], by_tool[(child.run_id, "bash")]
    assert "post-marker-parent" in parent_bash["tool_response"] and parent_bash["depth"] == 0
    assert parent_bash["tool_input"] == {"command": "echo post-marker-parent"}
    assert "post-marker-child" in child_bash["tool_response"] and child_bash["depth"] == 1
    assert "[project]" in by_tool[(child.run_id, "read_file")]["tool_response"]
    assert "child done" in by_tool[(root.run_id, "task")]["tool_response"]

    # the vetoing hook ran after the tool (the file was read) and marked the result an error
    [vetoed] = events(tmp_path, "veto.log")
    assert vetoed["run_id"] == child.run_id and vetoed["tool_name"] == "read_file"
    flagged = tool_results(h.requests_of(child.run_id)[1])[1]
    assert flagged["is_error"] is True
    assert "[project]" in flagged["content"]
    assert flagged["content"].endswith("[PostToolUse hook: post says no]")
    assert "is_error" not in tool_results(h.requests_of(child.run_id)[1])[0]


def test_subagent_start_exit_2_fails_the_child(project: Path, tmp_path: Path) -> None:
    log = hook_command(tmp_path, "log", "start.log")
    block = hook_command(tmp_path, "block", "block.log", "no explorers today")
    toml = (
        f"[[hooks.SubagentStart]]\ncommand = {json.dumps(log)}\n"
        f'[[hooks.SubagentStart]]\nmatcher = "^explorer$"\ncommand = {json.dumps(block)}\n'
    )
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {
                        "tool_calls": [
                            task_call("look around", subagent_type="explorer"),
                            task_call("do work", subagent_type="general"),
                        ]
                    },
                    {"expect_result": "SubagentStart hook: no explorers today", "text": "done"},
                ],
            },
            {"agent": "general", "depth": 1, "turns": [{"text": "general worked"}]},
        ]
    }
    h = with_config(project, toml, script)
    root = h.run()
    h.model.verify()
    assert root.status == RunStatus.SUCCEEDED, root.error
    kids = {k.agent: k for k in h.store.children(root.run_id)}
    explorer, general = kids["explorer"], kids["general"]
    assert explorer.status == RunStatus.FAILED
    assert explorer.error == "SubagentStart hook: no explorers today"
    assert h.requests_of(explorer.run_id) == []  # the model was never called for it
    assert general.status == RunStatus.SUCCEEDED and general.output == "general worked"
    results = tool_results(h.requests_of(root.run_id)[1])
    assert results[0]["is_error"] is True and "no explorers today" in results[0]["content"]
    assert "is_error" not in results[1]

    seen = {e["agent"]: e for e in events(tmp_path, "start.log")}
    assert set(seen) == {"explorer", "general"}  # never for the root
    assert seen["explorer"] == {
        "hook_event_name": "SubagentStart",
        "run_id": explorer.run_id,
        "agent": "explorer",
        "prompt": "look around",
    }
    assert [e["run_id"] for e in events(tmp_path, "block.log")] == [explorer.run_id]


def test_subagent_stop_exit_2_sends_the_child_back_to_work(project: Path, tmp_path: Path) -> None:
    command = hook_command(tmp_path, "block-first-1", "stop.log", "run the tests first")
    toml = f"[[hooks.SubagentStop]]\ncommand = {json.dumps(command)}\n"
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [task_call("implement it")]},
                    {"expect_result": "done, tests pass", "text": "all done"},
                ],
            },
            {
                "depth": 1,
                "turns": [
                    {"text": "done"},
                    {"expect_result": "SubagentStop hook: run the tests first",
                     "text": "done, tests pass"},
                ],
            },
        ]
    }  # fmt: skip
    h = with_config(project, toml, script)
    root = h.run()
    h.model.verify()
    assert root.status == RunStatus.SUCCEEDED and root.output == "all done"
    [child] = h.store.children(root.run_id)
    assert child.status == RunStatus.SUCCEEDED and child.output == "done, tests pass"
    second = h.requests_of(child.run_id)[1].messages[-1]
    assert second == {
        "role": "user",
        "content": [{"type": "text", "text": "SubagentStop hook: run the tests first"}],
    }
    blocks = [e for e in h.store.events(child.run_id) if e["kind"] == "subagent_stop_block"]
    assert [b["data"]["message"] for b in blocks] == ["run the tests first"]
    seen = events(tmp_path, "stop.log")
    assert seen == [{"hook_event_name": "SubagentStop", "run_id": child.run_id,
                     "agent": "general"}] * 2  # fmt: skip


def test_subagent_stop_is_capped_at_three_returns(project: Path, tmp_path: Path) -> None:
    command = hook_command(tmp_path, "block", "stop.log", "keep going")
    toml = f"[[hooks.SubagentStop]]\ncommand = {json.dumps(command)}\n"
    again = [{"expect_result": "SubagentStop hook: keep going", "text": f"v{n}"} for n in (2, 3, 4)]
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [task_call("implement it")]},
                    {"expect_result": "v4", "text": "all done"},
                ],
            },
            {"depth": 1, "turns": [{"text": "v1"}, *again]},
        ]
    }
    h = with_config(project, toml, script)
    root = h.run()
    h.model.verify()
    assert root.status == RunStatus.SUCCEEDED, root.error
    [child] = h.store.children(root.run_id)
    assert child.status == RunStatus.SUCCEEDED and child.output == "v4"
    assert child.usage.turns == 4
    blocks = [e for e in h.store.events(child.run_id) if e["kind"] == "subagent_stop_block"]
    assert len(blocks) == 3
    assert [e["run_id"] for e in events(tmp_path, "stop.log")] == [child.run_id] * 3


def test_a_hook_past_its_time_ends_with_all_it_started(project: Path, tmp_path: Path) -> None:
    """Past ``timeout_s`` the hook is killed with what it started, a process that left its
    group (``setsid``) included: nothing of it outlives the call."""
    token = f"{random.randrange(100, 999)}.{random.randrange(10**8)}"
    command = f"setsid sleep {token} & sleep {token}"
    toml = f"[[hooks.PreToolUse]]\ncommand = {json.dumps(command)}\ntimeout_s = 1\n"
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [bash("echo never")]},
                    {"expect_result": "PreToolUse hook timed out after 1s", "text": "done"},
                ],
            }
        ]
    }
    try:
        root = with_config(project, toml, script).run()
        assert root.status == RunStatus.SUCCEEDED, root.error
        assert none_left(f"sleep {token}")
    finally:
        for pid in host_pids(f"sleep {token}"):
            os.kill(pid, signal.SIGKILL)
