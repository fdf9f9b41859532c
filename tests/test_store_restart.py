"""Issue 45's trial as a test: a real Postgres store restarted (``pg_ctl stop -m fast``,
two seconds down, ``start``) under four background worktree runs and under a foreground
run with two children, all through the real CLI: every run ends ``succeeded`` with its
result recorded, its events hold the outage once, its files are on its branch."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.run import RunRecord, RunStatus
from orchestrator.store import open_url
from tests.pgserver import PgServer
from tests.support import init_repo, none_left, orch, task_call, wait_for, write_script
from tests.test_store_outage import DOWN_S, _ensure_up, pg_down, pg_up

WORK_S = 6  # each run's command: the restart falls in it


def _worker(name: str) -> list[dict[str, Any]]:
    """Write a file, run a WORK_S command, answer."""
    write = {"tool": "write_file", "input": {"path": f"{name}.txt", "content": name.upper()}}
    bash = {"tool": "bash", "input": {"command": f"sleep {WORK_S}; echo slept"}}
    return [
        {"tool_calls": [write]},
        {"tool_calls": [bash]},
        {"expect_result": "slept", "text": f"{name.upper()}-DONE"},
    ]


def _restart(server: PgServer) -> tuple[float, float]:
    """Postgres stopped, DOWN_S down, started: when it went away and when it was back."""
    t0 = time.time()
    try:
        pg_down(server)
        time.sleep(DOWN_S)
    finally:
        pg_up(server)
    return t0, time.time()


def _records(url: str, ids: list[str]) -> list[RunRecord]:
    store = open_url(url)
    try:
        return [store.require_run(r) for r in ids]
    finally:
        store.close()


def _commands(url: str, ids: list[str]) -> list[float]:
    """When each run called its bash command (its file written before); [] until all have."""
    store = open_url(url)
    try:
        at = [
            [
                e["at"]
                for e in store.events(r)
                if e["kind"] == "tool_call" and e["data"].get("tool") == "bash"
            ]
            for r in ids
        ]
    finally:
        store.close()
    return [a[0] for a in at] if all(at) else []


def _restart_as_they_end(server: PgServer, url: str, ids: list[str]) -> tuple[float, float]:
    """The restart begins just before the first command ends: the first endings meet it."""
    started = wait_for(lambda: _commands(url, ids), timeout=60, what="every run in its command")
    time.sleep(max(0.0, min(started) + WORK_S - 0.5 - time.time()))
    try:
        return _restart(server)
    finally:
        _ensure_up(server)


def _check_ended(
    url: str,
    repo: Path,
    records: list[RunRecord],
    files: dict[str, str],
    outage: tuple[float, float],
) -> int:
    """Every run succeeded with its output and one run_finished; the outage at most once in
    each run's events (a pair), once in those that ended while the store was away; each
    file on its run's branch. How many runs ended while it was away."""
    store = open_url(url)
    met = 0
    try:
        for rec in records:
            stored = store.require_run(rec.run_id)
            assert stored.status == RunStatus.SUCCEEDED, (rec.run_id, stored.error)
            assert (store.output(rec.run_id) or "").endswith("-DONE"), store.output(rec.run_id)
            kinds = [e["kind"] for e in store.events(rec.run_id)]
            assert kinds.count("run_finished") == 1, kinds
            away, back = kinds.count("store_unreachable"), kinds.count("store_back")
            assert away == back and away <= 1, kinds
            if outage[0] <= (stored.ended_at or 0) <= outage[1]:
                assert away == 1, (rec.run_id, kinds)
                met += 1
            if rec.run_id in files:
                branch = next(a["branch"] for a in stored.artifacts if a.get("branch"))
                shown = subprocess.run(
                    ["git", "show", f"{branch}:{files[rec.run_id]}.txt"],
                    cwd=repo,
                    capture_output=True,
                    text=True,
                )
                assert shown.stdout == files[rec.run_id].upper(), (branch, shown.stderr)
    finally:
        store.close()
    return met


@pytest.mark.postgres
def test_four_background_worktree_runs_ride_out_a_postgres_restart(
    pg_server: PgServer, pg_url: str, tmp_path: Path, hermetic_git: Path
) -> None:
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    env = {"ORCH_STORE": pg_url}
    names = [f"w{i}" for i in range(4)]
    files: dict[str, str] = {}
    for name in names:
        script = write_script(repo, {"conversations": [{"turns": _worker(name)}]}, f"{name}.yaml")
        r = orch(
            "task", f"do {name}", "--background", "--json", "--isolation", "worktree",
            "--model", f"scripted:{script}", cwd=repo, env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        files[json.loads(r.stdout)["run_id"]] = name
    ids = list(files)
    outage = _restart_as_they_end(pg_server, pg_url, ids)
    wait_for(lambda: all(r.status.ended for r in _records(pg_url, ids)), timeout=90)
    records = _records(pg_url, ids)
    assert _check_ended(pg_url, repo, records, files, outage) >= 1  # endings met it
    host = records[0].pid
    assert host is not None
    wait_for(lambda: none_left(f"-C {repo}"), timeout=30, what="no orch process left")
    logs = "".join(p.read_text() for p in (repo / ".orch" / "logs").glob("*"))
    assert "could not be recorded" not in logs and "dropped" not in logs, logs
    assert logs.count("is unreachable; keeping") <= 1, logs
    assert not (repo / ".orch" / "endings.jsonl").exists()


@pytest.mark.postgres
def test_a_foreground_run_with_two_children_rides_out_a_postgres_restart(
    pg_server: PgServer, pg_url: str, tmp_path: Path, hermetic_git: Path
) -> None:
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [task_call("first"), task_call("second")]},
                    {"text": "ROOT-DONE"},
                ],
            },
            {"depth": 1, "runs": 2, "turns": _worker("kid")},
        ]
    }
    path = write_script(repo, script)
    done: list[subprocess.CompletedProcess[str]] = []
    fg = threading.Thread(
        target=lambda: done.append(
            orch(
                "task",
                "two children",
                "--json",
                "--isolation",
                "worktree",
                "--model",
                f"scripted:{path}",
                cwd=repo,
                env={"ORCH_STORE": pg_url},
                timeout=180,
            )  # fmt: skip
        )
    )
    fg.start()
    try:

        def children() -> list[str]:
            store = open_url(pg_url)
            try:
                return [r.run_id for r in store.list_runs() if r.depth == 1]
            finally:
                store.close()

        kids = wait_for(lambda: len(children()) == 2 and children(), timeout=60)
        outage = _restart_as_they_end(pg_server, pg_url, kids)
    finally:
        fg.join(200)
    assert done, "the foreground run did not end"
    r = done[0]
    assert r.returncode == 0, (r.stdout, r.stderr)
    root_id = json.loads(r.stdout)["run_id"]
    store = open_url(pg_url)
    try:
        runs = store.list_runs(chain_id=store.require_run(root_id).chain_id)
    finally:
        store.close()
    assert len(runs) == 3
    assert _check_ended(pg_url, repo, runs, {k: "kid" for k in kids}, outage) >= 1
    assert "could not be recorded" not in r.stderr and "dropped" not in r.stderr, r.stderr
    assert r.stderr.count("is unreachable; keeping") <= 1, r.stderr
    assert none_left(f"-C {repo}")
