"""A hidden path is hidden from every tool (issue 20, class 8).

Through the real CLI with the scripted model, per tier: the model calls ``read_file``,
``grep`` and ``glob`` on a ``sandbox.hidden`` path, on orch's store (``.orch/orch.db``),
through a symlink to them, through ``..`` and by absolute path. Every call is a tool
error, a walk of the whole tree neither lists nor searches them, and no secret reaches
the model: the run's transcript (every request the model got) holds none of it.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import SandboxSettings
from orchestrator.store import SqliteStore
from orchestrator.workspaces.base import WorkspaceSpec
from orchestrator.workspaces.container.inside import files as inbox
from orchestrator.workspaces.hiding import hidden_reason, hidden_rels, mirrored
from tests.fakeapi import FakeAPI, serve, text_reply
from tests.support import git, init_repo, need_bwrap, orch, sandbox_image, write_script

SECRET = "HIDDEN-SECRET-7f3a"
STORED = "STORE-SECRET-91bc"  # the first run's prompt: in orch.db, never shown to the next


def _read(path: str) -> dict[str, Any]:
    return {"tool": "read_file", "input": {"path": path}}


def _grep(pattern: str, path: str | None = None) -> dict[str, Any]:
    return {"tool": "grep", "input": {"pattern": pattern, **({"path": path} if path else {})}}


def _glob(pattern: str) -> dict[str, Any]:
    return {"tool": "glob", "input": {"pattern": pattern}}


def _refused_calls(repo: Path) -> list[dict[str, Any]]:
    """Calls every tier must answer with a tool error."""
    db = repo / ".orch" / "orch.db"
    return [
        _read("secrets/token.txt"),
        _read("keys.env"),
        _read(".orch/orch.db"),
        _read(".orch/orch.db-wal"),
        _read(".ORCH/orch.db"),
        _read("src/../secrets/token.txt"),
        _read("src/../.orch/orch.db"),
        _read("../../orch.db"),  # a worktree lies in .orch/worktrees/<run>
        _read(f"../{repo.name}/.orch/orch.db"),
        _read(str(db)),
        _read("link-secret"),  # committed symlinks to them
        _read("link-db"),
        _read("link-up"),
        _read("link-dir/orch.db"),
        _grep("SECRET", "secrets"),
        _grep("SECRET", "secrets/token.txt"),
        _grep("SECRET", ".orch"),
        _grep("SECRET", "link-dir"),
        _grep("SECRET", "src/../.orch/orch.db"),
        _glob(".orch/*"),
        _glob("secrets/*"),
        _glob("secrets/token.txt"),
        _glob("keys.env"),
        _read("deep/er/secret.txt"),
        _read(".env.local"),
        _read("moved/er/secret.txt"),  # after bash's `mv deep moved` (refused by bwrap)
    ]


def _open_calls() -> list[dict[str, Any]]:
    """Calls that succeed but must show nothing hidden."""
    return [
        _glob("**/*"),
        _glob("*"),
        _glob("**/*token*"),
        _glob("*/orch.db*"),
        _grep("HIDDEN-SECRET|STORE-SECRET|SQLite"),
        _grep("x = 1", "."),
        _grep("SECRET", "moved"),
    ]


@pytest.fixture
def attacked(tmp_path: Path) -> Path:
    """A repository with secrets the user hid (a directory by a relative entry, a file by
    an absolute one), and committed symlinks to them and to the store."""
    repo = tmp_path / "repo"
    files = {
        "src/app.py": "x = 1\n",
        "secrets/token.txt": SECRET + "\n",
        "keys.env": f"KEY={SECRET}\n",
        "deep/er/secret.txt": SECRET + "\n",
    }
    init_repo(repo, files)
    (repo / "link-secret").symlink_to("secrets/token.txt")
    (repo / "link-db").symlink_to(".orch/orch.db")
    (repo / "link-up").symlink_to("../../orch.db")
    (repo / "link-dir").symlink_to(".orch")
    hidden = ["secrets", str(repo / "keys.env"), "deep/er/secret.txt", ".env.local"]
    (repo / "orch.toml").write_text(f"[sandbox]\nhidden = {json.dumps(hidden)}\n")
    # an untracked secret that .worktreeinclude would copy into a worktree or container
    (repo / ".gitignore").write_text(".env.local\n")
    (repo / ".worktreeinclude").write_text(".env.local\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "links")
    (repo / ".env.local").write_text(f"TOKEN={SECRET}\n")
    return repo


# bash moves a parent of a hidden path: the file would leave its cover (host tiers)
RENAME = {"tool": "bash", "input": {"command": "mv deep moved; echo moved=$?"}}
# bash looks for the included secret: it was never copied in (or is covered, shared)
INCLUDED = {"tool": "bash", "input": {"command": "cat .env.local; ls -a"}}


def _play(repo: Path, isolation: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run a first task (its prompt goes into the store), then the probing one; the
    probing run's record and the tool results the model got."""
    first = write_script(repo, {"conversations": [{"turns": [{"text": "ok"}]}]}, "first.yaml")
    r = orch("task", STORED, "--model", f"scripted:{first}", cwd=repo)
    assert r.returncode == 0, r.stderr
    state = repo / ".orch"
    assert STORED.encode() in b"".join(p.read_bytes() for p in state.glob("orch.db*"))
    calls = [*_refused_calls(repo), *_open_calls()]
    bash = [INCLUDED, RENAME] if isolation != "container" else [INCLUDED]
    turns = [{"tool_calls": bash}, {"tool_calls": calls}, {"text": "done"}]
    probe = write_script(repo, {"conversations": [{"turns": turns}]}, "probe.yaml")
    args = ["task", "probe", "--isolation", isolation, "--json", "--model", f"scripted:{probe}"]
    r = orch(*args, cwd=repo, timeout=240)
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert record["status"] == "succeeded", record
    store = SqliteStore(repo / ".orch" / "orch.db")
    try:
        transcript = store.transcript(record["run_id"]) or []
    finally:
        store.close()
    results = [
        block
        for message in transcript
        if message["role"] == "user" and isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    ]
    text = json.dumps(results)  # all the model was told about its calls
    assert SECRET not in text and STORED not in text and "SQLite format" not in text
    assert "moved=0" not in json.dumps(results[: len(bash)])
    results = results[len(bash) :]
    assert len(results) == len(calls)
    return record, results


