"""The warm orch of a Ray node (orchestrator/process/cluster/warm.py): one actor per node and
identity that later runs reuse (no second start, no second unbundle of a history the node
holds), a bundle cache per repository, an idle timeout; a foreground root on the cluster.

The cluster tests use a real loopback cluster (tests/raycluster.py, the ``cluster`` fixture
of tests/test_ray.py, a cluster of this module's own) and the real CLI; each gets warm
orchs of its own by forwarding a base URL of its own (the scripted model never calls it):
a different identity. Skipped where Ray is missing, except under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support import init_repo, orch, wait_for, write_script
from tests.test_ray import (
    RayCluster,
    _all_commands,
    cluster,
    git_out,
    runs,
    sleeper,
    started_remotely,
)

__all__ = ["cluster"]  # the fixture, for this module's tests
pytestmark = pytest.mark.ray


def writers(*names: str) -> dict[str, Any]:
    """A root that starts one worktree child per name, each writing ``<name>.txt``."""
    calls = [
        {"tool": "task", "input": {"description": n, "prompt": f"write file {n}",
                                   "isolation": "worktree"}}
        for n in names
    ]  # fmt: skip
    convs: list[dict[str, Any]] = [{"depth": 0, "turns": [{"tool_calls": calls}, {"text": "ok"}]}]
    for n in names:
        convs.append({"depth": 1, "prompt": f"file {n}$", "turns": [
            {"tool_calls": [{"tool": "write_file", "input": {"path": f"{n}.txt",
                                                             "content": f"{n}\n"}}]},
            {"text": f"wrote {n}"},
        ]})  # fmt: skip
    return {"conversations": convs}


def own_identity(cluster: RayCluster, **more: str) -> dict[str, str]:
    """The cluster's env with a base URL no other test forwards: warm orchs of its own."""
    return {**cluster.env, "ANTHROPIC_BASE_URL": f"http://127.0.0.1:9/{uuid.uuid4().hex}", **more}


