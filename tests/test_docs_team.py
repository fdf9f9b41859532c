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


def test_the_offline_team_example_runs_as_documented(tmp_path: Path) -> None:
    section = DOC.read_text().split("### A team run offline", 1)[1]
    [setup] = blocks(section, "bash")
    [script] = blocks(section, "yaml")
    console = blocks(section, "console")[0]
    (tmp_path / "team.yaml").write_text(script)
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
    assert "ok  greeter" in made.stdout
    command = console.splitlines()[0].removeprefix("$ ")
    assert command.startswith("orch team run --team greeter")
    repo = tmp_path / "team-demo"
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
    assert "Hello Ann!" not in (repo / "greet.py").read_text()  # the code, not the output
    assert "+ name + '!'" in (repo / "greet.py").read_text()
