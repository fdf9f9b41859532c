"""Agents in worktrees, end to end: the tools work in the worktree, results name the branch."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.run import RunStatus
from orchestrator.store import open_store
from tests.support import git, harness, init_repo, orch, task_call, tool_results


@pytest.fixture
def repo(project: Path) -> Path:
    init_repo(project)
    git(project, "checkout", "-qb", "feature")
    (project / "feature.txt").write_text("feature work\n")
    git(project, "add", ".")
    git(project, "-c", "user.name=u", "-c", "user.email=u@u", "commit", "-qm", "feature")
    return project


def test_worktree_child_works_on_its_branch_and_parent_sees_it(repo: Path) -> None:
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [task_call("add a module", isolation="worktree")]},
                    {"expect_result": r"\[branch orch/general/", "text": "ok"},
                ],
            },
            {
                "depth": 1,
                "turns": [
                    {
                        "tool_calls": [
                            {
                                "tool": "write_file",
                                "input": {"path": "src/new.py", "content": "X = 1\n"},
                            },
                            {
                                "tool": "bash",
                                "input": {
                                    "command": "pwd; git rev-parse --abbrev-ref HEAD; "
                                    "cat feature.txt"
                                },
                            },
                        ]
                    },
                    {"expect_result": "feature work", "text": "added src/new.py"},
                ],
            },
        ]
    }
    h = harness(repo, script)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    child = h.store.children(root.run_id)[0]
    (art,) = child.artifacts
    assert art["kind"] == "branch" and art["branch"].startswith("orch/general/")
    assert art["files_changed"] == 1 and art["insertions"] == 1
    assert art["base"] == git(repo, "rev-parse", "feature")  # the user's HEAD, not main
    # the user's tree is untouched; the branch holds the work
    assert git(repo, "status", "--porcelain") == ""
    assert not (repo / "src" / "new.py").exists()
    assert git(repo, "show", f"{art['branch']}:src/new.py") == "X = 1"
    bash_out = tool_results(h.requests_of(child.run_id)[1])[1]["content"]
    assert ".orch/worktrees/" in bash_out and art["branch"] in bash_out
    result = tool_results(h.requests_of(root.run_id)[-1])[0]["content"]
    assert art["commit"][:12] in result and "1 files +1 -0" in result


def test_paths_are_confined_to_the_worktree(repo: Path) -> None:
    script = {
        "conversations": [
            {
                "turns": [
                    {
                        "tool_calls": [
                            {
                                "tool": "write_file",
                                "input": {"path": "../../../escape.txt", "content": "x"},
                            },
                            {"tool": "read_file", "input": {"path": str(repo / "pyproject.toml")}},
                            {
                                "tool": "write_file",
                                "input": {"path": ".git", "content": "gitdir: /tmp/evil"},
                            },
                            {
                                "tool": "edit_file",
                                "input": {
                                    "path": "../../../pyproject.toml",
                                    "old_text": "demo",
                                    "new_text": "pwned",
                                },
                            },
                        ]
                    },
                    {"text": "tried"},
                ]
            }
        ]
    }
    h = harness(repo, script)
    root = h.run(isolation="worktree")
    results = tool_results(h.requests_of(root.run_id)[1])
    assert all(r.get("is_error") for r in results), results
    assert "outside the workspace" in results[0]["content"]
    assert "outside the workspace" in results[1]["content"]
    assert ".git" in results[2]["content"]
    assert not (repo / "escape.txt").exists()
    assert "pwned" not in (repo / "pyproject.toml").read_text()
    assert root.artifacts == []  # nothing changed: no branch left behind
    assert git(repo, "branch", "--list", "orch/*") == ""


def test_eight_parallel_worktree_children(repo: Path) -> None:
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {
                        "tool_calls": [
                            task_call(f"write file {i}", isolation="worktree") for i in range(8)
                        ]
                    },
                    {"text": "all written"},
                ],
            },
            *[
                {
                    "depth": 1,
                    "prompt": f"write file {i}$",
                    "turns": [
                        {
                            "tool_calls": [
                                {
                                    "tool": "write_file",
                                    "input": {"path": f"out/{i}.txt", "content": f"{i}\n"},
                                }
                            ]
                        },
                        {"text": f"wrote {i}"},
                    ],
                }
                for i in range(8)
            ],
        ]
    }
    h = harness(repo, script)
    root = h.run()
    kids = h.store.children(root.run_id)
    assert len(kids) == 8 and all(k.status == RunStatus.SUCCEEDED for k in kids)
    branches = {k.artifacts[0]["branch"] for k in kids}
    assert len(branches) == 8
    for k in kids:
        i = k.prompt.rsplit(" ", 1)[1]
        assert git(repo, "show", f"{k.artifacts[0]['branch']}:out/{i}.txt") == i
    assert git(repo, "status", "--porcelain") == ""
    assert git(repo, "worktree", "list").count("\n") == 0  # only the user's checkout is left


def test_cli_worktree_task_and_sigkill_keeps_the_work(repo: Path) -> None:
    data: dict[str, Any] = {
        "conversations": [
            {
                "turns": [
                    {
                        "tool_calls": [
                            {
                                "tool": "write_file",
                                "input": {"path": "wip.txt", "content": "half done\n"},
                            }
                        ]
                    },
                    {
                        "tool_calls": [
                            {"tool": "bash", "input": {"command": "touch ready; sleep 60"}}
                        ]
                    },
                    {"text": "never"},
                ]
            }
        ]
    }
    script = repo.parent / "wt.yaml"
    script.write_text(yaml.safe_dump(data))
    r = orch(
        "task",
        "write then hang",
        "--isolation",
        "worktree",
        "--background",
        "--json",
        "--model",
        f"scripted:{script}",
        cwd=repo,
    )
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    store = open_store(repo)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        rec = store.require_run(run_id)
        root = Path(rec.workspace.get("root", "/nonexistent"))
        if (root / "ready").exists():
            break
        time.sleep(0.1)
    assert rec.pid is not None
    os.kill(rec.pid, signal.SIGKILL)
    time.sleep(0.3)
    rows = json.loads(orch("ps", "--json", cwd=repo).stdout)
    assert next(x for x in rows if x["run_id"] == run_id)["status"] == "interrupted"
    rec = store.require_run(run_id)
    assert rec.error is not None and "kept work on branch" in (rec.error or "")
    branch = rec.workspace["branch"]
    assert git(repo, "show", f"{branch}:wip.txt") == "half done"
    assert git(repo, "status", "--porcelain") == ""
    listed = json.loads(orch("worktrees", "list", "--json", cwd=repo).stdout)
    assert any(w["branch"] == branch for w in listed)
