"""The CLI contract, run as a user would: real processes, real git repos, real SQLite."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import init_repo, none_left, orch, write_script

RESULT_KEYS = {
    "run_id",
    "chain_id",
    "parent_run_id",
    "depth",
    "agent",
    "isolation",
    "resumed_from",
    "node",  # where the run executed (docs/SCALING.md)
    "status",
    "summary",
    "error",
    "evidence",
    "artifacts",
    "usage",
    "workspace",
    "started_at",
    "ended_at",
    "egress",  # what it reached through the egress proxy (None: it asked nothing)
    "total_cost_usd",  # with the runs under it (Claude Code's name)
    "totals",  # what it used with the runs under it: tokens of each kind, cost
}


@pytest.fixture
def repo(project: Path) -> Path:
    return init_repo(project)


def test_missing_key_is_one_line_and_exit_2(repo: Path) -> None:
    r = orch("task", "Find which test framework this repo uses", "--json", cwd=repo)
    assert r.returncode == 2
    assert "ANTHROPIC_API_KEY" in r.stderr and "--model scripted:FILE" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_scripted_task_json_contract_and_clean_git(repo: Path) -> None:
    script = write_script(
        repo,
        {
            "conversations": [
                {
                    "depth": 0,
                    "turns": [
                        {
                            "tool_calls": [
                                {
                                    "tool": "task",
                                    "input": {
                                        "description": "find framework",
                                        "subagent_type": "explorer",
                                        "prompt": "Which test framework does pyproject.toml use?",
                                    },
                                }
                            ]
                        },
                        {"text": "pytest"},
                    ],
                },
                {
                    "agent": "explorer",
                    "turns": [
                        {
                            "tool_calls": [
                                {"tool": "read_file", "input": {"path": "pyproject.toml"}}
                            ]
                        },
                        {"text": "pytest, per [tool.pytest.ini_options]"},
                    ],
                },
            ]
        },
    )
    r = orch(
        "task",
        "Find which test framework this repo uses",
        "--json",
        "--model",
        f"scripted:{script}",
        cwd=repo,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) == RESULT_KEYS
    assert data["status"] == "succeeded" and data["summary"] == "pytest"
    assert data["depth"] == 0 and data["parent_run_id"] is None
    assert set(data["usage"]) == {
        "turns",
        "tool_uses",
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "cost_usd",
        "context_tokens",
        "compactions",
    }
    assert data["totals"]["runs"] == 2  # the root and its explorer
    assert data["totals"]["tokens"] >= data["usage"]["input_tokens"] > 0
    assert data["evidence"]["children"]
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout
    assert status == ""

    run_id = data["run_id"]
    tree = json.loads(orch("tree", run_id, "--json", cwd=repo).stdout)
    assert [(t["depth"], t["agent"]) for t in tree] == [(0, "general"), (1, "explorer")]
    assert tree[1]["parent_run_id"] == run_id and tree[1]["chain_id"] == data["chain_id"]
    chain_tree = json.loads(orch("tree", data["chain_id"], "--json", cwd=repo).stdout)
    assert len(chain_tree) == 2
    kinds = [e["kind"] for e in json.loads(orch("logs", run_id, "--json", cwd=repo).stdout)]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished"
    assert "child_spawned" in kinds and "tool_call" in kinds
    res = orch("result", run_id[:8], "--json", cwd=repo)
    assert res.returncode == 0 and json.loads(res.stdout)["run_id"] == run_id
    human = orch("tree", run_id, cwd=repo)
    assert "explorer" in human.stdout and "succeeded" in human.stdout


def test_exit_codes_follow_status(repo: Path) -> None:
    loop = write_script(
        repo,
        {
            "conversations": [
                {
                    "runs": "*",
                    "turns": [{"tool_calls": [{"tool": "glob", "input": {"pattern": "*"}}]}] * 5,
                }
            ]
        },
    )
    r = orch("task", "x", "--max-turns", "2", "--model", f"scripted:{loop}", cwd=repo)
    assert r.returncode == 1 and "max_turns (2)" in r.stderr
    slow = write_script(repo, {"conversations": [{"latency_s": 5, "turns": [{"text": "late"}]}]})
    r = orch("task", "x", "--timeout", "0.5", "--model", f"scripted:{slow}", "--json", cwd=repo)
    assert r.returncode == 124 and json.loads(r.stdout)["status"] == "timed_out"


def test_bad_input_is_one_line_exit_2(repo: Path) -> None:
    cases = [
        ("task", "x", "--isolation", "vm", "--model", "scripted:nope.yaml"),
        ("task", "x", "--model", "scripted:/no/such/script.yaml"),
        ("task", "   ", "--model", "scripted:x.yaml"),
        ("result", "r-doesnotexist"),
        ("task", "x", "--agent", "nobody", "--model", "scripted:SCRIPT"),
    ]
    good = write_script(repo, {"conversations": [{"turns": [{"text": "x"}]}]})
    for case in cases:
        args = [a.replace("SCRIPT", str(good)) for a in case]
        r = orch(*args, cwd=repo)
        assert r.returncode == 2, (case, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, case
    bad_yaml = repo.parent / "bad.yaml"
    bad_yaml.write_text("conversations:\n  - turns: [{txt: 1}]\n")
    r = orch("task", "x", "--model", f"scripted:{bad_yaml}", cwd=repo)
    assert r.returncode == 2 and "conversations.0.turns.0.txt" in r.stderr


def test_unused_script_turns_fail_the_command(repo: Path) -> None:
    script = write_script(
        repo,
        {
            "conversations": [
                {"turns": [{"text": "done early"}]},
                {"agent": "explorer", "turns": [{"text": "never asked"}]},
            ]
        },
    )
    r = orch("task", "x", "--model", f"scripted:{script}", cwd=repo)
    assert r.returncode == 1 and "script not fully used" in r.stderr


def test_ctrl_c_cancels_the_whole_tree(repo: Path) -> None:
    script = write_script(
        repo,
        {
            "conversations": [
                {
                    "depth": 0,
                    "turns": [
                        {
                            "tool_calls": [
                                {
                                    "tool": "task",
                                    "input": {"description": "sleeper", "prompt": "sleep"},
                                }
                            ]
                        },
                        {"text": "never"},
                    ],
                },
                {
                    "depth": 1,
                    "turns": [
                        {
                            "tool_calls": [
                                {
                                    "tool": "bash",
                                    "input": {"command": "echo $$ > sleeper.pid; sleep 60.301"},
                                }
                            ]
                        },
                        {"text": "never"},
                    ],
                },
            ]
        },
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "task",
            "go",
            "--json",
            "--model",
            f"scripted:{script}",
        ],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pidfile = repo / "sleeper.pid"
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert none_left("sleep 60.301")
    from orchestrator.store import open_store

    statuses = {r.status.value for r in open_store(repo).list_runs()}
    assert statuses == {"cancelled"}


def test_demo_runs_offline(tmp_path: Path) -> None:
    r = orch("demo", "--workdir", str(tmp_path / "d"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "explorer" in r.stdout and "Test framework: pytest" in r.stdout
    j = orch("demo", "--workdir", str(tmp_path / "e"), "--json", cwd=tmp_path)
    data = json.loads(j.stdout)
    assert sorted(r["depth"] for r in data["chain"]) == [0, 1, 1, 2]
    assert {r["status"] for r in data["chain"]} == {"succeeded"}
