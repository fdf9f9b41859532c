"""Worktree isolation on real git repos: the user's tree is never touched, work comes back as
branches, and ``orch worktrees`` lists, merges and prunes them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from orchestrator.branches import list_branches, merge, prune
from orchestrator.bwrap.profile import bwrap_choice
from orchestrator.cli.worktrees import worktrees_app
from orchestrator.errors import NotFound, OrchError, UsageError
from orchestrator.project.orchignore import STATE_IGNORE
from orchestrator.project.repo import parse_shortstat, short_run_id
from orchestrator.run import RunRecord, RunStatus, new_run_id
from orchestrator.store import SqliteStore
from orchestrator.workspaces.base import RunOutcome, WorkspaceSpec
from orchestrator.workspaces.branch import branch_name
from orchestrator.workspaces.worktree import WorktreeWorkspace, salvage_worktree
from tests.support import init_repo

AUTHOR = "orch coder <orch@localhost>"
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}


# -- helpers ----------------------------------------------------------------------------


def sh(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def orch_branches(repo: Path) -> list[str]:
    return sh(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/orch/").split()


def worktree_count(repo: Path) -> int:
    return sh(repo, "worktree", "list", "--porcelain").count("worktree ")


def user_files(repo: Path) -> list[str]:
    return sorted(
        str(p.relative_to(repo))
        for p in repo.rglob("*")
        if p.relative_to(repo).parts[0] not in (".git", ".orch")
    )


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str]] = []

    def register_resource(self, run_id: str, kind: str, ref: str) -> None:
        self.events.append(("register", run_id, kind, ref))

    def release_resource(self, run_id: str, kind: str, ref: str) -> None:
        self.events.append(("release", run_id, kind, ref))


def make_spec(base: Path, agent: str = "coder", **kw: Any) -> WorkspaceSpec:
    return WorkspaceSpec(
        run_id=new_run_id(), chain_id="c-test", agent=agent,
        description=kw.pop("description", "test run"), base=base, **kw,
    )  # fmt: skip


def run_changes(repo: Path, files: dict[str, str], **kw: Any) -> tuple[WorktreeWorkspace, str]:
    """One worktree run that writes ``files``; returns the closed workspace and its run id."""
    spec = make_spec(repo, **kw)

    async def body() -> WorktreeWorkspace:
        async with WorktreeWorkspace(spec) as ws:
            for name, text in files.items():
                (ws.root / name).parent.mkdir(parents=True, exist_ok=True)
                (ws.root / name).write_text(text)
            ws.set_outcome(RunOutcome("succeeded", f"write {', '.join(files)}"))
        return ws

    return asyncio.run(body()), spec.run_id


pytestmark = pytest.mark.usefixtures("hermetic_git")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """main with one commit, and a checked-out ``feature`` branch one commit ahead of it."""
    root = init_repo(tmp_path / "proj", {"a.txt": "one\ntwo\nthree\n", ".gitignore": ".env\n"})
    sh(root, "checkout", "-q", "-b", "feature")
    (root / "b.txt").write_text("feature\n")
    sh(root, "add", "-A")
    sh(root, "commit", "-q", "-m", "feature work")
    return root


# -- the workspace ----------------------------------------------------------------------


def test_user_tree_untouched_and_work_committed_on_branch(repo: Path, hermetic_git: Path) -> None:
    files_before, head_before = user_files(repo), sh(repo, "rev-parse", "HEAD")
    main_head = sh(repo, "rev-parse", "main")
    config_before = (repo / ".git" / "config").read_text()
    sink = RecordingSink()
    spec = make_spec(repo, sink=sink)

    async def body() -> tuple[WorktreeWorkspace, dict[str, Any], str]:
        async with WorktreeWorkspace(spec) as ws:
            assert ws.root.parent == (repo / ".orch" / "worktrees").resolve()
            (ws.root / "new.txt").write_text("new\n")
            (ws.root / "a.txt").write_text("one\nTWO\nthree\n")
            result = await ws.exec(
                "pwd; echo hi > from_bash.txt; mkdir -p d && echo x > d/y.txt",
                timeout_s=30, env=ENV,
            )  # fmt: skip
            assert result.exit_code == 0
            assert sh(repo, "status", "--porcelain") == ""  # the user sees nothing meanwhile
            ws.set_outcome(RunOutcome("succeeded", "add things"))
            return ws, ws.info(), result.output.splitlines()[0]

    ws, info, pwd = asyncio.run(body())
    assert pwd == info["root"]
    assert sh(repo, "status", "--porcelain", "--ignored=no") == ""
    assert user_files(repo) == files_before
    assert sh(repo, "rev-parse", "HEAD") == head_before
    assert (repo / "a.txt").read_text() == "one\ntwo\nthree\n"
    assert (repo / ".orch" / ".gitignore").read_text() == STATE_IGNORE

    branch = f"orch/coder/{short_run_id(spec.run_id)}"
    ran = bwrap_choice()  # the suite's (tests/conftest.py)
    assert info == {"isolation": "worktree", "root": info["root"], "branch": branch,
                    "base": head_before, "repo": str(repo), "os_sandbox": "bwrap",
                    "bwrap": {"path": ran.path, "version": ran.version, "source": ran.source},
                    "network": "none"}  # fmt: skip
    [artifact] = ws.artifacts()
    assert artifact == {
        "kind": "branch", "branch": branch, "base": head_before,
        "commit": sh(repo, "rev-parse", branch), "files_changed": 4, "insertions": 4,
        "deletions": 1,
    }  # fmt: skip
    assert head_before != main_head and sh(repo, "rev-parse", f"{branch}~1") == head_before
    who = sh(repo, "log", "-1", "--format=%an <%ae>|%cn <%ce>", branch)
    assert who == f"{AUTHOR}|{AUTHOR}"
    message = sh(repo, "log", "-1", "--format=%B", branch)
    assert message == f"add things\n\norch-run: {spec.run_id}\norch-status: succeeded"
    assert sh(repo, "show", f"{branch}:d/y.txt") == "x"
    assert not Path(info["root"]).exists() and worktree_count(repo) == 1
    assert [e for e in sink.events if e[2] == "worktree"] == [
        ("register", spec.run_id, "worktree", info["root"]),
        ("release", spec.run_id, "worktree", info["root"]),
    ]
    assert (repo / ".git" / "config").read_text() == config_before
    assert hermetic_git.read_text() == ""


def test_detached_head_is_the_base(repo: Path) -> None:
    sh(repo, "checkout", "-q", "--detach", "main")
    main_head = sh(repo, "rev-parse", "main")
    ws, _ = run_changes(repo, {"x.txt": "x\n"})
    [artifact] = ws.artifacts()
    assert artifact["base"] == main_head
    assert sh(repo, "rev-parse", f"{artifact['branch']}~1") == main_head
    assert sh(repo, "status", "--porcelain") == ""


def test_no_change_leaves_no_worktree_and_no_branch(repo: Path) -> None:
    (repo / ".env").write_text("SECRET=1\n")
    sink = RecordingSink()
    spec = make_spec(repo, sink=sink)

    async def body() -> WorktreeWorkspace:
        async with WorktreeWorkspace(spec) as ws:
            assert orch_branches(repo) == [branch_name("coder", spec.run_id)]
            (ws.root / ".env").write_text("ignored\n")  # ignored files are not work
            result = await ws.exec("ls >/dev/null", timeout_s=30, env=ENV)
            assert result.exit_code == 0
        return ws

    ws = asyncio.run(body())
    assert ws.artifacts() == []
    assert orch_branches(repo) == []
    assert worktree_count(repo) == 1
    assert list((repo / ".orch" / "worktrees").iterdir()) == []
    assert [e[0] for e in sink.events if e[2] == "worktree"] == ["register", "release"]


def test_cancelled_run_still_commits_its_work(repo: Path) -> None:
    spec = make_spec(repo)
    holder: list[WorktreeWorkspace] = []

    async def body() -> None:
        inside = asyncio.Event()

        async def agent() -> None:
            async with WorktreeWorkspace(spec) as ws:
                holder.append(ws)
                (ws.root / "wip.txt").write_text("work in progress\n")
                inside.set()
                await asyncio.sleep(3600)

        task = asyncio.create_task(agent())
        await asyncio.wait_for(inside.wait(), 30)
        deadline = time.monotonic() + 60
        while not task.done():  # keep cancelling while it closes: the close is shielded
            assert time.monotonic() < deadline, "the cancelled run did not end in 60 s"
            task.cancel()
            await asyncio.sleep(0.002)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(body())
    [artifact] = holder[0].artifacts()
    branch = artifact["branch"]
    assert sh(repo, "show", f"{branch}:wip.txt") == "work in progress"
    assert "orch-status: cancelled" in sh(repo, "log", "-1", "--format=%B", branch)
    assert worktree_count(repo) == 1
    assert sh(repo, "status", "--porcelain") == ""


def test_cancelled_while_creating_leaves_nothing(repo: Path) -> None:
    spec = make_spec(repo)

    async def body() -> None:
        async def agent() -> None:
            async with WorktreeWorkspace(spec):
                await asyncio.sleep(3600)

        task = asyncio.create_task(agent())
        await asyncio.sleep(0)
        deadline = time.monotonic() + 60
        while not task.done():
            assert time.monotonic() < deadline, "the cancelled run did not end in 60 s"
            task.cancel()
            await asyncio.sleep(0.001)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(body())
    assert orch_branches(repo) == [] and worktree_count(repo) == 1
    assert list((repo / ".orch" / "worktrees").iterdir()) == []


def test_eight_parallel_workspaces_on_one_repo(repo: Path) -> None:
    async def one(i: int) -> WorktreeWorkspace:
        async with WorktreeWorkspace(make_spec(repo, agent=f"a{i}")) as ws:
            (ws.root / f"f{i}.txt").write_text(f"{i}\n")
            result = await ws.exec(f"echo more >> f{i}.txt", timeout_s=30, env=ENV)
            assert result.exit_code == 0
            ws.set_outcome(RunOutcome("succeeded", f"file {i}"))
        return ws

    async def body() -> list[WorktreeWorkspace]:
        # a TaskGroup, not gather: a failing one cancels and awaits the others, so asyncio.run
        # never cancels a subprocess mid-creation at teardown (CPython gh-103847 hangs there)
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(i)) for i in range(8)]
        return [t.result() for t in tasks]

    spaces = asyncio.run(body())
    branches = [ws.artifacts()[0]["branch"] for ws in spaces]
    assert len(set(branches)) == 8
    for i, branch in enumerate(branches):
        files = sh(repo, "ls-tree", "-r", "--name-only", branch).split()
        assert f"f{i}.txt" in files
        assert not [f for f in files if f.startswith("f") and f != f"f{i}.txt"]
        assert sh(repo, "show", f"{branch}:f{i}.txt") == f"{i}\nmore"
    assert worktree_count(repo) == 1
    assert sh(repo, "status", "--porcelain") == ""


def test_parallel_workspaces_across_processes(repo: Path) -> None:
    script = textwrap.dedent(
        """
        import asyncio, sys
        from pathlib import Path
        from orchestrator.run import new_run_id
        from orchestrator.workspaces.base import WorkspaceSpec
        from orchestrator.workspaces.worktree import WorktreeWorkspace

        async def one(i):
            spec = WorkspaceSpec(new_run_id(), "c", f"p{sys.argv[2]}x{i}", "", Path(sys.argv[1]))
            async with WorktreeWorkspace(spec) as ws:
                (ws.root / f"p{sys.argv[2]}-{i}.txt").write_text("x")

        async def main():
            await asyncio.gather(*(one(i) for i in range(4)))

        asyncio.run(main())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(repo), str(n)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for n in range(3)
    ]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    assert len(orch_branches(repo)) == 12
    assert worktree_count(repo) == 1


