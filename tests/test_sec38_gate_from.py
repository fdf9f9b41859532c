"""Issue 38, class 14: a gate that cannot be talked round. With ``gate_from = "base"`` (a
team-file setting; the default unless the repository is trusted) the gate runs the base's
tests and test configuration against the candidate's code, on a commit orch makes on the
host; reviewers see changes to tests listed first. A writer that edits the test to pass, or
plants a ``conftest.py`` that ends pytest with 0, passes a ``"candidate"`` gate and fails a
``"base"`` one."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import UsageError
from orchestrator.teams.driver import run_team
from orchestrator.teams.gatefrom import config_changed, is_test_path, named_by
from orchestrator.teams.plan import make_plan, parse_team, resolve_gate_from
from orchestrator.teams.progress import TeamResult
from tests.support import harness, init_repo

pytestmark = pytest.mark.usefixtures("hermetic_git")

APPROVE = json.dumps({"verdict": "approve", "summary": "Fine.", "comments": []})
BUGGY = "def add(a, b):\n    return a - b\n"
SHELL_TEST = "grep -q 'a + b' calc.py\n"
SHELL_GATE = 'for t in tests/*.sh; do sh "$t" || exit 1; done'


def call(tool: str, **args: Any) -> dict[str, Any]:
    return {"tool": tool, "input": args}


def play(tmp_path: Path, files: dict[str, str], writes: dict[str, str], gate: str,
         gate_from: str | None) -> tuple[TeamResult, Path, Any]:  # fmt: skip
    """One round: the writer writes ``writes``, the gate runs, a reviewer approves."""
    root = init_repo(tmp_path / "proj", files)
    turns = [{"tool_calls": [call("write_file", path=p, content=c)]} for p, c in writes.items()]
    script = {
        "conversations": [
            {"agent": "writer", "turns": [*turns, {"text": "done"}]},
            {"agent": "reviewer", "runs": "*", "turns": [{"text": APPROVE}]},
        ]
    }
    h = harness(root, script)
    plan = make_plan(None, None, reviewers=["reviewer"], gate=gate, rounds=1, gate_from=gate_from)
    result = asyncio.run(run_team(h.runner, prompt="Implement add", workdir=root, plan=plan))
    return result, root, h


def branches(root: Path) -> list[str]:
    out = subprocess.run(["git", "branch", "--format=%(refname:short)"], cwd=root,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return out.stdout.split()


@pytest.mark.parametrize("gate_from", ["candidate", "base"])
def test_a_writer_that_rewrites_the_test_passes_only_its_own_gate(
    tmp_path: Path, gate_from: str
) -> None:
    """The fault: the gate judged the writer with the writer's own tests."""
    files = {"calc.py": "def add(a, b):\n    raise NotImplementedError\n",
             "tests/test_calc.sh": SHELL_TEST}  # fmt: skip
    writes = {"calc.py": BUGGY, "tests/test_calc.sh": "exit 0\n"}
    result, root, h = play(tmp_path, files, writes, SHELL_GATE, gate_from)
    [gate] = result.gates
    if gate_from == "candidate":
        assert gate.passed and result.approved, gate
        return
    assert not gate.passed and not result.approved, gate
    assert gate.gate_from == "base" and gate.swapped == ["tests/test_calc.sh"]
    assert not any(b.startswith("orch/team-gate/") for b in branches(root))  # cleaned up
    # the writer's branch is untouched: its own test is still on it
    shown = subprocess.run(["git", "show", f"{result.candidates[0].branch}:tests/test_calc.sh"],
                           cwd=root, capture_output=True, text=True, check=True)  # fmt: skip
    assert shown.stdout == "exit 0\n"


def test_a_correct_change_with_its_own_new_test_passes_the_base_gate(tmp_path: Path) -> None:
    """The base's tests are what the gate runs: a right change passes, the writer's new
    test file is left out of the gate (reviewers read it)."""
    files = {"calc.py": "def add(a, b):\n    raise NotImplementedError\n",
             "tests/test_calc.sh": SHELL_TEST}  # fmt: skip
    writes = {"calc.py": "def add(a, b):\n    return a + b\n", "tests/test_more.sh": "exit 1\n"}
    result, _, h = play(tmp_path, files, writes, SHELL_GATE, "base")
    [gate] = result.gates
    assert gate.passed and result.approved, gate
    assert gate.swapped == ["tests/test_more.sh"]
    [review_run] = [k for k in h.store.descendants(result.root_run_id) if k.agent == "reviewer"]
    prompt = h.store.require_run(review_run.run_id).prompt
    assert "[TESTS OR TEST CONFIGURATION CHANGED" in prompt
    assert prompt.index("tests/test_more.sh") < prompt.index("calc.py")


