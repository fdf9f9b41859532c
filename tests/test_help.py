"""Every command's --help, as a user reads it at 100 columns: classic placeholders, choices
listed, -C on every command that works on a project, no internal words; a mistyped command
line is one line."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, get_args

import pytest
import typer.main
from typer.testing import CliRunner

from orchestrator.cli.common import Isolation
from orchestrator.cli.main import app
from orchestrator.config import Settings
from orchestrator.workspaces.registry import TIER_NAMES

# Commands without -C/--workdir, and why it would make no sense there.
NO_WORKDIR = {
    "sandbox build": "builds the one sandbox image of this machine from orch's own files",
    "sandbox ps": "lists every orch container of the Docker engine, whatever its project",
}
JARGON = ("QueryChain", "tier", "reconcil", "lockdown")


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, cmd
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        if not sub.hidden:
            yield from _commands(sub, (*path, name))


def _flat(text: str) -> str:
    """Help as one line: frames gone, cells that wrapped at 100 columns joined."""
    return " ".join(re.sub("[│╭╮╰╯─]", " ", text).split())


def _help(path: tuple[str, ...]) -> str:
    r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert r.exit_code == 0, (path, r.output)
    return r.stdout


ALL = list(_commands(typer.main.get_command(app)))
LEAVES = [path for path, cmd in ALL if not hasattr(cmd, "commands")]


def test_the_walk_sees_every_command() -> None:
    names = {" ".join(p) for p in LEAVES}
    assert {"task", "resume", "result", "logs", "tree", "ps", "watch", "cancel", "demo",
            "trust", "agents list", "skills show", "team run", "sandbox config",
            "worktrees merge", "worktrees prune"} <= names  # fmt: skip
    assert not any(n.startswith("_") for n in names)  # internal commands stay hidden


@pytest.mark.parametrize("path", [p for p, _ in ALL], ids=lambda p: " ".join(p) or "orch")
def test_help_is_classic_and_plain(path: tuple[str, ...]) -> None:
    text = _help(path)
    for raw in ("<bool>", "<str>", "<int", "<float", "<path>", "{", "list[", "Path]"):
        assert raw not in text, (path, raw, text)
    for word in JARGON:
        assert word.lower() not in text.lower(), (path, word, text)
    if path in LEAVES:
        has_workdir = re.search(r"--workdir\s+-C\s+DIR\b", text) is not None
        assert has_workdir != (" ".join(path) in NO_WORKDIR), (path, text)
        assert "Show this message and exit." in text


def test_flags_values_choices_and_defaults_read_as_in_classic_typer() -> None:
    text = _flat(_help(("task",)))
    assert "--background Run detached." in text  # a flag: no placeholder
    assert "--agent -a TEXT Agent definition. [default: general]" in text
    assert "--isolation [shared|worktree|container] Where the agent works" in text
    assert "--executor [local|ray]" in text
    assert "--max-turns INTEGER RANGE [x>=1]" in text and "--agents-dir PATH" in text
    assert "Usage: orch task [OPTIONS] PROMPT" in text
    team = _flat(_help(("team", "run")))
    assert "--isolation [worktree|container]" in team and "else worktree" in team
    assert "--approve [all|majority|any]" in team and "--reviewer TEXT" in team
    merge = _flat(_help(("worktrees", "merge")))
    assert "Usage: orch worktrees merge [OPTIONS] RUN|BRANCH" in merge
    assert "[OPTIONS] [RUN_ID]" in _flat(_help(("watch",)))  # optional argument


def test_choices_are_the_real_ones() -> None:
    assert get_args(Isolation) == TIER_NAMES
    assert get_args(Settings.model_fields["executor"].annotation) == ("local", "ray")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["task", "x", "--isolation", "vm"], "'vm' is not one of 'shared', 'worktree'"),
        (["task"], "missing argument 'prompt'; see `orch task --help`"),
        (["task", "x", "--max-turns", "0"], "invalid value for '--max-turns'"),
        (["ps", "--bogus"], "no such option: --bogus"),
        (["--bogus"], "no such option: --bogus; see `orch --help`"),
        (["frobnicate"], "no such command 'frobnicate'; see `orch --help`"),
        (["worktrees", "merge"], "missing argument 'RUN|BRANCH'"),
        (["team", "run", "x", "--isolation", "shared"], "'shared' is not one of"),
    ],
)
def test_a_mistyped_command_line_is_one_line_exit_2(args: list[str], says: str) -> None:
    r = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    assert r.exit_code == 2, r.output
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("orch: ") and says in r.stderr, r.stderr
