"""Teams on real git repos: writer and reviewer take turns on one branch in one chain."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli.main import app
from orchestrator.cli.team import team_app
from orchestrator.errors import UsageError
from orchestrator.process.events import summary
from orchestrator.run import RunStatus
from orchestrator.teams.driver import run_team
from orchestrator.teams.plan import make_plan
from orchestrator.teams.progress import TeamResult
from orchestrator.teams.review import VerdictError, parse_verdict
from orchestrator.workspaces.base import WorkspaceSpec
from orchestrator.workspaces.worktree import WorktreeConfig, salvage_worktree
from tests.support import Harness, harness, init_repo

TASK = "Implement add(a, b) in calc.py"
BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
COMMENT = {"path": "calc.py", "line": 2, "comment": "add subtracts; return a + b instead"}


# -- helpers ----------------------------------------------------------------------------


def sh(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def verdict(kind: str, summary: str, comments: list[dict[str, Any]] | None = None) -> str:
    return json.dumps({"verdict": kind, "summary": summary, "comments": comments or []})


def write_turns(content: str, reply: str) -> list[dict[str, Any]]:
    return [
        {"tool_calls": [{"tool": "write_file", "input": {"path": "calc.py", "content": content}}]},
        {"text": reply},
    ]


def review(text: str, prompt: str | None = None, runs: int = 1) -> dict[str, Any]:
    conv: dict[str, Any] = {"agent": "reviewer", "runs": runs, "turns": [{"text": text}]}
    if prompt is not None:
        conv["prompt"] = prompt
    return conv


def writer(content: str, reply: str, prompt: str | None = None) -> dict[str, Any]:
    conv: dict[str, Any] = {"agent": "writer", "turns": write_turns(content, reply)}
    if prompt is not None:
        conv["prompt"] = prompt
    return conv


def team(h: Harness, **kwargs: Any) -> TeamResult:
    """A team run with flags as ``orch team run`` takes them (``reviewer``: one agent)."""
    if "reviewer" in kwargs:
        kwargs["reviewers"] = [kwargs.pop("reviewer")]
    if "merge" in kwargs:
        kwargs["merge"] = "merge" if kwargs["merge"] else "none"
    plan = make_plan(None, None, **kwargs)
    return asyncio.run(run_team(h.runner, prompt=TASK, workdir=h.root, plan=plan))


pytestmark = pytest.mark.usefixtures("hermetic_git")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return init_repo(
        tmp_path / "proj", {"calc.py": "def add(a, b):\n    raise NotImplementedError\n"}
    )


# -- the loop ---------------------------------------------------------------------------


def test_approved_in_round_two_on_one_branch_in_one_chain(repo: Path) -> None:
    base = sh(repo, "rev-parse", "HEAD")
    script = {
        "conversations": [
            writer(BUGGY, "Implemented add."),
            review(verdict("changes_requested", "add is wrong.", [COMMENT])),
            writer(FIXED, "Fixed add."),
            {
                "agent": "reviewer",
                "prompt": "Review round 2 of 3",
                "turns": [
                    {"tool_calls": [{"tool": "read_file", "input": {"path": "calc.py"}}]},
                    {
                        "expect_result": r"return a \+ b",
                        "text": "```json\n" + verdict("approve", "Correct now.") + "\n```",
                    },
                ],
            },
        ]
    }
    h = harness(repo, script)
    result = team(h)
    h.model.verify()
    assert result.approved and result.error is None and result.exit_code == 0
    assert result.status == RunStatus.SUCCEEDED and result.rounds == 2 and not result.merged
    assert [v.verdict for v in result.verdicts] == ["changes_requested", "approve"]
    assert result.verdicts[0].comments[0].comment == COMMENT["comment"]
    assert result.base == base and result.branch is not None
    assert result.commit == sh(repo, "rev-parse", result.branch)

    # the same branch got a second commit; the user's tree is untouched
    assert sh(repo, "rev-list", "--count", f"{base}..{result.branch}") == "2"
    assert sh(repo, "show", f"{result.branch}~1:calc.py") + "\n" == BUGGY
    assert sh(repo, "show", f"{result.branch}:calc.py") + "\n" == FIXED
    assert "NotImplementedError" in (repo / "calc.py").read_text()
    assert sh(repo, "rev-parse", "HEAD") == base and sh(repo, "status", "--porcelain") == ""
    assert sh(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/orch/") == (
        result.branch
    )

    # one chain: the team root at depth 0, four turns at depth 1
    runs = h.runs(result.chain_id)
    root, *kids = runs
    assert (root.run_id, root.agent, root.depth, root.parent_run_id) == (
        result.root_run_id, "team", 0, None,
    )  # fmt: skip
    assert root.status == RunStatus.SUCCEEDED and "approved" in root.output
    assert root.artifacts[0]["branch"] == result.branch
    assert root.artifacts[0]["files_changed"] == 1
    assert [(k.agent, k.depth, k.parent_run_id) for k in kids] == [
        (a, 1, root.run_id) for a in ("writer", "reviewer", "writer", "reviewer")
    ]
    assert all(k.status == RunStatus.SUCCEEDED for k in kids)
    assert [(r.round, r.role, r.run_id) for r in result.runs] == [
        (1, "writer", kids[0].run_id), (1, "reviewer", kids[1].run_id),
        (2, "writer", kids[2].run_id), (2, "reviewer", kids[3].run_id),
    ]  # fmt: skip
    assert [k.workspace["branch"] for k in kids] == [result.branch] * 4
    assert set(kids[0].allowed_tools) == {"read_file", "write_file", "edit_file", "glob", "grep",
                                          "bash"}  # fmt: skip
    assert set(kids[1].allowed_tools) == {"read_file", "glob", "grep"}
    verdicts = [e["data"] for e in h.store.events(root.run_id) if e["kind"] == "team_verdict"]
    assert [v["verdict"] for v in verdicts] == ["changes_requested", "approve"]

    # the prompts: the writer's second round carries the comments, the reviewer gets the diff
    assert h.requests_of(kids[0].run_id)[0].messages == [{"role": "user", "content": TASK}]
    # the writer goes on in its own conversation: the comments, tagged, are its next message
    assert kids[2].resumed_from == kids[0].run_id
    second = h.requests_of(kids[2].run_id)[0].messages[-1]["content"]
    assert f"[reviewer] calc.py:2: {COMMENT['comment']}" in str(second)
    assert "same branch" in str(second)
    review_one = h.requests_of(kids[1].run_id)[0].messages[0]["content"]
    assert "+    return a - b" in review_one and "-    raise NotImplementedError" in review_one
    assert TASK in review_one and '"verdict"' in review_one
    review_two = h.requests_of(kids[3].run_id)[0].messages[0]["content"]
    assert "+    return a + b" in review_two and COMMENT["comment"] in review_two


def test_never_approved_stops_after_the_rounds(repo: Path) -> None:
    script = {
        "conversations": [
            writer(BUGGY, "one"),
            writer(FIXED, "two"),
            review(verdict("changes_requested", "Still not right.", [COMMENT]), runs=2),
        ]
    }
    h = harness(repo, script)
    result = team(h, rounds=2)
    h.model.verify()
    assert not result.approved and result.exit_code == 1 and result.rounds == 2
    assert result.status == RunStatus.FAILED
    assert result.error is not None and "not approved after 2 round(s)" in result.error
    assert result.branch is not None and result.branch in result.error
    assert [v.verdict for v in result.verdicts] == ["changes_requested"] * 2
    root = h.store.require_run(result.root_run_id)
    assert root.status == RunStatus.FAILED and root.error == result.error
    assert len(h.store.children(root.run_id)) == 4
    assert sh(repo, "rev-list", "--count", f"{result.base}..{result.branch}") == "2"


def test_malformed_verdict_is_asked_again_once(repo: Path) -> None:
    script = {
        "conversations": [
            writer(FIXED, "done"),
            review(verdict("approve", "Fine."), prompt="not a valid verdict"),
            review("Looks good to me!"),
        ]
    }
    h = harness(repo, script)
    result = team(h)
    h.model.verify()
    assert result.approved and result.rounds == 1 and len(result.verdicts) == 1
    assert [(r.round, r.role) for r in result.runs] == [
        (1, "writer"), (1, "reviewer"), (1, "reviewer")
    ]  # fmt: skip
    retry = h.requests_of(result.runs[2].run_id)[0].messages[0]["content"]
    assert "not a valid verdict: the answer is not a JSON object" in retry
    assert "Looks good to me!" in retry and "+    return a + b" in retry
    [bad] = [e for e in h.store.events(result.root_run_id) if e["kind"] == "team_bad_verdict"]
    assert bad["data"]["run_id"] == result.runs[1].run_id


def test_malformed_twice_fails_the_round_clearly(repo: Path) -> None:
    script = {
        "conversations": [
            writer(FIXED, "done"),
            review('{"verdict": "lgtm", "summary": "ok"}', runs=2),
        ]
    }
    h = harness(repo, script)
    result = team(h, rounds=3)
    h.model.verify()
    assert not result.approved and result.exit_code == 1 and result.verdicts == []
    assert result.rounds == 1 and len(result.runs) == 3  # no second writer round
    assert result.error is not None
    assert result.error.startswith("round 1: the verdict of reviewer reviewer was malformed twice")
    assert "verdict: Input should be 'approve' or 'changes_requested'" in result.error
    assert all(r.run_id in result.error for r in result.runs[1:])
    assert h.store.require_run(result.root_run_id).status == RunStatus.FAILED


def test_merge_on_approve(repo: Path) -> None:
    script = {"conversations": [writer(FIXED, "done"), review(verdict("approve", "Good."))]}
    h = harness(repo, script)
    result = team(h, merge=True)
    assert result.approved and result.merged and result.exit_code == 0
    assert result.commit is not None and result.merge_commit == sh(repo, "rev-parse", "HEAD")
    assert sh(repo, "merge-base", "--is-ancestor", result.commit, "main") == ""
    assert (repo / "calc.py").read_text() == FIXED
    assert sh(repo, "status", "--porcelain") == ""
    assert "merged into your HEAD" in h.store.require_run(result.root_run_id).output


def test_control_files_are_shown_first_and_not_merged_without_the_flag(repo: Path) -> None:
    """A writer's bash plants an orch.toml hook; an approved --merge refuses it."""
    hook = "[[hooks.PreToolUse]]\ncommand = 'touch /tmp/pwned'\n"
    plant = {"tool": "bash", "input": {"command": f"printf {json.dumps(hook)} > orch.toml"}}
    turns = [{"tool_calls": [plant]}, *write_turns(FIXED, "done")]
    review_it = review(verdict("approve", "Good."), prompt="CONTROL FILES CHANGED")
    script = {"conversations": [{"agent": "writer", "turns": turns}, review_it]}
    h = harness(repo, script)
    result = team(h, merge=True)
    assert result.approved and not result.merged and result.exit_code == 1
    assert result.error is not None and "orch.toml" in result.error
    assert "--allow-control-files" in result.error
    assert not (repo / "orch.toml").exists()
    (review_run,) = [r for r in result.runs if r.role == "reviewer"]
    prompt = h.store.require_run(review_run.run_id).prompt
    assert prompt.index("CONTROL FILES CHANGED") < prompt.index("diff --git")

    h = harness(repo, {"conversations": [{"agent": "writer", "turns": turns},
                                          review(verdict("approve", "Good."))]})  # fmt: skip
    result = team(h, merge=True, allow_control_files=True)
    assert result.merged and (repo / "orch.toml").read_text() == hook


