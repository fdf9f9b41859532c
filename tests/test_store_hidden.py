"""Every runtime hides every store the run can reach (issue 20, class 6), through the CLI.

A run's prompt is private to its chain. A worktree run whose model tries to read the store
(``bash: cat`` of the SQLite file and its WAL, ``read_file`` of its path) gets nothing, and
the other run's prompt never reaches its model, wherever the store lives: ``$ORCH_HOME``
outside the repository here; on a Ray node, the spawner's store (tests/test_ray.py).

The repositories live under /var/tmp: under /tmp, the sandbox's private /tmp would hide
the store whatever orch did, and the test could not fail.
"""

from __future__ import annotations

import json
import os
import shlex
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.store import SqliteStore, store_paths
from orchestrator.storeurl import local_paths
from tests.fakeapi import FakeAPI, Responder, serve, text_reply, tool_reply
from tests.support import init_repo, need_bwrap, orch

PEEK = "peek-at-the-store"


def first_text(body: dict[str, Any]) -> str:
    content = body["messages"][0]["content"]
    return content if isinstance(content, str) else json.dumps(content)


def spy(db: Path, *, delegate: bool) -> Responder:
    """A model that reads ``db`` (and its WAL, and its directory) with bash and read_file in
    the run whose task holds PEEK; with ``delegate``, the root hands that to a worktree child."""
    files = [db, db.with_name(db.name + "-wal")]
    command = "; ".join(f"cat {shlex.quote(str(f))}" for f in files)
    command += f"; ls -la {shlex.quote(str(db.parent))}; echo peeked-done"

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        turn = len(body["messages"]) // 2
        if PEEK in first_text(body):
            if turn == 0:
                return tool_reply(("bash", {"command": command}), ("read_file", {"path": str(db)}))
            return text_reply("peeked")
        if turn == 0 and delegate:
            task = {"description": "peek", "prompt": f"{PEEK}: read the store",
                    "isolation": "worktree"}  # fmt: skip
            return tool_reply(("task", task))
        return text_reply("root done")

    return respond


def store_a_private_prompt(repo: Path, env: dict[str, str]) -> str:
    """Another run's prompt, now in the store (``secret`` of its chain)."""
    secret = "PRIVATE-PROMPT-" + uuid.uuid4().hex
    script = repo.parent / f"quiet-{uuid.uuid4().hex[:8]}.yaml"
    script.write_text(yaml.safe_dump({"conversations": [{"turns": [{"text": "ok"}]}]}))
    got = orch("task", "--isolation", "shared", "--model", f"scripted:{script}", secret,
               cwd=repo, env=env)  # fmt: skip
    assert got.returncode == 0, got.stderr
    return secret


def check_peek(api: FakeAPI, db: Path, secret: str) -> None:
    """The store holds ``secret``; the peeking run ran both tools and its model never saw it."""
    held = b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))
    assert secret.encode() in held  # it is there to be read: the test can fail
    peeks = [b for b in api.requests if PEEK in first_text(b)]
    assert len(peeks) == 2, [first_text(b) for b in api.requests]
    blocks = [b for b in peeks[1]["messages"][-1]["content"] if b.get("type") == "tool_result"]
    for body in peeks:
        assert secret not in json.dumps(body)  # the other run's prompt never reached it
    assert "SQLite format" not in json.dumps(blocks)  # nor any byte of the store
    assert len(blocks) == 2 and "peeked-done" in blocks[0]["content"]  # both tools ran
    assert blocks[1].get("is_error") is True  # read_file refused it


@pytest.mark.bwrap
def test_a_worktree_run_cannot_read_a_store_in_orch_home_outside_the_repo(
    outside_tmp: Path, hermetic_git: Path
) -> None:
    need_bwrap()
    home = outside_tmp / "orch-home"
    repo = init_repo(outside_tmp / "repo", {"README.md": "hi\n"})
    env = {"ORCH_HOME": str(home)}
    secret = store_a_private_prompt(repo, env)
    db = home / "orch.db"
    api = FakeAPI(spy(db, delegate=False))
    with serve(api):
        env |= {"ANTHROPIC_API_KEY": "sk-ant-test", "ANTHROPIC_BASE_URL": api.base_url}
        got = orch("task", "--isolation", "worktree", "--model", "sonnet",
                   f"{PEEK}: read the store", cwd=repo, env=env, timeout=120)  # fmt: skip
    assert got.returncode == 0, got.stderr
    check_peek(api, db, secret)


def test_store_paths_name_the_store_in_use_and_every_store_the_environment_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "spawner" / ".orch").mkdir(parents=True)
    spawners = SqliteStore(tmp_path / "spawner" / ".orch" / "orch.db")
    node_clone = tmp_path / "clone"
    node_clone.mkdir()
    monkeypatch.setenv("ORCH_HOME", str(tmp_path / "home-store"))
    monkeypatch.setenv("ORCH_STORE", "postgresql://u:pw@/runs?host=/srv/pg-sock,db.example")
    monkeypatch.setenv("PGHOST", "/var/lib/pg-other")
    monkeypatch.setenv("PGPASSFILE", "/srv/secrets/pgpass")
    try:
        found = store_paths(spawners, node_clone)
    finally:
        spawners.close()
    assert found == [
        str(tmp_path / "spawner" / ".orch"), str(node_clone / ".orch"),
        str(tmp_path / "home-store"), "/srv/pg-sock", "/var/lib/pg-other", "/srv/secrets/pgpass",
    ]  # fmt: skip
    assert local_paths("postgresql://%2Frun%2Fpg/db") == ["/run/pg"]
    assert local_paths("postgresql://user@localhost:5432/db") == []
    assert local_paths("postgresql://h/db?sslkey=/k/client.key&passfile=/k/pass") == [
        "/k/client.key", "/k/pass"
    ]  # fmt: skip


def test_a_memory_file_linked_to_the_store_or_a_hidden_path_never_reaches_a_prompt(
    tmp_path: Path, hermetic_git: Path
) -> None:
    """CLAUDE.md and AGENTS.md are copied into every system prompt: a repository that
    commits them as links to its own store, or to a ``sandbox.hidden`` file, gets neither
    in (and the model sees the rest of the prompt as usual)."""
    repo = init_repo(tmp_path / "repo", {"README.md": "hi\n", "notes/private.txt": ""})
    hidden = "HIDDEN-NOTE-" + uuid.uuid4().hex
    (repo / "notes" / "private.txt").write_text(hidden + "\n")
    home = Path(os.environ["HOME"])
    (home / ".orch").mkdir(exist_ok=True)
    (home / ".orch" / "config.toml").write_text(
        f'[sandbox]\nhidden = ["{repo / "notes" / "private.txt"}"]\n'
    )
    secret = store_a_private_prompt(repo, {})
    (repo / "CLAUDE.md").symlink_to(".orch/orch.db")
    (repo / "AGENTS.md").symlink_to("notes/private.txt")
    api = FakeAPI(lambda body: text_reply("done"))
    with serve(api):
        env = {"ANTHROPIC_API_KEY": "sk-ant-test", "ANTHROPIC_BASE_URL": api.base_url}
        got = orch("task", "--isolation", "shared", "--model", "sonnet", "hello",
                   cwd=repo, env=env, timeout=120)  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert api.requests  # it asked the model
    sent = json.dumps(api.requests)
    assert secret not in sent and "SQLite format" not in sent and hidden not in sent