def test_worktreeinclude_copies_ignored_files(repo: Path, tmp_path: Path) -> None:
    (repo / ".env").write_text("SECRET=1\n")  # git-ignored
    (repo / "local.cfg").write_text("local\n")  # untracked
    (repo / "a.txt").write_text("user's uncommitted edit\n")  # tracked: not copied
    (tmp_path / "outside.txt").write_text("outside\n")
    (repo / "link.txt").symlink_to(tmp_path / "outside.txt")
    (repo / ".worktreeinclude").write_text(
        "# files a fresh checkout needs\n.env\n../outside.txt\nlink.txt\na.txt\nnomatch*\n"
    )
    seen: dict[str, Any] = {}

    async def body(change: bool) -> WorktreeWorkspace:
        spec = make_spec(repo, include=("local.cfg",))
        async with WorktreeWorkspace(spec) as ws:
            seen["env"] = (ws.root / ".env").read_text()
            seen["cfg"] = (ws.root / "local.cfg").read_text()
            seen["a"] = (ws.root / "a.txt").read_text()
            seen["link"] = (ws.root / "link.txt").exists()
            seen["outside"] = (ws.root.parent / "outside.txt").exists()
            if change:
                (ws.root / "local.cfg").write_text("changed by the agent\n")
        return ws

    untouched = asyncio.run(body(change=False))
    assert seen == {"env": "SECRET=1\n", "cfg": "local\n", "a": "one\ntwo\nthree\n",
                    "link": False, "outside": False}  # fmt: skip
    assert untouched.artifacts() == []  # unchanged copies are not committed back
    changed = asyncio.run(body(change=True))
    branch = changed.artifacts()[0]["branch"]
    assert sh(repo, "ls-tree", "-r", "--name-only", branch).split() == [
        ".gitignore",
        "a.txt",
        "b.txt",
        "local.cfg",
    ]


