"""Background agents: in-process background children, and detached runs driven from the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.run import RunStatus
from orchestrator.store import SqliteStore, open_store
from tests.support import (
    alive,
    harness,
    none_left,
    orch,
    task_call,
    tool_results,
    wait_for,
    write_script,
)


def test_background_child_runs_while_parent_works_then_is_collected(project: Path) -> None:
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [task_call("slow research", run_in_background=True)]},
                    {
                        "expect_result": '"status": "running"',
                        "tool_calls": [
                            {"tool": "bash", "input": {"command": "echo parent-still-working"}}
                        ],
                    },
                    {
                        "expect_result": "parent-still-working",
                        "tool_calls": [{"tool": "task_output", "input": {"task_id": "TASK_ID"}}],
                    },
                    {"expect_result": "BACKGROUND-RESULT", "text": "collected"},
                ],
            },
            {"depth": 1, "latency_s": 0.8, "turns": [{"text": "BACKGROUND-RESULT"}]},
        ]
    }
    h = harness(project, script)
    # the task id is only known at run time: patch it into the script when the child exists
    original = h.model.complete

    async def complete(request: Any) -> Any:
        kids = h.store.children(request.run_id) if request.depth == 0 else []
        if kids:
            for turn in h.model.script.conversations[0].turns:
                for call in turn.tool_calls:
                    if call.input.get("task_id") == "TASK_ID":
                        call.input["task_id"] = kids[0].run_id
        return await original(request)

    h.model.complete = complete  # type: ignore[method-assign]
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    child = h.store.children(root.run_id)[0]
    assert child.background and child.status == RunStatus.SUCCEEDED
    parent_reqs = h.requests_of(root.run_id)
    first = json.loads(tool_results(parent_reqs[1])[0]["content"])
    assert first["task_id"] == child.run_id and first["status"] == "running"
    # the parent's second request went out before the child had finished
    assert child.ended_at is not None
    bash_done = [e for e in h.store.events(root.run_id) if e["kind"] == "tool_result"][0]["at"]
    assert bash_done < child.ended_at


def test_auto_background_moves_a_slow_child_and_parent_waits_for_it(project: Path) -> None:
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [task_call("slow one")]},
                    {"expect_result": '"backgrounded": true', "text": "I'll wait for it"},
                    {"expect_result": "task-notification", "text": "got the notification"},
                ],
            },
            {"depth": 1, "turns": [{"text": "SLOW-CHILD-DONE", "latency_s": 1.5}]},
        ]
    }
    h = harness(project, script, auto_background_after=0.5)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    assert root.output == "got the notification"
    child = h.store.children(root.run_id)[0]
    assert child.status == RunStatus.SUCCEEDED and child.background
    assert len(h.requests_of(child.run_id)) == 1  # not restarted, not interrupted
    kinds = [e["kind"] for e in h.store.events(child.run_id)]
    assert kinds.count("run_started") == 1 and "auto_backgrounded" in kinds
    last = h.requests_of(root.run_id)[-1]
    note = json.dumps(last.messages[-1])
    assert child.run_id in note and "SLOW-CHILD-DONE" in note and "succeeded" in note
    assert root.ended_at is not None and child.ended_at is not None
    assert root.ended_at >= child.ended_at  # the parent did not end before its child


def test_task_stop_cancels_child_and_descendants(project: Path) -> None:
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [task_call("long", run_in_background=True)]},
                    {"tool_calls": [{"tool": "bash", "input": {"command": "sleep 0.5"}}]},
                    {"tool_calls": [{"tool": "task_stop", "input": {"task_id": "TASK_ID"}}]},
                    {"expect_result": "cancelled", "text": "stopped"},
                ],
            },
            {"depth": 1, "turns": [{"tool_calls": [task_call("deeper")]}, {"text": "never"}]},
            {
                "depth": 2,
                "turns": [
                    {
                        "tool_calls": [
                            {"tool": "bash", "input": {"command": "echo $$ > gc.pid; sleep 60.201"}}
                        ]
                    },
                    {"text": "never"},
                ],
            },
        ]
    }
    h = harness(project, script)
    original = h.model.complete

    async def complete(request: Any) -> Any:
        if request.depth == 0:
            kids = h.store.children(request.run_id)
            for turn in h.model.script.conversations[0].turns:
                for call in turn.tool_calls:
                    if kids and call.input.get("task_id") == "TASK_ID":
                        call.input["task_id"] = kids[0].run_id
        return await original(request)

    h.model.complete = complete  # type: ignore[method-assign]
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    statuses = {r.depth: r.status for r in h.runs(root.chain_id)}
    assert statuses == {0: RunStatus.SUCCEEDED, 1: RunStatus.CANCELLED, 2: RunStatus.CANCELLED}
    assert none_left("sleep 60.201")


def test_stalled_background_run_times_out_with_partial_output(project: Path) -> None:
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [task_call("stuck", run_in_background=True)]},
                    {"text": "waiting"},
                    {"expect_result": "timed_out", "text": "it stalled"},
                ],
            },
            {
                "depth": 1,
                "turns": [
                    {
                        "text": "PARTIAL-BEFORE-STALL",
                        "tool_calls": [{"tool": "glob", "input": {"pattern": "*"}}],
                    },
                    {"text": "never", "latency_s": 30},  # the model hangs: no progress
                ],
            },
        ]
    }
    h = harness(project, script, stall_timeout=0.6)
    root = h.run()
    child = h.store.children(root.run_id)[0]
    assert child.status == RunStatus.TIMED_OUT
    assert child.error == "stalled: no progress for 0.6s"
    assert child.output == "PARTIAL-BEFORE-STALL"


def test_busy_background_runs_are_not_stalled(project: Path) -> None:
    """A long command, or waiting for its own children, is work, not a stall."""
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {"tool_calls": [task_call("busy", run_in_background=True)]},
                    {"text": "waiting"},
                    {"expect_result": "succeeded", "text": "done"},
                ],
            },
            {
                "depth": 1,
                "turns": [
                    {"tool_calls": [{"tool": "bash", "input": {"command": "sleep 1.5"}}]},
                    {"tool_calls": [task_call("grandchild", run_in_background=True)]},
                    {"text": "child waits for its grandchild"},
                    {"text": "CHILD-DONE"},
                ],
            },
            {
                "depth": 2,
                "turns": [
                    {"tool_calls": [{"tool": "bash", "input": {"command": "sleep 0.4"}}]},
                    {"tool_calls": [{"tool": "bash", "input": {"command": "sleep 0.4"}}]},
                    {"tool_calls": [{"tool": "bash", "input": {"command": "sleep 0.4"}}]},
                    {"text": "GRANDCHILD-DONE"},
                ],
            },
        ]
    }
    h = harness(project, script, stall_timeout=0.6)
    root = h.run()
    runs = {r.depth: r for r in h.runs(root.chain_id)}
    assert {d: r.status for d, r in runs.items()} == {
        0: RunStatus.SUCCEEDED,
        1: RunStatus.SUCCEEDED,
        2: RunStatus.SUCCEEDED,
    }, {d: r.error for d, r in runs.items()}


# -- across processes ---------------------------------------------------------------


def test_detached_run_progress_is_visible_from_another_process(project: Path) -> None:
    steps = [
        {"tool_calls": [{"tool": "bash", "input": {"command": f"sleep 0.4; echo {i}"}}]}
        for i in range(5)
    ]
    script = write_script(project, {"conversations": [{"turns": [*steps, {"text": "BG-FINAL"}]}]})
    t0 = time.monotonic()
    r = orch(
        "task",
        "work in the background",
        "--background",
        "--json",
        "--model",
        f"scripted:{script}",
        cwd=project,
    )
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 5  # returns at once (interpreter start-up included)
    run_id = json.loads(r.stdout)["run_id"]
    seen: list[int] = []
    statuses: list[str] = []
    end = time.monotonic() + 30
    while time.monotonic() < end:
        rows = json.loads(orch("ps", "--json", cwd=project).stdout)
        row = next(x for x in rows if x["run_id"] == run_id)
        seen.append(row["tool_uses"])
        statuses.append(row["status"])
        if row["status"] == "succeeded":
            break
        time.sleep(0.2)
    assert statuses[-1] == "succeeded" and "running" in statuses
    assert seen == sorted(seen) and len(set(seen)) >= 3  # tool_uses rose while we watched
    wanted = "run_id parent_run_id chain_id depth agent status isolation tool_uses pid"
    assert set(rows[0]) >= {*wanted.split(), "last_activity", "recent_activities", "summary"}
    res = orch("result", run_id, "--wait", "--json", cwd=project)
    assert res.returncode == 0 and json.loads(res.stdout)["summary"] == "BG-FINAL"


def test_cancel_from_another_terminal_leaves_no_process(project: Path) -> None:
    script = write_script(
        project,
        {
            "conversations": [
                {
                    "depth": 0,
                    "turns": [
                        {"tool_calls": [task_call("bg sleeper", run_in_background=True)]},
                        {
                            "tool_calls": [
                                {
                                    "tool": "bash",
                                    "input": {"command": "echo $$ > root.pid; sleep 60.202"},
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
                                    "input": {"command": "echo $$ > child.pid; sleep 60.203"},
                                }
                            ]
                        },
                        {"text": "never"},
                    ],
                },
            ]
        },
    )
    r = orch("task", "x", "--background", "--json", "--model", f"scripted:{script}", cwd=project)
    run_id = json.loads(r.stdout)["run_id"]
    pids = [project / "root.pid", project / "child.pid"]
    wait_for(lambda: all(p.exists() and p.read_text().strip() for p in pids))
    c = orch("cancel", run_id, "--json", cwd=project)
    assert c.returncode == 0, c.stderr
    assert {x["status"] for x in json.loads(c.stdout)} == {"cancelled"}
    assert none_left("sleep 60.202") and none_left("sleep 60.203")
    runs = open_store(project).list_runs()
    assert len(runs) == 2 and {x.status for x in runs} == {RunStatus.CANCELLED}
    worker_pid = runs[0].pid
    assert worker_pid is not None
    wait_for(lambda: not alive(worker_pid), 10)


def test_sigkill_of_worker_shows_interrupted_and_reaps(project: Path) -> None:
    script = write_script(
        project,
        {
            "conversations": [
                {
                    "turns": [
                        {
                            "text": "PARTIAL-WORK",
                            "tool_calls": [
                                {
                                    "tool": "bash",
                                    "input": {"command": "echo $$ > w.pid; sleep 60.204"},
                                }
                            ],
                        },
                        {"text": "never"},
                    ]
                }
            ]
        },
    )
    r = orch("task", "x", "--background", "--json", "--model", f"scripted:{script}", cwd=project)
    run_id = json.loads(r.stdout)["run_id"]
    pidfile = project / "w.pid"
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip() != "")
    worker = open_store(project).require_run(run_id).pid
    assert worker is not None
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: not alive(worker), 10)
    rows = json.loads(orch("ps", "--json", cwd=project).stdout)
    row = next(x for x in rows if x["run_id"] == run_id)
    assert row["status"] == "interrupted"
    assert "PARTIAL-WORK" in row["summary"]
    assert none_left("sleep 60.204")  # its process group was reaped
    rec = open_store(project).require_run(run_id)
    # Under the OS sandbox the command dies with its worker (bwrap --die-with-parent);
    # unsandboxed, reconcile kills the group: either way nothing is left, nor registered.
    assert rec.error is not None and rec.error.startswith("interrupted: owner process")
    assert open_store(project).resources(run_id) == []


def _hammer(db: str, run_id: str, seconds: float, out: Any) -> None:
    store = SqliteStore(Path(db))
    n = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            n += 1
            store.note_activity(run_id, "bash", f"update {n}", summary=f"n={n}")
            store.add_event(run_id, "tick", {"n": n})
        out.put((run_id, n, None))
    except Exception as e:  # reported to the parent, which fails the test
        out.put((run_id, n, repr(e)))
    finally:
        store.close()


@pytest.mark.slow
def test_store_under_load_loses_nothing(tmp_path: Path) -> None:
    import multiprocessing

    from orchestrator.run import RunRecord

    store = SqliteStore.for_project(tmp_path)
    ids = [f"r-load{i:02d}" for i in range(20)]
    for rid in ids:
        store.create_run(RunRecord(run_id=rid, chain_id="c-load"))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    seconds = float(os.environ.get("ORCH_LOAD_SECONDS", "20"))
    procs = [
        ctx.Process(target=_hammer, args=(str(store.path), rid, seconds, results)) for rid in ids
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [e for _, _, e in got if e]
    assert errors == []
    for rid, n, _ in got:
        rec = store.require_run(rid)
        assert rec.summary == f"n={n}" and rec.last_activity is not None
        assert rec.last_activity.summary == f"update {n}"
        assert len(store.events(rid)) == n
    assert sum(n for _, n, _ in got) > 1000


def test_watch_and_follow_end_with_the_run(project: Path) -> None:
    steps = [
        {"tool_calls": [{"tool": "bash", "input": {"command": f"sleep 0.3; echo step{i}"}}]}
        for i in range(3)
    ]
    script = write_script(project, {"conversations": [{"turns": [*steps, {"text": "WATCHED"}]}]})
    r = orch("task", "x", "--background", "--json", "--model", f"scripted:{script}", cwd=project)
    run_id = json.loads(r.stdout)["run_id"]
    follow = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "logs", run_id, "--follow", "--json"],
        cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watch = orch("watch", run_id, "--interval", "0.2", cwd=project, timeout=60)
    assert watch.returncode == 0, watch.stderr
    assert run_id in watch.stdout and "succeeded" in watch.stdout
    out, _ = follow.communicate(timeout=30)
    assert follow.returncode == 0
    kinds = [json.loads(line)["kind"] for line in out.splitlines()]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished"
    assert kinds.count("tool_call") == 3
    failing = write_script(
        project,
        {
            "conversations": [
                {
                    "runs": "*",
                    "turns": [{"tool_calls": [{"tool": "glob", "input": {"pattern": "*"}}]}] * 3,
                }
            ]
        },
        "fail.yaml",
    )
    r = orch(
        "task",
        "y",
        "--background",
        "--json",
        "--max-turns",
        "1",
        "--model",
        f"scripted:{failing}",
        cwd=project,
    )
    bad = json.loads(r.stdout)["run_id"]
    assert orch("watch", bad, "--interval", "0.2", cwd=project).returncode == 1


def test_reconcile_leaves_a_run_handed_to_a_new_owner_since_its_listing(tmp_path: Path) -> None:
    """A launcher hands its background run to the worker host, which writes its own pid,
    then the launcher exits. A reconcile that listed the run before the handoff and judges it
    after sees the launcher gone: it must judge the record as it is now (it interrupted
    live runs of the host, 2 in 100, under `orch task --background` launched 4 at a time)."""
    from orchestrator.engine.owner import me
    from orchestrator.process.reconcile import reconcile
    from orchestrator.run import RunRecord

    store = SqliteStore(tmp_path / "orch.db")
    launcher = subprocess.Popen(["true"])
    launcher.wait(30)  # the launcher: exited after the handoff
    record = RunRecord(
        run_id="r-00000000000a", chain_id="c-1", status=RunStatus.RUNNING, pid=launcher.pid
    )
    store.create_run(record)
    listed = store.list_runs(statuses=[RunStatus.QUEUED, RunStatus.RUNNING])
    pid, start = me()  # the host (this process: alive) took it over after the listing
    store.update_run(record.run_id, pid=pid, pid_start=start)

    class Snapshot:  # the store as reconcile sees it: the listing from before the handoff
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def list_runs(self, **_: Any) -> list[RunRecord]:
            return listed

    assert reconcile(Snapshot()) == []
    assert store.require_run(record.run_id).status == RunStatus.RUNNING
    # with no new owner, the gone launcher's run is interrupted as before
    store.update_run(record.run_id, pid=launcher.pid, pid_start=None)
    ended = reconcile(Snapshot())
    assert [r.status for r in ended] == [RunStatus.INTERRUPTED]


def test_reap_kills_what_of_a_run_left_its_process_group(tmp_path: Path) -> None:
    """bwrap makes the sandboxed command a session of its own; if bwrap's parent dies before
    the sandbox has its parent-death signal, killing the registered group leaves the sandbox
    running (seen under load: `test_a_caller_killed_takes_its_command_with_it`). Reap also
    kills this uid's processes started since the group that carry the run's mark (a
    command's environment, bwrap's --setenv), and nothing else."""
    from orchestrator.pgroups import group_ref
    from orchestrator.process.reconcile import reap
    from orchestrator.project.statedir import sign

    store = SqliteStore(tmp_path / "orch.db")
    run_id = "r-0000000000aa"
    leader = subprocess.Popen(["sleep", "60"], start_new_session=True)
    ref = group_ref(leader.pid)
    mark = {**os.environ, "ORCH_PARENT_RUN_ID": run_id}
    escaped = subprocess.Popen(["sleep", "61"], start_new_session=True, env=mark)
    bwrap_like = subprocess.Popen(  # a mark in its argv, as bwrap's --setenv
        [
            sys.executable,
            "-c",
            "import time; time.sleep(62)",
            "--setenv",
            "ORCH_PARENT_RUN_ID",
            run_id,
        ],
        start_new_session=True,
    )
    other = subprocess.Popen(  # another run's command: left alone
        ["sleep", "63"], start_new_session=True, env={**mark, "ORCH_PARENT_RUN_ID": "r-other"}
    )
    try:
        store.register_resource(run_id, "pgroup", sign(run_id, "pgroup", ref))
        done = reap(store, run_id)
        assert done == [f"killed process group {leader.pid}"]
        for proc in (leader, escaped, bwrap_like):
            assert proc.wait(10) == -9
        assert other.poll() is None
    finally:
        for proc in (leader, escaped, bwrap_like, other):
            proc.kill()
            proc.wait(30)


def test_every_background_child_is_notified_not_only_the_first(project: Path) -> None:
    """A notification delivered once must not cut the spawner off from the next ones."""
    bash = {"tool": "bash", "input": {"command": "sleep 1.2"}}
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [
                    {
                        "tool_calls": [
                            task_call("quick", run_in_background=True),
                            task_call("slow", run_in_background=True),
                        ]
                    },  # fmt: skip
                    {"tool_calls": [bash]},
                    {"expect_result": "QUICK-DONE", "tool_calls": [bash, bash]},
                    {"expect_result": "SLOW-DONE", "text": "both arrived"},
                ],
            },
            {"depth": 1, "prompt": "quick", "turns": [{"text": "QUICK-DONE", "latency_s": 0.2}]},
            {"depth": 1, "prompt": "slow", "turns": [{"text": "SLOW-DONE", "latency_s": 1.8}]},
        ]
    }
    h = harness(project, script)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    last = json.dumps(h.requests_of(root.run_id)[-1].messages[-1])
    assert "SLOW-DONE" in last and "task-notification" in last
