"""The host tiers' OS sandbox, attacked end to end through the engine (scripted model).

Each test plays an attack an agent's bash made before bubblewrap: writing the
user's checkout from a worktree child, reading orch's environment through
/proc, planting git hooks and fsmonitor, reading the store, escaping the depth
limit through a nested ``orch``. All are refused or without effect, and normal
work (git status, python, writes in the workspace) still works.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.bwrap import profile as osbox
from orchestrator.run import RunStatus
from tests.support import git, harness, init_repo, orch, task_call, tool_results, write_script

pytestmark = pytest.mark.bwrap

MARKER = "sk-ant-MARKER-7f3a"


@pytest.fixture(autouse=True)
def need_bwrap() -> None:
    reason = osbox.available()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"bubblewrap must work under CI: {reason}")
        pytest.skip(f"bubblewrap cannot run here: {reason}")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return init_repo(tmp_path / "proj", {"README.md": "# the user's\n", "src/app.py": "X = 1\n"})


def bash(command: str, **extra: Any) -> dict[str, Any]:
    return {"tool": "bash", "input": {"command": command, **extra}}


def outputs(h: Any, run_id: str, turn: int) -> list[str]:
    return [r["content"] for r in tool_results(h.requests_of(run_id)[turn])]


@pytest.mark.usefixtures("each_bwrap")
def test_worktree_child_cannot_write_outside_its_worktree(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    attacks = [
        "cd ../../.. && echo PWNED >> README.md",
        f"echo PWNED >> {repo}/README.md",
        f"echo PWNED > {outside}/x.txt",
        f"echo PWNED > {repo}/src/planted.py",
        f"mkdir -p {repo}/.orch/worktrees/other && echo PWNED > {repo}/.orch/worktrees/x",
        "echo work > mine.txt && git status --short && python3 -c 'print(6*7)'",
    ]
    script = {
        "conversations": [
            {
                "depth": 0,
                "turns": [{"tool_calls": [task_call("go", isolation="worktree")]}, {"text": "ok"}],
            },  # fmt: skip
            {"depth": 1, "turns": [{"tool_calls": [bash(a) for a in attacks]}, {"text": "done"}]},
        ]
    }
    h = harness(repo, script)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    (child,) = [r for r in h.runs(root.chain_id) if r.depth == 1]
    # Under /tmp (where tests live) a write outside lands in the sandbox's private tmpfs
    # and vanishes; elsewhere it fails read-only. Either way: no effect on the host.
    out = outputs(h, child.run_id, 1)
    assert "mine.txt" in out[5] and "42" in out[5] and "[exit code 0]" in out[5]
    assert (repo / "README.md").read_text() == "# the user's\n"
    assert not (repo / "src" / "planted.py").exists()
    assert list(outside.iterdir()) == []
    # the work itself landed on the child's branch at close
    (art,) = child.artifacts
    assert git(repo, "show", f"{art['branch']}:mine.txt") == "work"


def test_orchs_environment_and_store_are_out_of_reach(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", MARKER)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", MARKER + "-aws")
    db = project / ".orch" / "orch.db"
    reads = [
        "cat /proc/$PPID/environ /proc/1/environ | tr '\\0' '\\n'",
        "for f in /proc/[0-9]*/environ; do cat $f; done 2>/dev/null | tr '\\0' '\\n'; env",
        f"ls -A {project}/.orch | wc -l; head -c 16 {db}",
        "cat ~/.ssh/id_rsa",
    ]
    ssh = Path(os.environ["HOME"]) / ".ssh"
    ssh.mkdir()
    (ssh / "id_rsa").write_text("PRIVATE-KEY-MARKER\n")
    script = {"conversations": [{"turns": [{"tool_calls": [bash(r) for r in reads]},
                                           {"text": "done"}]}]}  # fmt: skip
    h = harness(project, script)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    out = "\n".join(outputs(h, root.run_id, 1))
    assert MARKER not in out and "PRIVATE-KEY-MARKER" not in out
    # the store's directory is an empty tmpfs inside: nothing listed, nothing read
    assert "SQLite format" not in out and "\n0\n" in "\n" + out and "No such file" in out
    assert db.exists()
    assert (db.stat().st_mode & 0o777) == 0o600
    assert (db.parent.stat().st_mode & 0o777) == 0o700


def test_planted_hooks_and_fsmonitor_never_run(repo: Path, tmp_path: Path) -> None:
    mark = tmp_path / "HOOK-RAN"
    hook = f"#!/bin/sh\ntouch {mark}\n"
    attacks = [
        f"printf '{hook}' > {repo}/.git/hooks/post-commit; chmod +x {repo}/.git/hooks/post-commit",
        f"git config core.fsmonitor 'touch {mark}'",
        f"git -C {repo} config core.hooksPath /tmp",
        "printf 'gitdir: /tmp/evil\\n' > .git; mkdir -p .git/hooks",
        f"mv .git .git-away; echo 'touch {mark}' > .git",
        "echo change > change.txt",
    ]
    script = {"conversations": [{"turns": [{"tool_calls": [bash(a) for a in attacks]},
                                           {"text": "done"}]}]}  # fmt: skip
    h = harness(repo, script)
    root = h.run(isolation="worktree")
    assert root.status == RunStatus.SUCCEEDED, root.error
    assert not mark.exists()
    assert not (repo / ".git" / "hooks" / "post-commit").exists()
    assert "fsmonitor" not in (repo / ".git" / "config").read_text()
    (art,) = root.artifacts
    assert git(repo, "show", f"{art['branch']}:change.txt") == "change"
    assert not mark.exists()  # nor did orch's own commit at close run anything


def test_nested_orch_in_the_sandbox_has_no_key_no_store_no_network(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", MARKER)
    nested = f"{sys.executable} -m orchestrator task hi --max-depth 9 --json; echo EXIT=$?"
    script = {"conversations": [{"turns": [{"tool_calls": [bash(nested)]}, {"text": "done"}]}]}
    h = harness(project, script)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    (out,) = outputs(h, root.run_id, 1)
    assert "EXIT=2" in out and MARKER not in out  # it ran, and stopped: no key, no model
    # the store's directory is a read-only empty tmpfs inside: it cannot even open one
    assert any(why in out for why in ("Read-only file system", "no model configured", "no run"))
    assert [r.run_id for r in h.store.list_runs()] == [root.run_id]


def _nested_script(project: Path) -> Path:
    return write_script(
        project, {"conversations": [{"turns": [{"text": "NESTED-ANSWER"}]}]}, "nested.yaml"
    )


def test_nested_orch_joins_the_chain_as_a_child(project: Path) -> None:
    """Unsandboxed (sandbox.os = "off"), a nested orch shares the store: it joins the chain."""
    nested = _nested_script(project)
    cmd = f"{sys.executable} -m orchestrator task hi --max-depth 9 --json --model scripted:{nested}"
    script = {"conversations": [{"depth": 0, "turns": [{"tool_calls": [bash(cmd)]},
                                                       {"text": "done"}]}]}  # fmt: skip
    h = harness(project, script, max_depth=2, sandbox={"os": "off"})
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    assert root.workspace["os_sandbox"] == "off"
    (out,) = outputs(h, root.run_id, 1)
    assert "[exit code 0]" in out, out
    (child,) = [r for r in h.runs(root.chain_id) if r.run_id != root.run_id]
    assert child.parent_run_id == root.run_id and child.depth == 1 and child.max_depth == 2
    assert json.loads(out.rsplit("\n[exit code", 1)[0])["summary"] == "NESTED-ANSWER"


def test_nested_orch_is_refused_past_the_depth_limit(project: Path) -> None:
    nested = _nested_script(project)
    cmd = f"{sys.executable} -m orchestrator task hi --max-depth 9 --json --model scripted:{nested}"
    script = {"conversations": [{"depth": 0, "turns": [{"tool_calls": [bash(cmd)]},
                                                       {"text": "done"}]}]}  # fmt: skip
    h = harness(project, script, max_depth=0, sandbox={"os": "off"})
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    (out,) = outputs(h, root.run_id, 1)
    assert "depth limit reached" in out and "[exit code 0]" not in out
    assert len(h.store.list_runs()) == 1


@pytest.mark.parametrize("isolation", ["shared", "worktree"])
def test_without_a_working_bwrap_a_host_run_fails_closed(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolation: str
) -> None:
    """A bwrap that cannot make namespaces (as where user namespaces are off): the run
    fails at start with one line naming the bwrap, its error and the fixes; nothing runs."""
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("ORCH_BWRAP", str(fake))
    script = {"conversations": [{"turns": [{"tool_calls": [bash("echo hi")]}, {"text": "x"}]}]}
    h = harness(repo, script)
    root = h.run(isolation=isolation)
    assert root.status == RunStatus.FAILED
    assert root.error is not None and "\n" not in root.error
    assert f"bwrap {fake} cannot create a sandbox here" in root.error
    assert "No permissions to create new namespace" in root.error
    assert "fix:" in root.error and 'sandbox.os = "off"' in root.error
    assert h.model.requests == []  # nothing ran
    assert git(repo, "branch", "--list", "orch/*") == ""  # and no worktree was left


def test_network_per_agent_definition_needs_trust_from_a_repository(project: Path) -> None:
    """An agent file with `network: host` gets the machine's network only once trusted."""
    import socket

    agents = project / ".orch" / "agents"
    agents.mkdir(parents=True)
    (agents / "netter.md").write_text(
        "---\nname: netter\ndescription: Needs the network.\ntools: Bash\nnetwork: host\n---\nGo.\n"
    )
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(5)
        port = server.getsockname()[1]
        probe = (
            f"{sys.executable} -c \"import socket; socket.create_connection(('127.0.0.1', {port}),"
            " 2); print('REA' + 'CHED')\" 2>&1 | tail -1"
        )
        turns = [{"tool_calls": [bash(probe)]}, {"text": "done"}]
        script = write_script(project, {"conversations": [{"agent": "netter", "turns": turns}]})

        def run() -> tuple[dict[str, Any], str]:
            r = orch("task", "x", "--agent", "netter", "--json", "--model", f"scripted:{script}",
                     cwd=project)  # fmt: skip
            assert r.returncode == 0, r.stderr
            result = json.loads(r.stdout)
            events = orch("logs", result["run_id"], "--json", cwd=project).stdout
            return result, events

        untrusted, events = run()
        assert untrusted["workspace"]["network"] == "none"
        assert "REACHED" not in events
        assert orch("trust", cwd=project).returncode == 0
        trusted, events = run()
        assert trusted["workspace"]["network"] == "host"
        assert "REACHED" in events


