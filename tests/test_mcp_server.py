"""``orch mcp`` through the SDK's own client: the real server process over stdio, a real git
repository, scripted models. Every tool; bad arguments; a client that goes away mid-task."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.types import CallToolResult, TextContent

from orchestrator.run import RunStatus
from orchestrator.store import SqliteStore
from tests.support import git, init_repo, need_bwrap, wait_for, write_script

pytestmark = [pytest.mark.bwrap, pytest.mark.slow]

TOOLS = {
    "task",
    "task_output",
    "task_stop",
    "list_runs",
    "run_result",
    "run_logs",
    "branch_diff",
    "merge_branch",
}


def writer(text: str = "wrote hello.txt", *, latency: float = 0.0, runs: Any = 1) -> dict[str, Any]:
    return {
        "agent": "general",
        "depth": 0,
        "runs": runs,
        "latency_s": latency,
        "turns": [
            {
                "tool_calls": [
                    {"tool": "write_file", "input": {"path": "hello.txt", "content": "hi\n"}}
                ]
            },
            {"text": text},
        ],
    }


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}


@asynccontextmanager
async def server(repo: Path, script: Path, *flags: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(
        command=sys.executable,
        args=[
            "-m",
            "orchestrator",
            "mcp",
            "-C",
            str(repo),
            "--model",
            f"scripted:{script}",
            *flags,
        ],
        env=env(),
        cwd=str(repo),
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def raw_server(repo: Path, script: Path) -> asyncio.subprocess.Process:
    """The server with pipes of our own, for what the SDK's client cannot send."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator", "mcp", "-C", str(repo),
        "--model", f"scripted:{script}",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env(),
    )  # fmt: skip


def text(result: CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, TextContent))


def ended(result: CallToolResult) -> tuple[str, str]:
    """The run id and status of a task's result: ``[task r-… succeeded · …]``."""
    head = text(result).split("\n", 1)[0]
    assert head.startswith("[task r-"), head
    run_id, status = head[len("[task ") :].split(" ")[:2]
    return run_id, status


def store(repo: Path) -> SqliteStore:
    return SqliteStore(repo / ".orch" / "orch.db")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    need_bwrap()
    return init_repo(tmp_path / "repo", {"README.md": "# demo\n"})


def test_a_worktree_task_returns_its_branch_and_every_tool_answers(repo: Path) -> None:
    script = write_script(repo, {"conversations": [writer()]})

    async def go() -> None:
        async with server(repo, script) as s:
            listed = await s.list_tools()
            assert {t.name for t in listed.tools} == TOOLS
            task = next(t for t in listed.tools if t.name == "task")
            assert "- explorer:" in (task.description or "")  # the agents it may start
            schema = task.input_schema
            assert {"prompt", "isolation", "run_in_background", "resume"} <= set(
                schema["properties"]
            )

            got = await s.call_tool(
                "task",
                {"description": "greet", "prompt": "write hello.txt", "isolation": "worktree"},
            )
            assert not got.is_error, text(got)
            assert "wrote hello.txt" in text(got) and "[branch orch/" in text(got)
            assert got.structured_content is None  # clients show it instead of the text
            run_id, status = ended(got)
            assert status == "succeeded"
            branch = text(got).split("[branch ")[1].split(" ")[0]
            assert git(repo, "show", f"{branch}:hello.txt") == "hi"
            assert not (repo / "hello.txt").exists()  # the user's tree is untouched

            rows = text(await s.call_tool("list_runs", {})).splitlines()
            assert len(rows) == 1 and rows[0].startswith(f"{run_id} general d0 worktree succeeded")
            res = text(await s.call_tool("run_result", {"task_id": run_id[:6]}))
            assert "wrote hello.txt" in res and f"[branch {branch} · commit" in res
            logs = text(await s.call_tool("run_logs", {"task_id": run_id}))
            assert "write_file: hello.txt" in logs and "run_finished" in logs
            diff = await s.call_tool("branch_diff", {"target": run_id})
            assert "+hi" in text(diff) and not diff.is_error
            merged = await s.call_tool("merge_branch", {"target": branch})
            assert not merged.is_error and f"merged {branch}" in text(merged)
            assert (repo / "hello.txt").read_text() == "hi\n"

    asyncio.run(go())


