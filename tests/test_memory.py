"""Project memory (CLAUDE.md, AGENTS.md, ~/.claude/CLAUDE.md) and the environment section
reach every agent's system prompt; what the model receives first is what is checked."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from orchestrator.catalog.definitions import load_catalog
from orchestrator.catalog.guidance import environment_section
from orchestrator.config import SandboxSettings, Settings
from orchestrator.engine.memory import FILE_MAX, TOTAL_MAX
from orchestrator.engine.runner import Runner
from orchestrator.models import ModelProvider
from orchestrator.run import RunStatus
from orchestrator.spec import RunSpec
from orchestrator.store import open_store
from tests.fakeapi import FakeAPI, serve, system_text, text_reply, tool_reply
from tests.support import harness, init_repo, sandbox_image, task_call

CLAUDE = "Always run `make check` before you answer. CLAUDE-RULE-7731"
AGENTS = "Use tabs in Makefiles. AGENTS-RULE-2209"
USER = "Answer in British English. USER-RULE-5150"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = init_repo(tmp_path / "proj", {"CLAUDE.md": CLAUDE + "\n", "AGENTS.md": AGENTS + "\n",
                                         "a.txt": "a\n"})  # fmt: skip
    user = Path(os.environ["HOME"]) / ".claude" / "CLAUDE.md"
    user.parent.mkdir(parents=True, exist_ok=True)
    user.write_text(USER + "\n")
    return root


def _delegating(isolation: str) -> dict[str, Any]:
    return {"conversations": [
        {"depth": 0, "turns": [{"tool_calls": [task_call("look", isolation=isolation)]},
                               {"text": "ok"}]},
        {"depth": 1, "turns": [{"text": "looked"}]},
    ]}  # fmt: skip


def _systems(h: Any, root_id: str) -> tuple[str, str]:
    (child,) = h.store.children(root_id)
    return h.requests_of(root_id)[0].system, h.requests_of(child.run_id)[0].system


def test_memory_and_tier_facts_reach_every_agent(repo: Path) -> None:
    h = harness(repo, _delegating("worktree"))
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    parent, child = _systems(h, root.run_id)
    for system in (parent, child):
        assert "# Project memory" in system
        assert CLAUDE in system and AGENTS in system and USER in system
        assert system.index(CLAUDE) < system.index(AGENTS) < system.index(USER)
        assert "cut:" not in system
        assert "- Network: none (package installs fail)." in system
        assert ".git is read-only" in system
    assert "Shared workspace" in parent and "uncommitted" in parent
    (kid,) = h.store.children(root.run_id)
    branch = kid.workspace["branch"]
    assert branch.startswith("orch/general/")
    assert f"Your own git worktree on branch {branch}" in child
    assert f"orch commits every change (build artefacts aside) to {branch}" in child
    assert "do not commit yourself" in child


def test_memory_is_cut_with_a_note_and_capped_in_all(repo: Path) -> None:
    (repo / "CLAUDE.md").write_text("C" * 20_000 + "TAIL-OF-CLAUDE\n")
    h = harness(repo, {"conversations": [{"turns": [{"text": "ok"}]}]})
    root = h.run()
    system = h.requests_of(root.run_id)[0].system
    assert "C" * FILE_MAX in system and "C" * (FILE_MAX + 1) not in system
    assert "TAIL-OF-CLAUDE" not in system
    assert f"[CLAUDE.md cut: {FILE_MAX:,} of its 20,015 bytes shown" in system
    assert AGENTS in system and USER in system  # the others still fit

    (repo / "AGENTS.md").write_text("A" * 20_000 + "\n")  # 16 KiB + 16 KiB: the total is used
    h = harness(repo, {"conversations": [{"turns": [{"text": "ok"}]}]})
    system = h.requests_of(h.run().run_id)[0].system
    assert "A" * FILE_MAX in system and USER not in system
    assert f"[~/.claude/CLAUDE.md cut: 0 of its {len(USER) + 1} bytes shown; orch shows at " \
           f"most {TOTAL_MAX:,} bytes in all]" in system  # fmt: skip


def test_the_setting_turns_it_off(repo: Path) -> None:
    h = harness(repo, {"conversations": [{"turns": [{"text": "ok"}]}]}, project_memory=False)
    system = h.requests_of(h.run().run_id)[0].system
    assert "# Project memory" not in system
    assert CLAUDE not in system and AGENTS not in system and USER not in system
    assert "# Environment" in system


def test_only_files_of_the_repository_are_read(repo: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.md"
    outside.write_text("OUTSIDE-SECRET-9\n")
    (repo / "CLAUDE.md").unlink()
    os.symlink(outside, repo / "CLAUDE.md")  # out of the repository: not followed
    (repo / "AGENTS.md").unlink()
    os.mkfifo(repo / "AGENTS.md")  # not a regular file: never opened (would block)
    h = harness(repo, {"conversations": [{"turns": [{"text": "ok"}]}]})
    system = h.requests_of(h.run().run_id)[0].system
    assert "OUTSIDE-SECRET-9" not in system and USER in system

    (repo / "AGENTS.md").unlink()
    (repo / "CLAUDE.md").unlink()
    (repo / "CLAUDE.md").write_text(CLAUDE + '\n@~/.ssh/id_rsa\nsandbox.os = "off"\n')
    os.symlink("CLAUDE.md", repo / "AGENTS.md")  # the common link inside the repository
    h = harness(repo, {"conversations": [{"turns": [{"text": "ok"}]}]})
    root = h.run()
    system = h.requests_of(root.run_id)[0].system
    assert system.count(CLAUDE) == 1 and "AGENTS.md (repository root)" not in system
    assert "@~/.ssh/id_rsa" in system  # text, never an import
    assert root.workspace["os_sandbox"] == "bwrap"  # nothing in it is a setting


def test_a_worktree_child_reads_the_users_checkout(repo: Path) -> None:
    """Memory comes from the user's working tree (uncommitted edits included), for a
    worktree child too, not from its branch's copy."""
    (repo / "CLAUDE.md").write_text("EDITED-NOT-COMMITTED-3\n")
    h = harness(repo, _delegating("worktree"))
    parent, child = _systems(h, h.run().run_id)
    assert "EDITED-NOT-COMMITTED-3" in parent and "EDITED-NOT-COMMITTED-3" in child


