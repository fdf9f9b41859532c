"""The container tier's one trust boundary, played end to end through the Runner.

A contained agent reached the host through host-side file tools, host git, cleanup and
nested worktrees run in its tree. Now nothing of the host is shared with the sandbox:
each escape class below is an agent (a scripted model) trying it, with ``orch-sandbox``
(python3 + git). The file runtime that runs inside is also unit-tested on the host.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.branches import merge
from orchestrator.config import SandboxSettings
from orchestrator.errors import UsageError
from orchestrator.run import RunRecord, RunStatus
from orchestrator.teams.driver import run_team
from orchestrator.teams.plan import make_plan
from orchestrator.workspaces.container import ContainerConfig
from orchestrator.workspaces.container.inside import files as inbox
from orchestrator.workspaces.container.runtime import parse_reply
from tests.support import Harness, harness, init_repo, tool_results
from tests.test_container import engine, labelled, leftovers, sandbox_image, sh

__all__ = ["engine", "sandbox_image"]  # module fixtures shared with test_container

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("hermetic_git")]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    files = {"README.md": "# demo\n", "src/app.py": "def main() -> int:\n    return 42\n"}
    return init_repo(tmp_path / "proj", files)


def boxed(repo: Path, script: dict[str, Any], **sandbox: Any) -> Harness:
    return harness(repo, script, sandbox=SandboxSettings(**sandbox))


def bash(command: str) -> dict[str, Any]:
    return {"tool": "bash", "input": {"command": command}}


def results(h: Harness, run_id: str) -> str:
    return json.dumps([tool_results(r) for r in h.requests_of(run_id)])


def vmrss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# -- the in-container runtime, on the host -----------------------------------------------


def test_inbox_runtime_rules_and_caps(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "outside.txt").write_text("OUTSIDE")
    (root / "out").symlink_to(tmp_path)
    os.mkfifo(root / "fifo")
    r = str(root)

    def call(request: dict[str, Any], data: bytes = b"") -> tuple[dict[str, Any], bytes]:
        head, body = inbox.handle(request, data, r)
        return parse_reply(json.dumps(head).encode() + b"\n" + body)

    assert call({"op": "read", "path": "src/a.py", "max_bytes": 3}) == (
        {"ok": True, "size": 12, "length": 3}, b"x =")  # fmt: skip
    for path in ("../outside.txt", "/etc/passwd", "out/outside.txt"):
        head, _ = call({"op": "read", "path": path, "max_bytes": 100})
        assert head["ok"] is False and head["kind"] == "unsafe", head
    assert call({"op": "read", "path": "fifo", "max_bytes": 9})[0]["kind"] == "unsafe"
    assert call({"op": "read", "path": "src", "max_bytes": 9})[0]["kind"] == "is_dir"
    assert call({"op": "read", "path": "nope", "max_bytes": 9})[0]["kind"] == "not_found"
    assert call({"op": "write", "path": "out/x", "size": 1}, b"x")[0]["kind"] == "unsafe"
    assert call({"op": "write", "path": "new/dir/f.txt"}, b"hi")[0]["ok"]
    assert (root / "new" / "dir" / "f.txt").read_bytes() == b"hi"
    _, body = call({"op": "glob", "pattern": "**/*", "limit": 10})
    assert json.loads(body) == {"files": ["new/dir/f.txt", "src/a.py"], "more": False}
    _, body = call({"op": "grep", "pattern": "y", "path": None, "glob": "*.py", "limit": 5})
    assert json.loads(body) == {"hits": ["src/a.py:2: y = 2"]}
    digest = hashlib.sha256(b"hi").hexdigest()
    _, body = call({"op": "prune", "files": {"new/dir/f.txt": digest, "src/a.py": digest}})
    assert json.loads(body) == {"removed": ["new/dir/f.txt"]} and (root / "src/a.py").exists()
    assert (tmp_path / "outside.txt").read_text() == "OUTSIDE"
    with pytest.raises(Exception, match="no valid answer"):
        parse_reply(b'{"ok": true, "length": 5}\nabc')


# -- (a) a weaker tier by delegation -------------------------------------------------------


@pytest.mark.parametrize("weaker", ["shared", "worktree"])
def test_a_container_runs_children_only_in_containers(
    repo: Path, sandbox_image: str, weaker: str
) -> None:
    script = {"conversations": [
        {"depth": 0, "turns": [
            {"tool_calls": [{"tool": "task", "input": {
                "description": "weak", "prompt": "escape", "isolation": weaker}}]},
            {"expect_result": "weaker than this agent's own 'container'",
             "tool_calls": [{"tool": "task", "input": {"description": "d", "prompt": "where"}}]},
            {"expect_result": "in-box", "text": "done"},
        ]},
        {"depth": 1, "turns": [
            {"tool_calls": [bash("pwd; hostname; test -e /var/run/docker.sock || echo in-box")]},
            {"expect_result": "/workspace", "text": "in-box"},
        ]},
    ]}  # fmt: skip
    h = boxed(repo, script, image=sandbox_image)
    rec = h.run("delegate", isolation="container")
    assert rec.status == RunStatus.SUCCEEDED, rec.error
    [child] = h.store.children(rec.run_id)
    assert child.isolation == "container" and child.workspace["container"]
    assert "sandbox" in results(h, child.run_id)  # the container's hostname
    assert leftovers(repo) == []


# -- (b) host git executing what the container wrote ---------------------------------------


def _plant(mark: Path, repo: Path) -> str:
    m = str(mark)
    hooks = "pre-commit post-commit post-checkout post-merge reference-transaction pre-push"
    return f"""set -e