def _check(results: list[dict[str, Any]], repo: Path) -> None:
    refused = len(_refused_calls(repo))
    for call, result in zip(_refused_calls(repo), results[:refused], strict=True):
        assert result.get("is_error"), (call, result)
    for result in results[refused:]:
        assert not result.get("is_error"), result
        content = json.dumps(result["content"])
        # neither the names nor the contents of hidden paths are shown
        assert "secrets/" not in content and "keys.env" not in content
        assert ".orch" not in content and "orch.db" not in content
        assert "secret.txt" not in content and "token" not in content
        assert SECRET not in content and STORED not in content
    listing = json.dumps(results[refused]["content"])
    assert "src/app.py" in listing  # the walk itself works


def test_hidden_paths_refused_by_every_file_tool_shared(attacked: Path) -> None:
    need_bwrap()
    record, results = _play(attacked, "shared")
    assert record["workspace"]["os_sandbox"] == "bwrap"
    _check(results, attacked)


def test_hidden_paths_refused_by_every_file_tool_worktree(attacked: Path) -> None:
    need_bwrap()
    record, results = _play(attacked, "worktree")
    assert "/.orch/worktrees/" in record["workspace"]["root"]  # the workspace is in .orch
    _check(results, attacked)


@pytest.mark.docker
def test_hidden_paths_refused_by_every_file_tool_container(attacked: Path) -> None:
    sandbox_image()
    record, results = _play(attacked, "container")
    assert record["workspace"]["isolation"] == "container"
    _check(results, attacked)


HIDDEN = ("secrets", "deep/er/secret.txt")


@pytest.mark.parametrize(
    ("rel", "refused"),
    [
        (".orch", True),
        (".orch/orch.db", True),
        ("sub/.Orch/x", True),
        ("secrets", True),
        ("SECRETS/token.txt", True),
        ("deep/er/secret.txt", True),
        ("deep/er", False),
        ("deep/er/secret.txt.bak", False),
        ("secretsX/a", False),
        ("src/app.py", False),
        (".orchestra/x", False),
        ("", False),
    ],
)
def test_the_host_and_the_container_rule_agree(rel: str, refused: bool) -> None:
    assert (hidden_reason(rel, HIDDEN) is not None) is refused
    assert (inbox.hidden_reason(rel, HIDDEN) is not None) is refused


