"""The real CLI on the Postgres store (a real server, tests/pgserver.py): runs, `ps`,
`result`, background runs and `cancel` from other processes, reconcile after a killed
worker, the `store` setting (and its trust gate), and no password anywhere."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from orchestrator.run import RunStatus
from orchestrator.store.postgres import PostgresStore
from tests.pgserver import PASSWORD, PASSWORD_ROLE, PgServer
from tests.support import alive, none_left, orch, task_call, wait_for, write_script

pytestmark = pytest.mark.postgres


def _runs(url: str) -> list[Any]:
    store = PostgresStore(url)
    try:
        return store.list_runs()
    finally:
        store.close()


def _delegating(project: Path, answer: str = "DONE-ON-PG") -> Path:
    return write_script(
        project,
        {
            "conversations": [
                {
                    "depth": 0,
                    "turns": [
                        {"tool_calls": [task_call("look around")]},
                        {"expect_result": "CHILD-SAW", "text": answer},
                    ],
                },
                {
                    "depth": 1,
                    "turns": [
                        {"tool_calls": [{"tool": "glob", "input": {"pattern": "src/*.py"}}]},
                        {"expect_result": "app.py", "text": "CHILD-SAW app.py"},
                    ],
                },
            ]
        },
    )


def test_a_task_on_postgres_is_seen_from_other_processes(project: Path, pg_url: str) -> None:
    env = {"ORCH_STORE": pg_url}
    script = _delegating(project)
    r = orch("task", "x", "--json", "--model", f"scripted:{script}", cwd=project, env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["status"] == "succeeded" and data["summary"] == "DONE-ON-PG"
    rows = json.loads(orch("ps", "--all", "--json", cwd=project, env=env).stdout)
    assert {(x["run_id"], x["status"]) for x in rows} >= {(data["run_id"], "succeeded")}
    assert len(rows) == 2 and {x["depth"] for x in rows} == {0, 1}
    res = orch("result", data["run_id"][:10], "--json", cwd=project, env=env)
    assert res.returncode == 0 and json.loads(res.stdout)["summary"] == "DONE-ON-PG"
    tree = json.loads(orch("tree", data["run_id"], "--json", cwd=project, env=env).stdout)
    assert [t["depth"] for t in tree] == [0, 1]
    kinds = [
        e["kind"]
        for e in json.loads(orch("logs", data["run_id"], "--json", cwd=project, env=env).stdout)
    ]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished" and "child_spawned" in kinds
    # the runs are in Postgres, and only there: SQLite (the default) never saw them
    assert {x.run_id for x in _runs(pg_url)} == {x["run_id"] for x in rows}
    assert not (project / ".orch" / "orch.db").exists()
    assert json.loads(orch("ps", "--all", "--json", cwd=project).stdout) == []


def test_background_and_cancel_from_another_process(project: Path, pg_url: str) -> None:
    env = {"ORCH_STORE": pg_url}
    sleeper = {"tool": "bash", "input": {"command": "echo $$ > w.pid; sleep 60.301"}}
    script = write_script(
        project, {"conversations": [{"turns": [{"tool_calls": [sleeper]}, {"text": "never"}]}]}
    )
    r = orch(
        "task", "x", "--background", "--json", "--model", f"scripted:{script}", cwd=project, env=env
    )
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    pidfile = project / "w.pid"
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip() != "")
    row = next(
        x
        for x in json.loads(orch("ps", "--json", cwd=project, env=env).stdout)
        if x["run_id"] == run_id
    )
    assert row["status"] == "running" and row["tool_uses"] >= 1
    c = orch("cancel", run_id, "--json", cwd=project, env=env)
    assert c.returncode == 0, c.stderr
    assert {x["status"] for x in json.loads(c.stdout)} == {"cancelled"}
    assert none_left("sleep 60.301")
    (rec,) = _runs(pg_url)
    assert rec.status == RunStatus.CANCELLED and rec.pid is not None
    worker = rec.pid
    wait_for(lambda: not alive(worker))


def test_a_killed_worker_is_reconciled_to_interrupted(project: Path, pg_url: str) -> None:
    env = {"ORCH_STORE": pg_url}
    turn = {
        "text": "PARTIAL-PG",
        "tool_calls": [{"tool": "bash", "input": {"command": "echo $$ > w.pid; sleep 60.302"}}],
    }
    script = write_script(project, {"conversations": [{"turns": [turn, {"text": "never"}]}]})
    r = orch(
        "task", "x", "--background", "--json", "--model", f"scripted:{script}", cwd=project, env=env
    )
    run_id = json.loads(r.stdout)["run_id"]
    pidfile = project / "w.pid"
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip() != "")
    (rec,) = _runs(pg_url)
    worker = rec.pid
    assert worker is not None
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: not alive(worker))
    rows = json.loads(orch("ps", "--json", cwd=project, env=env).stdout)
    row = next(x for x in rows if x["run_id"] == run_id)
    assert row["status"] == "interrupted" and "PARTIAL-PG" in row["summary"]
    assert none_left("sleep 60.302")
    store = PostgresStore(pg_url)
    try:
        got = store.require_run(run_id)
        assert got.error is not None and got.error.startswith("interrupted: owner process")
        assert store.resources(run_id) == []
        assert store.events(run_id)[-1]["data"]["status"] == "interrupted"
    finally:
        store.close()


# -- the `store` setting --------------------------------------------------------------
def test_store_in_orch_toml_needs_trust_and_env_wins(
    project: Path, pg_server: PgServer, pg_url: str, pg_db: str
) -> None:
    (project / "orch.toml").write_text(f'store = "{pg_url}"\n')
    script = _delegating(project)
    # untrusted: a repository may not send the runs elsewhere; SQLite, and a notice
    first = orch("task", "x", "--json", "--model", f"scripted:{script}", cwd=project)
    assert first.returncode == 0, first.stderr
    assert "store" in first.stderr and "orch trust" in first.stderr
    assert (project / ".orch" / "orch.db").exists() and _runs(pg_url) == []
    shown = orch("trust", "--show", "--json", cwd=project)
    assert shown.returncode == 0 and json.loads(shown.stdout)["settings"]["store"] == pg_url
    assert orch("trust", cwd=project).returncode == 0
    second = orch("task", "x", "--json", "--model", f"scripted:{script}", cwd=project)
    assert second.returncode == 0, second.stderr
    run_id = json.loads(second.stdout)["run_id"]
    assert run_id in {r.run_id for r in _runs(pg_url)}
    listed = json.loads(orch("ps", "--all", "--json", cwd=project).stdout)
    assert {x["run_id"] for x in listed} == {r.run_id for r in _runs(pg_url)}
    # ORCH_STORE wins over the file
    other = f"t_{pg_db}_env"
    pg_server.create_database(other)
    try:
        env_url = pg_server.url(other, user="orch")
        third = orch(
            "task",
            "x",
            "--json",
            "--model",
            f"scripted:{script}",
            cwd=project,
            env={"ORCH_STORE": env_url},
        )
        assert third.returncode == 0, third.stderr
        assert [r.run_id for r in _runs(env_url) if r.depth == 0] == [
            json.loads(third.stdout)["run_id"]
        ]
        assert len(_runs(pg_url)) == 2
    finally:
        pg_server.drop_database(other)


def test_store_in_the_user_config_needs_no_trust(project: Path, pg_url: str) -> None:
    config = Path.home() / ".orch" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f'store = "{pg_url}"\n')
    script = _delegating(project)
    r = orch("task", "x", "--json", "--model", f"scripted:{script}", cwd=project)
    assert r.returncode == 0, r.stderr
    assert "orch trust" not in r.stderr
    assert json.loads(r.stdout)["run_id"] in {x.run_id for x in _runs(pg_url)}


# -- the password ---------------------------------------------------------------------
def test_no_password_in_any_output_log_or_record(project: Path, pg_server: PgServer) -> None:
    pg_server.create_database("t_cli_secret", owner=PASSWORD_ROLE)
    try:
        url = pg_server.url("t_cli_secret", user=PASSWORD_ROLE, password=PASSWORD)
        env = {"ORCH_STORE": url}
        said: list[str] = []

        def run(*args: str, env: dict[str, str] = env) -> Any:
            r = orch(*args, cwd=project, env=env)
            said.extend([r.stdout, r.stderr])
            return r

        script = _delegating(project)
        assert run("task", "x", "--json", "--model", f"scripted:{script}").returncode == 0
        bg = run("task", "x", "--background", "--json", "--model", f"scripted:{script}")
        run_id = json.loads(bg.stdout)["run_id"]
        assert run("result", run_id, "--wait", "--json").returncode == 0
        run("ps", "--all", "--json")
        run("ps", "--all")
        run("logs", run_id)
        wrong = pg_server.url("t_cli_secret", user=PASSWORD_ROLE, password=PASSWORD + "x")
        bad = run("ps", env={"ORCH_STORE": wrong})
        assert bad.returncode != 0 and f"127.0.0.1:{pg_server.port}" in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
        (project / "orch.toml").write_text(f'store = "{url}"\n')
        shown = run("trust", "--show")
        assert "t_cli_secret" in shown.stdout
        files = [p for p in (project / ".orch").rglob("*") if p.is_file()]
        names = {p.name for p in files}  # the worker's log (a host's, or a run's own) is among them
        assert "host.log" in names or f"{run_id}.log" in names
        logs = [p.read_text(errors="replace") for p in files]
        texts = [*said, *logs, pg_server.dump("t_cli_secret"), pg_server.log()]
        for text in texts:
            assert "s3cret" not in text, text[:2000]
    finally:
        pg_server.drop_database("t_cli_secret")