def test_no_merge_without_approval_and_failed_merge_fails(repo: Path) -> None:
    script = {
        "conversations": [
            writer(BUGGY, "done"),
            review(verdict("changes_requested", "No.", [COMMENT])),
        ]
    }
    h = harness(repo, script)
    result = team(h, rounds=1, merge=True)
    assert not result.approved and not result.merged
    assert "NotImplementedError" in (repo / "calc.py").read_text()

    script = {"conversations": [writer(FIXED, "done"), review(verdict("approve", "Good."))]}
    h = harness(repo, script)
    (repo / "calc.py").write_text("user's uncommitted edit\n")
    result = team(h, merge=True)
    assert result.approved and not result.merged and result.exit_code == 1
    assert result.error is not None and "approved, but merging" in result.error
    assert "uncommitted changes" in result.error
    root = h.store.require_run(result.root_run_id)
    assert root.status == RunStatus.FAILED and f"error: {result.error}" in root.output
    assert (repo / "calc.py").read_text() == "user's uncommitted edit\n"


def test_writer_without_changes_and_failing_writer(repo: Path) -> None:
    h = harness(repo, {"conversations": [{"agent": "writer", "turns": [{"text": "nothing"}]}]})
    result = team(h)
    assert result.error is not None and "left no branch with changes" in result.error
    assert result.branch is None and result.rounds == 1 and len(result.runs) == 1

    broken = {"agent": "writer", "turns": [{"tool_calls": [{"tool": "glob", "input": {}}]}]}
    h = harness(repo, {"conversations": [broken]})
    result = team(h)
    assert result.error is not None and result.error.startswith("round 1: the writer run")
    assert result.runs[0].status == RunStatus.FAILED


