"""Seeing the work: a foreground `orch task` on a terminal draws its chain live and ends
with the answer and the branches; off a terminal it stays plain.

The real CLI runs under a pseudo-terminal (``pty``) with a fixed width and the stream it
writes is read back: each frame of the live view is the whole tree, so the last frame,
with the escape sequences taken out, is what the screen shows at the end. The runs are
worktree runs (sandboxed by the system or the bundled bubblewrap) whose agents write files.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
from rich.cells import cell_len

from tests.support import init_repo, orch, write_script

pytestmark = pytest.mark.usefixtures("hermetic_git")

ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][A-Z0-9]")
HOSTILE = "\x1b[2J[/]\u202ewipe"  # clear screen, a closing tag, a bidi override
ANSWER = "Both children finished: parser.py and test_parser.py are on their branches."


def script(latency: float) -> dict[str, Any]:
    """A root that writes a file and delegates to two writers, slowly enough to be seen."""
    return {
        "conversations": [
            {
                "depth": 0,
                "latency_s": latency,
                "turns": [
                    {
                        "tool_calls": [
                            {
                                "tool": "write_file",
                                "input": {"path": "NOTES.md", "content": "a\nb\n"},
                            }
                        ]
                    },
                    {
                        "tool_calls": [
                            {
                                "tool": "task",
                                "input": {
                                    "description": "write the parser module",
                                    "subagent_type": "writer",
                                    "prompt": "Write the parser",
                                },
                            },
                            {
                                "tool": "task",
                                "input": {
                                    "description": HOSTILE + " tests",
                                    "subagent_type": "writer",
                                    "prompt": "Write the tests",
                                },
                            },
                        ]
                    },
                    {"text": ANSWER},
                ],
            },
            *(
                {
                    "agent": "writer",
                    "prompt": f"Write the {what}",
                    "latency_s": latency * 2,
                    "turns": [
                        {
                            "tool_calls": [
                                {
                                    "tool": "write_file",
                                    "input": {"path": name, "content": "x = 1\n"},
                                }
                            ]
                        },
                        {"text": f"{name} written."},
                    ],
                }
                for what, name in (("parser", "parser.py"), ("tests", "test_parser.py"))
            ),
        ]
    }


@pytest.fixture
def repo(project: Path) -> Path:
    return init_repo(project)


def on_a_terminal(args: list[str], cwd: Path, columns: int, timeout: float = 60) -> tuple[int, str]:
    """Run the CLI with stdin, stdout and stderr on a pseudo-terminal ``columns`` wide;
    its exit code and everything it wrote."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "CI"):
        env.pop(name, None)
    env.update(TERM="xterm-256color", COLUMNS=str(columns), LINES="40")
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args], cwd=cwd, env=env,
        stdin=sub, stdout=sub, stderr=sub, start_new_session=True,
    )  # fmt: skip
    os.close(sub)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    data = os.read(main, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            raise AssertionError(f"orch {args} did not end in {timeout}s")
        code = proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(main)
    return code, b"".join(chunks).decode("utf-8", "replace")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()


def diffstat(repo: Path, branch: str) -> str:
    """git's own summary line for the branch against main."""
    return git(repo, "diff", "--shortstat", f"main...{branch}")


def test_a_foreground_task_on_a_terminal_draws_its_chain_and_ends_with_the_branches(
    repo: Path,
) -> None:
    path = write_script(repo, script(latency=0.4))
    args = ["task", "Add a parser\nwith tests", "--isolation", "worktree"]
    code, raw = on_a_terminal([*args, "--model", f"scripted:{path}"], repo, columns=80)
    assert code == 0, raw[-3000:]
    # what a model chose is shown, never obeyed: no clear screen, no bidi override
    assert "\x1b[2J" not in raw and "\u202e" not in raw and "Traceback" not in raw
    text = ESCAPES.sub("", raw).replace("\r\n", "\n")
    frames = text.split("orch ▸ ")
    assert len(frames) > 3, text  # redrawn while it ran
    assert any(re.search(r"running +write_file: (pars|test)", f) for f in frames)
    screen = frames[-1].rstrip("\n").split("\n")
    assert all(cell_len(line) <= 80 for line in screen), screen
    rows = screen[3 : screen.index("")]  # under the title, the header and its rule
    assert len(rows) == 3, screen
    assert rows[0].startswith("general   ") and "Add a parser" in rows[0]  # the prompt's line
    assert rows[1].startswith("├─ writer") and "write the parser" in rows[1]
    assert rows[2].startswith("└─ writer") and "\\x1b[2J[/]\\u202ew" in rows[2]
    assert all("succeeded" in r for r in rows), rows
    assert "3 agents, 0 running" in screen[0]
    # then the answer, then each branch: its name and commit, and git's diffstat
    at = screen.index(ANSWER)
    tail = screen[at + 1 :]
    branches = git(repo, "branch", "--list", "orch/*", "--format=%(refname:short)").split()
    assert len(branches) == 3
    root = next(b for b in branches if b.startswith("orch/general/"))
    assert tail[0] == f"branch {root}  commit {git(repo, 'rev-parse', root)[:12]}"
    assert tail[1] == " " + diffstat(repo, root) == " 1 file changed, 2 insertions(+)"
    for b in branches:
        assert any(line.startswith(f"branch {b}  commit ") for line in tail), (b, tail)


def test_off_a_terminal_the_output_stays_plain(repo: Path) -> None:
    path = write_script(repo, script(latency=0.0))
    args = ["task", "Add a parser", "-d", "parser " + HOSTILE, "--isolation", "worktree"]
    r = orch(*args, "--model", f"scripted:{path}", cwd=repo, env={"TERM": "xterm-256color"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == ANSWER + "\n"  # the answer alone: `> answer.md` keeps working
    assert "\x1b" not in r.stdout + r.stderr and "\u202e" not in r.stderr
    lines = r.stderr.splitlines()
    branches = [line.split()[1] for line in lines if line.startswith("branch ")]
    assert len(branches) == 3 and branches[0].startswith("orch/general/")
    for b in branches:
        assert f"commit {git(repo, 'rev-parse', b)[:12]}" in lines[lines.index(next(
            line for line in lines if line.startswith(f"branch {b} ")))]  # fmt: skip
    assert lines.count(" 1 file changed, 1 insertion(+)") == 2

    rows = json.loads(orch("ps", "--json", cwd=repo).stdout)
    root = next(row for row in rows if row["depth"] == 0)
    shown = orch("result", root["run_id"], cwd=repo)  # `orch result` names the branch too
    assert f"branch {branches[0]}  commit " in shown.stdout and "2 insertions(+)" in shown.stdout
    assert root["description"] == "parser " + HOSTILE  # --description: kept exactly
    assert sorted(row["description"] for row in rows if row["depth"] == 1) == [
        HOSTILE + " tests",
        "write the parser module",
    ]
    assert all(row["last_activity_at"] >= row["started_at"] for row in rows)

    j = orch("task", "Add a parser", "--json", "--isolation", "worktree", "--model",
             f"scripted:{path}", cwd=repo)  # fmt: skip
    assert j.returncode == 0, j.stderr
    assert json.loads(j.stdout)["summary"] == ANSWER and "branch " not in j.stderr
