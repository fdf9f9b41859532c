"""Runs on a real multi-node Ray cluster (tests/raycluster.py: a head and worker nodes, all
on 127.0.0.1), driven through the real CLI: where runs execute, what comes back, cancel
from another process, a node that dies, secrets, and that nothing leaves loopback.

Skipped where Ray is not installed (``pip install 'orch[ray]'``), except under
``CI=true`` where that fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.fakeapi import FakeAPI, serve, text_reply, tool_reply
from tests.pgserver import PASSWORD, PASSWORD_ROLE, PgServer
from tests.raycluster import LOOPBACK_ENV
from tests.support import init_repo, orch, wait_for, write_script
from tests.test_store_hidden import check_peek, spy, store_a_private_prompt

pytestmark = pytest.mark.ray
HERE = Path(__file__).parent


@dataclass
class RayCluster:
    proc: subprocess.Popen[str]
    info: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)

    def ask(self, line: str, timeout: float = 120) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def pids(self) -> set[int]:
        """Every process of the cluster: the helper and all its descendants."""
        found = {self.proc.pid}
        grew = True
        while grew:
            grew = False
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid in found and int(entry.name) not in found:
                    found.add(int(entry.name))
                    grew = True
        return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but Ray is not installed: .ci/run installs '.[dev,ray]'")
        pytest.skip("Ray is not installed: pip install 'orch[ray]'")
    where = tmp_path_factory.mktemp("ray")
    env = {**os.environ, **LOOPBACK_ENV}
    env.pop("RAY_ADDRESS", None)
    with (where / "log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "raycluster.py"), str(where)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            text=True, env=env, cwd=where, start_new_session=True,
        )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        proc.wait(10)
        pytest.fail(f"the Ray cluster did not start: {(where / 'log').read_text()[-2000:]}")
    info = json.loads((where / "cluster.json").read_text())
    running = RayCluster(proc, info, {"RAY_ADDRESS": info["address"], **LOOPBACK_ENV})
    try:
        yield running
    finally:
        try:
            running.ask("quit")
            proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def runs(repo: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    got = orch("ps", "--all", "--json", cwd=repo, env=env)
    assert got.returncode == 0, got.stderr
    rows: list[dict[str, Any]] = json.loads(got.stdout)
    return rows


def git_out(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()


def non_loopback(pids: set[int]) -> list[str]:
    """TCP connections of these processes whose peer is not a loopback address."""
    out = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True, check=True).stdout
    bad = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if not owners & pids:
            continue
        peer = line.split()[4]
        host = peer.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
        if not (host.startswith("127.") or host == "::1"):
            bad.append(line)
    return bad


TWO_WRITERS = {
    "conversations": [
        {"depth": 0, "turns": [
            {"tool_calls": [
                {"tool": "task", "input": {"description": "write a", "prompt": "write file a",
                                           "isolation": "worktree"}},
                {"tool": "task", "input": {"description": "write b", "prompt": "write file b",
                                           "isolation": "worktree"}},
            ]},
            {"text": "both done"},
        ]},
        {"depth": 1, "prompt": "file a", "latency_s": 0.5, "turns": [
            {"tool_calls": [{"tool": "write_file", "input": {"path": "a.txt",
                                                             "content": "from a\n"}}]},
            {"text": "wrote a"},
        ]},
        {"depth": 1, "prompt": "file b", "latency_s": 0.5, "turns": [
            {"tool_calls": [{"tool": "bash", "input": {"command": "echo from b > b.txt"}}]},
            {"text": "wrote b"},
        ]},
    ]
}  # fmt: skip


def test_worktree_children_spread_over_two_nodes_and_come_back_as_branches(
    cluster: RayCluster, tmp_path: Path
) -> None:
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    script = write_script(repo, TWO_WRITERS)
    got = orch(
        "task", "--executor", "ray", "--model", f"scripted:{script}", "--json", "write two",
        cwd=repo, env=cluster.env, timeout=180,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    rows = runs(repo, cluster.env)
    root = next(r for r in rows if r["depth"] == 0)
    children = [r for r in rows if r["depth"] == 1]
    assert len(children) == 2 and all(r["status"] == "succeeded" for r in children)
    assert "/ray-" not in (root["node"] or "")  # a shared-tier root stays in its process
    nodes = {r["node"] for r in children}
    ids = {cluster.info["head"][:8], cluster.info["worker"][:8]}
    assert {n.rsplit("/ray-", 1)[1] for n in nodes} == ids  # one child on each node
    for child in children:
        result = json.loads(orch("result", child["run_id"], "--json", cwd=repo).stdout)
        (art,) = result["artifacts"]
        assert art["kind"] == "branch" and art["files_changed"] == 1
        assert git_out(repo, "rev-parse", f"refs/heads/{art['branch']}") == art["commit"]
    branches = git_out(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/orch/")
    assert len(branches.split()) == 2
    for branch in branches.split():
        merged = orch("worktrees", "merge", branch, cwd=repo)
        assert merged.returncode == 0, merged.stderr
    assert (repo / "a.txt").read_text() == "from a\n"
    assert (repo / "b.txt").read_text() == "from b\n"
    assert git_out(repo, "status", "--porcelain") == ""
    assert non_loopback(cluster.pids()) == []


def sleeper(seconds: int, *, write: str = "") -> dict[str, Any]:
    before = f"echo {write} > progress.txt && " if write else ""
    return {
        "conversations": [
            {"depth": 0, "turns": [
                {"tool_calls": [{"tool": "bash", "input": {
                    "command": f"{before}sleep {seconds}", "timeout_s": seconds + 60}}]},
                {"text": "slept"},
            ]},
        ]
    }  # fmt: skip


def ended(repo: Path, env: dict[str, str], run_id: str) -> dict[str, Any] | None:
    """The run's ps row once it has ended, else None."""
    row = next(r for r in runs(repo, env) if r["run_id"] == run_id)
    return row if row["status"] not in ("queued", "running") else None


