"""orch as an MCP client in the container tier: the project's server runs inside the run's
container (a ``docker exec -i``), never on the host, and goes with the run."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from orchestrator.config import SandboxSettings
from orchestrator.run import RunStatus
from tests.support import harness
from tests.test_container import engine, sandbox_image
from tests.test_mcp_client import (
    KEY,
    MARKER,
    agent,
    call,
    child_of,
    child_script,
    processes_with,
    project,
    results,
)

__all__ = ["engine", "sandbox_image"]  # fixtures shared with test_container

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("hermetic_git", "engine")]


def test_a_container_child_calls_the_server_inside_its_container(
    tmp_path: Path, sandbox_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", MARKER)
    ssh = Path(os.environ["HOME"]) / ".ssh"
    ssh.mkdir(exist_ok=True)
    (ssh / "id_rsa").write_text(KEY + "\n")
    mark = f"mark-{uuid.uuid4().hex}"
    repo = project(tmp_path, mark, prober=agent("prober", "mcp__proj"))
    calls = [call("mcp__proj__probe"), call("mcp__proj__echo", x="hi")]
    script = child_script(calls, subagent_type="prober", isolation="container")
    h = harness(repo, script, sandbox=SandboxSettings(image=sandbox_image))
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    child = child_of(h, root)
    assert child.workspace is not None and child.workspace["isolation"] == "container"
    probe, echo = results(h, child)
    assert "cwd=/workspace" in probe["content"]  # inside the container's tree
    assert "ssh=unreadable" in probe["content"] and "api_key=<none>" in probe["content"]
    assert KEY not in probe["content"] and MARKER not in probe["content"]
    assert echo["content"] == "echo:hi"
    assert processes_with(mark) == []