def test_cancel_from_another_terminal_ends_the_team(repo: Path) -> None:
    slow = {"agent": "writer", "latency_s": 30, "turns": [{"text": "never seen"}]}
    h = harness(repo, {"conversations": [slow]})

    async def body() -> TeamResult:
        job = asyncio.create_task(
            run_team(h.runner, prompt=TASK, workdir=h.root, plan=make_plan(None, None))
        )
        for _ in range(500):  # until the writer has started (it then waits 30 s for a reply)
            await asyncio.sleep(0.02)
            if [r for r in h.store.list_runs() if r.agent == "writer" and r.started_at]:
                break
        root = next(r for r in h.store.list_runs() if r.agent == "team")
        h.store.request_cancel([root.run_id, *(r.run_id for r in h.store.descendants(root.run_id))])
        return await asyncio.wait_for(job, 20)

    result = asyncio.run(body())
    assert result.status == RunStatus.CANCELLED and result.exit_code == 1
    assert not result.approved and result.error == "cancelled"
    root, writer_run = h.runs(result.chain_id)
    assert root.status == RunStatus.CANCELLED and writer_run.status == RunStatus.CANCELLED
    assert root.ended_at is not None
    assert sh(repo, "worktree", "list", "--porcelain").count("worktree ") == 1


def test_refusals_are_clear(repo: Path, tmp_path: Path) -> None:
    h = harness(repo, {"conversations": [{"turns": [{"text": "unused"}]}]})
    with pytest.raises(
        UsageError, match=r"reviewer 'general' has tools that write \(bash, edit_file, write_file\)"
    ):
        team(h, reviewer="general")
    with pytest.raises(UsageError, match="isolation: Input should be 'worktree' or 'container'"):
        team(h, isolation="shared")
    with pytest.raises(UsageError, match="rounds: Input should be greater than or equal to 1"):
        team(h, rounds=0)
    with pytest.raises(UsageError, match="max_depth to 1 or more"):
        team(harness(repo, {"conversations": [{"turns": [{"text": "x"}]}]}, max_depth=0))
    with pytest.raises(UsageError, match="writer 'nobody' is not an agent"):
        team(h, writer="nobody")
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(UsageError, match="needs a git repository.*git init"):
        team(harness(plain, {"conversations": [{"turns": [{"text": "x"}]}]}))
    empty = tmp_path / "empty"
    empty.mkdir()
    sh(empty, "init", "-q")
    with pytest.raises(UsageError, match="no commits yet"):
        team(harness(empty, {"conversations": [{"turns": [{"text": "x"}]}]}))
    assert h.store.list_runs() == []  # nothing was started


