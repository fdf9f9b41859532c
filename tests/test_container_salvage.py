"""A container run whose orch process dies keeps its work: reconcile salvages it.

Each test starts ``orch task --background --isolation container`` (a real worker process,
the scripted model), SIGKILLs the worker while the agent's bash runs in the container,
and lets the next ``orch ps`` reconcile it: the work comes out through the same export as
a close (commit inside, capped bundle, hardened unbundle, compare-and-swap onto
``orch/<agent>/<id>``), with the repository, branch and starting commit taken from the run
record. A hostile agent's plants run nothing on the host; when nothing can be kept (engine
unreachable, container gone, bundle too large) the run still ends ``interrupted``, saying
why. Checkpoint refs of nested children are pruned.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.store import open_store
from tests.support import alive, init_repo, wait_for
from tests.test_container import engine, labelled, leftovers, sandbox_image, sh
from tests.test_container_boundary import _plant

__all__ = ["engine", "sandbox_image"]  # module fixtures shared with test_container

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("hermetic_git")]


def make_repo(path: Path, toml: str = "") -> Path:
    files = {"README.md": "# demo\n", "src/app.py": "def main() -> int:\n    return 42\n"}
    repo = init_repo(path, files)
    if toml:
        (repo / "orch.toml").write_text(toml)
        sh(repo, "add", "orch.toml")
        sh(repo, "commit", "-qm", "settings")
    return repo


def orch(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=repo,
                          env={**base, **env}, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def inside(container_id: str, command: str) -> str:
    return subprocess.run(["docker", "exec", container_id, "sh", "-c", command],
                          capture_output=True, text=True).stdout  # fmt: skip


def start(repo: Path, conversations: list[dict[str, Any]], ready: str = "started") -> str:
    """A background container run whose bash has made ``ready`` (in the last container
    started); returns its run id."""
    script = repo.parent / f"{repo.name}-script.yaml"
    script.write_text(yaml.safe_dump({"conversations": conversations}))
    r = orch(repo, "task", "crash me", "--background", "--isolation", "container", "--json",
             "--model", f"scripted:{script}")  # fmt: skip
    assert r.returncode == 0, r.stderr
    run_id: str = json.loads(r.stdout)["run_id"]
    chain = open_store(repo).require_run(run_id).chain_id
    wait_for(lambda: any("yes" in inside(c, f"test -f {ready} && echo yes")
                         for c in labelled(f"orch.chain_id={chain}")), 60)  # fmt: skip
    return run_id


def kill_owner(repo: Path, run_id: str) -> None:
    worker = open_store(repo).require_run(run_id).pid
    assert worker is not None
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: not alive(worker), 10)


def bash(command: str) -> dict[str, Any]:
    return {"tool": "bash", "input": {"command": command}}


def one_turn(command: str) -> list[dict[str, Any]]:
    return [{"turns": [{"tool_calls": [bash(command)]}, {"text": "never"}]}]


def ended(repo: Path, run_id: str, **env: str) -> dict[str, Any]:
    r = orch(repo, "ps", "--json", **env)  # reconciles first
    assert r.returncode == 0, r.stderr
    rows = {x["run_id"]: x for x in json.loads(r.stdout)}
    assert rows[run_id]["status"] == "interrupted"
    return open_store(repo).require_run(run_id).model_dump()


# -- the work is kept ---------------------------------------------------------------------


def test_a_sigkilled_container_run_keeps_its_work(tmp_path: Path, sandbox_image: str) -> None:
    repo = make_repo(tmp_path / "proj")
    write = (
        "mkdir -p out && for i in 1 2 3; do echo line-$i > out/f$i.txt; done && "
        "echo changed >> README.md && rm src/app.py && echo x > started && sleep 60"
    )
    run_id = start(repo, one_turn(write))
    [cid] = labelled(f"orch.run_id={run_id}")
    kill_owner(repo, run_id)
    rec = ended(repo, run_id)
    branch = f"orch/general/{run_id[2:10]}"
    tip = sh(repo, "rev-parse", branch)
    assert f"kept work on branch {branch} at {tip}" in rec["error"]
    assert f"removed container {cid[:12]}" in rec["error"]
    changed = sh(repo, "diff", "--name-status", "HEAD", branch).splitlines()
    assert sorted(changed) == ["A\tout/f1.txt", "A\tout/f2.txt", "A\tout/f3.txt",
                               "A\tstarted", "D\tsrc/app.py", "M\tREADME.md"]  # fmt: skip
    assert sh(repo, "show", f"{branch}:out/f2.txt") == "line-2"
    message = sh(repo, "log", "-1", "--format=%an%n%B", branch)
    assert "orch general" in message and f"orch-run: {run_id}" in message
    assert "orch-status: interrupted" in message
    assert sh(repo, "rev-parse", f"{branch}~1") == sh(repo, "rev-parse", "HEAD")
    assert not labelled(f"orch.run_id={run_id}") and leftovers(repo) == []
    assert open_store(repo).resources(run_id) == []
    assert sh(repo, "status", "--porcelain") == ""  # the user's checkout is untouched


def test_a_hostile_agents_plants_come_out_as_data_only(tmp_path: Path, sandbox_image: str) -> None:
    repo = make_repo(tmp_path / "proj")
    mark = tmp_path / "MARK"
    config_before = (repo / ".git" / "config").read_bytes()
    hooks_before = sorted(p.name for p in (repo / ".git" / "hooks").iterdir())
    plant = _plant(mark, repo)
    # after the crash a setsid leftover keeps swapping a link (atomically: the path is always
    # there, so git's add does not fail on a vanished file) while the salvage runs
    flip = f"ln -sfn {repo}/.git/hooks t1 && mv -T t1 hooklink; ln -sfn / t2 && mv -T t2 hooklink"
    racer = f"setsid bash -c 'while :; do {flip}; done' >/dev/null 2>&1 </dev/null &"
    run_id = start(repo, [{"turns": [
        {"tool_calls": [{"tool": "write_file", "input": {"path": "plant.sh", "content": plant}}]},
        {"tool_calls": [bash(f"bash plant.sh && rm plant.sh && {racer} echo x > started; "
                             "sleep 60")]},
        {"text": "never"},
    ]}])  # fmt: skip
    kill_owner(repo, run_id)
    rec = ended(repo, run_id)
    branch = f"orch/general/{run_id[2:10]}"
    assert f"kept work on branch {branch}" in rec["error"], rec["error"]
    files = set(sh(repo, "ls-tree", "-r", "--name-only", branch).split())
    assert {"work.txt", ".gitattributes", ".gitmodules", "nested", "host-config-link",
            "hard-linked-head"} <= files  # fmt: skip
    tree = sh(repo, "ls-tree", "-r", branch)
    assert "160000 commit" in next(x for x in tree.splitlines() if x.endswith("\tnested"))
    assert "120000 blob" in next(x for x in tree.splitlines() if x.endswith("host-config-link"))
    assert "120000 blob" in next(x for x in tree.splitlines() if x.endswith("\thooklink"))
    r = orch(repo, "worktrees", "list")  # the host reads the salvaged branch
    assert r.returncode == 0, r.stderr
    assert not mark.exists(), sorted(p.name for p in mark.iterdir())  # nothing ran on the host
    assert (repo / ".git" / "config").read_bytes() == config_before
    assert sorted(p.name for p in (repo / ".git" / "hooks").iterdir()) == hooks_before
    assert not (repo / "work.txt").exists() and not (repo / "nested").exists()
    assert not labelled(f"orch.run_id={run_id}") and leftovers(repo) == []


# -- when nothing can be kept -----------------------------------------------------------------


def test_salvage_failures_end_the_run_interrupted_with_a_reason(
    tmp_path: Path, sandbox_image: str
) -> None:
    small = "[sandbox]\nbundle_max_bytes = 100000\n"
    repos = {k: make_repo(tmp_path / k, small) for k in ("down", "gone", "big")}
    cmds = {"down": "echo kept > k.txt", "gone": "echo lost > l.txt",
            "big": "head -c 300000 /dev/urandom > noise.bin"}  # fmt: skip
    runs = {k: start(repos[k], one_turn(f"{cmds[k]} && echo x > started && sleep 60"))
            for k in repos}  # fmt: skip
    cids = {k: labelled(f"orch.run_id={runs[k]}")[0] for k in repos}
    for k in repos:
        kill_owner(repos[k], runs[k])
    try:
        # the engine is unreachable: interrupted, saying so; the container is left to its TTL
        rec = ended(repos["down"], runs["down"], DOCKER_HOST="unix:///nonexistent/docker.sock")
        assert f"could not reach container {cids['down'][:12]} to keep its work" in rec["error"]
        assert "Docker is not reachable" in rec["error"]
        assert open_store(repos["down"]).resources(runs["down"]) == []
        # the container is gone already
        subprocess.run(["docker", "rm", "-f", cids["gone"]], check=True, capture_output=True)
        rec = ended(repos["gone"], runs["gone"])
        assert f"container {cids['gone'][:12]} was already gone" in rec["error"]
        # the work is over sandbox.bundle_max_bytes: not taken, so never removed (its TTL
        # ends it; salvage removes only what it exported)
        rec = ended(repos["big"], runs["big"])
        assert "sandbox.bundle_max_bytes (100,000 bytes)" in rec["error"]
        assert f"container {cids['big'][:12]}" in rec["error"]
        assert "left it running until its TTL" in rec["error"]
        assert labelled(f"orch.run_id={runs['big']}") == [cids["big"]]
        for k in ("gone", "big"):
            assert sh(repos[k], "branch", "--list", "orch/*") == ""
            assert leftovers(repos[k]) == []
    finally:
        for k in ("down", "big"):
            subprocess.run(["docker", "rm", "-f", cids[k]], capture_output=True)


# -- checkpoints of nested children ----------------------------------------------------------


def test_a_crash_under_a_nested_child_salvages_both_and_drops_its_checkpoint(
    tmp_path: Path, sandbox_image: str
) -> None:
    repo = make_repo(tmp_path / "proj")
    run_id = start(repo, [
        {"depth": 0, "turns": [
            {"tool_calls": [bash("echo parent > p.txt")]},
            {"tool_calls": [{"tool": "task", "input": {
                "description": "nested", "prompt": "work", "isolation": "container"}}]},
            {"text": "never"},
        ]},
        {"depth": 1, "turns": [
            {"tool_calls": [bash("echo child > c.txt && echo x > child-started && sleep 60")]},
            {"text": "never"},
        ]},
    ], ready="child-started")  # fmt: skip
    store = open_store(repo)
    [child] = store.descendants(run_id)
    checkpoint = f"refs/orch/checkpoints/{child.run_id}"
    assert sh(repo, "for-each-ref", "--format=%(refname)", "refs/orch/") == checkpoint
    kill_owner(repo, run_id)
    ended(repo, run_id)
    child_rec = ended(repo, child.run_id)
    assert f"deleted {checkpoint}" in child_rec["error"]
    mine = f"orch/general/{child.run_id[2:10]}"
    assert sh(repo, "show", f"{mine}:c.txt") == "child"
    assert sh(repo, "show", f"{mine}:p.txt") == "parent"  # it started from the checkpoint
    assert sh(repo, "show", f"orch/general/{run_id[2:10]}:p.txt") == "parent"
    assert leftovers(repo) == [] and not labelled(f"orch.chain_id={child.chain_id}")


def test_worktrees_prune_drops_stale_checkpoints_and_bundle_refs(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "proj")
    head = sh(repo, "rev-parse", "HEAD")
    dead = subprocess.Popen(["true"])
    dead.wait(30)
    stale = ["refs/orch/checkpoints/r-ended-long-ago", f"refs/orch/in/{dead.pid}-{head}"]
    live = f"refs/orch/in/{os.getpid()}-{head}"  # a process that is still making a bundle
    for ref in [*stale, live]:
        sh(repo, "update-ref", ref, head)
    r = orch(repo, "worktrees", "prune", "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads(r.stdout)["deleted_refs"]) == sorted(stale)
    assert sh(repo, "for-each-ref", "--format=%(refname)", "refs/orch/") == live
    sh(repo, "update-ref", "-d", live)


def test_a_lock_left_by_a_cancelled_bundle_does_not_block_the_next(tmp_path: Path) -> None:
    """Cancelling a container's start kills its ``git update-ref`` of the base bundle's ref,
    which may leave that ref's lock behind; the next start in this process (the worker host
    lives on) makes its bundle all the same. A planted link is not followed to a lock."""
    import asyncio

    from orchestrator.project.repo import discover
    from orchestrator.workspaces.container import transfer

    repo = make_repo(tmp_path / "proj")
    head = sh(repo, "rev-parse", "HEAD")
    paths = asyncio.run(discover(repo)).main()
    ref = transfer.bundle_ref(head)
    lock = paths.common_dir / f"{ref}.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(head)  # what a killed update-ref leaves
    bundle = asyncio.run(transfer.base_bundle(paths, head))
    assert bundle.is_file() and not lock.exists()
    assert sh(repo, "for-each-ref", "refs/orch/") == ""  # the ref went too
    # refs/orch planted as a link elsewhere: nothing there is removed
    elsewhere = tmp_path / "elsewhere" / "in"
    elsewhere.mkdir(parents=True)
    (elsewhere / f"{ref.rsplit('/', 1)[1]}.lock").write_text("not ours")
    orch_refs = paths.common_dir / "refs" / "orch"
    shutil.rmtree(orch_refs)
    orch_refs.symlink_to(elsewhere.parent)
    transfer.drop_stale_lock(paths, ref)
    assert (elsewhere / f"{ref.rsplit('/', 1)[1]}.lock").read_text() == "not ours"
