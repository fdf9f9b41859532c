"""Issue 38, class 7: every repository file orch reads goes through the one safe path.

The repository's agent and skill files, and their directories, are read beneath the project
root through safefs (``catalog/owner.py``): a link that leads out of the project or to a
hidden path (``.orch/``, ``sandbox.hidden``, the usual secrets) is not followed, as memory
files, team files and ``.mcp.json`` already are not. The break through the real CLI:
``read_file`` refused a skill file that links to a hidden path, ``load_skill`` returned it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchestrator.catalog.definitions import load_catalog
from tests.support import init_repo, need_bwrap, orch, write_script

TOKEN = "Bearer DEPLOYTOKEN-38-7f1c"
SECRET_SKILL = f"---\nname: deploy\ndescription: how we deploy\n---\nUse {TOKEN}\n"
SECRET_AGENT = f"---\nname: deployer\ndescription: deploys\n---\nYour key: {TOKEN}\n"


def stored(repo: Path, *texts: str) -> list[str]:
    """Where the token shows: the command's output or orch's store files."""
    found = [f"output {i}" for i, t in enumerate(texts) if TOKEN in t]
    found += [str(p) for p in (repo / ".orch").glob("orch.db*") if TOKEN.encode() in p.read_bytes()]
    return found


@pytest.mark.bwrap
def test_load_skill_never_reads_a_skill_file_that_links_to_a_hidden_path(tmp_path: Path) -> None:
    need_bwrap()
    repo = init_repo(tmp_path / "proj", {"README.md": "hi\n"})
    (repo / ".orch" / "private").mkdir(parents=True)
    (repo / ".orch" / "private" / "deploy.md").write_text(SECRET_SKILL)  # the user's, hidden
    skill = repo / ".claude" / "skills" / "deploy"
    skill.mkdir(parents=True)
    (skill / "SKILL.md").symlink_to("../../../.orch/private/deploy.md")
    turns = [
        {
            "tool_calls": [
                {"tool": "read_file", "input": {"path": ".claude/skills/deploy/SKILL.md"}},
                {"tool": "load_skill", "input": {"name": "deploy"}},
            ]
        },
        {"text": "done"},
    ]
    script = write_script(repo, {"conversations": [{"depth": 0, "turns": turns}]})
    r = orch("task", "deploy", "--json", "--model", f"scripted:{script}", cwd=repo)
    assert r.returncode == 0, r.stdout + r.stderr
    assert stored(repo, r.stdout, r.stderr) == []
    listed = orch("skills", "list", "--json", cwd=repo)
    assert TOKEN not in listed.stdout + listed.stderr
    assert "hidden from agents" in listed.stdout, listed.stdout  # its errors, in the JSON


def planted(repo: Path, how: str) -> None:
    """The repository's agent or skill that reaches a file it may not: ``how``."""
    home = Path(os.environ["HOME"])
    (repo / "secrets").mkdir()
    (repo / "secrets" / "deploy.md").write_text(SECRET_SKILL)  # sandbox.hidden
    (repo / "secrets" / "deployer.md").write_text(SECRET_AGENT)
    (home / "deploy").mkdir()
    (home / "deploy" / "SKILL.md").write_text(SECRET_SKILL)  # outside the project
    claude = repo / ".claude"
    if how == "agent-file":
        (claude / "agents").mkdir(parents=True)
        (claude / "agents" / "deployer.md").symlink_to("../../secrets/deployer.md")
    elif how == "skill-dir":
        (claude / "skills").mkdir(parents=True)
        (claude / "skills" / "deploy").symlink_to(home / "deploy")
    elif how == "parent-dir":  # .claude itself leads into a hidden directory
        (repo / ".orch" / "x" / "skills" / "deploy").mkdir(parents=True)
        (repo / ".orch" / "x" / "skills" / "deploy" / "SKILL.md").write_text(SECRET_SKILL)
        claude.symlink_to(".orch/x")
    elif how == "named-dir":  # orch.toml names a directory that leads out
        (home / "agents").mkdir()
        (home / "agents" / "deployer.md").write_text(SECRET_AGENT)
        (repo / "tools").mkdir()
        (repo / "tools" / "agents").symlink_to(home / "agents")
    elif how == "hard-link":
        (claude / "agents").mkdir(parents=True)
        os.link(repo / "secrets" / "deployer.md", claude / "agents" / "deployer.md")


@pytest.mark.parametrize("how", ["agent-file", "skill-dir", "parent-dir", "named-dir", "hard-link"])
def test_no_repository_definition_is_read_through_a_link_out_or_to_a_hidden_path(
    tmp_path: Path, how: str
) -> None:
    repo = init_repo(tmp_path / "proj", {"README.md": "hi\n"})
    planted(repo, how)
    from orchestrator.trust import Trust

    trust = Trust(root=repo, agents_dirs=("tools/agents",))
    dirs = [repo / "tools" / "agents"] if how == "named-dir" else []
    cat = load_catalog(repo, agents_dirs=dirs, trust=trust, hidden=["secrets"])
    everything = json.dumps([d.model_dump() for d in [*cat.agents.values(), *cat.skills.values()]])
    assert TOKEN not in everything
    assert "deployer" not in cat.agents and "deploy" not in cat.skills
    assert cat.errors, how  # each says why, one line


def test_links_that_stay_in_the_project_are_fine(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "proj", {"docs/review.md": SECRET_AGENT.replace(TOKEN, "ok")})
    (repo / ".claude" / "agents").mkdir(parents=True)
    (repo / ".claude" / "agents" / "deployer.md").symlink_to("../../docs/review.md")
    (repo / ".orch" / "skills" / "deploy").mkdir(parents=True)
    (repo / ".orch" / "skills" / "deploy" / "SKILL.md").write_text(SECRET_SKILL.replace(TOKEN, "x"))
    cat = load_catalog(repo)
    assert cat.errors == []
    assert cat.agents["deployer"].repository and "deploy" in cat.skills
