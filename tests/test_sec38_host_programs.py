"""Issue 38 (classes 2/5/9 family): every program orch itself runs on the host comes from
where no agent can write (``fs/hostprograms.py``).

With the project's ``.venv`` activated (its ``bin`` first on ``PATH``, inside the checkout),
a sandboxed command plants ``.venv/bin/<program>``; orch's next host exec of that name must
not run it: the ``env`` that starts every bwrap sandbox, orch's hardened git (and
GitPython's ``git version`` at import), the system ``bwrap``."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.bwrap.profile import OsSandbox, SandboxUnavailable
from orchestrator.fs import hostprograms
from orchestrator.fs.hostprograms import ENV, host_path, host_program
from tests.support import init_repo, orch, write_script


def _activated(repo: Path) -> dict[str, str]:
    """The environment of a user who ran ``source .venv/bin/activate`` in ``repo``."""
    venv = repo / ".venv"
    path = f"{venv / 'bin'}:{Path(sys.executable).parent}:/usr/bin:/bin"
    return {"PATH": path, "VIRTUAL_ENV": str(venv)}


def _plant(name: str, marker: Path, real: str) -> str:
    """An agent's bash: a ``.venv/bin/<name>`` that notes it ran (in ``marker``, outside
    the checkout: only an unsandboxed process can write there), then runs ``real``."""
    trojan = f'#!/bin/sh\necho "$(id -u) {name} $*" >> {marker}\nexec {real} "$@"\n'
    return (
        f"mkdir -p .venv/bin && printf %s {shlex.quote(trojan)} > .venv/bin/{name} && "
        f"chmod +x .venv/bin/{name} && echo planted"
    )


def _run(
    repo: Path, env: dict[str, str], name: str, *commands: str, args: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    turns: list[dict[str, object]] = [
        {"tool_calls": [{"tool": "bash", "input": {"command": c}}]} for c in commands
    ]
    turns.append({"text": "ok"})
    script = write_script(repo, {"conversations": [{"depth": 0, "turns": turns}]}, name)
    r = orch("task", "go", "--json", *args, "--model", f"scripted:{script}", cwd=repo, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.mark.bwrap
def test_an_env_planted_on_an_activated_venv_never_starts_a_sandbox(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "proj", {"README.md": "hi\n", ".gitignore": ".venv/\n"})
    marker = tmp_path / "HOST-RAN"
    plant = _plant("env", marker, "/usr/bin/env")
    # the same run: command 2 and 3 start after the plant, through orch's host ``env``
    _run(repo, _activated(repo), "plant.yaml", plant, "echo second", "echo third")
    assert (repo / ".venv/bin/env").is_file()
    assert not marker.exists(), marker.read_text()


@pytest.mark.bwrap
def test_a_git_planted_on_an_activated_venv_never_runs_on_the_host(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "proj", {"README.md": "hi\n", ".gitignore": ".venv/\n"})
    marker = tmp_path / "HOST-RAN"
    env = _activated(repo)
    _run(repo, env, "plant.yaml", _plant("git", marker, "/usr/bin/git"))
    assert (repo / ".venv/bin/git").is_file()
    # the next run in a worktree: orch's host git makes, reads and closes it (GitPython too)
    r = _run(repo, env, "wt.yaml", "echo hi > new.txt", args=("--isolation", "worktree"))
    assert "worktree" in r.stdout
    assert not marker.exists(), marker.read_text()


def test_gitpython_imported_by_orch_runs_no_planted_git(tmp_path: Path) -> None:
    """``import git`` runs ``git version`` found on PATH: orch imports it through
    ``project/gitpy.py``, which names the host's git first."""
    repo = init_repo(tmp_path / "proj", {"README.md": "hi\n"})
    marker = tmp_path / "HOST-RAN"
    bin_dir = repo / ".venv/bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "git").write_text(f'#!/bin/sh\necho "git $*" >> {marker}\nexec /usr/bin/git "$@"\n')
    (bin_dir / "git").chmod(0o755)
    env = {**os.environ, **_activated(repo)}
    env.pop("GIT_PYTHON_GIT_EXECUTABLE", None)
    code = "import orchestrator.branches, git; print(git.Git.GIT_PYTHON_GIT_EXECUTABLE)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert not done.stdout.strip().startswith(str(repo)), done.stdout
    assert not marker.exists(), marker.read_text()