def test_bad_arguments_and_refusals_are_one_line_errors(repo: Path) -> None:
    script = write_script(repo, {"conversations": []})

    async def go() -> None:
        async with server(repo, script) as s:
            cases: list[tuple[str, dict[str, Any], str]] = [
                ("task", {}, "bad arguments for task: prompt: Field required"),
                ("task", {"prompt": "x", "bogus": 1}, "bogus: Extra inputs are not permitted"),
                ("task", {"prompt": "x", "isolation": "vm"}, "vm"),
                ("task", {"prompt": "x", "model": "scripted:/etc/passwd"}, "plays a whole run"),
                ("nosuch", {}, "no tool 'nosuch'"),
                ("run_result", {"task_id": "r-nope"}, "no run 'r-nope'"),
                ("merge_branch", {"target": "orch/x/y"}, "no orch branch matches"),
                ("list_runs", {"limit": 0}, "limit: Input should be greater than or equal to 1"),
            ]
            for name, args, says in cases:
                got = await s.call_tool(name, args)
                assert got.is_error, (name, args)
                line = text(got)
                assert says in line and "\n" not in line and "Traceback" not in line, line

    asyncio.run(go())


def test_merge_refuses_a_dirty_tree_and_control_files(repo: Path) -> None:
    script = write_script(repo, {"conversations": [writer()]})
    # a branch an agent could have left that changes a control file (planted with git)
    git(repo, "checkout", "-q", "-b", "orch/general/0badc0de")
    (repo / "orch.toml").write_text("store = 'postgresql://evil'\n")
    git(repo, "add", "orch.toml")
    git(repo, "commit", "-q", "-m", "settings")
    git(repo, "checkout", "-q", "main")

    async def go() -> None:
        async with server(repo, script) as s:
            got = await s.call_tool("task", {"prompt": "write hello.txt", "isolation": "worktree"})
            assert not got.is_error, text(got)
            run_id = ended(got)[0]
            (repo / "README.md").write_text("# edited, not committed\n")
            dirty = await s.call_tool("merge_branch", {"target": run_id})
            assert dirty.is_error and "uncommitted" in text(dirty), text(dirty)
            git(repo, "checkout", "README.md")
            ctl = await s.call_tool("merge_branch", {"target": "orch/general/0badc0de"})
            assert ctl.is_error and "control files (orch.toml)" in text(ctl), text(ctl)
            assert not (repo / "orch.toml").exists()
            ok = await s.call_tool("merge_branch", {"target": run_id, "squash": True})
            assert not ok.is_error and "squash-merged" in text(ok), text(ok)

    asyncio.run(go())


def test_the_servers_text_carries_no_control_characters(repo: Path) -> None:
    script = write_script(repo, {"conversations": [writer("red \x1b[31mALERT\x1b]52;c;eA==\x07")]})

    async def go() -> None:
        async with server(repo, script) as s:
            got = await s.call_tool("task", {"prompt": "write hello.txt"})
            said = text(got)
            assert "ALERT" in said and "\\x1b[31m" in said
            assert not any(ord(c) < 32 and c not in "\n\t" for c in said)

    asyncio.run(go())


def test_background_tasks_are_collected_and_stopped(repo: Path) -> None:
    slow = writer("slow done", latency=30) | {"prompt": "slow"}
    script = write_script(repo, {"conversations": [writer() | {"prompt": "hello"}, slow]})

    async def go() -> None:
        async with server(repo, script) as s:
            first = await s.call_tool(
                "task", {"prompt": "write hello.txt", "run_in_background": True}
            )
            task_id = json.loads(text(first))["task_id"]
            got = await s.call_tool("task_output", {"task_id": task_id, "timeout_s": 60})
            assert "wrote hello.txt" in text(got), text(got)
            second = await s.call_tool("task", {"prompt": "slow", "run_in_background": True})
            slow_id = json.loads(text(second))["task_id"]
            now = await s.call_tool("task_output", {"task_id": slow_id, "block": False})
            assert json.loads(text(now))["status"] in ("queued", "running")
            stopped = await s.call_tool("task_stop", {"task_id": slow_id})
            assert not stopped.is_error, text(stopped)
            assert json.loads(text(stopped))[0] == {"task_id": slow_id, "status": "cancelled"}

    asyncio.run(go())


