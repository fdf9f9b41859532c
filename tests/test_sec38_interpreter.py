"""Everything orch's interpreter loads is orch itself (issue 38, class 1).

The attack: orch is installed in the project's venv and the project is installed editable
there (``uv sync`` / ``poetry install``), so a ``.pth`` file of the venv puts the checkout on
``sys.path``; an agent writes ``sitecustomize.py`` in the checkout and the next ``orch``
command runs it with the user's keys. Now every command that opens a project refuses, in
one line, while its interpreter loads code from a place an agent there can write; ``orch
doctor`` says so, ``--help`` still works. The variants: an agent-written module that shadows
one orch imports, in the directory a worker host was started from (orch's helpers start
with ``-I``); and ``PYTHONPATH`` naming the checkout.

A venv here is a real one (``python -m venv --without-pip``) outside the checkout (poetry's
default place) whose ``.pth`` files reach orch's own installation and the checkout, and
whose ``bin/orch`` is a console script, as an installer writes it.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.process.interpreter import CODE, helper_argv, helper_path, refusal
from tests.support import init_repo, write_script

pytestmark = pytest.mark.bwrap


def make_venv(where: Path, *checkouts: Path) -> Path:
    """A venv at ``where`` with orch (this test run's installation) and, installed
    editable, each of ``checkouts``; its console script ``orch``."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True)
    (sitedir,) = (where / "lib").glob("python3*/site-packages")
    ours = [*site.getsitepackages(), str(CODE.parent)]
    lines = [f"import site; site.addsitedir({d!r})" for d in ours]
    (sitedir / "orch_itself.pth").write_text("\n".join(lines) + "\n")
    for i, checkout in enumerate(checkouts):  # as uv and poetry install a project editable
        (sitedir / f"_project{i}.pth").write_text(f"{checkout}\n")
    script = where / "bin" / "orch"
    script.write_text(
        f"#!{where / 'bin' / 'python'}\nimport sys\n"
        "from orchestrator.__main__ import main\nsys.exit(main())\n"
    )
    script.chmod(0o755)
    return script


def run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    full.pop("PYTHONPATH", None)
    full |= {"ANTHROPIC_API_KEY": "sk-ant-USERKEY", **env}
    return subprocess.run(
        argv, cwd=cwd, env=full, capture_output=True, text=True, timeout=120, check=False
    )


def planted(marker: Path) -> str:
    return (
        "import os, pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text(os.environ.get('ANTHROPIC_API_KEY', '?'))\n"
    )


def writes(repo: Path, name: str, path: str, content: str) -> Path:
    call = {"tool": "write_file", "input": {"path": path, "content": content}}
    turns = [{"tool_calls": [call]}, {"text": "done"}]
    return write_script(repo, {"conversations": [{"turns": turns}]}, name)


def test_an_editable_project_in_orchs_venv_is_refused_before_an_agent_runs(
    tmp_path: Path,
) -> None:
    repo = init_repo(tmp_path / "proj", {"README.md": "# the user's\n"})
    orch = make_venv(tmp_path / "venv", repo)
    marker = tmp_path / "pwned"
    script = writes(repo, "plant.yaml", "sitecustomize.py", planted(marker))
    r = run([str(orch), "task", "tidy up", "--model", f"scripted:{script}", "--json"], repo)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr + r.stdout
    assert f"loads code from {repo}" in lines[0] and "uv tool install orch" in lines[0]
    assert not (repo / "sitecustomize.py").exists(), "an agent ran"
    r = run([str(orch), "ps"], repo)  # the attack's second half: the next command
    assert r.returncode != 0 and "uv tool install orch" in r.stderr
    assert not marker.exists(), "orch ran code an agent wrote"
    r = run([str(orch), "doctor", "--offline"], repo)
    assert r.returncode == 1
    assert any(line.startswith("fail  imports") for line in r.stdout.splitlines()), r.stdout
    assert run([str(orch), "--help"], repo).returncode == 0
    # the same venv is fine for a project it does not reach
    other = init_repo(tmp_path / "other", {"README.md": "x\n"})
    assert run([str(orch), "ps"], other).returncode == 0


def test_pythonpath_naming_the_checkout_is_refused(tmp_path: Path) -> None:
    """Another place the interpreter loads from: PYTHONPATH=src, as a shell's .envrc sets
    it; and a ``.pth`` entry whose directory does not exist yet (site skips it today, an
    agent can make it tomorrow)."""
    repo = init_repo(tmp_path / "proj", {"src/app.py": "x = 1\n"})
    orch = make_venv(tmp_path / "venv")
    r = run([str(orch), "ps"], repo, PYTHONPATH=str(repo / "src"))
    assert r.returncode != 0 and f"take {repo / 'src'} out of PYTHONPATH" in r.stderr
    later = make_venv(tmp_path / "venv2", repo / "lib" / "not-yet")
    r = run([str(later), "ps"], repo)
    assert r.returncode != 0 and f"loads code from {repo / 'lib' / 'not-yet'}" in r.stderr


def test_a_worker_host_does_not_import_a_module_an_agent_wrote_where_it_started(
    tmp_path: Path,
) -> None:
    """orch installed outside the project (nothing to refuse); the agent writes ``yaml.py``
    in the checkout, where the next background run's launcher is typed: the worker host
    it starts there imports PyYAML, not the agent's file."""
    repo = init_repo(tmp_path / "proj", {"README.md": "# the user's\n"})
    orch = make_venv(tmp_path / "venv")
    marker = tmp_path / "pwned"
    script = writes(repo, "plant.yaml", "yaml.py", planted(marker))
    r = run([str(orch), "task", "tidy", "--model", f"scripted:{script}", "--json"], repo)
    assert r.returncode == 0, r.stderr
    assert (repo / "yaml.py").exists()
    quiet = write_script(repo, {"conversations": [{"turns": [{"text": "ok"}]}]}, "q.yaml")
    start = [str(orch), "task", "x", "--background", "--json", "--model", f"scripted:{quiet}"]
    r = run(start, repo)
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    done = run([str(orch), "result", run_id, "--wait", "--json"], repo)
    assert not marker.exists(), "a helper of orch imported the agent's yaml.py"
    assert done.returncode == 0, done.stderr + done.stdout
    assert json.loads(done.stdout)["status"] == "succeeded"


def test_helpers_start_isolated_with_orchs_code_and_without_the_typed_directory(
    tmp_path: Path,
) -> None:
    argv = helper_argv("orchestrator", "--help")
    assert argv[:2] == [sys.executable, "-I"]
    (tmp_path / "sitecustomize.py").write_text(planted(tmp_path / "pwned"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "Usage" in r.stdout, r.stderr
    assert not (tmp_path / "pwned").exists()
    assert str(CODE.parent) in helper_path()
    assert refusal(tmp_path) is None


def test_what_the_door_counts_as_read_only_is_what_every_host_sandbox_binds_so() -> None:
    from orchestrator.process.interpreter import ORCH_ITSELF
    from orchestrator.workspaces.host import ORCH_ITSELF as BOUND

    assert ORCH_ITSELF == BOUND
