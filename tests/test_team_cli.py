"""`orch team list|show|validate|run`: committed team files and one-line errors for bad ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli.main import app
from orchestrator.policy.controlpaths import is_control_path
from orchestrator.store import open_store
from tests.support import init_repo

pytestmark = pytest.mark.usefixtures("hermetic_git")

GOOD = 'description = "Writer and a reviewer"\ngate = "true"\nreviewers = ["reviewer"]\n'
BOXED = """---
name: boxed
description: An agent that must run in a container.
tools: read_file, write_file
isolation: container
---
Write code.
"""
BAD = {
    "ghost": ('writer = "nobody"\n', "writer 'nobody' is not an agent"),
    "writes": ('reviewers = ["reviewer", "general"]\n', "reviewer 'general' has tools that write"),
    "numgate": ("gate = 1\n", "gate: Input should be a valid string"),
    "weak": ('writer = "boxed"\nisolation = "worktree"\n', "requires isolation 'container'"),
    "extra": ('writer = "writer"\nreviewer = "reviewer"\n', "reviewer: unknown key"),
    "script": ('models = { writer = "scripted:/etc/hostname" }\n', "reads a file on this machine"),
    "broken": ("writer = \n", "not TOML"),
}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    files = {"calc.py": "x = 1\n", ".orch/teams/good.toml": GOOD, ".orch/agents/boxed.md": BOXED}
    files.update({f".orch/teams/{name}.toml": text for name, (text, _) in BAD.items()})
    root = init_repo(tmp_path / "proj", files)
    os.symlink("/etc/hostname", root / ".orch/teams/link.toml")
    return root


NOTICE = "is not a trusted repository, so these of its settings were left out: teams.script.models"


def cli(repo: Path, *args: str) -> tuple[int, str, str]:
    """A command's code, stdout and stderr, without the trust notice a command that reads
    the settings prints first (the `script` team's model needs trust)."""
    r = CliRunner().invoke(app, [*args, "-C", str(repo)])
    notice, _, rest = r.stderr.partition("\n")
    return r.exit_code, r.stdout, rest if NOTICE in notice else r.stderr


def test_list_and_show(repo: Path) -> None:
    code, out, _ = cli(repo, "team", "list")
    assert code == 0
    assert "good  Writer and a reviewer" in out
    assert "ghost" in out and "numgate  orch" not in out
    assert "link" not in out  # a symlink is neither listed nor followed
    code, _, err = cli(repo, "team", "show", "link")
    assert code == 2 and "cannot read it" in err and "symlink" in err
    code, out, _ = cli(repo, "team", "show", "good")
    assert code == 0 and 'gate = "true"' in out and 'approve = "all"' in out
    assert 'reviewers = ["reviewer"]' in out and "models" not in out  # none set
    code, _, err = cli(repo, "team", "show", "nope")
    assert code == 2 and err.count("\n") == 1 and "no team 'nope'" in err
    assert "teams here: broken, extra, ghost, good" in err
    code, _, err = cli(repo, "team", "show", "../etc")
    assert code == 2 and "is not a team name" in err


def test_a_team_file_is_a_control_file() -> None:
    """A writer that edits a team (to weaken its gate) is not merged without the flag."""
    assert is_control_path(".orch/teams/good.toml")


def test_validate_names_every_bad_file_in_one_line(repo: Path) -> None:
    code, out, err = cli(repo, "team", "validate")
    assert code == 1 and "ok  good" in out
    lines = err.strip().splitlines()
    for name, (_, why) in BAD.items():
        [line] = [x for x in lines if f".orch/teams/{name}.toml" in x or f"'{name}'" in x
                  or why in x and name in ("ghost", "writes", "weak")]  # fmt: skip
        assert why in line, line
    assert "Traceback" not in err
    assert cli(repo, "team", "validate", "good")[0] == 0
    code, _, err = cli(repo, "team", "validate", "weak")
    assert code == 1 and 'set isolation = "container"' in err


@pytest.mark.parametrize("name", sorted(BAD))
def test_run_refuses_a_bad_team_in_one_line_and_starts_nothing(repo: Path, name: str) -> None:
    code, _, err = cli(repo, "team", "run", "--team", name, "do it")
    assert code == 2, err
    assert err.count("\n") == 1 and BAD[name][1] in err and "Traceback" not in err
    assert open_store(repo, None).list_runs() == []


def test_flags_override_the_file_and_every_reviewer_counts(repo: Path) -> None:
    # --reviewer twice: the first is not dropped (it is the one refused here)
    code, _, err = cli(repo, "team", "run", "x", "--reviewer", "general", "--reviewer", "reviewer")
    assert code == 2 and "reviewer 'general' has tools that write" in err
    # a flag fixes a bad file: --isolation container for an agent that requires it
    code, _, err = cli(repo, "team", "run", "--team", "weak", "x", "--isolation", "container")
    assert code == 2 and "ANTHROPIC_API_KEY" in err  # past the team's checks: no model key
    code, _, err = cli(repo, "team", "run", "--team", "script", "x", "--writer-model", "opus")
    assert code == 2 and "reads a file on this machine" in err  # the file is checked itself
    code, _, err = cli(repo, "team", "status", "r-nothere")
    assert code == 2 and err.count("\n") == 1
    code, _, err = cli(repo, "team", "run", "x", "--lead", "--lead-agent", "nobody")
    assert code == 2 and "lead 'nobody' is not an agent" in err
    code, _, err = cli(repo, "team", "run", "x", "--lead", "--writers", "2")
    assert code == 2 and "a lead team has teammates, not best-of-N writers" in err