def test_parse_verdict() -> None:
    plain = parse_verdict(verdict("approve", "ok"))
    assert plain.approved and plain.comments == []
    fenced = parse_verdict("Here you go:\n```json\n" + verdict("changes_requested", "x",
                           [COMMENT]) + "\n```\nThanks")  # fmt: skip
    assert fenced.verdict == "changes_requested" and fenced.comments[0].line == 2
    prose = parse_verdict('My verdict: {"verdict": "approve", "summary": "s", "extra": 1} done')
    assert prose.approved
    for bad, why in [
        ("", "empty"),
        ("LGTM", "not a JSON object"),
        ("[1, 2]", "not an object"),
        ('{"verdict": "approve"}', "summary: Field required"),
        ('{"verdict": "approve", "summary": "s", "comments": [{"path": "a", "line": 0,'
         ' "comment": "c"}]}', "comments.0.line"),
    ]:  # fmt: skip
        with pytest.raises(VerdictError, match=why):
            parse_verdict(bad)


# -- the CLI ----------------------------------------------------------------------------


def script_file(where: Path, conversations: list[dict[str, Any]]) -> Path:
    path = where.parent / "team-script.yaml"
    path.write_text(yaml.safe_dump({"conversations": conversations}))
    return path


def test_cli_never_approved_exits_1(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = script_file(repo, [writer(BUGGY, "done"), review(verdict("changes_requested", "No",
                                                                     [COMMENT]))])  # fmt: skip
    monkeypatch.chdir(repo)
    args = ["run", TASK, "--rounds", "1", "--model", f"scripted:{script}"]
    r = CliRunner().invoke(team_app, args)
    assert r.exit_code == 1, r.output
    assert "changes_requested" in r.stdout and "calc.py:2" in r.stdout
    assert "not approved after 1 round(s)" in r.stderr
    missing = CliRunner().invoke(team_app, ["run", TASK])
    assert missing.exit_code == 2 and "ANTHROPIC_API_KEY" in missing.stderr
    bad = CliRunner().invoke(app, ["team", "run", TASK, "--isolation", "shared"])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "'shared' is not one of 'worktree', 'container'" in bad.stderr


def test_cli_team_run_json_end_to_end(repo: Path) -> None:
    script = script_file(
        repo,
        [
            writer(BUGGY, "v1"),
            review(verdict("changes_requested", "Wrong sign.", [COMMENT])),
            writer(FIXED, "v2"),
            review(verdict("approve", "Good.")),
        ],
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    r = subprocess.run(
        [sys.executable, "-m", "orchestrator", "team", "run", TASK, "--merge", "--json",
         "--model", f"scripted:{script}"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) == {*TeamResult.model_fields, *TeamResult.model_computed_fields}
    assert data["approved"] and data["merged"] and data["rounds"] == 2
    assert data["status"] == "succeeded" and data["error"] is None
    assert [v["verdict"] for v in data["verdicts"]] == ["changes_requested", "approve"]
    assert data["verdicts"][0]["comments"] == [COMMENT]
    assert data["branch"].startswith("orch/writer/") and len(data["commit"]) == 40
    assert sh(repo, "merge-base", "--is-ancestor", data["commit"], "HEAD") == ""
    assert (repo / "calc.py").read_text() == FIXED

    tree = subprocess.run(
        [sys.executable, "-m", "orchestrator", "tree", data["root_run_id"], "--json"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert tree.returncode == 0, tree.stderr
    runs = json.loads(tree.stdout)
    assert [(x["agent"], x["depth"]) for x in runs] == [
        ("team", 0), ("writer", 1), ("reviewer", 1), ("writer", 1), ("reviewer", 1)
    ]  # fmt: skip
    assert {x["chain_id"] for x in runs} == {data["chain_id"]}
    assert all(x["status"] == "succeeded" for x in runs)


# -- the gate -------------------------------------------------------------------------------


def test_the_gate_runs_sandboxed_in_a_throwaway_checkout_of_the_branch(repo: Path) -> None:
    script = {"conversations": [writer(FIXED, "done"), review(verdict("approve", "Good."))]}
    h = harness(repo, script)
    gate = "echo gate-was-here >> calc.py && touch planted.txt && grep -q 'a + b' calc.py"
    result = team(h, gate=gate)
    assert result.approved, result.error
    [g] = result.gates
    assert g.passed and g.exit_code == 0 and g.command == gate
    # what the gate changed is thrown away: the branch holds the writer's work only
    assert result.branch is not None
    assert sh(repo, "show", f"{result.branch}:calc.py") + "\n" == FIXED
    assert "planted.txt" not in sh(repo, "ls-tree", "--name-only", result.branch)
    assert sh(repo, "worktree", "list", "--porcelain").count("worktree ") == 1
    gate_run = h.store.require_run(g.run_id)
    assert (gate_run.agent, gate_run.isolation, gate_run.depth) == ("gate", "worktree", 1)
    assert gate_run.workspace["os_sandbox"] == "bwrap" and gate_run.workspace["network"] == "none"
    assert gate_run.workspace["root"] != str(repo)
    assert not [a for a in gate_run.artifacts if a.get("kind") == "branch"]
    events = {e["kind"]: e["data"] for e in h.store.events(result.root_run_id)}
    # `orch logs` shows each team event in a line:
    assert (
        summary("team_gate", events["team_gate"])
        == f"round 1 candidate 1: gate passed (exit 0): {gate}"
    )
    assert summary("team_verdict", events["team_verdict"]) == "round 1: [reviewer] approve: Good."
    root = h.store.require_run(result.root_run_id)  # the progress: in the root's record
    assert root.progress is not None and root.progress["approved"] is True


def test_a_gate_past_its_timeout_fails_and_its_output_goes_back_to_the_writer(
    repo: Path,
) -> None:
    script = {"conversations": [writer(FIXED, "done"), writer(FIXED + "# again\n", "again")]}
    h = harness(repo, script)
    result = team(h, gate="echo started; sleep 30", gate_timeout=1, rounds=2)
    assert not result.approved and result.reviews == []  # no reviewer was asked
    assert result.error is not None and "the gate never passed after 2 round(s)" in result.error
    assert [(g.passed, g.timed_out) for g in result.gates] == [(False, True)] * 2
    assert all(g.seconds < 15 for g in result.gates)
    second = h.requests_of(result.runs[2].run_id)[0].messages[-1]["content"]
    assert "gate timed out" in str(second)
    assert "started" in result.gates[0].output  # what it printed before its time was up


def test_a_crashed_throwaway_checkout_is_removed_not_committed(repo: Path) -> None:
    """A gate's or reviewer's worktree left by a crash: the salvage keeps nothing of it."""
    sh(repo, "branch", "orch/writer/abcd1234")
    tip = sh(repo, "rev-parse", "orch/writer/abcd1234")
    config = WorktreeConfig(branch="orch/writer/abcd1234", discard=True)
    spec = WorkspaceSpec(run_id="r-0123456789ab", chain_id="c-1", agent="gate", description="g",
                         base=repo)  # fmt: skip

    async def crash() -> Path:
        ws = config.provision(spec)
        await ws.__aenter__()  # never closed: the owner died
        (ws.root / "calc.py").write_text("changed by a crashed gate\n")
        return ws.root

    root = asyncio.run(crash())
    assert "(discard)" in sh(repo, "worktree", "list", "--porcelain")
    assert asyncio.run(salvage_worktree(root, spec.run_id, "interrupted", proven=True)) is None
    assert sh(repo, "rev-parse", "orch/writer/abcd1234") == tip
    assert sh(repo, "worktree", "list", "--porcelain").count("worktree ") == 1