def test_unsandboxed_runs_say_so_in_ps_tree_and_result(project: Path) -> None:
    config = Path(os.environ["HOME"]) / ".orch" / "config.toml"  # the user's own: no trust
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('[sandbox]\nos = "off"\n')
    script = write_script(project, {"conversations": [{"turns": [{"text": "done"}]}]})
    r = orch("task", "x", "--json", "--model", f"scripted:{script}", cwd=project)
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    assert json.loads(r.stdout)["workspace"]["os_sandbox"] == "off"
    for args in (["ps"], ["tree", run_id], ["result", run_id]):
        shown = orch(*args, cwd=project)
        assert shown.returncode == 0, shown.stderr
        assert "unsandboxed" in shown.stdout, (args, shown.stdout)
    rows = json.loads(orch("ps", "--json", cwd=project).stdout)
    assert rows[0]["os_sandbox"] == "off"


def test_the_real_sdk_path_keeps_the_key_and_the_checkout_out_of_reach(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same attacks through the real `anthropic` SDK against a fake Messages API: the
    key the SDK holds never reaches a command, and a worktree run writes only its worktree."""

    from orchestrator.catalog.definitions import load_catalog
    from orchestrator.config import Settings
    from orchestrator.engine.runner import Runner
    from orchestrator.models import ModelProvider
    from orchestrator.spec import RunSpec
    from orchestrator.store import open_store
    from orchestrator.workspaces.worktree import WorktreeConfig
    from tests.fakeapi import FakeAPI, serve, text_reply, tool_reply

    attack = (
        "cat /proc/$PPID/environ /proc/1/environ | tr '\\0' '\\n'; env; "
        f"echo PWNED >> {repo}/README.md; cd ../../.. && echo PWNED >> README.md; echo END"
    )

    def responder(body: dict[str, Any]) -> dict[str, Any]:
        if len(body["messages"]) == 1:
            return tool_reply(("bash", {"command": attack}))
        return text_reply("done")

    with serve(FakeAPI(responder)) as api:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", MARKER)
        settings = Settings(model="sonnet")
        provider = ModelProvider(settings)
        runner = Runner(
            settings=settings,
            store=open_store(repo),
            catalog=load_catalog(repo),
            models=provider,
        )

        async def go() -> Any:
            async with provider:
                spec = RunSpec(prompt="go", workdir=repo, workspace=WorktreeConfig())
                return await asyncio.wait_for(runner.run(spec), 300)

        root = asyncio.run(go())
        assert root.status == RunStatus.SUCCEEDED, root.error
        held = [h.get("x-api-key", "") + h.get("authorization", "") for h in api.headers]
        assert all(MARKER in h for h in held)  # the SDK holds the key...
        sent_back = json.dumps(api.requests[1]["messages"][-1])
        assert "END" in sent_back and MARKER not in sent_back  # ...no command ever sees it
    assert (repo / "README.md").read_text() == "# the user's\n"
