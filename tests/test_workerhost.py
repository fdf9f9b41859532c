"""The worker host: one detached process runs the background runs of a state dir."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.process.detach import ask
from orchestrator.run import RunRecord, RunStatus
from orchestrator.store import SqliteStore, open_store
from tests.fakeapi import FakeAPI, serve, text_reply
from tests.support import alive, gone, host_pids, init_repo, none_left, orch, wait_for, write_script

SLOW = {"conversations": [{"runs": "*", "turns": [{"text": "SLOW-DONE", "latency_s": 60}]}]}
QUICK = {"conversations": [{"runs": "*", "turns": [{"text": "QUICK-DONE"}]}]}


def _launch(project: Path, script: Path, *extra: str, idle: str = "0", **env: str) -> str:
    r = orch(
        "task", "go", "--background", "--json", "--model", f"scripted:{script}", *extra,
        cwd=project, env={"ORCH_HOST_IDLE": idle, **env},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["run_id"])


def _record(project: Path, run_id: str) -> RunRecord:
    store = open_store(project)
    try:
        return store.require_run(run_id)
    finally:
        store.close()


def _running(project: Path, ids: list[str]) -> bool:
    return all(_record(project, r).status == RunStatus.RUNNING for r in ids)


def _socket(state: Path) -> Path:
    socks = list(state.glob("host-*.sock"))
    assert len(socks) == 1, socks
    return socks[0]


def _hosts(project: Path) -> list[int]:
    hosts = set(host_pids("orchestrator _host --key"))
    return [p for p in host_pids(f"-C {project}") if p in hosts]


def test_three_runs_in_a_row_share_one_host_which_exits_when_idle(project: Path) -> None:
    script = write_script(project, QUICK)
    ids = [_launch(project, script, idle="10") for _ in range(3)]
    owners = {_record(project, rid).pid for rid in ids}
    assert len(owners) == 1
    (host,) = owners
    assert host is not None
    assert _hosts(project) == [host]
    for rid in ids:
        res = orch("result", rid, "--wait", "--json", cwd=project)
        assert res.returncode == 0 and json.loads(res.stdout)["summary"] == "QUICK-DONE"
    state = project / ".orch"
    log = (state / "logs" / "host.log").read_text()
    assert log.count("listening on") == 1 and all(f"adopted {rid}" in log for rid in ids)
    assert gone(host, timeout=30)  # idle 10 s after the last run, then it leaves
    assert none_left(f"-C {project}")
    assert list(state.glob("host-*.sock")) == []
    assert "exiting" in (state / "logs" / "host.log").read_text()


def test_projects_sharing_orch_home_keep_their_own_settings(tmp_path: Path) -> None:
    home = tmp_path / "shared-home"
    ids: dict[str, str] = {}
    for name, limit in (("a", 100), ("b", 200)):
        proj = tmp_path / name
        proj.mkdir()
        (proj / "orch.toml").write_text(f"tool_output_limit = {limit}\n")
        (proj / "big.txt").write_text("x" * 1000)
        turns = [
            {"tool_calls": [{"tool": "read_file", "input": {"path": "big.txt"}}]},
            {"expect_result": f"output cut at {limit} of", "text": f"LIMIT-{limit}"},
        ]
        script = write_script(proj, {"conversations": [{"turns": turns}]}, f"{name}.yaml")
        ids[name] = _launch(proj, script, idle="5", ORCH_HOME=str(home))
    env = {"ORCH_HOME": str(home)}
    summaries = {}
    for name, rid in ids.items():
        res = orch("result", rid, "--wait", "--json", cwd=tmp_path / name, env=env)
        assert res.returncode == 0, res.stdout
        summaries[name] = json.loads(res.stdout)["summary"]
    assert summaries == {"a": "LIMIT-100", "b": "LIMIT-200"}
    shared = SqliteStore(home / "orch.db")  # ORCH_HOME is not set in this process
    owners = {shared.require_run(rid).pid for rid in ids.values()}
    shared.close()
    assert len(owners) == 1  # one host, two projects, each with its own settings
    (host,) = owners
    assert host is not None
    os.kill(host, signal.SIGTERM)
    assert gone(host, timeout=20)


def test_sigkill_of_the_host_interrupts_all_its_runs(project: Path) -> None:
    script = write_script(project, SLOW)
    ids = [_launch(project, script) for _ in range(3)]
    wait_for(lambda: _running(project, ids))
    owners = {_record(project, rid).pid for rid in ids}
    assert len(owners) == 1
    (host,) = owners
    assert host is not None
    os.kill(host, signal.SIGKILL)
    assert gone(host)
    rows = json.loads(orch("ps", "--json", cwd=project).stdout)
    got = {r["run_id"]: r["status"] for r in rows}
    assert [got[rid] for rid in ids] == ["interrupted"] * 3
    assert all(f"owner process {host}" in (_record(project, r).error or "") for r in ids)
    assert none_left(f"-C {project}")


def test_cancel_of_one_run_leaves_the_others_running(project: Path) -> None:
    script = write_script(project, SLOW)
    ids = [_launch(project, script) for _ in range(3)]
    wait_for(lambda: _running(project, ids))
    c = orch("cancel", ids[1], "--json", cwd=project)
    assert c.returncode == 0, c.stderr
    assert [x["status"] for x in json.loads(c.stdout)] == ["cancelled"]
    time.sleep(1.0)  # a few heartbeats: the others must still be running
    assert _running(project, [ids[0], ids[2]])
    host = _record(project, ids[0]).pid
    assert host is not None and alive(host)
    c = orch("cancel", ids[0], "--json", cwd=project)
    c2 = orch("cancel", ids[2], "--json", cwd=project)
    assert c.returncode == 0 and c2.returncode == 0
    assert gone(host, timeout=20)  # idle 0: it leaves with its last run
    assert none_left(f"-C {project}")


def test_sigterm_cancels_runs_the_normal_way_and_keeps_worktree_work(
    tmp_path: Path, hermetic_git: Path
) -> None:
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    script = write_script(
        repo,
        {
            "conversations": [
                {
                    "runs": "*",
                    "turns": [
                        {
                            "tool_calls": [
                                {
                                    "tool": "write_file",
                                    "input": {"path": "work.txt", "content": "WORK"},
                                }
                            ]
                        },
                        {"text": "never", "latency_s": 60},
                    ],
                }
            ]
        },
    )
    ids = [_launch(repo, script, "--isolation", "worktree") for _ in range(2)]
    wait_for(lambda: all(_record(repo, r).usage.tool_uses >= 1 for r in ids))
    host = _record(repo, ids[0]).pid
    assert host is not None and {_record(repo, r).pid for r in ids} == {host}
    os.kill(host, signal.SIGTERM)
    assert gone(host, timeout=30)
    for rid in ids:
        rec = _record(repo, rid)
        assert rec.status == RunStatus.CANCELLED, rec.error
        art = next(a for a in rec.artifacts if a.get("branch"))
        shown = subprocess.run(
            ["git", "show", f"{art['branch']}:work.txt"], cwd=repo, capture_output=True, text=True
        )
        assert shown.stdout == "WORK"
    assert none_left(f"-C {repo}")


LAUNCHER = """
import sys, time
from pathlib import Path
import orchestrator.process.detach, orchestrator.engine.runner
from orchestrator.cli.main import main
go = Path(sys.argv[1])
(go.parent / f"ready-{sys.argv[2]}").write_text("")
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.001)
if not go.exists():
    sys.exit("the go file did not appear in 60 s")