def started_remotely(repo: Path, env: dict[str, str], run_id: str) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        row = next(r for r in runs(repo, env) if r["run_id"] == run_id)
        return row if row["status"] == "running" and "/ray-" in (row["node"] or "") else None

    found: dict[str, Any] = wait_for(check, 120, "the run to start on a node")
    return found


def sleeping_on_a_node(
    cluster: RayCluster, tmp_path: Path, write: str = ""
) -> tuple[Path, str, int, dict[str, Any]]:
    """A background worktree run on a node whose command sleeps (a unique duration, to find
    it in ``ps``): its repository, id, seconds and ps row once the sleep runs."""
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    seconds = 170 + uuid.uuid4().int % 20
    script = write_script(repo, sleeper(seconds, write=write))
    got = orch(
        "task", "--executor", "ray", "--isolation", "worktree", "--background", "--json",
        "--model", f"scripted:{script}", "sleep", cwd=repo, env=cluster.env,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    run_id = json.loads(got.stdout)["run_id"]
    row = started_remotely(repo, cluster.env, run_id)
    wait_for(lambda: f"sleep {seconds}" in _all_commands(), 60, "the command to run")
    return repo, run_id, seconds, row


def test_cancel_from_another_process_reaches_a_run_on_a_node(
    cluster: RayCluster, tmp_path: Path
) -> None:
    repo, run_id, seconds, _ = sleeping_on_a_node(cluster, tmp_path)
    cancelled = orch("cancel", run_id, cwd=repo, env=cluster.env)
    assert cancelled.returncode == 0, cancelled.stderr

    row = wait_for(lambda: ended(repo, cluster.env, run_id), 60, "the run to end")
    assert row["status"] == "cancelled"
    wait_for(lambda: f"sleep {seconds}" not in _all_commands(), 30, "the command to be killed")


def _all_commands() -> str:
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_a_node_that_dies_leaves_its_run_interrupted_and_the_store_whole(
    cluster: RayCluster, tmp_path: Path
) -> None:
    # a node of its own, the only one with enough orch_slots for the run's request
    node = cluster.ask("add 8")
    home = Path(os.environ["HOME"])
    (home / ".orch").mkdir(exist_ok=True)
    (home / ".orch" / "config.toml").write_text("[ray]\nslots = 5\n")
    repo, run_id, seconds, row = sleeping_on_a_node(cluster, tmp_path, write="halfway")
    assert row["node"].endswith(node[:8])
    assert cluster.ask("kill " + node) == "killed"

    row = wait_for(lambda: ended(repo, cluster.env, run_id), 90, "the run to end")
    assert row["status"] == "interrupted"
    result = json.loads(orch("result", run_id, "--json", cwd=repo).stdout)
    assert "was lost" in result["error"] and node[:8] in result["error"]
    logs = orch("logs", run_id, "--json", cwd=repo, env=cluster.env)
    events = [e["kind"] for e in json.loads(logs.stdout)]
    assert "run_started" in events and "tool_call" in events  # what it wrote is kept
    assert events[-1] == "run_finished"


def _first_text(body: dict[str, Any]) -> str:
    content = body["messages"][0]["content"]
    return content if isinstance(content, str) else json.dumps(content)


def _api_responder(body: dict[str, Any]) -> dict[str, Any]:
    turn = len(body["messages"]) // 2
    if "child-task" in _first_text(body):  # the child, on a node
        if turn == 0:
            return tool_reply(("write_file", {"path": "k.txt", "content": "from the node\n"}))
        return text_reply("child wrote k.txt")
    if turn == 0:
        return tool_reply(
            ("task", {"description": "on a node", "prompt": "child-task: write k.txt",
                      "isolation": "worktree"})
        )  # fmt: skip
    return text_reply("root done")


def test_the_api_key_reaches_nodes_through_the_runtime_env_and_nowhere_else(
    cluster: RayCluster, tmp_path: Path
) -> None:
    key = "sk-ant-test-" + uuid.uuid4().hex
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    with serve(FakeAPI(_api_responder)) as api:
        env = {**cluster.env, "ANTHROPIC_API_KEY": key, "ANTHROPIC_BASE_URL": api.base_url}
        got = orch("task", "--executor", "ray", "--model", "sonnet", "go", cwd=repo, env=env,
                   timeout=180)  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert "root done" in got.stdout
    child = next(r for r in runs(repo, cluster.env) if r["depth"] == 1)
    assert child["status"] == "succeeded" and "/ray-" in child["node"]
    # the child's requests came from its node, with the key, through the real SDK
    child_calls = [h for b, h in zip(api.requests, api.headers, strict=True)
                   if "child-task" in _first_text(b)]  # fmt: skip
    assert len(child_calls) == 2
    assert all(key in h.get("x-api-key", "") + h.get("authorization", "") for h in child_calls)
    assert git_out(repo, "show", f"orch/general/{child['run_id'][2:10]}:k.txt") == "from the node"
    # ... and the key is in no file of the store, orch's logs, or the cluster's logs
    leaks = [
        str(p) for top in (repo / ".orch", Path(cluster.info["temp_dir"]))
        for p in top.rglob("*") if p.is_file() and key.encode() in p.read_bytes()
    ]  # fmt: skip
    assert leaks == []
    assert key not in got.stdout + got.stderr


def test_a_container_child_runs_on_a_node_with_that_nodes_docker(
    cluster: RayCluster, tmp_path: Path
) -> None:
    image = "orch-sandbox:latest"
    have = subprocess.run(["docker", "image", "inspect", image], capture_output=True)
    if have.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {image} is missing (tests/test_container.py builds it)")
        pytest.skip(f"{image} is missing: run `orch sandbox build`")
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    script = write_script(repo, {
        "conversations": [
            {"depth": 0, "turns": [
                {"tool_calls": [{"tool": "task", "input": {
                    "description": "boxed", "prompt": "write in a box",
                    "isolation": "container"}}]},
                {"text": "done"},
            ]},
            {"depth": 1, "turns": [
                {"tool_calls": [{"tool": "bash", "input": {
                    "command": "id -u > uid.txt && echo boxed > c.txt"}}]},
                {"text": "boxed"},
            ]},
        ]
    })  # fmt: skip
    got = orch("task", "--executor", "ray", "--model", f"scripted:{script}", "box it",
               cwd=repo, env=cluster.env, timeout=300)  # fmt: skip
    assert got.returncode == 0, got.stderr
    child = next(r for r in runs(repo, cluster.env) if r["depth"] == 1)
    assert child["status"] == "succeeded" and child["isolation"] == "container"
    assert "/ray-" in child["node"]
    branch = f"orch/general/{child['run_id'][2:10]}"
    assert git_out(repo, "show", f"{branch}:c.txt") == "boxed"
    assert git_out(repo, "show", f"{branch}:uid.txt") == "10001"  # the sandbox user
    assert subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=orch.run_id={child['run_id']}"],
        capture_output=True, text=True, check=True,
    ).stdout.strip() == ""  # fmt: skip


