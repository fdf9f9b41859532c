"""Hooks cannot run agent code through what their interpreter loads (issue 38, class 3).

The attack: the README's own example hook, ``python3 ~/.orch/hooks/check_command.py``, a
script out of every workspace. The user works in the project's venv (outside the checkout,
poetry's default), activated, and the project is installed editable there: a ``.pth`` file
puts the checkout on that Python's path. The agent writes ``sitecustomize.py`` in the
checkout; the next hook's ``python3`` imports it on the host. Now the guard asks the hook's
Python where it imports from and refuses the hook (the run fails closed). The variants: an
environment variable that makes an interpreter load code (``NODE_OPTIONS=--require``, as
Yarn's Plug'n'Play sets it) is not passed to hooks; a hook script whose ``#!`` line names
that venv's Python through ``env`` is refused too; ``-S`` keeps site directories out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.policy.hookguard import hook_env, interpreter_refusal
from tests.support import init_repo, orch, write_script

pytestmark = pytest.mark.bwrap


def project_venv(where: Path, checkout: Path) -> Path:
    """A venv outside the checkout with the project installed editable; its bin dir."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True)
    (sitedir,) = (where / "lib").glob("python3*/site-packages")
    (sitedir / "_project.pth").write_text(f"{checkout}\n")  # as uv and poetry write it
    return where / "bin"


def user_hook(command: str, script: str, name: str) -> Path:
    hooks = Path.home() / ".orch" / "hooks"
    hooks.mkdir(parents=True, exist_ok=True)
    (hooks / name).write_text(script)
    toml = f'[[hooks.PreToolUse]]\nmatcher = "^bash$"\ncommand = {json.dumps(command)}\n'
    (Path.home() / ".orch" / "config.toml").write_text(toml)
    return hooks / name


def plant_then_bash(repo: Path, path: str, content: str) -> Path:
    turns: list[dict[str, Any]] = [
        {"tool_calls": [{"tool": "write_file", "input": {"path": path, "content": content}}]},
        {"tool_calls": [{"tool": "bash", "input": {"command": "echo hi"}}]},
        {"text": "done"},
    ]
    return write_script(repo, {"conversations": [{"turns": turns}]})


def test_the_readme_hook_does_not_import_an_agents_sitecustomize(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "proj", {"README.md": "# the user's\n"})
    venv_bin = project_venv(tmp_path / "venv", repo)
    readme = "python3 ~/.orch/hooks/check_command.py"
    user_hook(readme, "import sys\nsys.exit(0)\n", "check_command.py")
    marker = tmp_path / "pwned"
    planted = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran on the host')\n"
    script = plant_then_bash(repo, "sitecustomize.py", planted)
    activated = {
        "PATH": f"{venv_bin}:{os.environ['PATH']}",
        "VIRTUAL_ENV": str(venv_bin.parent),
    }
    r = orch("task", "fix", "--json", "--model", f"scripted:{script}", cwd=repo, env=activated)
    assert (repo / "sitecustomize.py").exists()  # the agent wrote it (its workspace)
    assert not marker.exists(), "a hook's Python imported the agent's sitecustomize.py"
    assert r.returncode != 0
    refused = [line for line in (r.stdout + r.stderr).splitlines() if "hook refused" in line]
    assert refused and f"loads code from {repo}" in refused[0], r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_node_options_from_the_users_environment_do_not_reach_a_hook(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "proj", {"README.md": "# the user's\n"})
    user_hook("node ~/.orch/hooks/check.js", "process.exit(0)\n", "check.js")
    marker = tmp_path / "pwned"
    planted = f"require('fs').writeFileSync({json.dumps(str(marker))}, 'ran on the host')\n"
    script = plant_then_bash(repo, ".pnp.cjs", planted)
    pnp = {"NODE_OPTIONS": f"--require {repo / '.pnp.cjs'}"}  # as `yarn run` sets it
    r = orch("task", "fix", "--json", "--model", f"scripted:{script}", cwd=repo, env=pnp)
    assert (repo / ".pnp.cjs").exists()
    assert not marker.exists(), "a hook's node loaded the agent's .pnp.cjs"
    assert r.returncode == 0, r.stderr  # the hook itself ran, without the variable
    assert json.loads(r.stdout)["status"] == "succeeded"


def test_a_hook_scripts_shebang_is_followed_to_its_python(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "proj", {"README.md": "x\n"})
    venv_bin = project_venv(tmp_path / "venv", repo)
    user_env = {"PATH": f"{venv_bin}:/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}
    env = hook_env(user_env, repo, tmp_path)
    assert "PYTHONPATH" not in env
    hook = tmp_path / "check.py"
    hook.write_text("#!/usr/bin/env python3\nimport sys\n")
    hook.chmod(0o755)
    for command in (str(hook), f"sh -c {hook}", f"python3 -I {hook}", f"exec python3 {hook}"):
        why = interpreter_refusal(command, repo, env, tmp_path)
        assert why is not None and f"loads code from {repo}" in why, command
    assert interpreter_refusal(f"python3 -S {hook}", repo, env, tmp_path) is None
    assert interpreter_refusal(f"python3 -IS {hook}", repo, env, tmp_path) is None
    system = {"PATH": "/usr/bin:/bin"}  # no venv on the way: nothing of the project
    assert interpreter_refusal(f"python3 {hook}", repo, system, tmp_path) is None
    assert interpreter_refusal("echo hi", repo, env, tmp_path) is None
