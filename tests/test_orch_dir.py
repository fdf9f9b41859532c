"""``.orch/.gitignore``: orch's state stays out of git, ``.orch/agents/`` and the like do not."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.project.orchignore import STATE_IGNORE, ensure_state_ignore
from tests.support import git, init_repo, orch, wait_for, write_script

# every path orch writes under .orch (orchignore.py's audit), as a file planted there
STATE_PATHS = [
    "orch.db", "orch.db-wal", "orch.db-shm", "orch.db-journal", "logs/host.log",
    "logs/r-123.log", "worktrees/r-123/src/app.py", "worktrees.lock", "host-abc123.sock",
    "host-abc123.lock", "owner", ".gitignore.0a1b2c.orch-tmp", "agents/.x.md.0a1b2c.orch-tmp",
]  # fmt: skip
CONFIG_PATHS = ["agents/x.md", "skills/s/SKILL.md", "teams/review.toml"]


def _untracked(repo: Path) -> list[str]:
    out = git(repo, "status", "--porcelain", "--untracked-files=all")
    return sorted(line[3:] for line in out.splitlines())


def test_after_real_commands_configuration_is_addable_and_state_is_not(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "proj", {"a.txt": "a\n"})
    script = write_script(repo, {"conversations": [{"turns": [{"text": "done"}]}]})
    started = orch("task", "say done", "--model", f"scripted:{script}", "--background", cwd=repo)
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.strip().split()[-1]
    waited = orch("result", run_id, "--wait", cwd=repo)
    assert waited.returncode == 0, waited.stderr
    assert (repo / ".orch" / "orch.db").is_file() and (repo / ".orch" / "logs").is_dir()
    assert (repo / ".orch" / ".gitignore").read_text() == STATE_IGNORE
    assert _untracked(repo) == []  # the state orch wrote, and its .gitignore, are ignored

    for rel in STATE_PATHS + CONFIG_PATHS:
        (repo / ".orch" / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / ".orch" / rel).write_text("x\n")
    assert _untracked(repo) == sorted(f".orch/{p}" for p in CONFIG_PATHS)
    git(repo, "add", ".orch/agents/x.md")  # committable without -f
    assert "A  .orch/agents/x.md" in git(repo, "status", "--porcelain")


def test_an_old_ignore_everything_file_is_upgraded_an_edited_one_kept(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "proj")
    (repo / ".orch").mkdir()
    (repo / ".orch" / ".gitignore").write_text("*\n")  # what orch wrote before
    assert orch("ps", cwd=repo).returncode == 0
    assert (repo / ".orch" / ".gitignore").read_text() == STATE_IGNORE

    edited = STATE_IGNORE + "/scratch/\n"
    (repo / ".orch" / ".gitignore").write_text(edited)
    assert orch("ps", cwd=repo).returncode == 0
    assert (repo / ".orch" / ".gitignore").read_text() == edited
    (repo / ".orch" / ".gitignore").write_text("*\n!agents/\n")  # the user's own rules
    ensure_state_ignore(repo / ".orch")
    assert (repo / ".orch" / ".gitignore").read_text() == "*\n!agents/\n"


def test_a_symlinked_gitignore_is_replaced_never_written_through(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "proj")
    outside = tmp_path / "victim"
    outside.write_text("*\n")  # even content orch would upgrade
    (repo / ".orch").mkdir()
    os.symlink(outside, repo / ".orch" / ".gitignore")
    assert orch("ps", cwd=repo).returncode == 0
    assert outside.read_text() == "*\n"
    ignore = repo / ".orch" / ".gitignore"
    assert not ignore.is_symlink() and ignore.read_text() == STATE_IGNORE


def test_a_symlinked_orch_dir_gets_no_gitignore_through_it(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "proj").mkdir()
    os.symlink(elsewhere, tmp_path / "proj" / ".orch")
    ensure_state_ignore(tmp_path / "proj" / ".orch")
    assert not (elsewhere / ".gitignore").exists()


def test_worktree_runs_leave_status_clean_with_committed_agents(tmp_path: Path) -> None:
    """A repository that commits .orch/agents/ and .orch/.gitignore: a worktree run's
    checkout under .orch/worktrees/ never shows in the user's status."""
    repo = init_repo(tmp_path / "proj", {"a.txt": "a\n"})
    (repo / ".orch" / "agents").mkdir(parents=True)
    ensure_state_ignore(repo / ".orch")
    agent = "---\nname: x\ndescription: X.\nisolation: worktree\n---\nYou are x.\n"
    (repo / ".orch" / "agents" / "x.md").write_text(agent)
    git(repo, "add", "-f", ".orch/.gitignore", ".orch/agents/x.md")
    git(repo, "-c", "user.name=u", "-c", "user.email=u@u", "commit", "-qm", "agents")
    script = write_script(repo, {"conversations": [{"agent": "x", "turns": [
        {"tool_calls": [{"tool": "write_file", "input": {"path": "b.txt", "content": "b\n"}}]},
        {"text": "wrote b"},
    ]}]})  # fmt: skip
    done = orch("task", "write b", "--agent", "x", "--model", f"scripted:{script}", cwd=repo)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: not any((repo / ".orch" / "worktrees").iterdir()), 10, "worktree removed")
    assert _untracked(repo) == []
    (branch,) = git(repo, "branch", "--format=%(refname:short)", "--list", "orch/x/*").split()
    assert git(repo, "show", f"{branch}:b.txt") == "b"
