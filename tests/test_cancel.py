"""A cancel (Ctrl+C, ``orch cancel``, a parent that ends) may land at any moment: it is
never lost, and it leaves no process behind and nothing waiting for one.

Python 3.11 loses a cancel that lands in the turn the thing awaited ends (``wait_for``; a
shield whose inner task is done by then), and asyncio, cancelled while it starts a
process, kills the leader alone and then waits for the pipes the rest still holds: a
bwrap killed before its sandbox set its parent-death signal left the sandbox running,
and the run waiting for it (found by ``test_warm.py`` under load). Each case is played
here for real, at many moments.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from asyncio.subprocess import PIPE
from collections.abc import Mapping
from pathlib import Path

import pytest

from orchestrator.bwrap.profile import OsSandbox, sandbox_env
from orchestrator.pgroups import kill_tree, reap, spawn
from orchestrator.store import open_store
from orchestrator.workspaces.base import NullSink, run_process
from orchestrator.workspaces.lifetime import Shielded, await_shielded, stopped
from tests.support import host_pids, init_repo, need_bwrap, none_left, wait_for


def _token() -> str:
    return f"{random.randrange(100, 999)}.{random.randrange(10**8)}"  # a unique sleep


def _kill(marker: str) -> None:
    for pid in host_pids(marker):
        os.kill(pid, signal.SIGKILL)


# -- a cancel is never lost ---------------------------------------------------------------


def test_a_cancel_in_the_turn_a_shielded_opening_ends_is_raised() -> None:
    async def main() -> list[str]:
        async def quick() -> int:
            return 1

        task = asyncio.create_task(await_shielded(quick()))
        await asyncio.sleep(0)  # it waits on the shield; quick() runs in the next turn
        task.cancel()  # the same turn as quick()'s end
        with pytest.raises(asyncio.CancelledError):
            await task

        ran: list[str] = []

        class Opened(Shielded):
            async def _open(self) -> None:
                ran.append("open")

            async def _undo(self) -> None:
                ran.append("undo")

            async def _shut(self, exc_type: type[BaseException] | None) -> None:
                ran.append("shut")

        async def body() -> None:
            async with Opened():
                ran.append("body")  # never: the cancel came before the body

        job = asyncio.create_task(body())
        await asyncio.sleep(0)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        return ran

    assert asyncio.run(main()) == ["open", "undo"]  # opened whole, then undone


def test_a_cancel_while_tasks_are_stopped_is_raised() -> None:
    async def main() -> str:
        async def slow_to_stop() -> None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                await asyncio.sleep(0.2)  # its own cleanup
                raise

        inner = asyncio.create_task(slow_to_stop())
        await asyncio.sleep(0)

        async def stopper() -> str:
            await stopped(inner)
            return "went on"  # (what `cancel(); suppress(CancelledError): await` did)

        outer = asyncio.create_task(stopper())
        await asyncio.sleep(0.05)
        outer.cancel()
        try:
            return await outer
        except asyncio.CancelledError:
            return "cancelled"

    assert asyncio.run(main()) == "cancelled"


# -- nothing is left behind ---------------------------------------------------------------


def test_kill_tree_kills_what_left_the_group() -> None:
    token = _token()
    leader = subprocess.Popen(
        ["bash", "-c", f"setsid sleep {token} & sleep {token}"], start_new_session=True
    )
    try:
        wait_for(lambda: len(host_pids(f"sleep {token}")) == 3, 10, "the sleepers")
        os.killpg(leader.pid, signal.SIGKILL)  # the group's kill alone...
        leader.wait(timeout=10)
        assert len(host_pids(f"sleep {token}")) == 1  # ...misses the one in its own session
        _kill(f"sleep {token}")

        leader = subprocess.Popen(
            ["bash", "-c", f"setsid sleep {token} & sleep {token}"], start_new_session=True
        )
        wait_for(lambda: len(host_pids(f"sleep {token}")) == 3, 10, "the sleepers")
        kill_tree(leader.pid)
        leader.wait(timeout=10)
        assert none_left(f"sleep {token}")
    finally:
        _kill(f"sleep {token}")


def test_kill_tree_finds_the_group_after_its_leader_is_gone() -> None:
    """The usual end of a command: it exited, a background job of its group lives on,
    and that job started something in a session of its own (found by a review)."""
    token = _token()
    job = f"sh -c 'setsid sleep {token} & exec sleep {token}'"
    leader = subprocess.Popen(["sh", "-c", f"{job} & exit 0"], start_new_session=True)
    try:
        leader.wait(timeout=10)
        wait_for(lambda: len(host_pids(f"sleep {token}")) == 2, 10, "the job and its child")
        kill_tree(leader.pid)
        assert none_left(f"sleep {token}")
    finally:
        _kill(f"sleep {token}")


def test_kill_tree_stops_what_left_the_group_before_it_can_start_more() -> None:
    token = _token()
    forker = f"i=0; while [ $i -lt 3000 ]; do sleep {token} & i=$((i+1)); done; wait"
    try:
        for _ in range(3):
            leader = subprocess.Popen(
                ["sh", "-c", f"setsid sh -c '{forker}' & sleep {token}"], start_new_session=True
            )
            wait_for(lambda: len(host_pids(f"sleep {token}")) > 20, 10, "the forker at work")
            kill_tree(leader.pid)
            leader.wait(timeout=10)
            assert none_left(f"sleep {token}"), "a child started during the kill survived it"
    finally:
        _kill(f"sleep {token}")


def test_a_reap_closes_the_pipes_a_process_outside_the_group_holds() -> None:
    """asyncio's ``Process.wait`` returns at once once the exit was seen: the pipes of a
    process that left the group stay open, and a read of them waits for it."""
    token = _token()

    async def main() -> bytes:
        proc = await spawn("sh", "-c", f"setsid sleep {token} & exit 0", stdout=PIPE)
        while proc.returncode is None:  # noqa: ASYNC110 - the exit, as asyncio saw it
            await asyncio.sleep(0.01)
        await reap(proc, 0.2)
        assert proc.stdout is not None
        async with asyncio.timeout(5):
            return await proc.stdout.read()

    try:
        assert asyncio.run(main()) == b""
    finally:
        _kill(f"sleep {token}")


def test_a_cancel_while_a_command_ends_cuts_none_of_its_end_short() -> None:
    token = _token()
    released: list[str] = []

    class Sink(NullSink):
        def release_resource(self, run_id: str, kind: str, ref: str) -> None:
            released.append(ref)

    async def main() -> set[asyncio.Task[object]]:
        job = asyncio.create_task(
            run_process(
                ["sh", "-c", f"sh -c 'setsid sleep {token} & exec sleep {token}' & exit 0"],
                cwd=None, env=dict(os.environ), timeout_s=30, sink=Sink(), run_id="r",
            )
        )  # fmt: skip
        wait = asyncio.get_running_loop().run_in_executor
        await wait(None, wait_for, lambda: len(host_pids(f"sleep {token}")) == 2, 10)
        await asyncio.sleep(0.2)  # it exited; its end waits for the pipe its job holds
        job.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await job
        return asyncio.all_tasks() - {asyncio.current_task()}

    try:
        assert asyncio.run(main()) == set()  # its reader and exit watch ended with it
        assert len(released) == 1  # and its group's registration went
        assert none_left(f"sleep {token}")
    finally:
        _kill(f"sleep {token}")


# A process that starts another in a session of its own, not yet tied to its parent's
# life for a while (its "setup"): bwrap and its sandbox, slowed down.
SLOW_SANDBOX = """
import os, sys, time
pid = os.fork()
if pid == 0:
    os.setsid()
    time.sleep(0.3)
    os.execvp("sleep", ["sleep", sys.argv[1]])