def test_a_client_that_goes_away_cancels_its_foreground_runs_not_its_background_ones(
    repo: Path,
) -> None:
    fore = writer("never", latency=60) | {"prompt": "foreground"}
    back = writer("background done", latency=3) | {"prompt": "background"}
    script = write_script(repo, {"conversations": [fore, back]})
    notes: list[str] = []

    async def go() -> None:
        async with server(repo, script) as s:
            db = store(repo)
            await s.call_tool("task", {"prompt": "background", "run_in_background": True})

            async def on_progress(
                progress: float, total: float | None, message: str | None
            ) -> None:
                notes.append(message or "")

            call = asyncio.ensure_future(
                s.call_tool(
                    "task",
                    {"prompt": "foreground", "isolation": "worktree"},
                    progress_callback=on_progress,
                )
            )

            def started() -> bool:
                return bool(notes) and any(r.prompt == "foreground" for r in db.list_runs())

            await asyncio.to_thread(wait_for, started, 30)
            call.cancel()  # then the client closes the server's stdin and goes

    asyncio.run(go())
    db = store(repo)
    fore_run = wait_for(lambda: [r for r in db.list_runs() if r.prompt == "foreground"])[0]
    ended = wait_for(lambda: (r := db.require_run(fore_run.run_id)).status.ended and r, 30)
    assert ended.status == RunStatus.CANCELLED
    assert "turns" in notes[0]  # what the run was doing, every few seconds
    back_run = next(r for r in db.list_runs() if r.prompt == "background")
    done = wait_for(lambda: (r := db.require_run(back_run.run_id)).status.ended and r, 60)
    assert done.status == RunStatus.SUCCEEDED and "background done" in (done.output or "")


def test_sigint_from_the_client_stops_the_server_and_its_runs(repo: Path) -> None:
    script = write_script(repo, {"conversations": [writer("never", latency=60)]})

    async def go() -> int:
        proc = await raw_server(repo, script)
        assert proc.stdin and proc.stdout
        init = (
            '{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":'
            '"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}\n'
            '{"jsonrpc":"2.0","method":"notifications/initialized"}\n'
            '{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"task",'
            '"arguments":{"prompt":"go","isolation":"worktree"}}}\n'
        )
        proc.stdin.write(init.encode())
        await proc.stdin.drain()
        await proc.stdout.readline()
        db = store(repo)
        await asyncio.to_thread(wait_for, lambda: db.list_runs(), 30)
        proc.send_signal(signal.SIGINT)
        return await asyncio.wait_for(proc.wait(), 60)

    code = asyncio.run(go())
    assert code == 0
    db = store(repo)
    run = db.list_runs()[0]
    assert db.require_run(run.run_id).status == RunStatus.CANCELLED


def test_an_untrusted_repository_gets_no_hook_and_no_unsandboxed_run_through_mcp(
    tmp_path: Path,
) -> None:
    need_bwrap()
    marker = tmp_path / "hook-ran"
    hook = f'[[hooks.PreToolUse]]\nmatcher = "^bash$"\ncommand = "touch {marker}"\n'
    repo = init_repo(
        tmp_path / "clone", {"orch.toml": hook + '[sandbox]\nos = "off"\n', "README.md": "hi\n"}
    )
    bash = {
        "agent": "general",
        "depth": 0,
        "turns": [
            {"tool_calls": [{"tool": "bash", "input": {"command": "echo hello"}}]},
            {"expect_result": "hello", "text": "done"},
        ],
    }
    script = write_script(repo, {"conversations": [bash]})

    async def go() -> str:
        async with server(repo, script) as s:
            got = await s.call_tool("task", {"prompt": "say hello"})
            assert ended(got)[1] == "succeeded", text(got)
            return ended(got)[0]

    run_id = asyncio.run(go())
    assert not marker.exists()  # the repository's hook did not run
    assert store(repo).require_run(run_id).workspace["os_sandbox"] == "bwrap"