def test_a_resumed_run_continues_its_branch_on_a_node(cluster: RayCluster, tmp_path: Path) -> None:
    home = Path(os.environ["HOME"])
    (home / ".orch").mkdir(exist_ok=True)
    (home / ".orch" / "config.toml").write_text('executor = "ray"\n')  # every command
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})

    def writer(path: str) -> dict[str, Any]:
        return {"conversations": [{"turns": [
            {"tool_calls": [{"tool": "write_file", "input": {"path": path, "content": "x\n"}}]},
            {"text": f"wrote {path}"},
        ]}]}  # fmt: skip

    first = orch(
        "task", "--isolation", "worktree", "--background", "--json", "--model",
        f"scripted:{write_script(repo, writer('one.txt'), 'one.yaml')}", "one",
        cwd=repo, env=cluster.env,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    old = json.loads(first.stdout)["run_id"]
    done = orch("result", old, "--wait", "--json", cwd=repo, env=cluster.env, timeout=180)
    assert json.loads(done.stdout)["status"] == "succeeded", done.stdout
    again = orch(
        "resume", old, "two", "--background", "--json", "--model",
        f"scripted:{write_script(repo, writer('two.txt'), 'two.yaml')}",
        cwd=repo, env=cluster.env,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    new = json.loads(again.stdout)["run_id"]
    got = json.loads(
        orch("result", new, "--wait", "--json", cwd=repo, env=cluster.env, timeout=180).stdout
    )
    assert got["status"] == "succeeded" and got["resumed_from"] == old
    assert "/ray-" in got["node"]
    branch = f"orch/general/{old[2:10]}"
    (art,) = got["artifacts"]
    assert art["branch"] == branch
    assert git_out(repo, "ls-tree", "--name-only", branch).split() == [
        "README.md", "one.txt", "two.txt",
    ]  # fmt: skip


def test_a_nodes_result_may_only_name_orch_branches_it_holds(tmp_path: Path) -> None:
    """A node's answer is data: refs outside orch/*, or heads its bundle does not hold,
    are refused before any ref moves."""
    from orchestrator.errors import OrchError
    from orchestrator.process.cluster.driver import RayExecutor
    from orchestrator.process.cluster.node import NodeResult
    from orchestrator.project.repo import discover_sync
    from orchestrator.run import RunRecord
    from tests.support import harness

    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    base = git_out(repo, "rev-parse", "HEAD")
    subprocess.run(["git", "checkout", "-q", "-b", "orch/general/abc"], cwd=repo, check=True)
    (repo / "w.txt").write_text("work\n")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "w"], cwd=repo, check=True)
    tip = git_out(repo, "rev-parse", "HEAD")
    bundle = tmp_path / "b.bundle"
    subprocess.run(["git", "bundle", "create", "-q", str(bundle), "orch/general/abc", f"^{base}"],
                   cwd=repo, check=True)  # fmt: skip
    subprocess.run(["git", "checkout", "-q", "main"], cwd=repo, check=True)
    subprocess.run(["git", "branch", "-qD", "orch/general/abc"], cwd=repo, check=True)
    h = harness(repo, {"conversations": [{"turns": [{"text": "x"}]}]})
    executor = RayExecutor(h.runner)
    main = discover_sync(repo).main()
    rec = RunRecord(run_id="r-000000000001", chain_id="c-1")
    h.store.create_run(rec)
    data = bundle.read_bytes()
    for heads in (
        {"refs/heads/main": tip},  # not an orch branch
        {"refs/heads/orch/../main": tip},
        {"refs/heads/orch/general/abc": base},  # not what the bundle holds
        {"refs/tags/orch/x": tip},
    ):
        bad = NodeResult(node="n", status="succeeded", heads=heads, bundle=data)
        with pytest.raises(OrchError, match="bad ref"):
            asyncio.run(executor._take(main, rec, bad, None))
        assert git_out(repo, "rev-parse", "main") == base
    good = NodeResult(
        node="n", status="succeeded", heads={"refs/heads/orch/general/abc": tip}, bundle=data
    )
    asyncio.run(executor._take(main, rec, good, None))
    assert git_out(repo, "rev-parse", "orch/general/abc") == tip
    assert git_out(repo, "rev-parse", "main") == base