@pytest.mark.bwrap
def test_a_system_bwrap_planted_on_an_activated_venv_never_runs(tmp_path: Path) -> None:
    """sandbox.bwrap = "system": the bwrap on PATH, without the checkout's entries."""
    system = hostprograms.host_program("bwrap")
    if system is None:
        pytest.skip("no system bwrap on PATH")
    repo = init_repo(tmp_path / "proj", {"README.md": "hi\n", ".gitignore": ".venv/\n"})
    marker = tmp_path / "HOST-RAN"
    env = {**_activated(repo), "ORCH_BWRAP": "system"}
    _run(repo, env, "plant.yaml", _plant("bwrap", marker, system))
    assert (repo / ".venv/bin/bwrap").is_file()
    r = _run(repo, env, "next.yaml", "echo second")  # a new orch process picks its bwrap
    assert system in r.stdout
    assert not marker.exists(), marker.read_text()


def test_a_system_bwrap_in_a_workspace_starts_no_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workspace that is no git checkout (the checkout rule does not see it) with its
    ``bin`` on PATH: the system bwrap found there is refused when a sandbox of that
    workspace starts (another workspace's sandbox keeps it read-only: ``own_paths``)."""
    from orchestrator.bwrap import find

    bundled = find.bundled_bwrap()
    if bundled is None:
        pytest.skip("no bundled bwrap")
    work = tmp_path / "work"
    (work / "bin").mkdir(parents=True)
    fake = work / "bin" / "bwrap"
    fake.write_text(f'#!/bin/sh\nexec {bundled} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("ORCH_BWRAP", "system")
    monkeypatch.setenv("PATH", f"{work / 'bin'}:/usr/bin:/bin")
    find.forget()
    try:
        assert find.bwrap_choice().path == str(fake)  # it works: only where it lies refuses it
        with pytest.raises(SandboxUnavailable, match="workspace an agent can write"):
            OsSandbox(workspace=work).wrap(["true"], work)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        assert OsSandbox(workspace=elsewhere).wrap(["true"], elsewhere)[2] == str(fake)
    finally:
        find.forget()


def test_host_path_leaves_out_every_entry_an_agent_could_write(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "proj", {"README.md": "hi\n"})
    other = init_repo(tmp_path / "other", {"README.md": "hi\n"})  # another project's checkout
    outside = tmp_path / "tools" / "bin"
    outside.mkdir(parents=True)
    linked = tmp_path / "linked"  # outside, a link into the checkout
    linked.symlink_to(repo / ".venv", target_is_directory=True)
    plain = tmp_path / "plain"  # a workspace that is no checkout
    (plain / "bin").mkdir(parents=True)
    entries = [
        ".venv/bin",  # relative
        "",
        str(repo / ".venv/bin"),
        str(repo / ".orch/worktrees/r-1/.venv/bin"),
        str(linked / "bin"),
        str(other / "node_modules/.bin"),
        str(plain / "bin"),
        str(outside),
        "/usr/bin",
    ]
    value = os.pathsep.join(entries)
    kept = [str(outside), "/usr/bin"]
    assert host_path(repo, value).split(os.pathsep) == [str(plain / "bin"), *kept]
    assert host_path(plain, value).split(os.pathsep) == kept
    assert host_path(None, value).split(os.pathsep) == [str(plain / "bin"), *kept]
    assert host_path(repo, ".:bin") == hostprograms.FALLBACK_PATH


def test_host_program_finds_none_an_agent_planted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = init_repo(tmp_path / "proj", {"README.md": "hi\n"})
    bin_dir = repo / ".venv/bin"
    bin_dir.mkdir(parents=True)
    for name in ("git", "bwrap", "orch-only-here"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    hostprograms.forget()
    assert host_program("orch-only-here") is None
    assert host_program("orch-only-here", repo) is None
    git = host_program("git", repo)
    assert git is not None and not git.startswith(str(repo))
    assert ENV in ("/usr/bin/env", "/bin/env")
