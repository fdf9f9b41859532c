"""Every command that takes a run takes its id or any unique prefix of it (cli/common.py
``find_run``): an ambiguous prefix or an unknown id is one line on stderr and exit 2."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli.main import app
from orchestrator.run import RunRecord, RunStatus
from orchestrator.store import SqliteStore
from tests.support import init_repo, write_script

pytestmark = pytest.mark.usefixtures("hermetic_git")

IDS = ["r-aaa111111111", "r-aaa222222222", "r-aab333333333", "r-aac444444444", "r-bbb555555555"]
UNIQUE = "r-bbb5"


@pytest.fixture
def repo(project: Path) -> Path:
    root = init_repo(project)
    store = SqliteStore.for_project(root)
    for n, run_id in enumerate(IDS):
        store.create_run(
            RunRecord(run_id=run_id, chain_id=f"c-{n:012d}", status=RunStatus.SUCCEEDED)
        )
        store.add_event(run_id, "run_finished", {"status": "succeeded", "n": n})
    store.close()
    return root


def _script(repo: Path) -> Path:
    return write_script(repo, {"conversations": [{"turns": [{"text": "more"}]}]})


# each command that takes a run, with the rest of its command line
COMMANDS: dict[str, Callable[[str, Path], list[str]]] = {
    "result": lambda ref, _: ["result", ref, "--json"],
    "logs": lambda ref, _: ["logs", ref, "--json"],
    "tree": lambda ref, _: ["tree", ref, "--json"],
    "watch": lambda ref, _: ["watch", ref, "--interval", "0.05"],
    "cancel": lambda ref, _: ["cancel", ref, "--json"],
    "resume": lambda ref, repo: ["resume", ref, "go on", "--model", f"scripted:{_script(repo)}"],
    "worktrees merge": lambda ref, _: ["worktrees", "merge", ref],
}


def _orch(repo: Path, args: list[str]) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, [*args, "-C", str(repo)])
    return r.exit_code, r.stdout, r.stderr


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("ref", ["r-aa", "aa", " r-aa "])
def test_an_ambiguous_prefix_lists_candidates_in_one_line(
    repo: Path, command: str, ref: str
) -> None:
    code, _, err = _orch(repo, COMMANDS[command](ref, repo))
    assert code == 2, (command, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "matches 4 runs" in err and "type more characters" in err
    assert "r-aaa111111111, r-aaa222222222, r-aab333333333, r-aac444444444" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_run_is_one_line(repo: Path, command: str) -> None:
    code, _, err = _orch(repo, COMMANDS[command]("r-zzz", repo))
    assert code == 2, (command, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "r-zzz" in err


def test_more_than_a_few_candidates_are_counted_not_listed(repo: Path) -> None:
    code, _, err = _orch(repo, ["result", "r-"])
    assert code == 2 and "matches 5 runs" in err and "and 1 more" in err
    assert err.count("r-") == 5  # the prefix itself and four candidates


@pytest.mark.parametrize("ref", [UNIQUE, "bbb5", IDS[-1]])
def test_a_unique_prefix_names_the_run_in_every_command(repo: Path, ref: str) -> None:
    full = IDS[-1]
    code, out, err = _orch(repo, COMMANDS["result"](ref, repo))
    assert code == 0 and json.loads(out)["run_id"] == full, err
    code, out, err = _orch(repo, COMMANDS["logs"](ref, repo))
    assert code == 0 and [e["data"]["n"] for e in json.loads(out)] == [4], err
    code, out, err = _orch(repo, COMMANDS["tree"](ref, repo))
    assert code == 0 and [r["run_id"] for r in json.loads(out)] == [full], err
    code, out, err = _orch(repo, COMMANDS["cancel"](ref, repo))
    assert code == 0 and json.loads(out) == [{"run_id": full, "status": "succeeded"}], err
    code, out, err = _orch(repo, COMMANDS["watch"](ref, repo))
    assert code == 0 and full in out, err
    # resume got as far as the run itself: it has no conversation to continue
    code, _, err = _orch(repo, COMMANDS["resume"](ref, repo))
    assert code != 0 and full in err and "matches" not in err, err
