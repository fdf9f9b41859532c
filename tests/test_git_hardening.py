"""Host git never runs what a sandbox (or a repository's config) planted.

Real git in tmp_path. Every plant runs a script that touches a marker file; the
operations orch runs (status, add -A, commit, diff, rev-parse, worktree add/remove,
branch -D, merge, and the worktree tier's close end to end) must leave no marker and
still do their job.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.branches import control_changes, list_branches, merge, open_repo
from orchestrator.cli.worktrees import worktrees_app
from orchestrator.errors import UsageError
from orchestrator.policy.controlpaths import is_control_path
from orchestrator.project.git import GitError, RepoPaths, driver_overrides, git, git_sync
from orchestrator.project.gitprocess import hardened_env, prepare
from orchestrator.project.repo import (
    diff_stats,
    discover_sync,
    ensure_orch_dir,
    locate,
    worktree_paths,
)
from orchestrator.run import new_run_id
from orchestrator.workspaces.base import RunOutcome, WorkspaceSpec
from orchestrator.workspaces.settle import commit_all, remove_worktree
from orchestrator.workspaces.worktree import WorktreeWorkspace

pytestmark = pytest.mark.usefixtures("hermetic_git")

IDENT = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
         "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip


SAFE = ("user.name=t", "user.email=t@t", "core.hooksPath=/dev/null", "core.fsmonitor=false",
        "commit.gpgSign=false", "submodule.recurse=false", "filter.evil.clean=",
        "filter.evil.smudge=", "filter.evil.required=false", "filter.proc.process=")  # fmt: skip


def raw(cwd: Path, *args: str) -> str:
    """Plain git for the test's own setup and checks, kept clear of the plants by hand."""
    safe = [arg for setting in SAFE for arg in ("-c", setting)]
    out = subprocess.run(["git", *safe, *args], cwd=cwd, capture_output=True, text=True, check=True)
    return out.stdout.strip()


class Plants:
    """Scripts that leave a marker when run; the markers fired so far."""

    def __init__(self, root: Path) -> None:
        self.markers = root / "markers"
        self.bin = root / "bin"
        self.markers.mkdir()
        self.bin.mkdir()

    def script(self, name: str, tail: str = "") -> str:
        path = self.bin / name
        path.write_text(f"#!/bin/sh\ntouch {self.markers / name}\n{tail}\n")
        path.chmod(0o755)
        return str(path)

    def hooks(self, where: Path, prefix: str) -> None:
        where.mkdir(parents=True, exist_ok=True)
        for hook in ("pre-commit", "post-commit", "commit-msg", "prepare-commit-msg",
                     "post-checkout", "post-merge", "pre-merge-commit", "reference-transaction",
                     "post-index-change", "pre-auto-gc"):  # fmt: skip
            target = where / hook
            target.write_text(f"#!/bin/sh\ntouch {self.markers / (prefix + hook)}\n")
            target.chmod(0o755)

    def fired(self) -> list[str]:
        return sorted(p.name for p in self.markers.iterdir())

    def plant_config(self, repo: Path) -> None:
        """Everything a repository config can make git run."""
        settings = {
            "core.fsmonitor": self.script("fsmonitor"),
            "core.hooksPath": str(repo.parent / "confighooks"),
            "core.pager": self.script("pager", "cat"),
            "core.editor": self.script("editor"),
            "commit.gpgSign": "true",
            "gpg.program": self.script("gpg"),
            "filter.evil.clean": self.script("clean", "cat"),
            "filter.evil.smudge": self.script("smudge", "cat"),
            "filter.evil.required": "true",
            "filter.proc.process": self.script("process"),
            "diff.evil.textconv": self.script("textconv", 'cat "$1"'),
            "diff.evil.command": self.script("diffcmd"),
            "diff.external": self.script("external"),
            "merge.evil.driver": self.script("mergedriver", "exit 0"),
            "submodule.sub.update": "!" + self.script("subupdate"),
            "submodule.recurse": "true",
        }
        for key, value in settings.items():
            raw(repo, "config", key, value)
        self.hooks(repo / ".git" / "hooks", "common-")
        self.hooks(repo.parent / "confighooks", "config-")