mkdir -p {m}
git config core.fsmonitor 'touch {m}/fsmonitor; false'
git config filter.evil.clean 'touch {m}/filter-clean; cat'
git config filter.evil.smudge 'touch {m}/filter-smudge; cat'
git config filter.evil.process 'touch {m}/filter-process'
git config diff.evil.textconv 'touch {m}/textconv; cat'
printf '* filter=evil diff=evil\\n' > .gitattributes
for h in {hooks}; do printf '#!/bin/sh\\ntouch {m}/hook-'$h'\\n' > .git/hooks/$h; chmod +x .git/hooks/$h; done
git init -q nested && git -C nested config core.fsmonitor 'touch {m}/nested'
echo n > nested/n && git -C nested add n
export GIT_AUTHOR_NAME=a GIT_AUTHOR_EMAIL=b GIT_COMMITTER_NAME=a GIT_COMMITTER_EMAIL=b
git -C nested commit -qm n
printf '[submodule "nested"]\\n\\tpath = nested\\n\\turl = ./nested\\n\\tupdate = !touch {m}/submodule\\n' > .gitmodules
mkdir trick && echo 'gitdir: {repo}/.git' > trick/.git
ln -s {repo}/.git/config host-config-link
ln .git/HEAD hard-linked-head
echo work > work.txt
echo planted
"""  # noqa: E501


def test_host_git_never_runs_what_the_container_wrote(
    repo: Path, sandbox_image: str, tmp_path: Path
) -> None:
    mark = tmp_path / "MARK"
    config_before = (repo / ".git" / "config").read_bytes()
    script = {"conversations": [
        {"depth": 0, "turns": [
            {"tool_calls": [{"tool": "write_file",  # (the bash deny list is a guardrail only)
                             "input": {"path": "plant.sh", "content": _plant(mark, repo)}}]},
            {"tool_calls": [bash("bash plant.sh && rm plant.sh")]},
            {"expect_result": "planted", "tool_calls": [{"tool": "task", "input": {
                "description": "nested", "prompt": "look", "isolation": "container"}}]},
            {"expect_result": "child saw work", "text": "planted everything"},
        ]},
        {"depth": 1, "turns": [
            {"tool_calls": [bash("cat work.txt && git status --short | head -3 && echo more > c")]},
            {"expect_result": "work", "text": "child saw work"},
        ]},
    ]}  # fmt: skip
    h = boxed(repo, script, image=sandbox_image)
    rec = h.run("plant", isolation="container")
    assert rec.status == RunStatus.SUCCEEDED, rec.error
    [art] = rec.artifacts
    [child] = h.store.children(rec.run_id)
    [child_art] = child.artifacts
    # the child started from the parent's committed state (a checkpoint commit)
    assert sh(repo, "show", f"{child_art['base']}:work.txt") == "work"
    assert sh(repo, "show", f"{child_art['branch']}:c") == "more"
    files = sh(repo, "ls-tree", "-r", "--name-only", art["branch"]).split()
    assert {"work.txt", ".gitattributes", ".gitmodules", "nested", "host-config-link"} <= set(files)
    # team-style: continue the branch in a new container, then the host lists and diffs it
    cont = {"conversations": [{"turns": [
        {"tool_calls": [bash("cat work.txt && echo again >> work.txt")]},
        {"expect_result": "work", "text": "continued"},
    ]}]}  # fmt: skip
    h2 = boxed(repo, cont, image=sandbox_image)
    spec = h2.spec("go on").model_copy(
        update={"workspace": ContainerConfig(branch=art["branch"], base=art["base"])}
    )
    rec2: RunRecord = asyncio.run(asyncio.wait_for(h2.runner.run(spec), 300))
    assert rec2.status == RunStatus.SUCCEEDED, rec2.error
    assert [a["branch"] for a in rec2.artifacts] == [art["branch"]]
    assert sh(repo, "show", f"{art['branch']}:work.txt") == "work\nagain"
    r = subprocess.run([sys.executable, "-m", "orchestrator", "worktrees", "list"],
                       cwd=repo, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert not mark.exists(), sorted(p.name for p in mark.iterdir())  # nothing ran on the host
    assert (repo / ".git" / "config").read_bytes() == config_before
    assert not (repo / "work.txt").exists() and leftovers(repo) == []


# -- (c) a symlink race inside the container ----------------------------------------------


def test_a_symlink_race_reaches_nothing_outside_the_container(
    repo: Path, sandbox_image: str, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_text("HOST-SECRET")
    loop = f"rm -rf d; mkdir d; echo inside > d/f; rm -rf d; ln -sfn {victim} d; ln -sfn / d"
    swap = f"setsid bash -c 'while :; do {loop}; done' >/dev/null 2>&1 < /dev/null & echo started"
    calls = []
    for i in range(8):
        calls.append({"tool": "read_file", "input": {"path": "d/f"}})
        calls.append({"tool": "write_file", "input": {"path": "d/f", "content": f"BOX-{i}"}})
        calls.append({"tool": "read_file", "input": {"path": "d/etc/hostname"}})
    script = {"conversations": [{"turns": [
        {"tool_calls": [bash(swap)]},
        {"tool_calls": calls},
        {"tool_calls": calls},
        {"tool_calls": [bash("rm -f d; echo done")]},
        {"text": "raced"},
    ]}]}  # fmt: skip
    h = boxed(repo, script, image=sandbox_image)
    before = sorted(p.name for p in tmp_path.iterdir())
    rec = h.run("race", isolation="container")
    assert rec.status == RunStatus.SUCCEEDED, rec.error
    assert (victim / "f").read_text() == "HOST-SECRET" and os.listdir(victim) == ["f"]
    assert "HOST-SECRET" not in results(h, rec.run_id)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not labelled(f"orch.run_id={rec.run_id}")  # the setsid leftover went with it


# -- (d) cleanup following symlinks ---------------------------------------------------------


def test_an_include_copy_swapped_for_a_symlink_leaves_the_original(
    repo: Path, sandbox_image: str
) -> None:
    (repo / ".gitignore").write_text(".env\n")
    (repo / ".worktreeinclude").write_text(".env\nlocal.cfg\n")
    sh(repo, "add", "-A")
    sh(repo, "commit", "-qm", "include")
    (repo / ".env").write_text("KEY=original\n")
    (repo / "local.cfg").write_text("untouched\n")  # untracked, not ignored
    script = {"conversations": [{"turns": [
        {"tool_calls": [bash(f"cat .env local.cfg && rm .env && ln -s {repo}/.env .env && "
                             f"ln -s {repo} user-tree && echo swapped")]},  # fmt: skip
        {"expect_result": "KEY=original", "text": "swapped"},
    ]}]}  # fmt: skip
    h = boxed(repo, script, image=sandbox_image)
    rec = h.run("swap", isolation="container")
    assert rec.status == RunStatus.SUCCEEDED, rec.error
    assert (repo / ".env").read_text() == "KEY=original\n"
    assert (repo / "local.cfg").read_text() == "untouched\n"
    [art] = rec.artifacts
    files = sh(repo, "ls-tree", "-r", "--name-only", art["branch"]).split()
    assert "user-tree" in files and "local.cfg" not in files  # the unchanged copy was pruned
    assert sh(repo, "cat-file", "-p", f"{art['branch']}:user-tree") == str(repo)  # a link


# -- (e) host memory --------------------------------------------------------------------------


def test_a_3_gib_sparse_file_keeps_orch_small(repo: Path, sandbox_image: str) -> None:
    script = {"conversations": [{"turns": [
        {"tool_calls": [bash("truncate -s 3G big.bin && echo big.bin >> .git/info/exclude "
                             "&& ls -la big.bin")]},  # fmt: skip
        {"tool_calls": [
            {"tool": "read_file", "input": {"path": "big.bin"}},
            {"tool": "grep", "input": {"pattern": "x", "path": "big.bin"}},
            {"tool": "grep", "input": {"pattern": "never-there"}},
            {"tool": "glob", "input": {"pattern": "**/*.bin"}},
            bash("cat big.bin | head -c 100000000 | tr '\\0' a"),
        ]},
        {"expect_result": "over the 10,485,760-byte read limit", "text": "big"},
    ]}]}  # fmt: skip
    h = boxed(repo, script, image=sandbox_image)
    before = vmrss_kib()
    rec = h.run("big", isolation="container")
    grown = vmrss_kib() - before
    assert rec.status == RunStatus.SUCCEEDED, rec.error
    assert "3,221,225,472 bytes" in results(h, rec.run_id)
    assert grown < 150 * 1024, f"orch grew by {grown} KiB"
    assert rec.artifacts == []


# -- (f) control files arrive on the branch and are not merged silently -------------------


def test_a_container_writers_control_file_is_refused_by_merge(
    repo: Path, sandbox_image: str
) -> None:
    script = {"conversations": [{"turns": [
        {"tool_calls": [bash("printf 'max_depth = 9\\n' > orch.toml && echo ok > feature.txt")]},
        {"text": "changed settings"},
    ]}]}  # fmt: skip
    h = boxed(repo, script, image=sandbox_image)
    rec = h.run("settings", isolation="container")
    [art] = rec.artifacts
    assert sh(repo, "show", f"{art['branch']}:orch.toml") == "max_depth = 9"
    with pytest.raises(UsageError, match=r"changes control files \(orch.toml\)"):
        merge(repo, art["branch"])
    assert not (repo / "orch.toml").exists()
    report = merge(repo, art["branch"], allow_control_files=True)
    assert report.control_files == ["orch.toml"]


# -- limits -------------------------------------------------------------------------------------


def test_containers_per_chain_and_bundle_size_are_capped(repo: Path, sandbox_image: str) -> None:
    script = {"conversations": [
        {"depth": 0, "turns": [
            {"tool_calls": [{"tool": "task", "input": {"description": "one more",
                                                       "prompt": "x"}}]},  # fmt: skip
            {"expect_result": "sandbox.max_per_chain", "text": "capped"},
        ]},
    ]}  # fmt: skip
    h = boxed(repo, script, image=sandbox_image, max_per_chain=1)
    rec = h.run("cap", isolation="container")
    assert rec.status == RunStatus.SUCCEEDED, rec.error
    [child] = h.store.children(rec.run_id)
    assert child.status == RunStatus.FAILED and "sandbox.max_per_chain" in (child.error or "")

    big = {"conversations": [{"turns": [
        {"tool_calls": [bash("head -c 300000 /dev/urandom > noise.bin")]},
        {"text": "made noise"},
    ]}]}  # fmt: skip
    h = boxed(repo, big, image=sandbox_image, bundle_max_bytes=100_000)
    rec = h.run("noise", isolation="container")
    assert rec.status == RunStatus.FAILED and "sandbox.bundle_max_bytes" in (rec.error or "")
    assert sh(repo, "branch", "--list", "orch/*") == "" and leftovers(repo) == []
    assert not labelled(f"orch.run_id={rec.run_id}")


# -- a team in containers ----------------------------------------------------------------------


def test_a_container_team_writes_and_reviews_in_containers(repo: Path, sandbox_image: str) -> None:
    approve = json.dumps({"verdict": "approve", "summary": "ok", "comments": []})
    script = {"conversations": [
        {"agent": "writer", "turns": [
            {"tool_calls": [bash("echo 'def add(a, b):\n    return a + b' > calc.py && pwd")]},
            {"expect_result": "/workspace", "text": "wrote calc.py"},
        ]},
        {"agent": "reviewer", "turns": [
            {"tool_calls": [{"tool": "read_file", "input": {"path": "/workspace/calc.py"}}]},
            {"expect_result": "return a", "text": "```json\n" + approve + "\n```"},
        ]},
    ]}  # fmt: skip
    h = boxed(repo, script, image=sandbox_image)
    result = asyncio.run(
        run_team(
            h.runner,
            prompt="add",
            workdir=repo,
            plan=make_plan(None, None, isolation="container", merge="merge"),
        )
    )
    assert result.approved and result.merged, result.error
    kids = h.runs(result.chain_id)[1:]
    assert [(k.agent, k.isolation) for k in kids] == [("writer", "container"),
                                                       ("reviewer", "container")]  # fmt: skip
    assert (repo / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    assert sh(repo, "worktree", "list").count("\n") == 0 and leftovers(repo) == []


def test_hooks_of_a_container_run_run_in_the_users_checkout(
    repo: Path, sandbox_image: str, tmp_path: Path
) -> None:
    seen = tmp_path / "hook-cwd"
    script = {"conversations": [{"turns": [
        {"tool_calls": [bash("echo hi")]},
        {"text": "done"},
    ]}]}  # fmt: skip
    hook = {
        "matcher": "^bash$",
        "command": f"pwd > {seen}; printenv ORCH_PROJECT_DIR >> {seen}; cat > {seen}.json",
    }
    h = harness(repo, script, sandbox=SandboxSettings(image=sandbox_image),
                hooks={"PreToolUse": [hook]})  # fmt: skip
    rec = h.run("hooked", isolation="container")
    assert rec.status == RunStatus.SUCCEEDED, rec.error
    cwd, project = seen.read_text().splitlines()  # a private empty directory, and
    assert Path(cwd).name.startswith("orch-hook-") and project == str(repo)  # the checkout
    assert json.loads(Path(f"{seen}.json").read_text())["cwd"] == str(repo)