def warm(cluster: RayCluster) -> dict[str, dict[str, Any]]:
    """Every live warm orch of the cluster, by actor name: its stats (from the node)."""
    code = (
        "import json, sys; from orchestrator.process.cluster.warm import list_stats; "
        "print(json.dumps(list_stats(sys.argv[1])))"
    )
    got = subprocess.run(
        [sys.executable, "-c", code, cluster.info["address"]],
        env={**cluster.env, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    return {s["name"]: s for s in json.loads(got.stdout.strip().splitlines()[-1])}


def task(repo: Path, env: dict[str, str], script: Path, *more: str) -> str:
    got = orch("task", "--executor", "ray", *more, "--model", f"scripted:{script}", "go",
               cwd=repo, env=env, timeout=240)  # fmt: skip
    assert got.returncode == 0, got.stderr
    return got.stdout


def commit(repo: Path, name: str) -> None:
    (repo / name).write_text(f"{name}\n")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", name], cwd=repo, check=True)


def test_later_runs_reuse_each_nodes_warm_orch_and_bring_only_new_commits(
    cluster: RayCluster, tmp_path: Path
) -> None:
    env = own_identity(cluster)
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    before = set(warm(cluster))
    task(repo, env, write_script(repo, writers("a", "b"), "one.yaml"))
    first = {k: v for k, v in warm(cluster).items() if k not in before}
    assert len(first) == 2  # one per node: the two children were spread
    assert {s["node"] for s in first.values()} == {
        r["node"] for r in runs(repo, env) if r["depth"] == 1
    }
    for s in first.values():
        assert (s["started"], s["runs"], s["unbundled"], s["thin"]) == (1, 1, 1, 0)

    task(repo, env, write_script(repo, writers("c", "d"), "two.yaml"))  # same HEAD
    second = warm(cluster)
    for name, s in first.items():
        again = second[name]
        assert again["pid"] == s["pid"] and again["started"] == 1  # the same process
        assert (again["runs"], again["unbundled"]) == (2, 1)  # nothing sent: it had the commit

    commit(repo, "new.txt")  # a commit the nodes lack: only it travels
    task(repo, env, write_script(repo, writers("e", "f"), "three.yaml"))
    third = warm(cluster)
    for name, s in first.items():
        now = third[name]
        assert now["pid"] == s["pid"] and now["repositories"] == 1
        assert (now["runs"], now["unbundled"], now["thin"]) == (3, 2, 1)
    children = [r for r in runs(repo, env) if r["depth"] == 1]
    assert len(children) == 6 and all(r["status"] == "succeeded" for r in children)
    assert all("/ray-" in r["node"] for r in children)
    last = sorted(children, key=lambda r: r["run_id"])
    for child in children:
        branch = f"orch/general/{child['run_id'][2:10]}"
        files = git_out(repo, "ls-tree", "--name-only", branch).split()
        assert "README.md" in files and len(files) in (2, 3)
    assert last  # every child's branch came home, the third round's with new.txt
    assert sum("new.txt" in git_out(repo, "ls-tree", "--name-only",
                                    f"orch/general/{r['run_id'][2:10]}")
               for r in children) == 2  # fmt: skip


ROOT_ON_A_NODE = {
    "conversations": [
        {"depth": 0, "turns": [
            {"tool_calls": [
                {"tool": "write_file", "input": {"path": "root.txt", "content": "root\n"}},
                {"tool": "task", "input": {"description": "kid", "prompt": "write kid",
                                           "isolation": "worktree"}},
            ]},
            {"text": "root finished on its node"},
        ]},
        {"depth": 1, "turns": [
            {"tool_calls": [{"tool": "write_file", "input": {"path": "kid.txt",
                                                             "content": "kid\n"}}]},
            {"text": "kid done"},
        ]},
    ]
}  # fmt: skip


def test_a_foreground_root_runs_on_the_cluster(cluster: RayCluster, tmp_path: Path) -> None:
    env = own_identity(cluster)
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    out = task(repo, env, write_script(repo, ROOT_ON_A_NODE), "--isolation", "worktree")
    assert "root finished on its node" in out  # the foreground command waited and printed it
    rows = runs(repo, env)
    root = next(r for r in rows if r["depth"] == 0)
    kid = next(r for r in rows if r["depth"] == 1)
    assert root["status"] == kid["status"] == "succeeded"
    assert "/ray-" in root["node"] and kid["node"] == root["node"]  # its children: its node
    assert git_out(repo, "show", f"orch/general/{root['run_id'][2:10]}:root.txt") == "root"
    assert git_out(repo, "show", f"orch/general/{kid['run_id'][2:10]}:kid.txt") == "kid"
    assert not (repo / "root.txt").exists()  # the user's checkout is untouched
    assert any(s["runs"] >= 1 for s in warm(cluster).values() if s["node"] == root["node"])


def test_a_warm_orch_ends_itself_once_idle(cluster: RayCluster, tmp_path: Path) -> None:
    env = own_identity(cluster, ORCH_RAY_IDLE_S="2")
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    before = set(warm(cluster))
    task(repo, env, write_script(repo, writers("a"), "one.yaml"))
    wait_for(lambda: not set(warm(cluster)) - before, 90, "the idle warm orch to end")
    env["ORCH_RAY_IDLE_S"] = "600"  # the next one lives on (the cluster ends with the module)
    task(repo, env, write_script(repo, writers("b"), "two.yaml"))  # the same HEAD
    made = [s for k, s in warm(cluster).items() if k not in before]
    # a fresh one (had the first lived on, this would be its second run), its cache anew
    assert [(s["started"], s["runs"], s["unbundled"]) for s in made] == [(1, 1, 1)]
    children = [r for r in runs(repo, env) if r["depth"] == 1]
    assert [r["status"] for r in children] == ["succeeded"] * 2
    assert all("/ray-" in r["node"] for r in children)


def test_a_run_on_a_node_ends_when_its_spawner_dies(cluster: RayCluster, tmp_path: Path) -> None:
    """The warm orch outlives the command; the run does not: Ray removes the reservation
    the dead spawner owned, and the node's orch ends the run then (its sandboxed command
    with it)."""
    env = own_identity(cluster)
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    seconds = 170 + uuid.uuid4().int % 20
    script = write_script(repo, sleeper(seconds))
    full = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")} | env
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "task", "--executor", "ray", "--isolation",
         "worktree", "--model", f"scripted:{script}", "sleep"],
        cwd=repo, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        run_id = wait_for(lambda: next(iter(runs(repo, env)), {}).get("run_id"), 60, "a run")
        started_remotely(repo, env, run_id)
        wait_for(lambda: f"sleep {seconds}" in _all_commands(), 60, "the command to run")
    finally:
        proc.kill()
        proc.wait(30)
    wait_for(lambda: f"sleep {seconds}" not in _all_commands(), 90, "the orphan to end")
    assert sum(s.get("orphaned", 0) for s in warm(cluster).values()) >= 1


# -- the bundle cache, without Ray ---------------------------------------------------------


def _bundle(repo: Path, dest: Path, ref: str, *rest: str) -> bytes:
    head = git_out(repo, "rev-parse", "HEAD")
    subprocess.run(["git", "update-ref", ref, head], cwd=repo, check=True)
    subprocess.run(["git", "bundle", "create", "-q", str(dest), ref, *rest], cwd=repo,
                   check=True)  # fmt: skip
    return dest.read_bytes()


def test_a_nodes_cache_checks_bundles_and_keeps_repositories_apart(tmp_path: Path) -> None:
    """A bundle that builds on commits the cache lacks is refused; a run's repository gets
    the packs of its own repository's cache only."""
    from orchestrator.process.cluster.node import NodeTask
    from orchestrator.process.cluster.warm import BundleCache, _checkout
    from orchestrator.spec import Launch

    a = init_repo(tmp_path / "a", {"README.md": "a\n"})
    a_first = git_out(a, "rev-parse", "HEAD")
    commit(a, "two.txt")
    a_head = git_out(a, "rev-parse", "HEAD")
    b = init_repo(tmp_path / "b", {"README.md": "b\n"})
    b_head = git_out(b, "rev-parse", "HEAD")
    ref = "refs/orch/in/1-x"
    root = tmp_path / "node"
    root.mkdir()

    async def scenario() -> Path:
        cache_a, cache_b = BundleCache(root / "a.git"), BundleCache(root / "b.git")
        thin = _bundle(a, tmp_path / "thin.bundle", ref, f"^{a_first}")
        with pytest.raises(RuntimeError, match="does not fit"):
            await cache_a.take(thin, a_head, ref)  # it lacks what the bundle builds on
        assert not await cache_a.has(a_head)
        assert await cache_a.take(_bundle(a, tmp_path / "a.bundle", ref), a_head, ref) == 0
        assert await cache_b.take(_bundle(b, tmp_path / "b.bundle", ref), b_head, ref) == 0
        with pytest.raises(RuntimeError, match="does not hold"):  # a start it does not name
            await cache_b.take(_bundle(b, tmp_path / "b2.bundle", ref), a_head, ref)
        spec = NodeTask(run_id="r-1", start=b_head, bundle_ref=ref, repo_key="0" * 64,
                        settings={}, launch=Launch(), max_bundle=1 << 20)  # fmt: skip
        made = await _checkout(spec, cache_b.packs(), tmp_path / "run")
        return made.main_root

    run = asyncio.run(scenario())
    assert (run / "README.md").read_text() == "b\n"
    assert git_out(run, "rev-parse", "HEAD") == b_head
    for sha in (a_first, a_head):  # nothing of repository a reached b's run
        assert subprocess.run(["git", "cat-file", "-e", sha], cwd=run).returncode != 0


@pytest.mark.parametrize(
    "answer", [["has", True], {"has": True}, {"has": "yes", "tips": "abc"}, None, "x" * 10]
)
def test_a_nodes_malformed_answer_on_its_cache_is_a_clean_error(answer: Any) -> None:
    """What a node says its cache holds is data: anything but ``{"has": bool, "tips":
    [...]}`` is one clear error, never a KeyError or a bundle chosen from it."""
    from orchestrator.errors import OrchError
    from orchestrator.process.cluster.driver import RayExecutor

    class Have:
        @staticmethod
        async def remote(*_: Any) -> Any:
            return answer

    class Actor:
        have = Have()

    executor = object.__new__(RayExecutor)
    executor._known = set()
    executor._secrets = {}
    with pytest.raises(OrchError, match="malformed"):
        asyncio.run(executor._bundle_for(Actor(), "n1", None, "a" * 40, "k"))  # type: ignore[arg-type]


def test_bundles_of_one_commit_made_at_once_are_each_whole(tmp_path: Path) -> None:
    """Two children sent to two nodes at once each need the new commit: their thin bundles
    share its ref name (made, bundled, deleted); made one after the other, each is whole."""
    from orchestrator.process.cluster.warm import thin_bundle
    from orchestrator.project.repo import discover_sync
    from orchestrator.workspaces.container.transfer import bundle_ref

    root = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    commit(root, "new.txt")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    repo = discover_sync(root)
    dests = [tmp_path / f"b{i}.bundle" for i in range(8)]

    async def one(i: int, dest: Path) -> None:
        await asyncio.sleep(i * 0.004)  # the nodes answer a moment apart
        await thin_bundle(repo, head, dest, bundle_ref(head), [base])

    async def at_once() -> None:
        await asyncio.gather(*(one(i, d) for i, d in enumerate(dests)))

    asyncio.run(at_once())
    for d in dests:
        listed = subprocess.run(["git", "bundle", "list-heads", str(d)], cwd=root,
                                capture_output=True, text=True, check=True)  # fmt: skip
        assert listed.stdout.split() == [head, bundle_ref(head)]
    refs = subprocess.run(["git", "for-each-ref", "refs/orch/in"], cwd=root,
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert refs.stdout == ""  # each ref was deleted after its bundle
