"""Issue 38, classes 4 and 6: one ownership rule for definitions, and capabilities that belong
to the chain.

Class 4: whether an agent is the user's or the repository's is one predicate
(``catalog/owner.py``): a directory the repository's ``orch.toml`` names is the repository's
wherever it points (``/proc/self/cwd/...``, ``/proc/self/root/...``, ``..``), and one whose
real path lies in the project is, whoever named it. So the repository's agent never gets the
user's ``~/.orch/mcp.json`` server (and its secret). Played through the real CLI.

Class 6: the user's servers are never offered anywhere below a repository agent: a child (a
user agent), a grandchild, a child of another user agent below it, and a team with a
repository member all run without them (real bubblewrap, scripted model).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.catalog.definitions import load_catalog
from orchestrator.catalog.owner import Owners
from orchestrator.mcpclient.names import NO_USERS
from orchestrator.run import RunStatus
from orchestrator.store.sqlite import SqliteStore
from tests.support import harness, init_repo, need_bwrap, orch, task_call, write_script

pytestmark = pytest.mark.bwrap

SECRET = "VAULT-SECRET-38-c4e1"
VAULT = Path(__file__).with_name("sec38_vault_server.py")


@pytest.fixture(autouse=True)
def bwrap() -> None:
    need_bwrap()


def agent(name: str, tools: str) -> str:
    return f"---\nname: {name}\ndescription: {name} agent\ntools: {tools}\n---\nYou {name}.\n"


def users_vault() -> Path:
    """The user's own server in ``~/.orch/mcp.json``, its token in its env; its home."""
    home = Path(os.environ["HOME"])
    (home / ".orch").mkdir(exist_ok=True)
    decl = {"command": sys.executable, "args": [str(VAULT)], "env": {"VAULT_URL": SECRET}}
    (home / ".orch" / "mcp.json").write_text(json.dumps({"mcpServers": {"vault": decl}}))
    return home


def users_agent(name: str, tools: str) -> None:
    agents = Path(os.environ["HOME"]) / ".orch" / "agents"
    agents.mkdir(parents=True, exist_ok=True)
    (agents / f"{name}.md").write_text(agent(name, tools))


def reveal() -> dict[str, Any]:
    return {"tool": "mcp__vault__reveal", "input": {}}


def plays(name: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"agent": name, "turns": [{"tool_calls": calls}, {"text": "done"}]}


def leaked(repo: Path, *texts: str) -> list[str]:
    """Where the secret shows: the command's output, or any file under the checkout (its
    store, transcripts and logs included)."""
    found = [f"output {i}" for i, t in enumerate(texts) if SECRET in t]
    for path in repo.rglob("*"):
        if path.is_file() and not path.is_symlink() and SECRET.encode() in path.read_bytes():
            found.append(str(path))
    return found


def mcp_notes(repo: Path) -> list[str]:
    store = SqliteStore.for_project(repo)
    try:
        notes: list[str] = []
        for run in store.list_runs():
            for e in store.events(run.run_id):
                if e["kind"] == "mcp":
                    notes += e["data"]["notes"]
        return notes
    finally:
        store.close()


# -- class 4: the break, through the real CLI --------------------------------------------


@pytest.mark.parametrize(
    "named",
    [
        "/proc/self/cwd/tools/agents",  # the issue's
        "/proc/self/root{root}/tools/agents",  # another route to the same directory
        "{outside}/in/agents",  # a link outside the checkout that leads into it
    ],
    ids=["proc-self-cwd", "proc-self-root", "link-outside"],
)
def test_a_directory_the_repository_names_is_the_repositorys_wherever_it_points(
    tmp_path: Path, named: str
) -> None:
    users_vault()
    repo, outside = tmp_path / "proj", tmp_path / "elsewhere"
    toml = f"agents_dirs = [{json.dumps(named.format(root=repo, outside=outside))}]\n"
    init_repo(repo, {"orch.toml": toml, "tools/agents/spy.md": agent("spy", "mcp__vault")})
    outside.mkdir()
    (outside / "in").symlink_to(repo / "tools")
    script = write_script(repo, {"conversations": [plays("spy", [reveal()])]})
    r = orch("task", "go", "--agent", "spy", "--json", "--model", f"scripted:{script}", cwd=repo)
    assert r.returncode == 0, r.stdout + r.stderr
    assert leaked(repo, r.stdout, r.stderr) == []
    assert any("'vault' is the user's" in n for n in mcp_notes(repo)), mcp_notes(repo)
    # the agent is listed as the repository's: `orch agents list` and trust agree
    shown = orch("agents", "show", "spy", "--json", cwd=repo)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["repository"] is True


def test_a_repository_link_into_the_users_agents_is_still_the_repositorys(
    tmp_path: Path,
) -> None:
    """A link in the checkout that leads into ``~/.orch/agents`` (a directory, or a file) is
    read as the repository's: it never makes the user's agent (or a file the repository
    chose) the user's, and it is not read at all (it leads out of the project)."""
    home = users_vault()
    users_agent("mine", "mcp__vault")
    repo = init_repo(tmp_path / "proj", {"README.md": "hi\n"})
    (repo / ".claude").mkdir()
    (repo / ".claude" / "agents").symlink_to(home / ".orch" / "agents")
    cat = load_catalog(repo, home=home)
    assert "mine" in cat.agents and not cat.from_repository(cat.agents["mine"])
    assert any("leads outside the project" in str(e) for e in cat.errors), cat.errors
    # and a file of the user's dir that links into the checkout is the repository's
    (repo / "planted.md").write_text(agent("planted", "mcp__vault"))
    (home / ".orch" / "agents" / "planted.md").symlink_to(repo / "planted.md")
    cat = load_catalog(repo, home=home)
    assert cat.from_repository(cat.agents["planted"])
    assert NO_USERS in cat.denies(cat.agents["planted"])


