"""Auto-commits leave build artefacts out (``commit_exclude`` on top of ``.gitignore``),
never a file the repository tracks: the worktree tier (host git) and the container tier
(git inside, the EXPORT script)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import DEFAULT_COMMIT_EXCLUDE, SandboxSettings, Settings
from orchestrator.run import RunStatus
from tests.support import git, harness, init_repo, sandbox_image


def _write(path: str, content: str) -> dict[str, Any]:
    return {"tool": "write_file", "input": {"path": path, "content": content}}


def _script() -> dict[str, Any]:
    # the artefacts come from bash (as a test run or an install makes them), the real
    # file from write_file; a tracked .pyc changes too
    make = ("mkdir -p pkg/__pycache__ node_modules/dep .venv/bin && "
            "printf 'pyc' > pkg/__pycache__/mod.cpython-311.pyc && "
            "echo 'x' > node_modules/a.js && echo 'y' > node_modules/dep/index.js && "
            "echo 'v' > .venv/bin/python && echo 'l' > build.log && echo 's' > x.secret && "
            "printf 'changed' > vendored/tool.pyc")  # fmt: skip
    return {"conversations": [{"turns": [
        {"tool_calls": [_write("pkg/real.py", "REAL = 1\n"),
                        {"tool": "bash", "input": {"command": make}}]},
        {"text": "done"},
    ]}]}  # fmt: skip


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = init_repo(tmp_path / "proj", {"a.txt": "a\n", "vendored/tool.pyc": "tracked"})
    return root


def _branch_files(repo: Path, art: dict[str, Any]) -> list[str]:
    return sorted(git(repo, "diff", "--name-only", art["base"], art["commit"]).split())


def test_worktree_commit_leaves_artefacts_out_and_keeps_tracked_files(repo: Path) -> None:
    # the user's global ignore file still applies, and a repository's `!x` cannot undo it
    ignore = Path(os.environ["HOME"]) / ".config" / "git" / "ignore"
    ignore.parent.mkdir(parents=True, exist_ok=True)
    ignore.write_text("*.secret\n")
    h = harness(repo, _script(), commit_exclude=["*.log", "!*.secret"])
    rec = h.run("build things", isolation="worktree")
    assert rec.status == RunStatus.SUCCEEDED, rec.error
    (art,) = rec.artifacts
    assert _branch_files(repo, art) == ["pkg/real.py", "vendored/tool.pyc"]
    assert git(repo, "show", f"{art['branch']}:vendored/tool.pyc") == "changed"
    assert git(repo, "status", "--porcelain") == ""


def test_a_pattern_can_re_include_a_default_and_only_artefacts_leave_no_branch(
    repo: Path,
) -> None:
    h = harness(repo, _script(), commit_exclude=["!node_modules/"])
    rec = h.run("build things", isolation="worktree")
    assert rec.status == RunStatus.SUCCEEDED, rec.error
    (art,) = rec.artifacts
    assert _branch_files(repo, art) == [
        "build.log", "node_modules/a.js", "node_modules/dep/index.js", "pkg/real.py",
        "vendored/tool.pyc", "x.secret",
    ]  # fmt: skip
    only_artefacts = {"conversations": [{"turns": [
        {"tool_calls": [{"tool": "bash", "input": {"command": "mkdir -p __pycache__ && "
                                                   "echo c > __pycache__/m.pyc"}}]},
        {"text": "ran the tests"},
    ]}]}  # fmt: skip
    branches = git(repo, "branch", "--list", "orch/*")
    h = harness(repo, only_artefacts)
    rec = h.run("run the tests", isolation="worktree")
    assert rec.status == RunStatus.SUCCEEDED, rec.error
    assert rec.artifacts == []  # nothing but artefacts: no commit, no branch
    assert git(repo, "branch", "--list", "orch/*") == branches


def test_commit_exclude_is_validated() -> None:
    assert "__pycache__/" in DEFAULT_COMMIT_EXCLUDE and "node_modules/" in DEFAULT_COMMIT_EXCLUDE
    assert "dist/" not in DEFAULT_COMMIT_EXCLUDE  # may be a project's real output
    with pytest.raises(ValueError, match="one-line gitignore pattern"):
        Settings(commit_exclude=["a\nb"])
    with pytest.raises(ValueError, match="one-line gitignore pattern"):
        Settings(commit_exclude=["  "])


# -- the container tier ---------------------------------------------------------------


@pytest.mark.docker
@pytest.mark.usefixtures("hermetic_git")
def test_container_commit_leaves_artefacts_out_and_keeps_tracked_files(repo: Path) -> None:
    image = sandbox_image()
    h = harness(repo, _script(), commit_exclude=["*.log", "*.secret"],
                sandbox=SandboxSettings(image=image))  # fmt: skip
    rec = h.run("build things", isolation="container")
    assert rec.status == RunStatus.SUCCEEDED, rec.error
    (art,) = rec.artifacts
    assert _branch_files(repo, art) == ["pkg/real.py", "vendored/tool.pyc"]
    assert git(repo, "show", f"{art['branch']}:vendored/tool.pyc") == "changed"