os.waitpid(pid, 0)
"""


async def _cancelled_after(
    delay: float, argv: list[str], cwd: Path, env: Mapping[str, str]
) -> float:
    """Run ``argv`` as a command, cancel it ``delay`` seconds in; how long the cancel took
    (20 s and more: it waits for something, and the test fails there)."""
    task = asyncio.create_task(
        run_process(argv, cwd=cwd, env=env, timeout_s=600, sink=NullSink(), run_id="r")
    )
    await asyncio.sleep(delay)
    began = time.monotonic()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        async with asyncio.timeout(20):
            await task
    return time.monotonic() - began


def test_a_command_cancelled_while_its_sandbox_sets_up_leaves_nothing(tmp_path: Path) -> None:
    token = _token()
    argv, env = [sys.executable, "-c", SLOW_SANDBOX, token], dict(os.environ)

    try:
        for delay in (0.0, 0.001, 0.005, 0.02, 0.05, 0.1, 0.2, 0.4):
            took = asyncio.run(_cancelled_after(delay, argv, tmp_path, env))
            assert took < 10, f"a cancel {delay}s in took {took:.1f} s"
            assert none_left(f"sleep {token}"), f"a cancel {delay}s in left the command"
    finally:
        _kill(f"sleep {token}")


def test_a_sandbox_cancelled_at_any_moment_of_its_start_leaves_nothing(tmp_path: Path) -> None:
    """bwrap's sandbox sets its parent-death signal only once it runs: a cancel in the
    first milliseconds used to kill bwrap alone, and the run waited on the sandbox's
    pipes for as long as its command ran."""
    need_bwrap()
    token = _token()
    box = OsSandbox(workspace=tmp_path, env=sandbox_env(os.environ, {}))
    argv = box.wrap(["bash", "-c", f"sleep {token}"], tmp_path)

    try:
        for step in range(40):  # 0 to 78 ms after the start: before, during, after the setup
            took = asyncio.run(_cancelled_after(step * 0.002, argv, tmp_path, box.env))
            assert took < 10, f"a cancel {step * 2} ms in took {took:.1f} s"
            assert none_left(token), f"a cancel {step * 2} ms in left the sandbox running"
    finally:
        _kill(token)


def test_ctrl_c_at_any_moment_ends_the_run_and_its_command(tmp_path: Path) -> None:
    need_bwrap()
    repo = init_repo(tmp_path / "proj", {"a.txt": "alpha\n"})
    token = _token()
    script = tmp_path / "s.json"
    turns = [{"tool_calls": [{"tool": "bash", "input": {"command": f"cat a.txt; sleep {token}"}}]},
             {"text": "never"}]  # fmt: skip
    script.write_text(json.dumps({"conversations": [{"turns": turns}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    argv = [sys.executable, "-m", "orchestrator", "task", "go", "--model", f"scripted:{script}"]
    store = open_store(repo)
    try:
        for delay in (0.0, 0.3, 0.6, 0.9, 1.2, "command"):
            proc = subprocess.Popen(
                argv, cwd=repo, env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            if delay == "command":
                wait_for(lambda: host_pids(f"sleep {token}"), 30, "the agent's command")
            else:
                time.sleep(float(delay))
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)  # it ends: nothing waits for the sandbox
            # 130 and one line; before Python's own handler is set, killed by the signal
            assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in err, err
            assert none_left(token), f"Ctrl+C at {delay} left the agent's command running"
        runs = store.list_runs()
        assert runs and all(r.status.ended for r in runs)  # none left `running` behind
    finally:
        _kill(token)
