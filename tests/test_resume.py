"""Resume: a child (or a root) goes on with its stored conversation, workspace and branch."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.catalog.definitions import load_catalog
from orchestrator.cli.common import open_project
from orchestrator.config import Settings
from orchestrator.engine.runner import Runner
from orchestrator.errors import OrchError
from orchestrator.models import ModelProvider
from orchestrator.process.reconcile import reconcile
from orchestrator.run import RunRecord, RunStatus
from orchestrator.spec import RunSpec
from orchestrator.store import SqliteStore, open_store
from orchestrator.store.base import bound_transcript
from tests.fakeapi import FakeAPI, plain, serve, system_text, text_reply, tool_reply
from tests.support import git, harness, init_repo, orch, write_script

TASK_ID = re.compile(r"\[task (r-[0-9a-f]+) ")


def _depth(body: dict[str, Any]) -> int:
    m = re.search(r"at delegation depth (\d+)", system_text(body))
    assert m
    return int(m.group(1))


def _last_text(body: dict[str, Any]) -> str:
    content = body["messages"][-1]["content"]
    if isinstance(content, str):
        return content
    return " ".join(str(b.get("text") or b.get("content") or "") for b in content)


def _child_id(body: dict[str, Any]) -> str:
    m = TASK_ID.search(_last_text(body))
    assert m, _last_text(body)
    return m.group(1)


class Script:
    """The fake API's replies: a parent starts a child, then resumes it."""

    def __init__(self, isolation: str, resume_in_same_run: bool) -> None:
        self.isolation = isolation
        self.same_run = resume_in_same_run

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        last = _last_text(body)
        if _depth(body) == 0:
            if last == "Start.":
                return tool_reply(
                    (
                        "task",
                        {"description": "one", "prompt": "First job.", "isolation": self.isolation},
                    ),
                )
            if "[task" in last and "resumed" not in last and self.same_run:
                return tool_reply(
                    ("task", {"resume": _child_id(body), "prompt": "Second job."}),
                )
            if "Go on." in last:
                return tool_reply(("task", {"resume": body["resume_id"], "prompt": "Second job."}))
            return text_reply("parent done")
        if last == "First job.":
            return tool_reply(("write_file", {"path": "one.txt", "content": "v1\n"}))
        if "Second job." in last:
            return tool_reply(("write_file", {"path": "two.txt", "content": "v2\n"}))
        return text_reply("wrote one" if "two.txt" not in json.dumps(body) else "wrote two")


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = FakeAPI(lambda body: text_reply("unused"))
    with serve(fake) as running:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", running.base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-fake")
        yield running


def _runner(root: Path, **settings: Any) -> tuple[Runner, ModelProvider]:
    cfg = Settings(model="sonnet", auto_background_after=0, **settings)
    provider = ModelProvider(cfg)
    runner = Runner(
        settings=cfg, store=open_store(root), catalog=load_catalog(root), models=provider
    )
    return runner, provider


def _run(runner: Runner, provider: ModelProvider, spec: RunSpec) -> RunRecord:
    async def go() -> RunRecord:
        async with provider:
            return await asyncio.wait_for(runner.run(spec), 300)

    return asyncio.run(go())


def _children(store: SqliteStore, chain_id: str) -> list[RunRecord]:
    return [r for r in store.list_runs(chain_id=chain_id) if r.depth == 1]


def _check_continued(api: FakeAPI, store: SqliteStore, old: RunRecord, new: RunRecord) -> None:
    """The resumed child's first request is the old conversation + the new prompt."""
    assert new.resumed_from == old.run_id and new.run_id != old.run_id
    assert new.status == RunStatus.SUCCEEDED, new.error
    assert new.agent == old.agent and new.isolation == old.isolation
    kept = store.transcript(old.run_id)
    assert kept is not None and kept[0] == {"role": "user", "content": "First job."}
    firsts = [b for b in api.requests if _depth(b) == 1 and "Second job." in _last_text(b)]
    first = plain(firsts[0]["messages"])
    assert first[: len(kept) - 1] == plain(kept[:-1])  # the old turns, as sent before
    assert "Second job." in json.dumps(first[-1])  # and the new prompt last
    assert len(first) >= 3  # not a fresh conversation