sys.argv = ["orch", *sys.argv[3:]]
main()
"""


def test_racing_launchers_start_one_host(project: Path) -> None:
    script = write_script(project, QUICK)
    go = project.parent / "go"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    env["ORCH_HOST_IDLE"] = "2"
    args = ["task", "go", "--background", "--json", "--model", f"scripted:{script}"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(go), str(i), *args],
            cwd=project,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(4)
    ]
    wait_for(lambda: len(list(go.parent.glob("ready-*"))) == 4, 60)
    go.write_text("go")  # every launcher has imported what it needs: they start at once
    ids = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        ids.append(json.loads(out)["run_id"])
    owners = {_record(project, rid).pid for rid in ids}
    assert len(owners) == 1
    log = (project / ".orch" / "logs" / "host.log").read_text()
    assert log.count("listening on") == 1
    for rid in ids:
        assert orch("result", rid, "--wait", cwd=project).returncode == 0
    (host,) = owners
    assert host is not None and gone(host, timeout=20)


def test_a_stale_socket_of_a_dead_host_is_replaced(project: Path) -> None:
    script = write_script(project, SLOW)
    first = _launch(project, script)
    wait_for(lambda: _running(project, [first]))
    old = _record(project, first).pid
    assert old is not None
    sock = _socket(project / ".orch")
    os.kill(old, signal.SIGKILL)
    assert gone(old)
    assert sock.exists()  # left behind: nobody answers on it
    quick = write_script(project, QUICK, "quick.yaml")
    second = _launch(project, quick)
    res = orch("result", second, "--wait", "--json", cwd=project)
    assert res.returncode == 0 and json.loads(res.stdout)["summary"] == "QUICK-DONE"
    new = _record(project, second).pid
    assert new is not None and new != old
    assert _record(project, first).status == RunStatus.INTERRUPTED
    assert gone(new, timeout=20) and none_left(f"-C {project}")


def _slow_host(project: Path) -> tuple[str, int, Path]:
    script = write_script(project, SLOW)
    rid = _launch(project, script)
    wait_for(lambda: _running(project, [rid]))
    host = _record(project, rid).pid
    assert host is not None
    return rid, host, _socket(project / ".orch")


def _stop(project: Path, host: int) -> None:
    os.kill(host, signal.SIGTERM)
    assert gone(host, timeout=20)
    assert none_left(f"-C {project}")


_TIGHTER = """
import json, resource, sys
from pathlib import Path
from orchestrator.process.detach import ask
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), min(hard, 256)))
print(ask(Path(sys.argv[1]), {"run_id": "r-000000000000", "env": json.loads(sys.argv[2])}))
"""


def test_the_socket_refuses_anything_but_a_queued_run_of_the_asker(project: Path) -> None:
    rid, host, sock = _slow_host(project)
    try:
        assert (sock.stat().st_mode & 0o777) == 0o600
        bare = ask(sock, {"run_id": "r-000000000000"})  # no environment: not a handoff
        assert bare["ok"] is False and "expected one line" in str(bare["error"])
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
        env["ORCH_HOST_IDLE"] = "0"  # exactly the launcher's (`_launch`)
        bogus = ask(sock, {"run_id": "r-000000000000", "env": env})
        assert bogus == {"ok": False, "error": "no such run in this store"}
        again = ask(sock, {"run_id": rid, "env": env})
        assert again["ok"] is False and "already" in str(again["error"])
        other_env = ask(sock, {"run_id": rid, "env": env | {"ORCH_X": "1"}})
        assert "environment is not" in str(other_env["error"])
        tighter = subprocess.run([sys.executable, "-c", _TIGHTER, str(sock), json.dumps(env)],
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "limits or privileges" in tighter.stdout, (tighter.stdout, tighter.stderr)
        extra = ask(sock, {"run_id": rid, "command": "rm -rf /"})
        assert extra["ok"] is False
        # A queued background run, but queued by another process: not ours to hand over.
        store = open_store(project)
        other = RunRecord(
            run_id="r-notyours0000", chain_id="c-notyours0000", background=True, pid=1,
            options={"spec": {"workdir": str(project)}, "launch": {}},
        )  # fmt: skip
        store.create_run(other)
        refused = ask(sock, {"run_id": other.run_id, "env": env})
        assert refused["ok"] is False and "another process" in str(refused["error"])
        assert store.require_run(other.run_id).status == RunStatus.QUEUED
        store.close()
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(str(sock))
        raw.sendall(b"not json\n")
        assert json.loads(raw.makefile().readline())["ok"] is False
        raw.close()
        assert alive(host) and _record(project, rid).status == RunStatus.RUNNING
    finally:
        _stop(project, host)
    assert _record(project, rid).status == RunStatus.CANCELLED


def _as_nobody(path: str, run_id: str) -> str:
    """Connect as uid 65534 (a forked child) and return the host's answer line."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(rfd)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(json.dumps({"run_id": run_id}).encode() + b"\n")
            os.write(wfd, s.makefile("rb").readline())
            code = 0
        except BaseException as e:
            os.write(wfd, f"child failed: {e!r}".encode())
        finally:
            os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as r:
        answer = r.read().decode()
    os.waitpid(pid, 0)
    return answer


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as another user")
def test_a_peer_of_another_uid_is_refused(project: Path) -> None:
    rid, host, sock = _slow_host(project)
    state = sock.parent
    dirfd = os.open(state, os.O_PATH | os.O_DIRECTORY)
    try:
        os.chmod(state, 0o711)  # opened up for this test only: the uid check must hold alone
        os.chmod(sock, 0o666)
        answer = _as_nobody(f"/proc/self/fd/{dirfd}/{sock.name}", rid)  # fd: inherited
        assert json.loads(answer) == {"ok": False, "error": "another user"}, answer
        assert "refused a connection of uid 65534" in (state / "logs" / "host.log").read_text()
        assert _record(project, rid).status == RunStatus.RUNNING
    finally:
        os.close(dirfd)
        os.chmod(state, 0o700)
        _stop(project, host)