@pytest.fixture
def evil(tmp_path: Path) -> tuple[Path, Plants]:
    """A repository whose history has ``.gitattributes`` naming drivers, then config naming
    scripts for them (and hooks everywhere)."""
    plants = Plants(tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    raw(repo, "init", "-q", "-b", "main")
    attributes = "*.txt filter=evil diff=evil merge=evil\n*.p filter=proc\n"
    (repo / ".gitattributes").write_text(attributes)
    (repo / "a.txt").write_text("one\ntwo\nthree\n")
    (repo / "b.p").write_text("p\n")
    raw(repo, "add", "-A")
    raw(repo, "commit", "-q", "-m", "init")
    plants.plant_config(repo)
    return repo, plants


def main_of(repo: Path) -> RepoPaths:
    return discover_sync(repo).main()


# -- the environment and forced config ------------------------------------------------------


def test_child_environment_is_scrubbed(
    evil: tuple[Path, Plants], monkeypatch: pytest.MonkeyPatch
) -> None:
    repo, plants = evil
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-secret")
    monkeypatch.setenv("GITHUB_TOKEN", "ghp-secret")
    monkeypatch.setenv("GIT_DIR", "/nonexistent")
    monkeypatch.setenv("GIT_CONFIG_PARAMETERS", "'core.fsmonitor'='x'")
    env = hardened_env(IDENT)
    assert "ANTHROPIC_API_KEY" not in env and "GITHUB_TOKEN" not in env
    assert env["GIT_CONFIG_GLOBAL"] == os.devnull and env["GIT_CONFIG_NOSYSTEM"] == "1"
    assert env["HOME"] == os.devnull  # no directory at all: nothing to plant in (issue 38)
    assert env["GIT_AUTHOR_NAME"] == "t"
    with pytest.raises(ValueError, match="not an author"):
        hardened_env({"ANTHROPIC_API_KEY": "x"})
    # what a process git starts really gets (an alias runs `env` through the shell)
    shown = asyncio.run(git("-c", "alias.showenv=!env", "showenv", repo=main_of(repo))).out
    names = {line.split("=", 1)[0] for line in shown.splitlines() if "=" in line}
    assert "ANTHROPIC_API_KEY" not in names and "GITHUB_TOKEN" not in names
    assert "sk-ant-secret" not in shown and "'core.fsmonitor'='x'" not in shown  # (-c is ours)
    assert "GIT_DIR=/nonexistent" not in shown
    # GitPython's commands too (its own execute would copy os.environ)
    with open_repo(main_of(repo)) as r:
        via_gitpython = r.git(c="alias.showenv=!env").showenv()
    assert "sk-ant-secret" not in via_gitpython and "ghp-secret" not in via_gitpython
    assert plants.fired() == []


def test_forced_config_beats_repository_config(evil: tuple[Path, Plants]) -> None:
    repo, plants = evil
    main = main_of(repo)
    for key, want in (("core.fsmonitor", "false"), ("submodule.recurse", "false"),
                      ("commit.gpgSign", "false"), ("diff.external", "")):  # fmt: skip
        got = git_sync("config", "--show-scope", "--get", key, repo=main).out
        assert got.rstrip("\n") == f"command\t{want}"
    hooks = git_sync("config", "--get", "core.hooksPath", repo=main).out.strip()
    assert hooks == os.devnull and hooks != str(repo.parent / "confighooks")
    assert plants.fired() == []


def test_only_rev_parse_may_discover_a_repository(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="explicit repository"):
        prepare(("status",), None, cwd=tmp_path)
    cmd = prepare(("status",), RepoPaths(tmp_path / ".git", tmp_path, tmp_path / ".git", tmp_path))
    assert cmd.env["GIT_DIR"] == str(tmp_path / ".git")
    assert cmd.env["GIT_WORK_TREE"] == str(tmp_path)
    assert os.path.isabs(cmd.argv[0])


def test_driver_overrides_from_a_listing() -> None:
    listing = "\0".join([
        "local", "file:.git/config", "filter.Evil.clean",
        "local", "file:.git/config", "diff.x.y.textconv",
        "local", "file:.git/config", "merge.m.driver",
        "local", "file:.git/config", "core.bare",
        "command", "command line:", "filter.ours.clean",
        "local", "file:.git/config", "include.path",
    ]) + "\0"  # fmt: skip
    overrides, origins, cacheable = driver_overrides(listing)
    found = dict(overrides)
    assert found["filter.Evil.clean"] == "" and found["filter.Evil.smudge"] == ""
    assert found["filter.Evil.process"] == "" and found["filter.Evil.required"] == "false"
    assert found["diff.x.y.textconv"] == "" and found["diff.x.y.command"] == ""
    assert found["merge.m.driver"] == "false"
    assert not any(k.startswith("filter.ours") or k.startswith("core.") for k in found)
    assert origins == {".git/config"} and cacheable is False


def test_errors_name_the_command_and_git_first_line(evil: tuple[Path, Plants]) -> None:
    repo, _ = evil
    with pytest.raises(GitError, match=r"^git rev-parse failed in .*: Needed a single revision$"):
        git_sync("rev-parse", "--verify", "nope", repo=main_of(repo))


def test_timeout_kills_git_and_what_it_started(evil: tuple[Path, Plants]) -> None:
    repo, _ = evil
    start = time.monotonic()
    with pytest.raises(GitError, match="timed out after"):
        asyncio.run(git("-c", "alias.slow=!sleep 30", "slow", repo=main_of(repo), timeout_s=0.5))
    with pytest.raises(GitError, match="timed out after"):
        git_sync("-c", "alias.slow=!sleep 30", "slow", repo=main_of(repo), timeout_s=0.5)
    assert time.monotonic() - start < 10


# -- the operations orch runs, each under every plant ------------------------------------------


def test_close_time_operations_run_nothing(evil: tuple[Path, Plants], tmp_path: Path) -> None:
    repo, plants = evil
    main = main_of(repo)
    attacker = tmp_path / "attacker"
    raw(tmp_path, "init", "-q", str(attacker))
    raw(attacker, "config", "core.fsmonitor", plants.script("attacker-fsmonitor"))
    plants.hooks(attacker / ".git" / "hooks", "attacker-")

    async def body() -> None:
        path = repo / ".orch" / "worktrees" / "r-1"
        ensure_orch_dir(repo)  # as orch makes it (statedir.py: marked as ours)
        await git("worktree", "add", "-q", "-b", "orch/t/1", str(path), "HEAD", repo=main)
        tree = await locate(path)
        assert tree.git_dir == repo / ".git" / "worktrees" / "r-1"
        assert (path / "a.txt").read_text() == "one\ntwo\nthree\n"  # checked out, no smudge
        # what a sandbox writes: work, a nested repo with a fsmonitor, submodule config,
        # and a .git file pointing at the attacker's gitdir
        (path / "a.txt").write_text("one\ntwo\nthree\nfour\n")
        (path / "new.txt").write_text("new\n")
        nested = path / "nested"
        raw(tmp_path, "init", "-q", str(nested))
        (nested / "f.txt").write_text("f\n")
        raw(nested, "add", "-A")
        raw(nested, "commit", "-q", "-m", "nested")
        raw(tmp_path, "init", "-q", str(path / "empty"))  # a nested repository, no commit yet
        (path / "empty" / "e.txt").write_text("e\n")
        raw(nested, "config", "core.fsmonitor", plants.script("nested-fsmonitor"))
        raw(nested, "config", "filter.n.clean", plants.script("nested-clean", "cat"))
        (nested / ".gitattributes").write_text("* filter=n\n")
        plants.hooks(nested / ".git" / "hooks", "nested-")
        (nested / "g.txt").write_text("dirty\n")
        (path / ".gitmodules").write_text(
            f'[submodule "sub"]\n\tpath = sub\n\turl = {attacker}\n\tupdate = !touch x\n'
        )
        (path / ".git").write_text(f"gitdir: {attacker / '.git'}\n")

        status = await git("status", "--porcelain", "-z", "--untracked-files=all",
                           "--ignore-submodules=dirty", repo=tree)  # fmt: skip
        assert {e[3:] for e in status.out.split("\0") if e} >= {"a.txt", "new.txt", "nested/"}
        assert await commit_all(tree, "t", "work")  # the tier's: status, add -A, diff, commit
        names = raw(repo, "diff-tree", "-r", "--name-only", "--no-commit-id", "orch/t/1")
        # empty/ (no commit) fails `add -A`: it is left out; nested/ (a commit) is a gitlink
        assert sorted(names.split()) == [".gitmodules", "a.txt", "nested", "new.txt"]
        assert "160000 commit" in raw(repo, "ls-tree", "orch/t/1", "nested")
        assert (await diff_stats(tree, "HEAD~1", "HEAD"))[0] == 4
        with pytest.raises(GitError, match="cannot run"):  # diff.external: fails closed
            await git("diff", "HEAD~1", "HEAD", "--", "a.txt", repo=tree)
        tip = (await git("rev-parse", "orch/t/1", repo=main)).out.strip()
        assert raw(repo, "cat-file", "blob", f"{tip}:a.txt") == "one\ntwo\nthree\nfour"
        assert raw(attacker, "rev-list", "--all") == ""  # the attacker's gitdir untouched
        # the tier's removal: `worktree remove` refuses the planted .git, so it falls back
        await remove_worktree(main, path, None)
        assert not path.exists() and raw(repo, "worktree", "list").count("\n") == 0
        # merge it into the user's tree (a.txt changed on one side only: no driver needed)
        await git("merge", "--no-ff", "--no-edit", "--no-verify", "-q", "orch/t/1",
                  repo=main, identity=IDENT)  # fmt: skip
        assert (repo / "a.txt").read_text() == "one\ntwo\nthree\nfour\n"
        await git("branch", "-D", "orch/t/1", repo=main)

    asyncio.run(body())
    assert plants.fired() == []


def test_merge_driver_becomes_a_conflict(evil: tuple[Path, Plants]) -> None:
    repo, plants = evil
    main = main_of(repo)
    raw(repo, "checkout", "-q", "-b", "side")
    (repo / "a.txt").write_text("ONE\ntwo\nthree\n")
    raw(repo, "-c", "filter.evil.clean=", "-c", "filter.evil.smudge=", "commit", "-qam", "side")
    raw(repo, "-c", "filter.evil.smudge=", "checkout", "-q", "main")
    (repo / "a.txt").write_text("one\ntwo\nTHREE\n")
    raw(repo, "-c", "filter.evil.clean=", "commit", "-qam", "main")
    probe = git_sync("merge-tree", "--write-tree", "--name-only", "main", "side", repo=main,
                     check=False)  # fmt: skip
    assert probe.code == 1 and "a.txt" in probe.out  # the driver "false": a conflict
    assert plants.fired() == []


def test_filters_neutralized_store_and_check_out_raw_content(evil: tuple[Path, Plants]) -> None:
    repo, plants = evil
    main = main_of(repo)
    (repo / "a.txt").write_text("changed\n")
    (repo / "b.p").write_text("changed p\n")
    git_sync("add", "-A", repo=main)
    git_sync("commit", "--no-verify", "-q", "-m", "c", repo=main, identity=IDENT)
    assert raw(repo, "cat-file", "blob", "HEAD:a.txt") == "changed"
    (repo / "a.txt").unlink()
    git_sync("checkout", "--", "a.txt", repo=main)
    assert (repo / "a.txt").read_text() == "changed\n"
    with pytest.raises(GitError, match="cannot run"):  # diff.external: fails closed
        git_sync("diff", "HEAD~1", "HEAD", repo=main)
    with pytest.raises(GitError, match="cannot run"):  # textconv: fails too
        git_sync("diff", "--no-ext-diff", "HEAD~1", "HEAD", repo=main)
    shown = git_sync("diff", "--no-ext-diff", "--no-textconv", "HEAD~1", "HEAD", repo=main)
    assert "+changed" in shown.out
    assert plants.fired() == []


# -- end to end: a worktree run writes every plant; close and merge run none of them -----------


def test_worktree_tier_close_and_merge_run_nothing(
    evil: tuple[Path, Plants], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo, plants = evil
    raw(repo, "config", "user.name", "The User")
    raw(repo, "config", "user.email", "user@example.com")
    attacker = tmp_path / "attacker"
    raw(tmp_path, "init", "-q", str(attacker))
    raw(attacker, "config", "core.fsmonitor", plants.script("attacker-fsmonitor"))
    spec = WorkspaceSpec(run_id=new_run_id(), chain_id="c-test", agent="coder",
                         description="evil run", base=repo)  # fmt: skip

    async def body() -> WorktreeWorkspace:
        async with WorktreeWorkspace(spec) as ws:
            (ws.root / "a.txt").write_text("one\ntwo\nthree\nfour\n")
            nested = ws.root / "nested"
            raw(tmp_path, "init", "-q", str(nested))
            raw(nested, "config", "core.fsmonitor", plants.script("nested-fsmonitor"))
            (nested / "x").write_text("x\n")
            (ws.root / ".gitmodules").write_text('[submodule "s"]\n\tpath = s\n\turl = /x\n')
            (ws.root / ".git").write_text(f"gitdir: {attacker / '.git'}\n")
            ws.set_outcome(RunOutcome("succeeded", "evil work"))
        return ws

    ws = asyncio.run(body())
    [art] = ws.artifacts()
    assert raw(repo, "cat-file", "blob", f"{art['commit']}:a.txt") == "one\ntwo\nthree\nfour"
    assert raw(repo, "log", "-1", "--format=%an", art["commit"]) == "orch coder"
    assert plants.fired() == []
    # the merge guard: .gitmodules is a control file
    assert control_changes(repo, art["base"], art["commit"]) == [".gitmodules"]
    with pytest.raises(UsageError, match=r"control files \(\.gitmodules\).*--allow-control-files"):
        merge(repo, spec.run_id)
    monkeypatch.chdir(repo)
    refused = CliRunner().invoke(worktrees_app, ["merge", spec.run_id])
    assert refused.exit_code == 2 and "--allow-control-files" in refused.output
    merged = CliRunner().invoke(worktrees_app, ["merge", spec.run_id, "--allow-control-files",
                                                "--json"])  # fmt: skip
    assert merged.exit_code == 0, merged.output
    report = json.loads(merged.output)
    assert report["control_files"] == [".gitmodules"] and not report["already_merged"]
    assert (repo / "a.txt").read_text() == "one\ntwo\nthree\nfour\n"
    assert [i.merged for i in list_branches(repo)] == [True]
    assert raw(repo, "log", "-1", "--format=%an <%ae>") == "The User <user@example.com>"
    assert plants.fired() == []


def test_worktree_found_through_its_admin_dir(evil: tuple[Path, Plants], tmp_path: Path) -> None:
    repo, _ = evil
    main = main_of(repo)
    path = repo / ".orch" / "worktrees" / "r-2"
    ensure_orch_dir(repo)
    git_sync("worktree", "add", "-q", "--detach", str(path), "HEAD", repo=main)
    (path / ".git").write_text(f"gitdir: {tmp_path}\n")  # never read
    found = worktree_paths(main, path)
    assert found is not None and found.git_dir == repo / ".git" / "worktrees" / "r-2"
    assert worktree_paths(main, tmp_path) is None


# -- control paths ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "control"),
    [("orch.toml", True), ("sub/orch.toml", True), (".orch/x", True), (".claude/settings.json",
     True), (".worktreeinclude", True), (".gitattributes", True), ("lib/.gitattributes", True),
     (".gitmodules", True), (".gitignore", True), (".github/workflows/ci.yml", True),
     (".githooks/pre-commit", True), (".husky/pre-push", True), (".envrc", True),
     (".pre-commit-config.yaml", True), ("src/app.py", False), ("docs/github.md", False),
     ("hooks/pre-commit", False), ("README.md", False), (".mcp.json", True),
     (".vscode/tasks.json", True), (".devcontainer/devcontainer.json", True),
     (".cursor/mcp.json", True), (".codex/config.toml", True), (".circleci/config.yml", True),
     ("Jenkinsfile", True), ("AGENTS.md", True), ("sub/CLAUDE.md", True),
     ("docs/agents.md", True), ("src/vscode.py", False)],
)  # fmt: skip
def test_is_control_path(path: str, control: bool) -> None:
    assert is_control_path(path) is control


def test_hooks_path_from_config_is_a_control_dir(evil: tuple[Path, Plants]) -> None:
    repo, _ = evil
    raw(repo, "config", "core.hooksPath", "tools/hooks")
    base = raw(repo, "rev-parse", "HEAD")
    (repo / "tools" / "hooks").mkdir(parents=True)
    (repo / "tools" / "hooks" / "pre-commit").write_text("#!/bin/sh\n")
    (repo / "tools" / "other.py").write_text("x = 1\n")
    (repo / "orch.toml").write_text("[x]\n")
    raw(repo, "add", "-A")
    raw(repo, "-c", "filter.evil.clean=", "commit", "-q", "-m", "c")
    assert control_changes(repo, base, "HEAD") == ["orch.toml", "tools/hooks/pre-commit"]
    assert control_changes(repo, None, base) == [".gitattributes"]
