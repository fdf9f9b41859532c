"""Hooks are host code the agent cannot change (issue 20, class 3).

A hook runs on the host, unsandboxed. The attack: with the README's old example hook
(``python3 scripts/check_command.py``), an agent of the shared or worktree tier rewrote that
script and had the host run it. Now a hook naming a file in a workspace is refused and its
run fails closed; the rest run from a private empty directory. End to end through the CLI,
with the scripted model and the real bubblewrap; the variants in-process.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.policy.hookguard import hook_env, refusal
from tests.support import init_repo, need_bwrap, orch, write_script

BENIGN = "import sys\nsys.exit(0)\n"


def planted(marker: Path) -> str:
    """What the agent writes over the hook script: reads ~/.ssh, writes outside."""
    return (
        "import os, pathlib\n"
        "ssh = pathlib.Path.home() / '.ssh'\n"
        f"pathlib.Path({str(marker)!r}).write_text(str(list(ssh.glob('*'))))\n"
    )


def user_config(toml: str) -> None:
    (Path.home() / ".orch").mkdir(exist_ok=True)
    (Path.home() / ".orch" / "config.toml").write_text(toml)


def hook_toml(command: str) -> str:
    return f'[[hooks.PreToolUse]]\nmatcher = "^bash$"\ncommand = {json.dumps(command)}\n'


def rewrite_then_bash(repo: Path, marker: Path, agent: str) -> Path:
    turns: list[dict[str, Any]] = [
        {
            "tool_calls": [
                {
                    "tool": "write_file",
                    "input": {"path": "scripts/check_command.py", "content": planted(marker)},
                }
            ]
        },
        {"tool_calls": [{"tool": "bash", "input": {"command": "echo hi"}}]},
        {"text": "done"},
    ]
    return write_script(repo, {"conversations": [{"agent": agent, "turns": turns}]})


def refused_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "hook refused" in line]


@pytest.mark.parametrize("isolation", ["shared", "worktree"])
def test_an_agent_cannot_rewrite_the_hook_the_host_runs(tmp_path: Path, isolation: str) -> None:
    need_bwrap()
    marker = tmp_path / "pwned"
    (Path.home() / ".ssh").mkdir()
    (Path.home() / ".ssh" / "id_rsa").write_text("secret\n")
    repo = init_repo(tmp_path / "repo", {"scripts/check_command.py": BENIGN})
    user_config(hook_toml("python3 scripts/check_command.py"))  # the README's old example
    (Path.home() / ".orch" / "agents").mkdir()
    (Path.home() / ".orch" / "agents" / "fixer.md").write_text(
        "---\nname: fixer\ndescription: Fixes.\ntools: write_file, bash\n"
        f"isolation: {isolation}\n---\nFix.\n"
    )
    script = rewrite_then_bash(repo, marker, "fixer")
    r = orch("task", "fix", "--agent", "fixer", "--json", "--model", f"scripted:{script}", cwd=repo)
    assert not marker.exists(), "the host ran a hook script the agent wrote"
    assert r.returncode != 0
    result = json.loads(r.stdout)
    assert result["status"] == "failed" and result["isolation"] == isolation
    [line] = refused_lines(result["error"])
    assert "scripts/check_command.py" in line and "~/.orch/hooks/" in line
    # The agent did write the file (its own workspace): only the host never ran it.
    if isolation == "shared":
        assert "pwned" in (repo / "scripts/check_command.py").read_text()


def test_a_trusted_repositorys_hook_script_in_the_repository_is_refused(tmp_path: Path) -> None:
    """Trust lets a repository's hooks run, never a file an agent of it could rewrite."""
    need_bwrap()
    marker = tmp_path / "pwned"
    repo = init_repo(
        tmp_path / "repo",
        {
            "scripts/check_command.py": BENIGN,
            "orch.toml": hook_toml(f"{shlex.quote(sys.executable)} scripts/check_command.py"),
        },
    )
    assert orch("trust", cwd=repo).returncode == 0
    script = rewrite_then_bash(repo, marker, "general")
    r = orch("task", "fix", "--json", "--model", f"scripted:{script}", cwd=repo)
    assert not marker.exists()
    result = json.loads(r.stdout)
    assert r.returncode != 0 and result["status"] == "failed"
    [line] = refused_lines(result["error"])
    assert "put the script outside every workspace (e.g. ~/.orch/hooks/)" in line