def test_without_hosts_a_run_gets_a_worker_of_its_own(project: Path) -> None:
    script = write_script(project, QUICK)
    rid = _launch(project, script, ORCH_WORKER_HOST="0")
    res = orch("result", rid, "--wait", "--json", cwd=project)
    assert res.returncode == 0 and json.loads(res.stdout)["summary"] == "QUICK-DONE"
    assert not (project / ".orch" / "logs" / "host.log").exists()
    assert "worker of its own" in (project / ".orch" / "logs" / f"{rid}.log").read_text()
    assert none_left(f"-C {project}")


def test_runs_on_the_real_sdk_share_the_host(project: Path) -> None:
    api = FakeAPI(lambda body: text_reply("SDK-DONE"))
    with serve(api) as running:
        env = {
            "ANTHROPIC_BASE_URL": running.base_url,
            "ANTHROPIC_API_KEY": "sk-test-fake",
            "ORCH_HOST_IDLE": "3",
        }
        ids = []
        for _ in range(2):
            r = orch("task", "go", "--background", "--json", cwd=project, env=env)
            assert r.returncode == 0, r.stderr
            ids.append(json.loads(r.stdout)["run_id"])
        for rid in ids:
            res = orch("result", rid, "--wait", "--json", cwd=project, env=env)
            assert res.returncode == 0 and json.loads(res.stdout)["summary"] == "SDK-DONE"
        assert len(api.requests) == 2
    owners = {_record(project, rid).pid for rid in ids}
    assert len(owners) == 1
    (host,) = owners
    assert host is not None and gone(host, timeout=20)
    assert none_left(f"-C {project}")