def test_network_and_sandbox_facts_follow_the_settings(repo: Path) -> None:
    h = harness(repo, {"conversations": [{"turns": [{"text": "ok"}]}]}, network="host")
    system = h.requests_of(h.run().run_id)[0].system
    assert "- Network: the machine's network (allowed by the user)." in system
    off = environment_section(root="/r", isolation="shared", agent="a", depth=0, max_depth=3,
                              workspace={"os_sandbox": "off", "network": "none"})  # fmt: skip
    assert ".git is read-only" not in off and "without an OS sandbox" in off
    box = environment_section(root="/workspace", isolation="container", agent="a", depth=1,
                              max_depth=3, workspace={"branch": "orch/a/123"})  # fmt: skip
    assert "A Docker container: /workspace is its own git repository on branch orch/a/123" in box
    assert "You may commit" in box and "- Network: none" in box
    assert ".git is read-only" not in box


def _responder(body: dict[str, Any]) -> dict[str, Any]:
    if len(body["messages"]) == 1 and "depth 0" in system_text(body):
        return tool_reply(("task", {"description": "x", "prompt": "look", "isolation": "worktree"}))
    return text_reply("done")


def test_the_first_request_to_the_messages_api_carries_it(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serve(FakeAPI(_responder)) as api:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", api.base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-fake")
        settings = Settings()
        provider = ModelProvider(settings)
        runner = Runner(settings=settings, store=open_store(repo), catalog=load_catalog(repo),
                        models=provider)  # fmt: skip

        async def go() -> Any:
            async with provider:
                return await runner.run(RunSpec(prompt="go", workdir=repo))

        root = asyncio.run(go())
    assert root.status == RunStatus.SUCCEEDED, root.error
    firsts = [b for b in api.requests if len(b["messages"]) == 1]
    assert len(firsts) == 2  # the root's and the worktree child's
    for body in firsts:
        system = system_text(body)
        assert CLAUDE in system and AGENTS in system and USER in system
    assert "Your own git worktree on branch orch/general/" in system_text(firsts[1])


@pytest.mark.docker
@pytest.mark.usefixtures("hermetic_git")
def test_a_container_run_gets_the_host_memory_and_its_tier_facts(repo: Path) -> None:
    (repo / "CLAUDE.md").write_text("EDITED-ON-THE-HOST-8\n")  # not committed: not in the box
    h = harness(repo, {"conversations": [{"turns": [{"text": "ok"}]}]},
                sandbox=SandboxSettings(image=sandbox_image()))  # fmt: skip
    root = h.run(isolation="container")
    assert root.status == RunStatus.SUCCEEDED, root.error
    system = h.requests_of(root.run_id)[0].system
    assert "EDITED-ON-THE-HOST-8" in system and USER in system
    branch = root.workspace["branch"]
    assert f"A Docker container: /workspace is its own git repository on branch {branch}" in system
    assert "- Network: none (package installs fail)." in system


def test_children_read_the_files_anew_but_find_the_repository_once(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fan-out asks git where the checkout is once per directory (not once a child),
    while each child reads the files as they are when it starts: an edit made by an
    earlier child reaches a later one."""
    from orchestrator.engine.memory import memory_source as search

    searched: list[Path] = []

    def counted(start: Path, *args: Any) -> Any:
        searched.append(start)
        return search(start, *args)

    monkeypatch.setattr("orchestrator.engine.runner.memory_source", counted)
    edit = {"tool": "bash", "input": {"command": "echo EDITED-BY-FIRST-4410 > CLAUDE.md"}}
    script = {"conversations": [
        {"depth": 0, "turns": [
            {"tool_calls": [task_call("first", description="a")]},
            {"tool_calls": [task_call(f"later {i}", description=f"b{i}") for i in range(4)]},
            {"text": "ok"}]},
        {"depth": 1, "prompt": "first", "turns": [{"tool_calls": [edit]}, {"text": "edited"}]},
        {"depth": 1, "prompt": "later", "runs": 4, "turns": [{"text": "read"}]},
    ]}  # fmt: skip
    h = harness(repo, script)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    assert searched == [repo.resolve()]  # the root and its five children: one search
    kids = h.store.children(root.run_id)
    assert len(kids) == 5
    first = next(k for k in kids if k.prompt == "first")
    assert CLAUDE in h.requests_of(first.run_id)[0].system
    for kid in kids:
        if kid is not first:
            system = h.requests_of(kid.run_id)[0].system
            assert "EDITED-BY-FIRST-4410" in system and CLAUDE not in system