def test_a_hook_outside_the_workspace_runs_from_a_private_directory(tmp_path: Path) -> None:
    """The documented example: a script in ~/.orch/hooks/ blocks `git push`; it runs from
    an empty directory of its own, with the workspace in ORCH_PROJECT_DIR and the event."""
    need_bwrap()
    hooks = Path.home() / ".orch" / "hooks"
    hooks.mkdir(parents=True)
    log = tmp_path / "hook.log"
    (hooks / "guard_bash.py").write_text(
        "import json, os, sys\n"
        "event = json.load(sys.stdin)\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(json.dumps([os.getcwd(), os.listdir('.'), os.environ['ORCH_PROJECT_DIR'],"
        " event['cwd']]) + '\\n')\n"
        "if 'git push' in event['tool_input'].get('command', ''):\n"
        "    print('pushing is for humans', file=sys.stderr)\n"
        "    sys.exit(2)\n"
    )
    user_config(hook_toml("python3 ~/.orch/hooks/guard_bash.py"))
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n"})
    turns = [
        {"tool_calls": [{"tool": "bash", "input": {"command": "git push origin main"}}]},
        {"expect_result": "blocked by PreToolUse hook: pushing is for humans", "text": "ok"},
    ]
    script = write_script(repo, {"conversations": [{"agent": "general", "turns": turns}]})
    r = orch("task", "push", "--json", "--model", f"scripted:{script}", cwd=repo)
    assert r.returncode == 0, r.stdout + r.stderr
    [[cwd, listing, project, event_cwd]] = [json.loads(x) for x in log.read_text().splitlines()]
    assert listing == [] and not Path(cwd).exists()  # empty, and removed afterwards
    assert not Path(cwd).is_relative_to(repo) and project == event_cwd == str(repo)


# -- the variants, in-process ----------------------------------------------------------------


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "ws" / "scripts").mkdir(parents=True)
    (tmp_path / "ws" / "scripts" / "x.py").write_text(BENIGN)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "ok.py").write_text(BENIGN)
    return tmp_path / "ws"


def check(command: str, ws: Path) -> str | None:
    env = hook_env(dict(os.environ), ws, Path("/"))
    return refusal(command, ws, env)


@pytest.mark.parametrize(
    "command",
    [
        "python3 scripts/x.py",
        "bash x.sh",
        "sh -c 'python3 scripts/x.py'",
        'bash -c "cd .. && python3 ws/scripts/x.py"',
        "{ws}/scripts/x.py",
        "python3 {ws}/scripts/x.py",
        "python3 < {ws}/scripts/x.py",
        "cd {ws} && python3 x.py",
        "env --chdir={ws} python3 -c 1",
        "PYTHONPATH={ws} python3 -m x",
        "python3 $ORCH_PROJECT_DIR/scripts/x.py",
        "python3 ${{ORCH_PROJECT_DIR}}/scripts/x.py",
        "python3 $UNSET_THING/x.py",
        "python3 $(echo {ws}/scripts/x.py)",
        "python3 `echo x`",
        "python3 {link_in}",  # a link outside pointing into the workspace
        "python3 {link_dir_in}/scripts/x.py",
        "python3 {ws}/out/ok.py",  # a link in the workspace pointing out: it could be retargeted
        "echo log >> {ws}/hook.log",  # a write through whatever the agent left there
    ],
)
def test_a_hook_naming_a_workspace_file_is_refused(ws: Path, command: str) -> None:
    outside = ws.parent / "outside"
    (outside / "link.py").symlink_to(ws / "scripts" / "x.py")
    (outside / "dirlink").symlink_to(ws)
    (ws / "out").symlink_to(outside)
    text = command.format(ws=ws, link_in=outside / "link.py", link_dir_in=outside / "dirlink")
    why = check(text, ws)
    assert why is not None and why.startswith("hook refused: ") and "\n" not in why


@pytest.mark.parametrize(
    "command",
    [
        "python3 {outside}/ok.py",
        "python3 ~/.orch/hooks/x.py",
        "python3 $HOME/.orch/hooks/x.py",
        "grep -q forbidden && {{ echo 'no' >&2; exit 2; }}; exit 0",
        "echo $$ > {outside}/pid; exec sleep 30",
        "jq -e .tool_input",
        "true",
    ],
)
def test_a_hook_outside_every_workspace_may_run(ws: Path, command: str) -> None:
    assert check(command.format(outside=ws.parent / "outside"), ws) is None


def test_a_worktree_runs_hooks_may_not_name_the_main_checkout_either(tmp_path: Path) -> None:
    main = tmp_path / "main"
    worktree = main / ".orch" / "worktrees" / "r1"
    worktree.mkdir(parents=True)
    assert check(f"python3 {main}/scripts/x.py", worktree) is not None
    assert check("python3 scripts/x.py", worktree) is not None


def test_a_run_in_a_subdirectory_may_not_name_the_rest_of_its_checkout(tmp_path: Path) -> None:
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    (tmp_path / "repo" / "sub").mkdir()
    assert check(f"python3 {tmp_path}/repo/scripts/x.py", tmp_path / "repo" / "sub") is not None


def test_the_hook_environment_leads_into_no_workspace(ws: Path) -> None:
    env = {
        "PATH": f"{ws}/.venv/bin:/usr/bin:.:bin",
        "PYTHONPATH": f"/opt/lib:{ws}",
        "VIRTUAL_ENV": f"{ws}/.venv",
        "LANG": "C.UTF-8",
    }
    out = hook_env(env, ws, Path("/tmp"))
    assert out["PATH"] == "/usr/bin" and "PYTHONPATH" not in out and "VIRTUAL_ENV" not in out
    assert out["LANG"] == "C.UTF-8" and out["ORCH_PROJECT_DIR"] == str(ws)