def test_a_repository_cannot_send_runs_to_a_cluster_of_its_choosing(tmp_path: Path) -> None:
    """``executor`` and ``[ray]`` decide where the runs (and the API key) go: a cloned
    repository's own values are left out until the user trusts it."""
    from orchestrator.config import load_settings_with_trust

    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    (repo / "orch.toml").write_text(
        'executor = "ray"\nmodel = "haiku"\n[ray]\naddress = "127.0.0.1:9"\n'
    )
    settings, trust = load_settings_with_trust(repo)
    assert settings.executor == "local" and settings.ray.address is None
    assert settings.model == "haiku"  # the rest of the file applies
    assert {"executor", "ray"} <= set(trust.left_out)
    got = orch("task", "--model", "scripted:/nonexistent", "x", cwd=repo)
    assert "executor" in got.stderr and "orch trust" in got.stderr
    # the user's own choice applies at once
    home = Path(os.environ["HOME"])
    (home / ".orch").mkdir(exist_ok=True)
    (home / ".orch" / "config.toml").write_text('executor = "ray"\n[ray]\nslots = 2\n')
    mine, _ = load_settings_with_trust(tmp_path)
    assert mine.executor == "ray" and mine.ray.slots == 2


def test_reconcile_judges_an_owner_on_another_node_by_its_heartbeat(tmp_path: Path) -> None:
    """A pid means nothing on another node: a run owned there stays while its heartbeat is
    fresh (even if that pid is dead here, or alive here as something else) and becomes
    interrupted once it is stale, with nothing of it reaped here."""
    from orchestrator.engine import owner as background
    from orchestrator.process.reconcile import reconcile
    from orchestrator.run import RunRecord, RunStatus, now
    from orchestrator.store import SqliteStore

    store = SqliteStore(tmp_path / "orch.db")
    here = background.this_node()
    mine_dead = RunRecord(run_id="r-00000000000a", chain_id="c-1", status=RunStatus.RUNNING,
                          pid=2**22 + 7, node=here)  # fmt: skip
    remote = RunRecord(run_id="r-00000000000b", chain_id="c-1", status=RunStatus.RUNNING,
                       pid=2**22 + 7, node="elsewhere/ray-12345678")  # fmt: skip
    remote_init = RunRecord(run_id="r-00000000000c", chain_id="c-1", status=RunStatus.RUNNING,
                            pid=1, node="elsewhere/ray-87654321")  # fmt: skip
    for rec in (mine_dead, remote, remote_init):
        store.create_run(rec)
    store.register_resource(remote.run_id, "pgroup", "1:0")  # pid 1's group: never ours
    store.heartbeat([remote.run_id, remote_init.run_id])
    fixed = {r.run_id for r in reconcile(store)}
    assert fixed == {mine_dead.run_id}  # a dead local pid; the remote ones beat
    # stale heartbeats: both remote runs are gone, whatever their pid is here
    store.update_run(remote.run_id, started_at=now() - 3600)
    with store.dialect.transaction() as query:
        query("UPDATE runs SET heartbeat_at = ?", (now() - background.REMOTE_STALE_S - 5,))
    ended = {r.run_id: r for r in reconcile(store)}
    assert set(ended) == {remote.run_id, remote_init.run_id}
    assert all(r.status == RunStatus.INTERRUPTED for r in ended.values())
    assert "on elsewhere/ray-12345678 is gone" in (ended[remote.run_id].error or "")
    assert store.resources(remote.run_id)  # its node's: nothing reaped from here