def test_hidden_paths_map_into_the_workspace(tmp_path: Path) -> None:
    repo, home = tmp_path / "repo", Path(os.environ["HOME"])
    tree = repo / ".orch" / "worktrees" / "r-1"
    hidden = ["rel/x", "../up", str(repo / "abs.env"), "~/.netrc"]
    spec = WorkspaceSpec(
        run_id="r-1",
        chain_id="c",
        agent="a",
        description="",
        base=repo,
        sandbox=SandboxSettings(hidden=hidden),
        state_dir=repo / ".orch",
    )
    # a worktree mirrors the repository: its absolute hidden paths hold there too; the
    # state dir that contains the worktree hides nothing inside it
    assert hidden_rels(spec, [tree, repo]) == (".orch", "abs.env", "rel/x")
    # a shared child working in its parent's worktree: the same, told by the path alone
    assert mirrored(tree) == [tree, repo]
    assert hidden_rels(spec, mirrored(tree)) == (".orch", "abs.env", "rel/x")
    # a workspace that is $HOME holds the home's secrets
    home_rels = hidden_rels(spec, [home])
    assert ".ssh" in home_rels and ".netrc" in home_rels and ".orch" in home_rels
    # a state dir elsewhere inside the workspace ($ORCH_HOME)
    spec = replace(spec, state_dir=repo / "state")
    assert "state" in hidden_rels(spec, [repo])


def test_planted_memory_links_show_the_model_no_hidden_file(tmp_path: Path) -> None:
    """``CLAUDE.md`` / ``AGENTS.md`` go into every system prompt: a committed link from
    them to the store or to a hidden path shows nothing (the real SDK sees the prompt)."""
    repo = init_repo(tmp_path / "repo", {"secrets/token.txt": SECRET + "\n"})
    (repo / "CLAUDE.md").symlink_to(".orch/orch.db")
    (repo / "AGENTS.md").symlink_to("secrets/token.txt")
    (repo / "orch.toml").write_text('[sandbox]\nhidden = ["secrets"]\n')
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "memory links")
    first = write_script(repo, {"conversations": [{"turns": [{"text": "ok"}]}]}, "first.yaml")
    assert orch("task", STORED, "--model", f"scripted:{first}", cwd=repo).returncode == 0
    with serve(FakeAPI(lambda body: text_reply("done"))) as api:
        env = {"ANTHROPIC_BASE_URL": api.base_url, "ANTHROPIC_API_KEY": "sk-test-fake"}
        r = orch("task", "hello", cwd=repo, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    (request,) = api.requests
    system = json.dumps(request["system"])
    assert "SQLite" not in system and STORED not in system and SECRET not in system


def test_a_shared_child_takes_its_spawners_hidden_paths_only_when_they_fit(
    tmp_path: Path,
) -> None:
    """A hundred shared children in one directory do not each resolve the same paths: a
    child takes its spawner's hidden list when the spawner is that directory, made with
    the same settings; anything else is found anew."""
    from orchestrator.workspaces.hiding import inherited
    from orchestrator.workspaces.shared import SharedWorkspace

    (tmp_path / "secrets").mkdir()
    (tmp_path / "other").mkdir()
    sandbox = SandboxSettings(hidden=["secrets", "~/.ssh"])
    parent = SharedWorkspace(WorkspaceSpec("r-p", "c", "general", "p", tmp_path, sandbox=sandbox))
    assert "secrets" in parent.hidden
    child_spec = WorkspaceSpec("r-c", "c", "general", "c", tmp_path, sandbox=sandbox, parent=parent)
    assert inherited(child_spec, tmp_path) == parent.hidden
    assert SharedWorkspace(child_spec).hidden == parent.hidden
    other = SandboxSettings(hidden=["other"])
    differs = WorkspaceSpec("r-d", "c", "general", "d", tmp_path, sandbox=other, parent=parent)
    assert inherited(differs, tmp_path) is None
    assert "other" in SharedWorkspace(differs).hidden
    elsewhere = WorkspaceSpec("r-e", "c", "general", "e", tmp_path / "other", parent=parent)
    assert inherited(elsewhere, tmp_path / "other") is None