def _check_branch(root: Path, old: RunRecord, new: RunRecord) -> None:
    branch = old.workspace["branch"]
    assert new.workspace["branch"] == branch
    log = git(root, "log", "--format=%s", branch).splitlines()
    assert len(log) == 3  # init, the first run's commit, the resumed run's on top
    files = git(root, "ls-tree", "--name-only", branch).split()
    assert "one.txt" in files and "two.txt" in files
    assert git(root, "rev-parse", f"{branch}~1") == str(old.artifacts[0]["commit"])


@pytest.mark.parametrize("isolation", ["shared", "worktree"])
def test_resume_a_succeeded_child(api: FakeAPI, project: Path, isolation: str) -> None:
    root = init_repo(project)
    api.responder = Script(isolation, resume_in_same_run=True)
    runner, provider = _runner(root)
    done = _run(runner, provider, RunSpec(prompt="Start.", workdir=root))
    assert done.status == RunStatus.SUCCEEDED, done.error
    store = SqliteStore.for_project(root)
    first, second = _children(store, done.chain_id)
    assert first.parent_run_id == second.parent_run_id == done.run_id
    _check_continued(api, store, first, second)
    parent_saw = [_last_text(b) for b in api.requests if _depth(b) == 0][-1]
    assert f"[task {second.run_id} succeeded · resumed {first.run_id}" in parent_saw
    if isolation == "worktree":
        _check_branch(root, first, second)
    else:
        assert (root / "one.txt").exists() and (root / "two.txt").exists()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    return proc.pid


@pytest.mark.parametrize("isolation", ["shared", "worktree"])
def test_resume_an_interrupted_child(api: FakeAPI, project: Path, isolation: str) -> None:
    """A crashed tree: the root is resumed from the CLI side, and it resumes its child."""
    root = init_repo(project)
    script = Script(isolation, resume_in_same_run=False)
    api.responder = script
    runner, provider = _runner(root)
    done = _run(runner, provider, RunSpec(prompt="Start.", workdir=root))
    store = SqliteStore.for_project(root)
    (child,) = _children(store, done.chain_id)
    # the owner dies: both runs look alive with a dead owner; the child's conversation is
    # the one a crash after its tool results leaves (its last reply never came)
    pid = _dead_pid()
    for rid in (done.run_id, child.run_id):
        store.update_run(rid, status=RunStatus.RUNNING, pid=pid, ended_at=None)
    kept = store.transcript(child.run_id)
    assert kept is not None and kept[-1]["role"] == "assistant"
    store.save_transcript(child.run_id, kept[:-1])
    assert {r.run_id for r in reconcile(store)} == {done.run_id, child.run_id}
    child = store.require_run(child.run_id)
    assert child.status == RunStatus.INTERRUPTED

    api.responder = lambda body: script({**body, "resume_id": child.run_id})
    runner, provider = _runner(root)
    again = _run(runner, provider, RunSpec(prompt="Go on.", workdir=root, resume=done.run_id))
    assert again.status == RunStatus.SUCCEEDED, again.error
    assert again.resumed_from == done.run_id and again.chain_id == done.chain_id
    resumed = [r for r in _children(store, done.chain_id) if r.resumed_from]
    assert len(resumed) == 1 and resumed[0].parent_run_id == again.run_id
    _check_continued(api, store, child, resumed[0])
    # the interrupted child's last message was its tool results: the prompt joins it
    first = [b for b in api.requests if _depth(b) == 1 and "Second job." in _last_text(b)][0]
    assert first["messages"][-1]["content"][0]["type"] == "tool_result"
    if isolation == "worktree":
        _check_branch(root, child, resumed[0])


def _spawn_refused(runner: Runner, spec: RunSpec) -> str:
    with pytest.raises(OrchError) as e:
        asyncio.run(runner.spawn(spec))
    return str(e.value)