PYTEST_FILES = {
    "calc.py": "def add(a, b):\n    raise NotImplementedError\n",
    "test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 2) == 4\n",
}
CONFTEST = "import atexit, os\n\natexit.register(lambda: os._exit(0))\n"


@pytest.mark.parametrize("gate_from", ["candidate", "base"])
def test_a_conftest_that_ends_pytest_with_zero_passes_only_its_own_gate(
    tmp_path: Path, gate_from: str
) -> None:
    """The variant: the writer leaves the test alone and plants a conftest.py that
    registers atexit(os._exit(0)), so pytest exits 0 whatever failed."""
    python = shutil.which("python3")
    probe = subprocess.run([str(python), "-c", "import pytest"], capture_output=True)
    if python is None or probe.returncode != 0:
        pytest.skip("python3 with pytest is needed for a pytest gate")
    gate = f"{python} -m pytest -q -p no:cacheprovider test_calc.py"
    writes = {"calc.py": BUGGY, "conftest.py": CONFTEST}
    result, _, _ = play(tmp_path, PYTEST_FILES, writes, gate, gate_from)
    [gate_run] = result.gates
    if gate_from == "candidate":
        assert gate_run.passed, gate_run
    else:
        assert not gate_run.passed and gate_run.swapped == ["conftest.py"], gate_run


def test_what_counts_as_a_test_path() -> None:
    for path in ["tests/x.py", "src/pkg/tests/data.json", "test_a.py", "a_test.go",
                 "conftest.py", "web/app.spec.ts", "pytest.ini", "tox.ini", "jest.config.js",
                 "tsconfig.build.json", "pytest.py", "_pytest/main.py", "node_modules/x/y.js",
                 "sub/.coveragerc", "FooTest.java"]:  # fmt: skip
        assert is_test_path(path), path
    for path in ["calc.py", "src/latest.py", "README.md", "contest.py", "attestation.py"]:
        assert not is_test_path(path), path
    assert named_by("make test && sh ./ci/check.sh", {"Makefile", "ci/check.sh", "a.py"}) == {
        "Makefile", "ci/check.sh"}  # fmt: skip
    assert named_by("npm test", {"package.json"}) == {"package.json"}
    assert named_by("grep -q 'a + b' calc.py", {"calc.py"}) == set()  # read, not run
    assert named_by("X=1 python3 tools/t.py -q | tee log", {"tools/t.py"}) == {"tools/t.py"}
    assert named_by("timeout 60 ./check", {"check"}) == {"check"}
    old = '[project]\nname = "p"\n[tool.pytest.ini_options]\naddopts = "-q"\n'
    assert not config_changed("pyproject.toml", old, old.replace('"p"', '"q"'))
    assert config_changed("pyproject.toml", old, old.replace("-q", "-q --co"))
    assert config_changed("setup.cfg", "[tool:pytest]\na = 1\n", "[tool:pytest]\na = 2\n")
    assert config_changed("package.json", '{"scripts": {"test": "jest"}}', '{"scripts": {}}')


def test_a_repositorys_team_cannot_relax_the_gate_until_trusted() -> None:
    loose = parse_team('gate = "make test"\ngate_from = "candidate"\n', "t.toml")
    with pytest.raises(UsageError, match="only once trusted"):
        resolve_gate_from(loose, None, trusted=False)
    assert resolve_gate_from(loose, None, trusted=True) == "candidate"
    assert resolve_gate_from(loose, "candidate", trusted=False) == "candidate"  # the user's flag
    assert resolve_gate_from(None, None, trusted=False) == "base"
    assert resolve_gate_from(None, None, trusted=True) == "candidate"


def test_orch_team_refuses_a_relaxed_gate_in_an_untrusted_repository(tmp_path: Path) -> None:
    """Through the CLI: `orch team validate` and `orch team run` refuse, in one line, a
    repository's team that sets gate_from = "candidate" before `orch trust`."""
    from typer.testing import CliRunner

    from orchestrator.cli.main import app

    loose = 'gate = "true"\nreviewers = ["reviewer"]\ngate_from = "candidate"\n'
    root = init_repo(tmp_path / "proj", {"calc.py": "x = 1\n", ".orch/teams/loose.toml": loose})
    for args in (["team", "validate", "loose"], ["team", "run", "--team", "loose", "do it"]):
        r = CliRunner().invoke(app, [*args, "-C", str(root)])
        assert r.exit_code != 0 and "only once trusted" in r.stderr, (args, r.output)
        assert "Traceback" not in r.output and r.stderr.strip().count("\n") == 0, r.stderr
