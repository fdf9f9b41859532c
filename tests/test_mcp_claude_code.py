"""A real MCP client: Claude Code 2.1 (npm ``@anthropic-ai/claude-code``) in print mode,
offline, in a network namespace with only loopback, against a fake Messages API. It calls
``mcp__orch__task`` with isolation worktree; orch's run (on the same fake API) writes a
file on its own branch; the branch and the run's answer reach Claude Code as the tool
result, and Claude Code prints its final answer.

Claude Code is installed with npm into ``~/.cache/orch-tests/claude-code-2.1`` the first
time; where npm or the registry is unreachable, or no network namespace can be made, the
test skips saying so (under CI=true too: the registry is outside this suite's control).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import git, init_repo, need_bwrap

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from peer import Skipped, ensure_claude, netns_prefix  # noqa: E402

from tests import claude_inside as inside  # noqa: E402

CACHE = Path("~").expanduser() / ".cache" / "orch-tests" / "claude-code-2.1"  # the real home
VERSION = "2.1"

pytestmark = [pytest.mark.bwrap, pytest.mark.slow]


@pytest.fixture(scope="module")
def claude() -> tuple[list[str], Path]:
    try:
        prefix = netns_prefix()
        binary, version = ensure_claude(prefix, cache=CACHE, version=VERSION)
    except Skipped as e:
        pytest.skip(str(e))
    assert version.startswith("2.1."), version
    return prefix, binary


def _result_of(exchanges: list[dict[str, Any]]) -> dict[str, Any]:
    final = next(e for e in exchanges if e["label"] == "claude:final")
    results: list[dict[str, Any]] = inside.tool_results(final["body"])
    assert len(results) == 1
    return results[0]


def test_claude_code_delegates_to_orch_over_mcp(
    claude: tuple[list[str], Path], tmp_path: Path
) -> None:
    need_bwrap()
    prefix, binary = claude
    repo = init_repo(tmp_path / "repo", {"README.md": "# demo\n"})
    report = tmp_path / "report.json"
    script = ROOT / "tests" / "claude_inside.py"
    got = subprocess.run(
        [*prefix, sys.executable, str(script), str(binary), str(repo), str(report)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert got.returncode == 0, got.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["rc"] == 0, data["stderr"]
    labels = [e["label"] for e in data["exchanges"]]
    assert labels.count("claude:tool_use") == 1, (labels, data["mcp_log"])
    assert {"orch:write", "orch:answer", "claude:final"} <= set(labels), labels

    result = _result_of(data["exchanges"])
    said = json.dumps(result["content"])
    assert not result.get("is_error"), said
    assert inside.CHILD_ANSWER in said and "[branch orch/general/" in said, said
    assert "succeeded" in said
    branch = said.split("[branch ")[1].split(" ")[0]
    assert git(repo, "show", f"{branch}:hello.txt") == "hello from orch"
    assert not (repo / "hello.txt").exists()  # the user's checkout is untouched
    assert json.loads(data["stdout"])["result"] == inside.FINAL

    # orch's run saw a fresh conversation: its first request held only the prompt
    first = next(e for e in data["exchanges"] if e["label"] == "orch:write")
    assert len(first["body"]["messages"]) == 1