def test_refusals_are_one_line(project: Path) -> None:
    h = harness(
        project,
        {
            "conversations": [
                {
                    "depth": 0,
                    "turns": [
                        {
                            "tool_calls": [
                                {"tool": "task", "input": {"prompt": "a", "description": "a"}},
                                {"tool": "task", "input": {"prompt": "b", "description": "b"}},
                            ]
                        },
                        {"text": "done"},
                    ],
                },
                {
                    "depth": 1,
                    "prompt": "^a$",
                    "turns": [
                        {
                            "tool_calls": [
                                {"tool": "task", "input": {"prompt": "g", "description": "g"}}
                            ]
                        },
                        {"text": "a done"},
                    ],
                },
                {"depth": 1, "prompt": "^b$", "turns": [{"text": "b done"}]},
                {"depth": 2, "turns": [{"text": "g done"}]},
            ]
        },
    )
    root = h.run("go")
    runs = {r.prompt: r for r in h.runs(root.chain_id)}
    a, b, g = runs["a"], runs["b"], runs["g"]

    def child_spec(parent: str, resume: str) -> RunSpec:
        return RunSpec(prompt="more", workdir=project, parent_run_id=parent, resume=resume)

    # not its own child: a grandchild, a sibling's child, another run's child
    msg = _spawn_refused(h.runner, child_spec(root.run_id, g.run_id))
    assert "no such task was started by this agent" in msg and "\n" not in msg
    assert "no such task" in _spawn_refused(h.runner, child_spec(b.run_id, g.run_id))
    # unknown id
    assert "no such task" in _spawn_refused(h.runner, child_spec(root.run_id, "r-nope"))
    # a root from the CLI side: a child is not a root
    msg = _spawn_refused(h.runner, RunSpec(prompt="x", workdir=project, resume=a.run_id))
    assert "resume a child through task" in msg
    # still running
    h.store.update_run(b.run_id, status=RunStatus.RUNNING)
    msg = _spawn_refused(h.runner, child_spec(root.run_id, b.run_id))
    assert "still running" in msg and "\n" not in msg
    h.store.update_run(b.run_id, status=RunStatus.SUCCEEDED)
    # no transcript (pruned, or never kept)
    assert h.store.prune_transcripts(float("inf")) >= 4
    msg = _spawn_refused(h.runner, child_spec(root.run_id, b.run_id))
    assert "its conversation was not kept" in msg and "\n" not in msg
    # a refused resume stores nothing
    assert len(h.runs(root.chain_id)) == 4


def test_the_tool_refuses_an_unknown_task_id(project: Path) -> None:
    h = harness(
        project,
        {
            "conversations": [
                {
                    "depth": 0,
                    "turns": [
                        {
                            "tool_calls": [
                                {"tool": "task", "input": {"prompt": "x", "resume": "r-0"}}
                            ]
                        },
                        {"expect_result": "task refused: cannot resume 'r-0'", "text": "ok"},
                    ],
                },
            ]
        },
    )
    assert h.run("go").status == RunStatus.SUCCEEDED


def test_retention_prunes_old_transcripts(project: Path) -> None:
    store = SqliteStore.for_project(project)
    for rid in ("r-old", "r-new"):
        store.save_transcript(rid, [{"role": "user", "content": rid}])
    with sqlite3.connect(store.path) as db:
        db.execute("UPDATE transcripts SET saved_at = saved_at - 31 * 86400 WHERE run_id = 'r-old'")
    open_project(project, quiet=True)  # every command prunes (30 days by default)
    assert store.transcript("r-old") is None
    assert store.transcript("r-new") == [{"role": "user", "content": "r-new"}]
    open_project(project, quiet=True, transcript_retention_days=0)  # 0 keeps none
    assert store.transcript("r-new") is None
    h = harness(
        project, {"conversations": [{"turns": [{"text": "hi"}]}]}, transcript_retention_days=0
    )
    assert h.store.transcript(h.run("x").run_id) is None  # and none is saved