def test_nested_worktree_bases_on_parent_worktree_head(repo: Path) -> None:
    out: dict[str, Any] = {}

    async def body() -> None:
        async with WorktreeWorkspace(make_spec(repo, agent="lead")) as parent:
            (parent.root / "p.txt").write_text("parent\n")
            sh(parent.root, "add", "p.txt")
            sh(parent.root, "commit", "-q", "-m", "parent work")
            out["parent_head"] = sh(parent.root, "rev-parse", "HEAD")
            (parent.root / "uncommitted.txt").write_text("not carried\n")
            async with WorktreeWorkspace(make_spec(parent.root, agent="helper")) as child:
                out["child_root"] = child.root
                out["child_info"] = child.info()
                out["carried"] = sorted(p.name for p in child.root.iterdir())
                (child.root / "c.txt").write_text("child\n")
            out["child"] = child.artifacts()
            parent.set_outcome(RunOutcome("succeeded", "parent"))
        out["parent"] = parent.artifacts()

    asyncio.run(body())
    assert out["child_root"].parent == (repo / ".orch" / "worktrees").resolve()
    assert out["child_info"]["base"] == out["parent_head"]
    assert out["child_info"]["repo"] == str(repo)
    assert "p.txt" in out["carried"] and "uncommitted.txt" not in out["carried"]
    [child] = out["child"]
    assert child["branch"].startswith("orch/helper/")
    assert sh(repo, "rev-parse", f"{child['branch']}~1") == out["parent_head"]
    [parent] = out["parent"]
    assert sh(repo, "show", f"{parent['branch']}:uncommitted.txt") == "not carried"
    assert worktree_count(repo) == 1 and sh(repo, "status", "--porcelain") == ""


