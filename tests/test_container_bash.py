"""``bash`` in a container goes through its program server (``inside/server.py``): no exec
each, the command in a session of its own whose whole group goes at its end, timeout or
cancel, its output capped as on the host; a killed or lying server costs an exec."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from orchestrator.workspaces.base import MAX_CAPTURE, RunOutcome
from orchestrator.workspaces.container import ContainerWorkspace
from orchestrator.workspaces.container.channel import Server
from tests.test_container import engine, inside, leftovers, repo, sandbox_image, spec_for
from tests.test_container_server import FIND_SERVER, execs

__all__ = ["engine", "repo", "sandbox_image"]  # fixtures shared with test_container

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("hermetic_git")]

SLEEPS = "ps -eo args | grep '^sleep 30' || true"


async def _ready(ws: ContainerWorkspace) -> int:
    """The server answered once; the container's exec count from then on."""
    r = await ws.exec("true", timeout_s=30, env={})
    assert r.exit_code == 0, r.output
    return execs(ws.container_id)


def _closed(ws: ContainerWorkspace) -> None:
    ws.set_outcome(RunOutcome("succeeded"))


def test_bash_goes_through_the_server(repo: Path, sandbox_image: str) -> None:
    async def body() -> None:
        async with ContainerWorkspace(spec_for(repo, image=sandbox_image)) as ws:
            before = await _ready(ws)
            r = await ws.exec("echo out; echo err >&2; echo $$ > pid; exit 3", timeout_s=30, env={})
            assert (r.exit_code, r.output, r.timed_out) == (3, "out\nerr\n", False)
            r = await ws.exec("kill -TERM $$", timeout_s=30, env={})
            assert r.exit_code == 143  # as a shell reports a signal
            for i in range(5):
                r = await ws.exec(f"echo {i} > f{i}; cat f{i}", timeout_s=30, env={})
                assert r.output == f"{i}\n"
            # its own session and group, not the server's
            r = await ws.exec("ps -o pid=,pgid=,sid= -p $$", timeout_s=30, env={})
            pid, pgid, sid = r.output.split()
            assert pid == pgid == sid
            assert execs(ws.container_id) == before  # nine commands, no exec
            _closed(ws)

    asyncio.run(body())
    assert leftovers(repo) == []


def test_timeout_cancel_and_the_end_kill_the_whole_group(repo: Path, sandbox_image: str) -> None:
    async def body() -> None:
        async with ContainerWorkspace(spec_for(repo, image=sandbox_image)) as ws:
            assert ws.box is not None
            before = await _ready(ws)
            server = ws.box.server
            t0 = time.monotonic()
            r = await ws.exec("(sleep 300 &); sleep 301 & echo started; wait", timeout_s=1, env={})
            assert r.timed_out and r.exit_code is None and r.output == "started\n"
            assert time.monotonic() - t0 < 4
            assert inside(ws.container_id, SLEEPS) == ""  # the background children too
            task = asyncio.create_task(ws.exec("sleep 302 & sleep 303", timeout_s=60, env={}))
            await asyncio.sleep(0.5)
            assert "sleep 302" in inside(ws.container_id, SLEEPS)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert inside(ws.container_id, SLEEPS) == ""
            t0 = time.monotonic()
            r = await ws.exec("sleep 304 & echo done", timeout_s=30, env={})
            assert r.exit_code == 0 and r.output == "done\n" and time.monotonic() - t0 < 3
            assert inside(ws.container_id, SLEEPS) == ""  # left in the background: gone too
            assert isinstance(server, Server) and ws.box.server is server  # it lives on
            before = execs(ws.container_id)  # (the CLI's finished execs drop out)
            r = await ws.exec("echo still", timeout_s=30, env={})
            assert r.output == "still\n" and execs(ws.container_id) == before
            _closed(ws)

    asyncio.run(body())


def test_bash_output_is_capped(repo: Path, sandbox_image: str) -> None:
    async def body() -> None:
        async with ContainerWorkspace(spec_for(repo, image=sandbox_image)) as ws:
            before = await _ready(ws)
            r = await ws.exec("head -c 3000000 /dev/zero | tr '\\0' x", timeout_s=60, env={})
            assert r.exit_code == 0
            assert len(r.output) == MAX_CAPTURE and r.truncated_bytes == 3_000_000 - MAX_CAPTURE
            assert set(r.output) == {"x"} and execs(ws.container_id) == before
            _closed(ws)

    asyncio.run(body())


def test_a_killed_server_costs_an_exec(repo: Path, sandbox_image: str) -> None:
    async def body() -> None:
        async with ContainerWorkspace(spec_for(repo, image=sandbox_image)) as ws:
            assert ws.box is not None
            await _ready(ws)
            first = ws.box.server
            assert inside(ws.container_id, f"kill -9 $({FIND_SERVER}) && echo K") == "K\n"
            r = await ws.exec("echo x >> runs; echo ran", timeout_s=30, env={})
            assert (r.exit_code, r.output) == (0, "ran\n")  # by an exec of its own
            assert ws.box.server is None
            r = await ws.exec("echo again", timeout_s=30, env={})  # in a new server
            second = ws.box.server
            assert r.output == "again\n" and second is not None and second is not first
            # killed by its own command: what it said is kept, the command not run twice
            r = await ws.exec(
                f"echo y >> runs; echo before; kill -9 $({FIND_SERVER}); sleep 5; echo after",
                timeout_s=30,
                env={},
            )
            assert r.exit_code == 137 and r.output.startswith("before\n"), r.output
            assert "after" not in r.output and "program server broke" in r.output
            assert inside(ws.container_id, "cat runs") == "x\ny\n"
            assert inside(ws.container_id, "ps -eo args | grep '^sleep 5' || true") == ""
            r = await ws.exec("echo fine", timeout_s=30, env={})
            assert r.output == "fine\n" and ws.box.server not in (None, first, second)
            _closed(ws)

    asyncio.run(body())


@pytest.mark.parametrize(
    "forged",
    [
        "printf '\\177\\377\\377\\377'",  # a frame of 2 GiB: over any cap
        'printf \'\\0\\0\\0\\0{"code": 0, "err": "", "id": "guess"}\\n\'',  # not its id
        "printf '\\0\\0\\0\\0[0]\\n'",  # not a trailer
        "printf '\\0\\0\\0\\0{'; head -c 300000 /dev/zero | tr '\\0' x",  # no end to it
    ],
)
def test_a_lying_server_is_not_trusted(repo: Path, sandbox_image: str, forged: str) -> None:
    async def body() -> None:
        async with ContainerWorkspace(spec_for(repo, image=sandbox_image)) as ws:
            await _ready(ws)
            t0 = time.monotonic()
            r = await ws.exec(
                f"echo hi; pid=$({FIND_SERVER}); ({forged}) > /proc/$pid/fd/1; sleep 20",
                timeout_s=60,
                env={},
            )
            assert r.exit_code == 137 and "program server broke" in r.output, r
            assert time.monotonic() - t0 < 10  # the sleep did not run on
            assert inside(ws.container_id, "ps -eo args | grep '^sleep 20' || true") == ""
            r = await ws.exec("echo fine", timeout_s=30, env={})
            assert (r.exit_code, r.output) == (0, "fine\n")
            _closed(ws)

    asyncio.run(body())