def test_runs_on_the_cluster_are_recorded_in_postgres_and_seen_from_anywhere(
    cluster: RayCluster, tmp_path: Path, pg_server: PgServer
) -> None:
    """The shared store: children on both nodes write the same Postgres database (through
    a password-protected role); `ps`, `result` and `tree` from another directory with only
    the store's URL see them; the password is nowhere in a task's arguments, logs or output."""
    name = f"t_ray_{uuid.uuid4().hex[:8]}"
    pg_server.create_database(name, owner=PASSWORD_ROLE)
    try:
        url = pg_server.url(name, user=PASSWORD_ROLE, password=PASSWORD)
        env = {**cluster.env, "ORCH_STORE": url}
        repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
        script = write_script(repo, TWO_WRITERS)
        got = orch("task", "--executor", "ray", "--model", f"scripted:{script}", "write two",
                   cwd=repo, env=env, timeout=180)  # fmt: skip
        assert got.returncode == 0, got.stderr
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        rows = runs(elsewhere, env)
        children = [r for r in rows if r["depth"] == 1]
        assert len(children) == 2 and all(r["status"] == "succeeded" for r in children)
        assert len({r["node"] for r in children}) == 2
        assert all("/ray-" in r["node"] for r in children)
        tree = orch("tree", rows[0]["run_id"], "--json", cwd=elsewhere, env=env)
        assert tree.returncode == 0 and all(r["run_id"] in tree.stdout for r in children)
        assert not (repo / ".orch" / "orch.db").exists()  # nothing went to SQLite
        for child in children:
            (art,) = json.loads(orch("result", child["run_id"], "--json", cwd=elsewhere,
                                     env=env).stdout)["artifacts"]  # fmt: skip
            assert git_out(repo, "rev-parse", f"refs/heads/{art['branch']}") == art["commit"]
        leaks = [
            str(p) for top in (repo / ".orch", Path(cluster.info["temp_dir"]))
            for p in top.rglob("*") if p.is_file() and PASSWORD.encode() in p.read_bytes()
        ]  # fmt: skip
        assert leaks == [] and PASSWORD not in got.stdout + got.stderr
        assert PASSWORD not in pg_server.dump(name)
    finally:
        pg_server.drop_database(name)