def test_transcript_size_bound() -> None:
    big = "x" * 1000
    messages: list[dict[str, Any]] = [{"role": "user", "content": "the task"}]
    for i in range(40):
        messages.append({"role": "assistant", "content": [{"type": "text", "text": f"a{i}{big}"}]})
        messages.append({"role": "user", "content": f"u{i}{big}"})
    text, cut = bound_transcript(messages, limit=10_000)
    kept = json.loads(text)
    assert cut and len(text) <= 10_000
    assert kept[0]["content"][0] == {"type": "text", "text": "the task"}
    assert "transcript cut" in kept[0]["content"][1]["text"]
    assert kept[1]["role"] == "assistant" and kept[-1] == messages[-1]
    assert [m["role"] for m in kept[1:]] == ["assistant", "user"] * (len(kept[1:]) // 2)
    assert bound_transcript(messages[:3], limit=10_000) == (
        json.dumps(messages[:3], separators=(",", ":")),
        False,
    )


def test_store_keeps_a_huge_transcript_bounded(project: Path) -> None:
    store = SqliteStore.for_project(project)
    turn = "y" * 100_000
    messages: list[dict[str, Any]] = [{"role": "user", "content": "task"}]
    for _ in range(30):  # ~6 MB
        messages += [{"role": "assistant", "content": turn}, {"role": "user", "content": turn}]
    store.save_transcript("r-big", messages)
    kept = store.transcript("r-big")
    assert kept is not None and len(json.dumps(kept)) <= 2 * 1024 * 1024
    assert kept[-1] == messages[-1] and "transcript cut" in json.dumps(kept[0])


def test_orch_resume_from_the_cli(project: Path) -> None:
    repo = init_repo(project)
    first = write_script(repo, {"conversations": [{"turns": [{"text": "first answer"}]}]}, "a.yaml")
    r = orch("task", "Say something.", "--json", "--model", f"scripted:{first}", cwd=repo)
    assert r.returncode == 0, r.stderr
    old = json.loads(r.stdout)
    second = write_script(
        repo, {"conversations": [{"turns": [{"text": "second answer"}]}]}, "b.yaml"
    )
    r = orch(
        "resume",
        old["run_id"][:8],
        "And more.",
        "--json",
        "--model",
        f"scripted:{second}",
        cwd=repo,
    )
    assert r.returncode == 0, r.stderr
    new = json.loads(r.stdout)
    assert new["resumed_from"] == old["run_id"] and new["chain_id"] == old["chain_id"]
    assert new["summary"] == "second answer" and new["run_id"] != old["run_id"]
    kept = SqliteStore.for_project(repo).transcript(new["run_id"])
    assert kept is not None
    assert [m["content"] for m in kept][:3] == [
        "Say something.",
        [{"type": "text", "text": "first answer"}],
        "And more.",
    ]
    # detached: a worker continues it
    third = write_script(repo, {"conversations": [{"turns": [{"text": "third answer"}]}]}, "c.yaml")
    r = orch("resume", new["run_id"], "Again.", "--background", "--json", "--model",
             f"scripted:{third}", cwd=repo)  # fmt: skip
    assert r.returncode == 0, r.stderr
    detached = json.loads(r.stdout)["run_id"]
    r = orch("result", detached, "--wait", "--json", cwd=repo)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["summary"] == "third answer"
    assert json.loads(r.stdout)["resumed_from"] == new["run_id"]
    # an unknown id is a usage error
    r = orch("resume", "r-000000000000", "x", "--model", f"scripted:{second}", cwd=repo)
    assert r.returncode != 0 and "no run" in r.stderr


def test_a_branch_left_by_no_change_run_is_not_continued(project: Path) -> None:
    """A worktree run that changed nothing left no branch: its continuation makes a new one."""
    from orchestrator.engine.admission import branch_exists

    repo = init_repo(project)
    git(repo, "branch", "orch/general/kept")
    assert branch_exists(repo, "orch/general/kept")
    assert not branch_exists(repo, "orch/general/gone")
    assert not branch_exists(project.parent, "orch/general/kept")  # not a repository