def hwm_mb(pid: int) -> float:
    """A process's peak resident memory so far, in MiB."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if "VmHWM" in x)
    return int(line.split()[1]) / 1024


def test_an_oversized_client_message_is_dropped_unbuffered_and_the_server_goes_on(
    repo: Path,
) -> None:
    script = write_script(repo, {"conversations": []})

    async def go() -> tuple[bytes, float, float]:
        proc = await raw_server(repo, script)
        assert proc.stdin and proc.stdout
        proc.stdin.write(b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n')
        await proc.stdin.drain()
        await asyncio.wait_for(proc.stdout.readline(), 60)
        before = hwm_mb(proc.pid)
        chunk = b"a" * (1 << 20)
        proc.stdin.write(b'{"jsonrpc":"2.0","id":9,"method":"ping","params":{"x":"')
        for _ in range(96):  # 96 MiB without a newline, then the rest of it
            proc.stdin.write(chunk)
            await proc.stdin.drain()
        proc.stdin.write(b'"}}\n{"jsonrpc":"2.0","id":2,"method":"ping"}\n')
        await proc.stdin.drain()
        answer = await asyncio.wait_for(proc.stdout.readline(), 60)
        after = hwm_mb(proc.pid)
        proc.stdin.close()
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        return answer, before, after

    answer, before, after = asyncio.run(go())
    assert json.loads(answer)["id"] == 2  # the ping after it, answered; none for the huge one
    assert after - before < 40, (before, after)  # never held whole (96 MiB)


def test_a_task_resumes_an_ended_root_run_on_its_branch(repo: Path) -> None:
    edit = {"path": "hello.txt", "old_text": "hi", "new_text": "hi again"}
    again = {
        "agent": "general",
        "depth": 0,
        "turns": [
            {"tool_calls": [{"tool": "edit_file", "input": edit}]},
            {"text": "edited hello.txt"},
        ],
    }
    script = write_script(repo, {"conversations": [writer(), again]})

    async def go() -> tuple[str, str, str]:
        async with server(repo, script) as s:
            first = await s.call_tool(
                "task", {"prompt": "write hello.txt", "isolation": "worktree"}
            )
            old = ended(first)[0]
            got = await s.call_tool("task", {"prompt": "now edit it", "resume": old[:8]})
            assert not got.is_error, text(got)
            new, status = ended(got)
            assert status == "succeeded" and f"resumed {old}" in text(got)
            child = await s.call_tool("task", {"prompt": "x", "resume": "r-nope"})
            assert child.is_error and "no run 'r-nope'" in text(child)
            return old, new, text(got).split("[branch ")[1].split(" ")[0]

    old, new, branch = asyncio.run(go())
    assert new != old
    assert git(repo, "show", f"{branch}:hello.txt") == "hi again"
    assert store(repo).require_run(new).resumed_from == old


def test_merges_at_once_lose_nothing_of_the_users_branch(repo: Path) -> None:
    def writes(k: int) -> dict[str, Any]:
        call = {"tool": "write_file", "input": {"path": f"f{k}.txt", "content": f"{k}\n"}}
        return {
            "agent": "general",
            "depth": 0,
            "prompt": f"file {k}$",
            "turns": [{"tool_calls": [call]}, {"text": f"wrote f{k}.txt"}],
        }

    n = 6
    script = write_script(repo, {"conversations": [writes(k) for k in range(n)]})

    async def go() -> list[CallToolResult]:
        async with server(repo, script) as s:
            runs = [
                ended(await s.call_tool("task", {"prompt": f"file {k}", "isolation": "worktree"}))[
                    0
                ]
                for k in range(n)
            ]
            merges = [
                s.call_tool("merge_branch", {"target": r, "squash": k % 2 == 1})
                for k, r in enumerate(runs)
            ]
            return list(await asyncio.gather(*merges))

    results = asyncio.run(go())
    assert [r.is_error for r in results] == [False] * n, [text(r) for r in results]
    tree = git(repo, "ls-tree", "--name-only", "HEAD").split()
    assert {f"f{k}.txt" for k in range(n)} <= set(tree)  # every merge's file is in HEAD
    assert git(repo, "status", "--porcelain") == ""  # nothing left behind in the checkout


def test_an_untrusted_repository_cannot_make_orch_read_a_file_as_a_model_script(
    tmp_path: Path,
) -> None:
    need_bwrap()
    secret = tmp_path / "secret.txt"
    secret.write_text("line1\nline2: x: y\n")  # YAML that fails on a line it would quote
    toml = f'model = "scripted:{secret}"\n[model_aliases]\nfast = "scripted:{secret}"\n'
    repo = init_repo(tmp_path / "clone", {"orch.toml": toml, "README.md": "hi\n"})
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "orchestrator", "mcp", "-C", str(repo)], env=env()
    )

    async def go() -> list[str]:
        async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
            await s.initialize()
            said = []
            for args in ({"prompt": "x"}, {"prompt": "x", "model": "fast"}):
                got = await s.call_tool("task", args)
                assert got.is_error
                said.append(text(got))
            return said

    for said in asyncio.run(go()):
        assert "line2" not in said and "secret.txt" not in said, said


def test_a_clients_runs_get_a_branch_unless_the_user_allows_the_checkout(repo: Path) -> None:
    (repo / ".orch" / "agents").mkdir(parents=True)
    (repo / ".orch" / "agents" / "boxed.md").write_text(
        "---\nname: boxed\ndescription: works in a container\nisolation: container\n---\nhi\n"
    )
    git(repo, "add", ".orch/agents/boxed.md")
    git(repo, "commit", "-q", "-m", "agent")
    slow = writer("slow", latency=30, runs="*") | {"prompt": "slow"}
    script = write_script(repo, {"conversations": [slow, writer(runs="*")]})

    async def go() -> None:
        async with server(repo, script, "--max-live", "1") as s:
            got = await s.call_tool("task", {"prompt": "write hello.txt"})
            assert "[branch orch/" in text(got)  # no isolation asked: a worktree
            assert not (repo / "hello.txt").exists()
            shared = await s.call_tool("task", {"prompt": "x", "isolation": "shared"})
            assert shared.is_error and "--allow-shared" in text(shared)
            weaker = await s.call_tool(
                "task", {"prompt": "x", "subagent_type": "boxed", "isolation": "worktree"}
            )
            assert weaker.is_error and "isolation container" in text(weaker), text(weaker)
            bg = await s.call_tool("task", {"prompt": "slow", "run_in_background": True})
            assert not bg.is_error, text(bg)
            more = await s.call_tool("task", {"prompt": "slow", "run_in_background": True})
            assert more.is_error and "at most 1" in text(more), text(more)
            await s.call_tool("task_stop", {"task_id": json.loads(text(bg))["task_id"]})
        async with server(repo, script, "--allow-shared") as s:
            got = await s.call_tool("task", {"prompt": "write hello.txt", "isolation": "shared"})
            assert not got.is_error and (repo / "hello.txt").read_text() == "hi\n"

    asyncio.run(go())


def test_invisible_characters_and_lone_surrogates_reach_no_client(repo: Path) -> None:
    hidden = "see\u200b\U000e0041\U000e0042\ufe0f\u202e end"
    script = write_script(repo, {"conversations": [writer(hidden, runs="*")]})

    async def go() -> None:
        async with server(repo, script) as s:
            got = await s.call_tool("task", {"prompt": "write hello.txt", "description": hidden})
            said = text(got)
            assert "\\u200b\\ue0041\\ue0042\\ufe0f\\u202e" in said.replace("\\U000", "\\u"), said
            assert not any(ord(c) > 0xFFFF or c in "\u200b\ufe0f\u202e" for c in said)
            rows = text(await s.call_tool("list_runs", {}))
            assert "\u200b" not in rows and "\\u200b" in rows

    asyncio.run(go())

    async def raw() -> dict[str, Any]:  # a lone surrogate (the SDK's client cannot send one)
        proc = await raw_server(repo, script)
        assert proc.stdin and proc.stdout
        proc.stdin.write(
            b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":'
            b'"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"1"}}}\n'
            b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n'
            b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"task",'
            b'"arguments":{"prompt":"hello \\ud800 there"}}}\n'
        )
        await proc.stdin.drain()
        while (answer := json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))).get(
            "id"
        ) != 2:
            pass
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 60)
        got: dict[str, Any] = answer
        return got

    answer = asyncio.run(raw())
    assert "[task r-" in answer["result"]["content"][0]["text"], answer  # answered, not lost


def test_without_a_client_on_stdin_the_server_says_so_and_exits(repo: Path) -> None:
    def run(stdin: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator", "mcp", "-C", str(repo)],
            stdin=stdin, capture_output=True, text=True, env=env(), timeout=60,
        )  # fmt: skip

    with open(repo / "README.md") as a_file:
        runs = [run(subprocess.DEVNULL), run(a_file)]
    for got in runs:
        assert got.returncode == 2 and got.stdout == ""
        [line] = got.stderr.splitlines()
        assert line.startswith("orch: orch mcp talks MCP over a pipe"), line
