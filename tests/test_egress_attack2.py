"""Attacks on the network allow-list, second review: the paths by which a run gets a
network wider than it was given (the CLI's flags, resume, ...), end to end.

Each test plays one attack and asserts that it is refused; every test here fails on the
code it was written against. Everything stays on this machine: the servers listen on
127.0.0.1, the sandboxes have network namespaces of their own (or, where a test shows a
run wrongly given ``host``, the machine's, and then only its loopback is touched), and no
name is resolved by real DNS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import git, init_repo, orch, write_script
from tests.test_egress import bash, fetch

pytestmark = pytest.mark.bwrap


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return init_repo(tmp_path / "proj", {"README.md": "# the user's\n"})


def users_config(text: str) -> None:
    user = Path.home() / ".orch" / "config.toml"
    user.parent.mkdir(parents=True, exist_ok=True)
    user.write_text(text)


def probe_script(repo: Path, other: int, name: str = "script.yaml", out: str = "out.txt") -> Path:
    """A one-run script whose command fetches 127.0.0.1:other into ``out`` (in the shared
    tier: the project directory, where the test reads it)."""
    call = bash(fetch(f"http://127.0.0.1:{other}/leak") + f" > {out}")
    data = {"conversations": [{"turns": [{"tool_calls": [call]}, {"text": "ok"}]}]}
    return write_script(repo, data, name)


def task_json(repo: Path, *args: str) -> dict[str, Any]:
    r = orch("task", "x", "--json", *args, cwd=repo, timeout=120)
    assert r.returncode == 0, r.stderr
    result: dict[str, Any] = json.loads(r.stdout)
    return result


# -- 1. the CLI's --allow / --network lose to the agent file's network -------------------


@pytest.mark.parametrize("flag", ["--allow", "--network"])
def test_the_command_lines_network_is_not_widened_by_an_untrusted_repository_agent(
    repo: Path, servers: tuple[int, int], flag: str
) -> None:
    """The user's own settings say ``host``; this once they run the repository's agent
    with ``--allow 127.0.0.1:ALLOWED`` (or ``--network none``). The flags are settings
    overrides, and ``Execution._reach`` takes the agent's network before the settings':
    the untrusted repository's agent file (``127.0.0.1:*``, "narrower" than the user's
    ``host``, so no trust is asked) replaces the user's explicit flag, and its command
    reaches a port the flag did not give."""
    allowed, other = servers
    users_config('network = "host"\n')
    agents = repo / ".orch" / "agents"
    agents.mkdir(parents=True)
    (agents / "netter.md").write_text(
        "---\nname: netter\ndescription: x\ntools: Bash\n"
        "network: {allow: ['127.0.0.1:*']}\n---\nGo.\n"
    )
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "the repository's agent")
    script = probe_script(repo, other)
    given = ["--allow", f"127.0.0.1:{allowed}"] if flag == "--allow" else ["--network", "none"]
    result = task_json(repo, "--agent", "netter", *given, "--model", f"scripted:{script}")
    said = (repo / "out.txt").read_text()
    want = {"allow": [f"127.0.0.1:{allowed}"]} if flag == "--allow" else "none"
    assert result["workspace"]["network"] == want, result["workspace"]["network"]
    assert "BODY" not in said, said


# -- 2. `orch resume` forgets the run's --allow / --network ------------------------------


@pytest.mark.parametrize("flag", ["--allow", "--network"])
def test_a_resumed_run_keeps_the_network_it_was_started_with(
    repo: Path, servers: tuple[int, int], flag: str
) -> None:
    """``orch task --allow ...`` (or ``--network none``) puts the flag in the settings, not
    the run's spec; ``orch resume`` has no such flag and ``continuation`` keeps only the
    spec's network, so the resumed run gets the user's settings again (here ``host``: the
    machine's whole network, the host's loopback services included)."""
    allowed, other = servers
    users_config('network = "host"\n')
    given = ["--allow", f"127.0.0.1:{allowed}"] if flag == "--allow" else ["--network", "none"]
    first = task_json(repo, *given, "--model", f"scripted:{probe_script(repo, other)}")
    want = {"allow": [f"127.0.0.1:{allowed}"]} if flag == "--allow" else "none"
    assert first["workspace"]["network"] == want
    assert "BODY" not in (repo / "out.txt").read_text()
    again = probe_script(repo, other, "again.yaml", "again.txt")
    r = orch("resume", first["run_id"], "go on", "--json", "--model", f"scripted:{again}",
             cwd=repo, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    resumed = json.loads(r.stdout)
    said = (repo / "again.txt").read_text()
    assert resumed["workspace"]["network"] == want, resumed["workspace"]["network"]
    assert "BODY" not in said, said