def test_not_a_repo_and_empty_repo_are_clear_errors(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(UsageError, match=r"git repo.*isolation 'shared'") as info:
        asyncio.run(WorktreeWorkspace(make_spec(plain)).__aenter__())
    assert "\n" not in str(info.value)
    with pytest.raises(UsageError, match="git repo"):
        list_branches(plain)
    empty = tmp_path / "empty"
    empty.mkdir()
    sh(empty, "init", "-q")
    with pytest.raises(UsageError, match="no commits yet"):
        asyncio.run(WorktreeWorkspace(make_spec(empty)).__aenter__())
    assert not (empty / ".orch").exists()


# -- orch worktrees list | merge | prune ------------------------------------------------


def test_list_and_merge(repo: Path) -> None:
    head = sh(repo, "rev-parse", "HEAD")
    _, run_id = run_changes(repo, {"new.txt": "new\n", "a.txt": "one\n2\nthree\n"})
    [info] = list_branches(repo)
    assert info.branch == branch_name("coder", run_id) and info.run_id == run_id
    assert (info.ahead, info.behind, info.base, info.path) == (1, 0, head, None)
    assert (info.files_changed, info.insertions, info.deletions) == (2, 2, 1)
    assert info.merged is False

    report = merge(repo, run_id)
    assert report.into == "feature" and not report.already_merged and not report.stashed
    assert len(sh(repo, "rev-list", "--parents", "-n1", "HEAD").split()) == 3  # a merge commit
    assert (repo / "new.txt").read_text() == "new\n"
    assert sh(repo, "status", "--porcelain") == ""
    assert (report.files_changed, report.insertions, report.deletions) == (2, 2, 1)
    [after] = list_branches(repo)
    assert after.merged and after.ahead == 0
    assert merge(repo, short_run_id(run_id)).already_merged


def test_squash_merge(repo: Path) -> None:
    _, run_id = run_changes(repo, {"s.txt": "squashed\n"})
    branch = branch_name("coder", run_id)
    report = merge(repo, branch, squash=True)
    assert report.squash and report.files_changed == 1
    assert len(sh(repo, "rev-list", "--parents", "-n1", "HEAD").split()) == 2  # one parent
    assert f"orch-run: {run_id}" in sh(repo, "log", "-1", "--format=%B")
    assert (repo / "s.txt").read_text() == "squashed\n"
    [info] = list_branches(repo)
    assert info.merged and info.ahead == 1  # squash-merged: detected by content
    assert asyncio.run(prune(repo)).deleted_branches == [branch]


def test_conflicting_merge_is_refused_naming_the_file(repo: Path) -> None:
    _, run_id = run_changes(repo, {"a.txt": "one\nagent\nthree\n"})
    (repo / "a.txt").write_text("one\nuser\nthree\n")
    sh(repo, "commit", "-q", "-am", "user edit")
    head = sh(repo, "rev-parse", "HEAD")
    with pytest.raises(UsageError, match=r"would conflict in a\.txt") as info:
        merge(repo, run_id)
    assert "\n" not in str(info.value)
    assert sh(repo, "rev-parse", "HEAD") == head and sh(repo, "status", "--porcelain") == ""


def test_dirty_tree_refused_unless_stash(repo: Path) -> None:
    _, run_id = run_changes(repo, {"new.txt": "new\n"})
    (repo / "b.txt").write_text("user's uncommitted change\n")
    head = sh(repo, "rev-parse", "HEAD")
    with pytest.raises(UsageError, match=r"uncommitted changes \(b\.txt\).*--stash"):
        merge(repo, run_id)
    assert sh(repo, "rev-parse", "HEAD") == head and not (repo / "new.txt").exists()

    report = merge(repo, run_id, stash=True)
    assert report.stashed and report.warning is None
    assert (repo / "new.txt").exists()
    assert (repo / "b.txt").read_text() == "user's uncommitted change\n"
    assert sh(repo, "stash", "list") == ""

    sh(repo, "checkout", "-q", "b.txt")
    _, second = run_changes(repo, {"second.txt": "2\n"})
    (repo / "notes.txt").write_text("untracked files do not count as dirty\n")
    assert not merge(repo, second).stashed
    assert (repo / "second.txt").exists() and (repo / "notes.txt").exists()


def test_merge_unknown_target(repo: Path) -> None:
    with pytest.raises(NotFound, match="orch worktrees list"):
        merge(repo, "r-doesnotexist")


def test_prune_salvages_leftovers_and_deletes_merged_branches(repo: Path) -> None:
    _, merged_id = run_changes(repo, {"m.txt": "merged\n"})
    merge(repo, merged_id)
    _, unmerged_id = run_changes(repo, {"u.txt": "unmerged\n"})
    crashed, idle = make_spec(repo, agent="crash"), make_spec(repo, agent="idle")

    async def start_and_crash() -> list[Path]:  # entered, never closed: a crashed owner
        roots = []
        for spec in (crashed, idle):
            ws = await WorktreeWorkspace(spec).__aenter__()
            roots.append(ws.root)
        (roots[0] / "half-done.txt").write_text("leftover work\n")
        return roots

    crashed_root, idle_root = asyncio.run(start_and_crash())
    running = {crashed.run_id, idle.run_id}
    first = asyncio.run(prune(repo, is_running=lambda run_id: run_id in running))
    assert sorted(first.running) == sorted(running)
    assert first.deleted_branches == [branch_name("coder", merged_id)]
    assert first.kept_branches == [branch_name("coder", unmerged_id)]
    assert crashed_root.exists() and idle_root.exists()

    second = asyncio.run(prune(repo, is_running=lambda run_id: False))
    crashed_branch = branch_name("crash", crashed.run_id)
    assert [a["branch"] for a in second.salvaged] == [crashed_branch]
    assert sorted(second.removed_worktrees) == sorted([str(crashed_root), str(idle_root)])
    assert not crashed_root.exists() and not idle_root.exists() and worktree_count(repo) == 1
    assert sh(repo, "show", f"{crashed_branch}:half-done.txt") == "leftover work"
    message = sh(repo, "log", "-1", "--format=%B", crashed_branch)
    assert f"orch-run: {crashed.run_id}\norch-status: interrupted" in message
    unmerged = branch_name("coder", unmerged_id)
    assert sorted(orch_branches(repo)) == sorted([crashed_branch, unmerged])

    forced = asyncio.run(prune(repo, force=True))
    assert sorted(forced.deleted_branches) == sorted([crashed_branch, unmerged])
    assert orch_branches(repo) == []
    assert sh(repo, "status", "--porcelain") == ""


def test_salvage_worktree_directly(repo: Path, tmp_path: Path) -> None:
    spec = make_spec(repo, agent="gone")

    async def crash() -> Path:
        ws = await WorktreeWorkspace(spec).__aenter__()
        (ws.root / "x.txt").write_text("x\n")
        return ws.root

    root = asyncio.run(crash())
    artifact = asyncio.run(salvage_worktree(root, spec.run_id, "interrupted"))
    assert artifact is not None
    assert artifact["branch"] == branch_name("gone", spec.run_id)
    assert artifact["base"] == sh(repo, "rev-parse", "HEAD") and artifact["files_changed"] == 1
    assert not root.exists()
    assert asyncio.run(salvage_worktree(root, spec.run_id, "interrupted")) is None
    assert asyncio.run(salvage_worktree(tmp_path / "nowhere", "r-x", "interrupted")) is None


def test_cli_list_merge_prune(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, run_id = run_changes(repo, {"cli.txt": "cli\n"})
    monkeypatch.chdir(repo)
    runner = CliRunner()
    listed = runner.invoke(worktrees_app, ["list", "--json"])
    assert listed.exit_code == 0, listed.output
    assert [i["run_id"] for i in json.loads(listed.stdout)] == [run_id]
    assert runner.invoke(worktrees_app, ["list"]).exit_code == 0
    missing = runner.invoke(worktrees_app, ["merge", "nope"])
    assert missing.exit_code == 2 and missing.stderr.startswith("orch: no orch branch matches")
    merged = runner.invoke(worktrees_app, ["merge", run_id, "--json"])
    assert merged.exit_code == 0 and json.loads(merged.stdout)["branch"].startswith("orch/coder/")
    pruned = runner.invoke(worktrees_app, ["prune", "--json"])
    assert pruned.exit_code == 0, pruned.output
    assert len(json.loads(pruned.stdout)["deleted_branches"]) == 1


def test_pure_helpers() -> None:
    assert short_run_id("r-0123456789ab") == "01234567"
    assert branch_name("my agent/..x", "r-0123456789ab") == "orch/my-agent-.x/01234567"
    assert branch_name("...", "r-ab") == "orch/agent/ab"
    assert parse_shortstat(" 3 files changed, 10 insertions(+), 2 deletions(-)") == (3, 10, 2)
    assert parse_shortstat(" 1 file changed, 1 deletion(-)") == (1, 0, 1)


def test_exec_refuses_before_enter(repo: Path) -> None:
    ws = WorktreeWorkspace(make_spec(repo))
    with pytest.raises(OrchError, match="not open"):
        asyncio.run(ws.exec("touch oops", timeout_s=5, env=ENV))
    assert not (repo / "oops").exists()


def test_cli_merge_takes_a_run_prefix_and_dash_c(repo: Path, tmp_path: Path) -> None:
    """`orch worktrees merge` resolves a run as every command does (any unique prefix, with
    or without ``r-``) and works on the repository -C names, from anywhere."""
    _, run_id = run_changes(repo, {"prefix.txt": "p\n"})
    store = SqliteStore.for_project(repo)
    store.create_run(RunRecord(run_id=run_id, chain_id="c-test", status=RunStatus.SUCCEEDED))
    store.close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    runner = CliRunner()
    args = ["-C", str(repo), "--json"]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(elsewhere)  # not a repository: only -C points at one
        listed = runner.invoke(worktrees_app, ["list", *args])
        assert listed.exit_code == 0, listed.output
        assert [i["run_id"] for i in json.loads(listed.stdout)] == [run_id]
        merged = runner.invoke(worktrees_app, ["merge", run_id[2:8], *args])
    assert merged.exit_code == 0, merged.output
    report = json.loads(merged.stdout)
    assert report["run_id"] == run_id and report["files_changed"] == 1
    assert (repo / "prefix.txt").read_text() == "p\n"
