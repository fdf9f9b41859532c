"""A cancel always lands (issue 38, class 13): a background run cancelled at any moment of
its start (queued, handed to a cold or a warm worker host, opening its workspace) ends
``cancelled`` within a few seconds, by ``orch cancel`` and by MCP ``task_stop``, and
nothing of it keeps running.

The break: with a cold host, a cancel that came before the host adopted the run was seen
by the host's supervisor before the run's task had taken its first step; the task ended
without ever running, the record stayed ``queued`` under a living host, ``orch cancel``
waited 20 s and said the owner "did not stop them", and the run ended ``interrupted``
once the idle host left, a minute later.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.run import RunRecord, RunStatus
from orchestrator.store import open_store
from tests.support import alive, gone, host_pids, none_left, orch, wait_for, write_script

DELAYS = (0.0, 0.05, 0.2, 1.0)  # after `orch task --background` returns
SETTLE_S = 6.0  # "within a few seconds": the cancel's own answer, a cold host included
WARMER = {"conversations": [{"runs": "*", "turns": [{"text": "WARM", "latency_s": 60}]}]}


def _token() -> str:
    return f"{random.randrange(100, 999)}.{random.randrange(10**8)}"


def _sleeper(token: str) -> dict[str, Any]:
    """Every run: a command that sleeps (long), then an answer it never reaches."""
    call = {"tool": "bash", "input": {"command": f"sleep {token}"}}
    return {"conversations": [{"runs": "*", "turns": [{"tool_calls": [call]}, {"text": "x"}]}]}


def _launch(project: Path, script: Path, env: dict[str, str]) -> str:
    r = orch(
        "task", "go", "--background", "--json", "--model", f"scripted:{script}",
        cwd=project, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["run_id"])


def _record(project: Path, run_id: str) -> RunRecord:
    store = open_store(project)
    try:
        return store.require_run(run_id)
    finally:
        store.close()


def _hosts(project: Path) -> list[int]:
    hosts = set(host_pids("orchestrator _host --key"))
    return [p for p in host_pids(f"-C {project}") if p in hosts]


def _end_hosts(project: Path) -> None:
    for pid in _hosts(project):
        os.kill(pid, signal.SIGTERM)
        if not gone(pid, 20):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("mode", ["cold", "warm", "worker"])
@pytest.mark.parametrize("delay", DELAYS, ids=[f"{d:g}s" for d in DELAYS])
def test_a_background_run_cancelled_at_any_moment_of_its_start_ends_cancelled(
    project: Path, mode: str, delay: float
) -> None:
    """``cold``: the launcher starts the worker host; ``warm``: one runs a run already;
    ``worker``: no hosts (``ORCH_WORKER_HOST=0``), a worker of its own."""
    warm = mode == "warm"
    token = _token()
    script = write_script(project, _sleeper(token))
    env = {"ORCH_HOST_IDLE": "30"}  # an idle host stays: its runs' owner lives on
    if mode == "worker":
        env["ORCH_WORKER_HOST"] = "0"
    try:
        if warm:  # a host that already runs a run: the handoff is quick
            warmer = _launch(project, write_script(project, WARMER, "warm.yaml"), env)
            wait_for(lambda: _record(project, warmer).status == RunStatus.RUNNING, 30, "warm")
        rid = _launch(project, script, env)
        time.sleep(delay)
        began = time.monotonic()
        c = orch("cancel", rid, "--json", "--wait", "20", cwd=project, env=env)
        took = time.monotonic() - began
        assert c.returncode == 0, c.stderr
        assert json.loads(c.stdout)[0]["status"] == "cancelled", c.stdout
        assert took < SETTLE_S, f"the cancel took {took:.1f}s"
        assert _record(project, rid).status == RunStatus.CANCELLED
        assert none_left(f"sleep {token}"), "the run's command outlived its cancel"
        if warm:  # the other run of the host is untouched
            assert _record(project, warmer).status == RunStatus.RUNNING
            host = _record(project, warmer).pid
            assert host is not None and alive(host)
    finally:
        _end_hosts(project)
        for pid in host_pids(f"sleep {token}"):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("delay", [0.0, 0.3], ids=["at-once", "0.3s"])
def test_task_stop_of_a_background_run_on_a_cold_host_ends_it_cancelled(
    tmp_path: Path, delay: float
) -> None:
    """The same through the MCP server (``task_stop``), the host cold."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.types import TextContent

    from tests.support import init_repo

    repo = init_repo(tmp_path / "repo", {"README.md": "# demo\n"})
    token = _token()
    call = {"tool": "bash", "input": {"command": f"sleep {token}"}}
    turns = [{"tool_calls": [call]}, {"text": "x"}]
    script = write_script(repo, {"conversations": [{"depth": 0, "runs": "*", "turns": turns}]})
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    env["ORCH_HOST_IDLE"] = "30"
    argv = ["-m", "orchestrator", "mcp", "-C", str(repo), "--model", f"scripted:{script}"]
    params = StdioServerParameters(command=sys.executable, args=argv, env=env, cwd=str(repo))

    def text(result: Any) -> str:
        return "\n".join(c.text for c in result.content if isinstance(c, TextContent))

    async def go() -> tuple[str, float, str]:
        async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
            await s.initialize()
            started = await s.call_tool("task", {"prompt": "go", "run_in_background": True})
            task_id = json.loads(text(started))["task_id"]
            await asyncio.sleep(delay)
            began = time.monotonic()
            stopped = await s.call_tool("task_stop", {"task_id": task_id})
            assert not stopped.is_error, text(stopped)
            return task_id, time.monotonic() - began, text(stopped)

    try:
        task_id, took, answer = asyncio.run(go())
        assert json.loads(answer)[0] == {"task_id": task_id, "status": "cancelled"}, answer
        assert took < SETTLE_S, f"task_stop took {took:.1f}s"
        assert none_left(f"sleep {token}")
    finally:
        _end_hosts(repo)
        for pid in host_pids(f"sleep {token}"):
            os.kill(pid, signal.SIGKILL)