def test_the_ownership_rule(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "proj", {"tools/agents/a.md": agent("a", "Read")})
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "in").symlink_to(repo / "tools")
    owners = Owners.of(repo, [Path("/somewhere/else"), Path("/proc/self/cwd/tools/agents")])
    assert owners.repository_dir("/somewhere/else")  # named: the repository's, wherever
    assert owners.repository_dir(Path("/proc/self/cwd/tools/agents"))
    assert owners.repository_dir(repo / "tools" / "agents")
    assert owners.repository_dir(outside / "in" / "agents")  # a link into the project
    assert not owners.repository_dir(outside)
    assert Owners.of(repo).repository_dir(Path(f"/proc/self/root{repo}/tools/agents"))
    assert Owners.of(repo).repository_dir(repo / ".." / repo.name / "tools")


# -- class 6: below a repository agent, no user server ----------------------------------


def chain(repo: Path, conversations: list[dict[str, Any]], first: str) -> list[Any]:
    h = harness(repo, {"conversations": conversations})
    root = h.run(agent=first)
    assert root.status == RunStatus.SUCCEEDED, root.error
    return sorted(h.runs(root.chain_id), key=lambda r: r.depth)


def offered(repo: Path, run_id: str) -> list[str]:
    store = SqliteStore.for_project(repo)
    try:
        return [t for e in store.events(run_id) if e["kind"] == "mcp" for t in e["data"]["tools"]]
    finally:
        store.close()


def test_a_repository_agents_child_of_the_user_is_not_offered_the_users_server(
    tmp_path: Path,
) -> None:
    """The issue's break: the repository agent is refused the user's tool, its child (a user
    agent that names it) is offered it and hands the secret back."""
    users_vault()
    users_agent("fetcher", "mcp__vault__reveal")
    lead = agent("lead", "Task, mcp__vault")  # it names the server: refused it at run time
    repo = init_repo(tmp_path / "proj", {".claude/agents/lead.md": lead})
    runs = chain(
        repo,
        [
            plays("lead", [reveal(), task_call("fetch the token", subagent_type="fetcher")]),
            plays("fetcher", [reveal()]),
        ],
        "lead",
    )
    lead, child = runs
    assert leaked(repo) == []
    assert offered(repo, child.run_id) == []
    assert NO_USERS in lead.allowed_tools and NO_USERS in child.allowed_tools


def test_no_run_below_a_repository_agent_is_offered_the_users_server(tmp_path: Path) -> None:
    """Variants: a grandchild through another user agent; a user agent's own server."""
    users_vault()
    users_agent("middle", "Task, mcp__vault")
    users_agent("fetcher", "mcp__vault__reveal")
    own = (
        "---\nname: ownvault\ndescription: d\ntools: Read\nmcpServers:\n"
        f"  - mine: {{command: {sys.executable}, args: [{VAULT}], "
        f"env: {{VAULT_URL: {SECRET}}}}}\n---\nYou.\n"
    )
    (Path(os.environ["HOME"]) / ".orch" / "agents" / "ownvault.md").write_text(own)
    lead = "---\nname: lead\ndescription: every tool (mcp__*)\n---\nYou lead.\n"
    repo = init_repo(tmp_path / "proj", {".claude/agents/lead.md": lead})
    runs = chain(
        repo,
        [
            plays("lead", [task_call("a", subagent_type="middle")]),
            {
                "agent": "middle",
                "turns": [
                    {"tool_calls": [reveal(), task_call("b", subagent_type="fetcher")]},
                    {"tool_calls": [task_call("c", subagent_type="ownvault")]},
                    {"text": "done"},
                ],
            },
            plays("fetcher", [reveal()]),
            plays("ownvault", [{"tool": "mcp__mine__reveal", "input": {}}]),
        ],
        "lead",
    )
    assert len(runs) == 4
    assert leaked(repo) == []
    for run in runs:
        assert offered(repo, run.run_id) == [], run.agent
        assert NO_USERS in run.allowed_tools, run.agent
    # the same user agents, started by the user (no repository agent above): offered
    runs = chain(repo, [plays("fetcher", [reveal()])], "fetcher")
    assert offered(repo, runs[0].run_id) == ["mcp__vault__reveal"]


def test_a_team_with_a_repository_member_offers_no_member_the_users_server(
    tmp_path: Path,
) -> None:
    """Variant through a team: a repository lead (or reviewer) and a user's writer: the
    team's root keeps NO_USERS, so every member run below it does."""
    from orchestrator.teams.driver import TeamDriver
    from orchestrator.teams.plan import TeamPlan

    users_vault()
    users_agent("writer", "Read, Write, Edit, mcp__vault")
    repo = init_repo(
        tmp_path / "proj", {".claude/agents/reviewer.md": agent("reviewer", "Read, Grep")}
    )
    h = harness(repo, {"conversations": [plays("x", [])]})
    assert not h.catalog.from_repository(h.catalog.agent("writer"))
    team = TeamDriver(h.runner, TeamPlan(writer="writer", reviewers=["reviewer"]))
    assert team.definition.repository
    assert NO_USERS in h.catalog.denies(team.definition)
    Path(repo / ".claude/agents/reviewer.md").unlink()
    h = harness(repo, {"conversations": [plays("x", [])]})
    team = TeamDriver(h.runner, TeamPlan(writer="writer", reviewers=["reviewer"]))
    assert not team.definition.repository  # bundled reviewer, the user's writer
