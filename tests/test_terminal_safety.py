"""What a model writes reaches the terminal as text: escape sequences written out, never
obeyed; Rich markup shown, never interpreted; ``--json`` keeps the exact string.

End to end through the real CLI: a scripted run (description, final texts), and runs put
in the store directly (agent names, errors, activity summaries, event data) for ps, tree,
result, logs and watch.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from orchestrator.cli.safe import safe_markup, safe_text, shown
from orchestrator.run import Activity, RunRecord, RunStatus, Usage, new_run_id, now
from orchestrator.store import SqliteStore
from tests.support import orch, write_script

# Each hostile piece, and how it must show on the terminal.
HOSTILE = {
    "clear screen": ("\x1b[2J", "\\x1b[2J"),
    "OSC 52 clipboard": ("\x1b]52;c;aGVsbG8=\x07", "\\x1b]52;c;aGVsbG8=\\x07"),
    "OSC 8 link": (
        "\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\",
        "\\x1b]8;;http://x\\x1b\\link\\x1b]8;;\\x1b\\",
    ),
    "closing tag": ("[/]", "[/]"),
    "link markup": ("[link=http://evil]x[/link]", "[link=http://evil]x[/link]"),
    "style markup": ("[bold red]", "[bold red]"),
    "bidi override": ("\u202eevil", "\\u202eevil"),
    "C1 CSI": ("\x9b2J", "\\x9b2J"),
}
EVIL = " ".join(raw for raw, _ in HOSTILE.values())
UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# Plain output whatever the machine's settings: no colours (they are escape sequences too),
# and lines wide enough that no escaped sequence is wrapped in the middle.
ENV = {
    "COLUMNS": "2000",
    "LINES": "200",
    "FORCE_COLOR": "",
    "TTY_COMPATIBLE": "",
    "TTY_INTERACTIVE": "",
    "NO_COLOR": "1",
}


def run_orch(*args: str, cwd: Path, code: int = 0) -> subprocess.CompletedProcess[str]:
    r = orch(*args, cwd=cwd, env=ENV)
    both = r.stdout + r.stderr
    assert r.returncode == code, (args, r.returncode, r.stderr[-2000:])
    assert "Traceback" not in both and "MarkupError" not in both, both[-2000:]
    bad = UNSAFE.search(both)
    assert bad is None, (args, repr(bad.group()), both[max(0, bad.start() - 80) : bad.end() + 80])
    return r


def assert_all_shown(text: str, forms: list[str] | None = None) -> None:
    for form in forms or [shown_form for _, shown_form in HOSTILE.values()]:
        assert form in text, (form, text[-3000:])


# -- the function ---------------------------------------------------------------------
def _render(text: Any) -> str:
    console = Console(width=2000, color_system=None, highlight=False, force_terminal=False)
    with console.capture() as cap:
        console.print(text)
    return cap.get()


def test_shown_writes_out_every_control_and_bidi_character() -> None:
    for code in [*range(0x00, 0x20), *range(0x7F, 0xA0)]:
        ch = chr(code)
        if ch == "\n":
            assert shown(ch) == "\\n" and shown(ch, multiline=True) == "\n"
        elif ch == "\t":
            assert shown(ch) == "\\t" and shown(ch, multiline=True) == "\t"
        elif ch == "\r":
            assert shown(ch) == "\\r" == shown(ch, multiline=True)
        else:
            assert shown(ch) == f"\\x{code:02x}" == shown(ch, multiline=True)
    for code in [*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C]:
        assert shown(chr(code)) == f"\\u{code:04x}"
    assert shown("a\r\nb", multiline=True) == "a\nb"
    assert shown("héllo — 世界 [b]x[/b] \\x1b") == "héllo — 世界 [b]x[/b] \\x1b"  # unchanged
    assert shown(None) == "" and shown(42) == "42"


@pytest.mark.parametrize("name", HOSTILE)
def test_safe_text_is_shown_not_obeyed(name: str) -> None:
    raw, expected = HOSTILE[name]
    for rendered in (
        _render(safe_text(raw)),
        _render(f"[red]{safe_markup(raw)}[/]"),
        _render(safe_text(raw, multiline=True)),
    ):
        assert rendered == expected + "\n"


@given(st.text())
def test_shown_output_is_always_safe(text: str) -> None:
    for multiline in (False, True):
        out = shown(text, multiline=multiline)
        assert UNSAFE.search(out) is None
        assert ("\n" in out) <= multiline and ("\t" in out) <= multiline
    if UNSAFE.search(text) is None and "\n" not in text and "\t" not in text:
        assert shown(text) == text  # ordinary text is left alone
    assert UNSAFE.search(_render(safe_text(text, multiline=True))) is None


# -- through the CLI: a scripted run ------------------------------------------------------
FINAL = "first line\n" + EVIL + "\tafter a tab\nlast line"


def _script(project: Path) -> Path:
    return write_script(
        project,
        {
            "conversations": [
                {
                    "depth": 0,
                    "runs": "*",
                    "turns": [
                        {
                            "tool_calls": [
                                {
                                    "tool": "task",
                                    "input": {"description": EVIL, "prompt": "child " + EVIL},
                                }
                            ]
                        },
                        {"text": FINAL},
                    ],
                },
                {"depth": 1, "runs": "*", "turns": [{"text": "child says " + EVIL}]},
            ]
        },
    )


def test_task_tree_and_result_of_a_scripted_run(project: Path) -> None:
    script = _script(project)
    r = run_orch("task", "go", "--model", f"scripted:{script}", cwd=project)
    assert_all_shown(r.stdout)
    lines = r.stdout.splitlines()  # a multi-line answer keeps its lines and its tab
    assert lines[0] == "first line" and lines[-1] == "last line"
    assert re.search(r"\\x9b2J\s+after a tab", r.stdout) and "\\t" not in r.stdout

    j = run_orch("task", "go", "--model", f"scripted:{script}", "--json", cwd=project)
    data = json.loads(j.stdout)
    assert data["summary"] == FINAL  # exact, although stdout held no control character
    run_id = data["run_id"]

    tree = run_orch("tree", run_id, cwd=project)
    assert_all_shown(tree.stdout)  # the child's description
    chain = json.loads(run_orch("tree", run_id, "--json", cwd=project).stdout)
    assert [c["description"] for c in chain if c["depth"] == 1] == [EVIL]
    assert [c["summary"] for c in chain if c["depth"] == 1] == ["child says " + EVIL]

    result = run_orch("result", run_id, cwd=project)
    assert_all_shown(result.stdout)
    assert "first line\n" in result.stdout and "\\t" not in result.stdout


# -- through the CLI: runs put in the store -----------------------------------------------
@pytest.fixture
def hostile_runs(project: Path) -> dict[str, str]:
    """A failed root run with hostile error, output, activity and events; one child per piece."""
    store = SqliteStore.for_project(project)
    t = now()
    root = new_run_id()
    activity = Activity(tool="bash", summary=EVIL, at=t)
    store.create_run(
        RunRecord(
            run_id=root,
            chain_id="c-" + root[2:],
            agent="general",
            description=EVIL,
            status=RunStatus.FAILED,
            summary=FINAL,
            output=FINAL,
            error="boom: " + EVIL,
            usage=Usage(turns=1),
            last_activity=activity,
            recent_activities=[activity],
            created_at=t,
            started_at=t,
            updated_at=t,
            ended_at=t,
        )
    )
    store.save_output(root, FINAL)
    store.add_event(root, "tool_call", {"tool": "bash", "input": {"command": EVIL}})
    store.add_event(root, "run_finished", {"status": "failed", "error": EVIL})
    for raw, _ in HOSTILE.values():
        child = new_run_id()
        act = Activity(tool="bash", summary="bash: " + raw, at=t)
        store.create_run(
            RunRecord(
                run_id=child,
                chain_id="c-" + root[2:],
                parent_run_id=root,
                depth=1,
                agent=raw[:20],  # agent names come from agent files: untrusted too
                description="desc " + raw,
                isolation=raw[:12],
                status=RunStatus.SUCCEEDED,
                output=raw,
                last_activity=act,
                recent_activities=[act],
                created_at=t,
                started_at=t,
                updated_at=t,
                ended_at=t,
            )
        )
        store.add_event(child, "assistant_text", {"turn": 1, "text": "says " + raw, "chars": 9})
    store.close()
    return {"root": root, "chain": "c-" + root[2:]}


def test_ps_tree_result_logs_watch_of_hostile_runs(
    project: Path, hostile_runs: dict[str, str]
) -> None:
    root, chain = hostile_runs["root"], hostile_runs["chain"]
    for args in (("ps",), ("ps", "--all")):
        assert_all_shown(run_orch(*args, cwd=project).stdout)  # activity column, agent column
    for ref in (root, chain):
        assert_all_shown(run_orch("tree", ref, cwd=project).stdout)  # descriptions

    result = run_orch("result", root, cwd=project, code=1)  # failed: its normal exit code
    assert_all_shown(result.stdout)
    assert "error: boom: \\x1b[2J" in result.stdout
    assert "first line\n" in result.stdout and "\\t" not in result.stdout

    logs = run_orch("logs", root, cwd=project)  # a command, an error
    assert_all_shown(logs.stdout)
    assert "bash: \\x1b[2J" in logs.stdout and "failed · \\x1b[2J" in logs.stdout
    tree = run_orch("logs", root, "--tree", cwd=project)  # children: agent names, their text
    assert tree.stdout.count("assistant_text") == len(HOSTILE)
    for raw, shown_form in HOSTILE.values():
        assert f"/{shown(raw[:20])} " in tree.stdout and f"says {shown_form}" in tree.stdout

    watch = run_orch("watch", root, "--interval", "0.05", cwd=project, code=1)
    assert_all_shown(watch.stdout)  # the children's rows of the live view


def test_json_keeps_the_exact_strings(project: Path, hostile_runs: dict[str, str]) -> None:
    root, chain = hostile_runs["root"], hostile_runs["chain"]
    rows = json.loads(run_orch("ps", "--all", "--json", cwd=project).stdout)
    by_id = {r["run_id"]: r for r in rows}
    assert by_id[root]["last_activity"]["summary"] == EVIL
    assert by_id[root]["summary"] == FINAL
    assert {r["agent"] for r in rows if r["depth"] == 1} == {
        raw[:20] for raw, _ in HOSTILE.values()
    }

    runs = json.loads(run_orch("tree", chain, "--json", cwd=project).stdout)
    assert {r["description"] for r in runs if r["depth"] == 1} == {
        "desc " + raw for raw, _ in HOSTILE.values()
    }
    res = json.loads(run_orch("result", root, "--json", cwd=project, code=1).stdout)
    assert res["error"] == "boom: " + EVIL and res["summary"] == FINAL
    events = json.loads(run_orch("logs", root, "--json", cwd=project).stdout)
    assert [e["data"] for e in events] == [
        {"tool": "bash", "input": {"command": EVIL}},
        {"status": "failed", "error": EVIL},
    ]
