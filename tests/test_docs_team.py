"""docs/AGENTS.md's offline team example, run as written: its commands, its script, its output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "AGENTS.md"

pytestmark = pytest.mark.usefixtures("hermetic_git")


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.DOTALL)


EXAMPLES = [  # (its heading, the next heading, its team, its repository, its script)
    ("### A team run offline", "## Lead teams", "greeter", "team-demo", "team.yaml"),
    ("### A lead team offline", None, "builders", "lead-demo", "lead.yaml"),
]


@pytest.mark.parametrize(("heading", "until", "team", "where", "script_name"), EXAMPLES)
def test_the_offline_team_examples_run_as_documented(
    tmp_path: Path, heading: str, until: str | None, team: str, where: str, script_name: str
) -> None:
    section = DOC.read_text().split(heading, 1)[1]
    if until is not None:
        section = section.split(until, 1)[0]
    [setup] = blocks(section, "bash")
    [script] = blocks(section, "yaml")
    console = blocks(section, "console")[0]
    (tmp_path / script_name).write_text(script)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "orch"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m orchestrator "$@"\n')
    shim.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
        "GIT_AUTHOR_NAME": "me", "GIT_AUTHOR_EMAIL": "me@example.com",
        "GIT_COMMITTER_NAME": "me", "GIT_COMMITTER_EMAIL": "me@example.com",
    }  # fmt: skip
    made = subprocess.run(["bash", "-euc", setup], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert f"ok  {team}" in made.stdout
    command = console.splitlines()[0].removeprefix("$ ")
    assert command.startswith(f"orch team run --team {team}")
    repo = tmp_path / where
    ran = subprocess.run(["bash", "-euc", command], cwd=repo, env=env, capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    assert ran.returncode == 0, ran.stderr

    # the documented output, ids, hashes and times aside
    def shape(text: str) -> list[str]:
        text = re.sub(r"\b(r|c)-[0-9a-f]{12}\b", "ID", text)
        text = re.sub(r"\b[0-9a-f]{8,12}\b", "HASH", text)
        text = re.sub(r"in \d+\.\ds", "in Ns", text)
        return [line.rstrip() for line in text.splitlines()]

    documented = console.split("\n$ ", 1)[0].splitlines()[1:]
    assert shape(ran.stdout) == shape("\n".join(documented))
    merged = [line.split()[-1] for line in ran.stdout.splitlines() if "merged into" in line]
    assert (
        merged
        and subprocess.run(  # merged: the documented history is the real one
            ["git", "log", "--oneline"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.startswith(merged[0][:7])
    )
