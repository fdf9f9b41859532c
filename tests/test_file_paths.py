"""File-tool paths: words checked by the tools, then opened race-free beneath the root.

Each case goes through the real tool and the real host runtime (``safefs``):
``..`` and absolute paths out, sibling prefixes, symlinks (out, in, loops), hard
links, writes into ``.git`` and orch's control files.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import Settings
from orchestrator.run import Evidence
from orchestrator.tools.base import Tool, ToolContext, ToolFailure, ToolOutput
from orchestrator.tools.files import EditFileTool, GlobTool, ReadFileTool, WriteFileTool
from orchestrator.workspaces.base import ProcessResult
from orchestrator.workspaces.host import HostRuntime


async def _no_exec(command: str, **_: Any) -> ProcessResult:
    raise AssertionError("file tools run no command")


def call(root: Path, tool: Tool, **args: Any) -> ToolOutput:
    ctx = ToolContext(
        run_id="r-test",
        runtime=HostRuntime(root, _no_exec),
        settings=Settings(),
        env={},
        evidence=Evidence(),
        spawner=None,  # type: ignore[arg-type]  # file tools never delegate
        skills={},
    )
    try:
        return asyncio.run(tool.run(ctx, tool.input_model.model_validate(args)))
    except ToolFailure as e:
        return ToolOutput(str(e), is_error=True)


def read(root: Path, path: str) -> ToolOutput:
    return call(root, ReadFileTool(), path=path)


def write(root: Path, path: str, content: str = "x") -> ToolOutput:
    return call(root, WriteFileTool(), path=path, content=content)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    (r / "src").mkdir(parents=True)
    (r / "src" / "a.py").write_text("x = 1\n")
    (r / ".git" / "hooks").mkdir(parents=True)
    (r / ".git" / "config").write_text("[core]\n")
    return r


def test_relative_and_absolute_paths_inside_are_fine(root: Path) -> None:
    assert read(root, "src/a.py").content == "x = 1\n"
    assert read(root, str(root / "src" / "a.py")).content == "x = 1\n"
    assert not write(root, "src/../src/new.py", "y").is_error
    assert (root / "src" / "new.py").read_text() == "y"


@pytest.mark.parametrize("path", ["../outside.txt", "src/../../outside.txt", "/etc/passwd", "/tmp"])
def test_paths_outside_are_refused(root: Path, path: str) -> None:
    for out in (read(root, path), write(root, path)):
        assert out.is_error and "outside the workspace" in out.content


def test_sibling_prefix_is_not_inside(root: Path) -> None:
    evil = root.parent / (root.name + "_evil")
    evil.mkdir()
    (evil / "f").write_text("secret")
    for path in (str(evil / "f"), f"../{root.name}_evil/f"):
        out = read(root, path)
        assert out.is_error and "secret" not in out.content


def test_symlinks_are_never_followed(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("s3cret")
    (root / "link_file").symlink_to(outside / "secret.txt")
    (root / "link_dir").symlink_to(outside)
    (root / "inner").symlink_to(root / "src")
    for p in ("link_file", "link_dir/secret.txt", "link_dir/new.txt", "inner/a.py"):
        for out in (read(root, p), write(root, p)):
            assert out.is_error and "symlink" in out.content, (p, out.content)
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert (outside / "secret.txt").read_text() == "s3cret"


def test_symlink_loops_are_refused(root: Path) -> None:
    (root / "loop").symlink_to(root / "loop")
    (root / "a").symlink_to(root / "b")
    (root / "b").symlink_to(root / "a")
    for p in ("loop", "a", "a/x.txt", "src/../loop"):
        assert read(root, p).is_error and write(root, p).is_error
    assert "src/a.py" in call(root, GlobTool(), pattern="**/*").content


def test_writes_into_git_are_refused_reads_allowed(root: Path) -> None:
    for p in (".git/config", ".git/hooks/pre-commit", "src/../.git/x", ".GIT/config"):
        out = write(root, p)
        assert out.is_error and ".git" in out.content
    assert read(root, ".git/config").content == "[core]\n"


def test_hard_links_are_refused(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "victim.txt"
    outside.write_text("important")
    os.link(outside, root / "hl.txt")
    for out in (read(root, "hl.txt"), write(root, "hl.txt", "pwned")):
        assert out.is_error and "hard link" in out.content
    assert outside.read_text() == "important"


@pytest.mark.parametrize(
    "path",
    [
        "orch.toml",
        "ORCH.TOML",
        ".orch/agents/evil.md",
        ".orch/skills/x/SKILL.md",
        ".orch/orch.db",
        ".claude/settings.json",
        ".claude/agents/evil.md",
        ".worktreeinclude",
        "src/../orch.toml",
    ],
)
def test_writes_to_orch_control_files_are_refused_reads_allowed(root: Path, path: str) -> None:
    (root / ".orch" / "agents").mkdir(parents=True)
    (root / ".claude").mkdir()
    (root / "orch.toml").write_text("model = 'sonnet'\n")
    out = write(root, path)
    assert out.is_error and "orch control file" in out.content
    if path.lower().replace("src/../", "") == "orch.toml" and path == "orch.toml":
        assert read(root, path).content == "model = 'sonnet'\n"  # reading them is fine


def test_control_file_check_is_relative_to_the_workspace_root(root: Path) -> None:
    worktree = root / ".orch" / "worktrees" / "run1"
    (worktree / "src").mkdir(parents=True)
    assert not write(worktree, "src/new.py").is_error
    assert not write(worktree, "notes/orch.toml").is_error
    for p in ("orch.toml", ".claude/settings.json"):
        out = write(worktree, p)
        assert out.is_error and "orch control file" in out.content


def test_reads_are_capped_before_loading(root: Path) -> None:
    with (root / "big.bin").open("wb") as f:
        f.truncate(64 * 1024 * 1024)  # sparse: nothing on disk
    out = read(root, "big.bin")
    assert out.is_error and "over the 10,485,760-byte read limit" in out.content
    edit = call(root, EditFileTool(), path="big.bin", old_text="a", new_text="b")
    assert edit.is_error and "read limit" in edit.content
