"""Sandboxes made ahead (orchestrator/workspaces/spare.py): a command that runs in one is
confined, killed and answered exactly as one run in a sandbox made on the spot, and no
spare outlives its workspace or serves two commands."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import SandboxSettings
from orchestrator.run import RunStatus, new_run_id
from orchestrator.workspaces.base import WorkspaceSpec
from orchestrator.workspaces.shared import SharedWorkspace
from orchestrator.workspaces.spare import SPARE_AFTER_S, SPARE_FIRST_S, Shell
from tests.support import harness, need_bwrap, tool_results

pytestmark = pytest.mark.bwrap


@pytest.fixture(autouse=True)
def bwrap_works() -> None:
    need_bwrap()


class Sink:
    def __init__(self) -> None:
        self.held: set[str] = set()

    def register_resource(self, run_id: str, kind: str, ref: str) -> None:
        self.held.add(ref)

    def release_resource(self, run_id: str, kind: str, ref: str) -> None:
        self.held.discard(ref)


def _env() -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}


def _spec(root: Path, sink: Sink, **sandbox: Any) -> WorkspaceSpec:
    return WorkspaceSpec(
        new_run_id(), "c-spare", "general", "spare", root, sink=sink,
        sandbox=SandboxSettings(**sandbox),
    )  # fmt: skip


def _play(body: Callable[[SharedWorkspace, Sink], Coroutine[Any, Any, None]], root: Path) -> Sink:
    sink = Sink()

    async def main() -> None:
        async with SharedWorkspace(_spec(root, sink)) as ws:
            await body(ws, sink)

    asyncio.run(main())
    return sink


def _spare_now(shell: Shell, env: dict[str, str]) -> None:
    """Have a spare made now (``expect`` waits after its first time)."""
    if shell._later is not None:
        shell._later.cancel()
        shell._later = None
    shell._make_spare(dict(env))


async def _ready(shell: Shell) -> int:
    """The pid of the spare once made (asked for: it is made a moment later)."""
    async with asyncio.timeout(5):
        while shell._spare is None:  # noqa: ASYNC110 - the shell's timer makes it
            assert shell._later is not None, "no spare asked for"
            await asyncio.sleep(0.01)
    started = await asyncio.shield(shell._spare)
    return started.proc.pid


ODD = [
    "echo 'single' \"double\" \\back\\slash $((6*7))",
    "printf '%s\\n' 'line one' 'line two'; echo tail",
    "echo ünïcödé ✓ && echo $'tab\\there'",
    "   echo leading-spaces  ",
    "x=1\ny=2\necho $((x+y))",
    "cat; echo after-stdin",  # stdin is /dev/null: cat ends at once
    "exit 7",
    "echo to-stderr >&2",
]


def test_a_spare_runs_the_command_as_a_fresh_sandbox_does(tmp_path: Path) -> None:
    async def body(ws: SharedWorkspace, sink: Sink) -> None:
        shell, env = ws._shell, _env()
        for command in ODD:
            fresh = await ws.exec(command, timeout_s=10, env=env)  # no spare: made on the spot
            _spare_now(shell, env)
            await _ready(shell)
            before = shell.spares_used
            spared = await ws.exec(command, timeout_s=10, env=env)
            assert shell.spares_used == before + 1, command
            assert (spared.exit_code, spared.output) == (fresh.exit_code, fresh.output), command

    _play(body, tmp_path)


def test_a_spare_is_confined_like_any_command(tmp_path: Path) -> None:
    secret = Path(os.environ.get("HOME", "/root")) / ".ssh"
    probe = (
        "echo pid=$$; cat /proc/1/comm; "
        "env | sort; touch /etc/orch-spare-probe 2>/dev/null && echo WROTE-ETC; "
        f"ls {secret} 2>&1 | head -1; "
        "(exec 3<>/dev/tcp/127.0.0.1/22) 2>/dev/null && echo NET || echo no-net; "
        "touch made-here && echo wrote-workspace"
    )

    async def body(ws: SharedWorkspace, sink: Sink) -> None:
        env = {**_env(), "ANTHROPIC_API_KEY": "sk-ant-NOT-FOR-THE-SANDBOX"}
        fresh = await ws.exec(probe, timeout_s=10, env=env)
        (tmp_path / "made-here").unlink()
        ws._shell.expect(env)
        await _ready(ws._shell)
        spared = await ws.exec(probe, timeout_s=10, env=env)
        assert ws._shell.spares_used == 1
        assert spared.output == fresh.output
        assert "sk-ant-NOT" not in spared.output and "WROTE-ETC" not in spared.output
        assert "no-net" in spared.output and "wrote-workspace" in spared.output
        assert "pid=2" in spared.output  # its own PID namespace

    _play(body, tmp_path)


def test_timeout_kills_the_whole_group_of_a_spare(tmp_path: Path) -> None:
    async def body(ws: SharedWorkspace, sink: Sink) -> None:
        env = _env()
        ws._shell.expect(env)
        await _ready(ws._shell)
        result = await ws.exec(
            "(sleep 3; echo LEFTOVER > left.txt) & echo started; sleep 30", timeout_s=1, env=env
        )
        assert result.timed_out and result.exit_code is None
        assert "started" in result.output
        await asyncio.sleep(3.5)
        assert not (tmp_path / "left.txt").exists()

    _play(body, tmp_path)


def test_a_command_with_a_nul_never_reaches_a_spare(tmp_path: Path) -> None:
    async def body(ws: SharedWorkspace, sink: Sink) -> None:
        env = _env()
        ws._shell.expect(env)
        await _ready(ws._shell)
        with pytest.raises(ValueError, match="null"):  # as a fresh sandbox refuses it
            await ws.exec("touch cut\x00; touch whole", timeout_s=5, env=env)
        assert ws._shell.spares_used == 0
        assert not (tmp_path / "cut").exists()

    _play(body, tmp_path)


def test_a_spare_for_another_environment_or_a_dead_one_is_not_used(tmp_path: Path) -> None:
    async def body(ws: SharedWorkspace, sink: Sink) -> None:
        shell, env = ws._shell, _env()
        shell.expect(env)
        first = await _ready(shell)
        other = {**env, "ORCH_DEPTH": "2"}
        result = await ws.exec("echo $ORCH_DEPTH", timeout_s=10, env=other)
        assert shell.spares_used == 0 and result.output.strip() == "2"
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)  # the unfit spare was killed
        _spare_now(shell, env)
        dead = await _ready(shell)
        os.killpg(dead, signal.SIGKILL)
        await asyncio.sleep(0.2)
        result = await ws.exec("echo once >> once.txt; echo ran", timeout_s=10, env=env)
        assert shell.spares_used == 0 and result.output.strip() == "ran"
        assert (tmp_path / "once.txt").read_text() == "once\n"

    _play(body, tmp_path)


def test_no_spare_outlives_its_workspace(tmp_path: Path) -> None:
    pids: list[int] = []

    async def body(ws: SharedWorkspace, sink: Sink) -> None:
        env = _env()
        ws._shell.expect(env)  # the first request: a spare soon after
        await asyncio.sleep(SPARE_FIRST_S + 0.2)
        await _ready(ws._shell)
        await ws.exec("true", timeout_s=10, env=env)
        assert ws._shell.spares_used == 1 and ws._shell._spare is None
        ws._shell.expect(env)  # a later request: one a moment later
        assert ws._shell._spare is None
        await asyncio.sleep(SPARE_AFTER_S + 0.3)
        pids.append(await _ready(ws._shell))
        assert sink.held  # registered: a crash leaves it to reconcile

    sink = _play(body, tmp_path)
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)
    assert sink.held == set()


def test_with_the_os_sandbox_off_no_spare_is_made(tmp_path: Path) -> None:
    async def main() -> None:
        async with SharedWorkspace(_spec(tmp_path, Sink(), os="off")) as ws:
            ws._shell.expect(_env())
            assert ws._shell._spare is None
            result = await ws.exec("echo plain", timeout_s=5, env=_env())
            assert result.output == "plain\n"

    asyncio.run(main())


def test_a_runs_first_command_runs_in_the_sandbox_made_at_its_start(tmp_path: Path) -> None:
    """Through the engine: the sandbox's init names the loader (it was made before the
    command existed), and the next command runs as well (in a spare or a fresh one)."""
    probe = "tr '\\0' ' ' </proc/1/cmdline"
    script = {
        "conversations": [
            {
                "turns": [
                    {  # the model thinks: meanwhile the sandbox is made
                        "latency_s": 0.5,
                        "tool_calls": [{"tool": "bash", "input": {"command": probe}}],
                    },
                    {"tool_calls": [{"tool": "bash", "input": {"command": probe}}]},
                    {"text": "done"},
                ]
            }
        ]
    }
    h = harness(tmp_path, script)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    first, second = (tool_results(r)[0]["content"] for r in h.requests_of(root.run_id)[1:3])
    assert 'read -r -d "" c' in first and probe not in first
    assert "[exit code 0]" in second


def test_a_spare_killed_as_soon_as_it_is_made_never_hangs_the_close(tmp_path: Path) -> None:
    """A run that ends at once kills its spare while bubblewrap may still be setting up: the
    close must not wait on a sandbox that missed the group's kill (its shell reads the
    closed stdin's end and goes)."""

    async def main() -> None:
        for _ in range(20):
            sink = Sink()
            async with asyncio.timeout(10):
                async with SharedWorkspace(_spec(tmp_path, sink)) as ws:
                    _spare_now(ws._shell, _env())
                    await asyncio.sleep(0)
            assert sink.held == set()

    asyncio.run(main())
    assert _loaders_in(tmp_path) == []


def _loaders_in(where: Path) -> list[int]:
    """Pids of spare shells (or their sandboxes) still waiting in ``where``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b'read -r -d "" c' in argv and str(where).encode() in argv:
            found.append(int(entry.name))
    return found