def test_a_worktree_child_on_a_node_cannot_read_the_spawners_store(
    cluster: RayCluster, outside_tmp: Path
) -> None:
    """Issue 20, class 6: the node's sandbox hides the store the run writes to (the
    spawner's SQLite file, not only the node's clone's .orch); another run's prompt in it
    never reaches the child's model."""
    repo = init_repo(outside_tmp / "repo", {"README.md": "hi\n"})
    secret = store_a_private_prompt(repo, cluster.env)
    db = repo / ".orch" / "orch.db"
    api = FakeAPI(spy(db, delegate=True))
    with serve(api):
        env = {
            **cluster.env,
            "ANTHROPIC_API_KEY": "sk-ant-test",
            "ANTHROPIC_BASE_URL": api.base_url,
        }
        got = orch("task", "--executor", "ray", "--model", "sonnet", "go", cwd=repo, env=env,
                   timeout=180)  # fmt: skip
    assert got.returncode == 0, got.stderr
    child = next(r for r in runs(repo, cluster.env) if r["depth"] == 1)
    assert child["status"] == "succeeded" and "/ray-" in child["node"]  # it ran on a node
    check_peek(api, db, secret)


def test_a_node_runs_with_the_spawners_api_settings_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's own base URL (or token) never pairs with the spawner's key: a name the
    spawner does not set is unset for the run, and everything is back afterwards."""
    from orchestrator.process.cluster.driver import FORWARDED_ENV
    from orchestrator.process.cluster.node import spawner_env

    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://node-own.invalid")
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", "node-token")
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    secrets = {k: "" for k in FORWARDED_ENV} | {"ANTHROPIC_API_KEY": "sk-spawner"}
    with spawner_env(secrets):
        assert os.environ.get("ANTHROPIC_API_KEY") == "sk-spawner"
        assert "ANTHROPIC_BASE_URL" not in os.environ
        assert "ANTHROPIC_AUTH_TOKEN" not in os.environ
    assert os.environ["ANTHROPIC_BASE_URL"] == "http://node-own.invalid"
    assert os.environ["ANTHROPIC_AUTH_TOKEN"] == "node-token"
    assert "ANTHROPIC_API_KEY" not in os.environ