def test_launchers_with_other_environments_get_hosts_of_their_own(project: Path) -> None:
    script = write_script(project, SLOW)
    a = _launch(project, script, ORCH_TEST_FLAVOUR="one")
    b = _launch(project, script, ORCH_TEST_FLAVOUR="two")
    c = _launch(project, script, ORCH_TEST_FLAVOUR="one")
    wait_for(lambda: _running(project, [a, b, c]))
    pa, pb, pc = (_record(project, r).pid for r in (a, b, c))
    assert pa == pc and pa != pb  # a run never sees another launcher's environment
    assert len(list((project / ".orch").glob("host-*.sock"))) == 2
    for pid in (pa, pb):
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        assert gone(pid, timeout=20)
    assert {_record(project, r).status for r in (a, b, c)} == {RunStatus.CANCELLED}
    assert none_left(f"-C {project}")


_LAUNCHER = """
import sys
from pathlib import Path
from orchestrator.process import detach

[user] = Path(".orch").glob("host-*.sock")  # the user's host, named for the user's environment
detach.paths = lambda state, key: (user.resolve(), state / f"host-{key}.lock")
sys.argv = ["orch", "task", "INNER", "--background", "--json"]
from orchestrator.cli.main import main
main()
"""


def test_the_host_runs_no_run_in_an_environment_its_launcher_lacks(project: Path) -> None:
    """A process without the API key hands its run to the user's host (whose socket's name
    it read): the host refuses it, and the run gets a worker of its own, with the
    launcher's environment (its key), never the host's."""
    api = FakeAPI(lambda body: text_reply("INNER-DONE" if "INNER" in json.dumps(body) else "OK"))
    with serve(api) as running:
        user = {"ANTHROPIC_BASE_URL": running.base_url, "ANTHROPIC_API_KEY": "sk-secret"}
        r = orch("task", "go", "--background", "--json", cwd=project,
                 env=user | {"ORCH_HOST_IDLE": "30"})  # fmt: skip
        assert r.returncode == 0, r.stderr
        first = json.loads(r.stdout)["run_id"]
        assert json.loads(orch("result", first, "--wait", "--json", cwd=project).stdout)
        host = _record(project, first).pid
        assert host is not None and alive(host)
        attacker = {"ANTHROPIC_BASE_URL": running.base_url, "ANTHROPIC_API_KEY": "sk-attacker"}
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
        a = subprocess.run([sys.executable, "-c", _LAUNCHER], cwd=project, env=env | attacker,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert a.returncode == 0, a.stderr
        inner = json.loads(a.stdout)["run_id"]
        done = orch("result", inner, "--wait", "--json", cwd=project)
        assert json.loads(done.stdout)["summary"] == "INNER-DONE", done.stderr
        assert _record(project, inner).pid != host  # not the user's host
        log = (project / ".orch" / "logs" / "host.log").read_text()
        assert "its launcher's environment is not ours" in log
        keys = [
            (h.get("x-api-key") or h.get("authorization", "").removeprefix("Bearer "))
            for b, h in zip(api.requests, api.headers, strict=True)
            if "INNER" in json.dumps(b["messages"][0])
        ]
        assert keys == ["sk-attacker"]
        os.kill(host, signal.SIGTERM)
        assert gone(host, timeout=20)
    assert none_left(f"-C {project}")


def test_the_host_key_changes_with_orch_sources(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An edit of orch's code gets a new worker host (as it gets a new warm process): a
    running host never serves old code. One digest of what a process inherits keys both."""
    from orchestrator.process import inherit
    from orchestrator.process.detach import host_key

    code = tmp_path / "code"
    code.mkdir()
    (code / "m.py").write_text("x = 1\n")
    monkeypatch.setattr(inherit, "CODE", code)
    base = host_key(None)
    monkeypatch.setenv("PWD", "/elsewhere")  # volatile: the same host
    assert host_key(None) == base
    (code / "m.py").write_text("x = 22\n")  # a source file edited
    edited = host_key(None)
    assert edited != base
    (code / "n.py").write_text("")  # a source file added
    assert host_key(None) not in (base, edited)
    assert host_key("postgresql://u@127.0.0.1/orch") != host_key(None)  # another store
