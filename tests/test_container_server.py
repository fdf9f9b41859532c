"""The container's long-lived program server (``workspaces/boxserve.py``): file tools and
the close's export run without an exec each; when the agent kills it or writes into its
stream, calls go by execs of their own and nothing it says is trusted."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from orchestrator.config import SandboxSettings
from orchestrator.errors import OrchError
from orchestrator.workspaces.base import RunOutcome
from orchestrator.workspaces.container import ContainerPool, ContainerWorkspace
from tests.test_container import engine, inside, leftovers, repo, sandbox_image, sh, spec_for

__all__ = ["engine", "repo", "sandbox_image"]  # fixtures shared with test_container

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("hermetic_git")]

# the server is the one `python3 -u -c ...` (file tools run `python3 -c ...`)
FIND_SERVER = (
    "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q '^python3 -u -c' "
    "&& basename $p; done | head -1"
)


def execs(container_id: str) -> int:
    out = subprocess.run(["docker", "inspect", container_id], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return len(json.loads(out)[0]["ExecIDs"] or [])


def kept(repo: Path, ws: ContainerWorkspace, path: str) -> str:
    """The file ``path`` on the branch the closed workspace left, nothing else left over."""
    [art] = ws.artifacts()
    assert leftovers(repo) == []
    return sh(repo, "show", f"{art['branch']}:{path}")


def test_file_tools_and_the_export_need_no_exec_each(repo: Path, sandbox_image: str) -> None:
    spec = spec_for(repo, image=sandbox_image)

    async def body() -> ContainerWorkspace:
        async with ContainerWorkspace(spec) as ws:
            rt = ws.runtime()
            await rt.write_file("a.txt", b"one\n")  # the server is up once this answers
            before = execs(ws.container_id)
            for i in range(5):
                await rt.write_file(f"f{i}.txt", f"{i}\n".encode())
                assert (await rt.read_file(f"f{i}.txt", max_bytes=100)).data == f"{i}\n".encode()
            assert await rt.glob("f*.txt", limit=10) == ([f"f{i}.txt" for i in range(5)], False)
            assert execs(ws.container_id) == before  # ten calls, no exec
            ws.set_outcome(RunOutcome("succeeded", "files"))
        return ws

    ws = asyncio.run(body())
    [art] = ws.artifacts()
    assert sh(repo, "show", f"{art['branch']}:f3.txt") == "3"
    assert art["files_changed"] == 6 and leftovers(repo) == []


def test_a_pool_claim_fills_the_workspace_without_an_exec(repo: Path, sandbox_image: str) -> None:
    async def body() -> ContainerWorkspace:
        async with ContainerPool(repo, SandboxSettings(image=sandbox_image), size=1) as pool:
            async with asyncio.timeout(60):
                await pool.wait_ready()  # started, and its server greeted
            [warm] = pool.ready
            before = execs(warm.container_id)
            async with ContainerWorkspace(spec_for(repo, image=sandbox_image)) as ws:
                assert ws.pooled and ws.container_id == warm.container_id
                assert execs(ws.container_id) == before  # the fill went through the server
                assert (await ws.runtime().read_file("README.md", max_bytes=100)).data
                r = await ws.exec("echo pooled > p.txt", timeout_s=30, env={})
                assert r.exit_code == 0, r.output
                ws.set_outcome(RunOutcome("succeeded", "pooled"))
        return ws

    assert kept(repo, asyncio.run(body()), "p.txt") == "pooled"


def test_a_killed_server_costs_nothing_but_time(repo: Path, sandbox_image: str) -> None:
    spec = spec_for(repo, image=sandbox_image)

    async def body() -> ContainerWorkspace:
        async with ContainerWorkspace(spec) as ws:
            rt = ws.runtime()
            await rt.write_file("a.txt", b"one\n")
            # the agent (same uid) kills it between calls: its own commands run in the server
            assert inside(ws.container_id, f"kill -9 $({FIND_SERVER}) && echo KILLED") == "KILLED\n"
            # the next calls (and the close's export) go by execs of their own
            assert (await rt.read_file("a.txt", max_bytes=100)).data == b"one\n"
            await rt.write_file("b.txt", b"two\n")
            assert ws.box is not None and ws.box.server is None
            ws.set_outcome(RunOutcome("succeeded", "after the kill"))
        return ws

    assert kept(repo, asyncio.run(body()), "b.txt") == "two"


@pytest.mark.parametrize(
    "forged",
    [
        "printf '\\177\\377\\377\\377'",  # a frame of 2 GiB: over any cap, read no further
        "printf '\\0\\0\\0\\0not json\\n'",  # a trailer that is not one
        "printf '\\0\\0\\0\\0{'; head -c 300000 /dev/zero | tr '\\0' x",  # no end to it
    ],
)
def test_words_forged_into_the_servers_stream_are_not_trusted(
    repo: Path, sandbox_image: str, forged: str
) -> None:
    spec = spec_for(repo, image=sandbox_image)

    async def body() -> ContainerWorkspace:
        async with ContainerWorkspace(spec) as ws:
            rt = ws.runtime()
            await rt.write_file("a.txt", b"one\n")
            # the agent writes into the server's stdout (same uid) ahead of the next answer
            forge = f"pid=$({FIND_SERVER}); ({forged}) > /proc/$pid/fd/1 && echo FORGED"
            assert inside(ws.container_id, forge) == "FORGED\n"
            try:
                got = await rt.read_file("a.txt", max_bytes=100)
            except OrchError as e:  # refused as over its cap
                assert "cap" in str(e)
            else:  # or thrown away, and asked again by an exec
                assert got.data == b"one\n"
            assert ws.box is not None and ws.box.server is None
            await rt.write_file("b.txt", b"two\n")
            ws.set_outcome(RunOutcome("succeeded", "forged"))
        return ws

    assert kept(repo, asyncio.run(body()), "b.txt") == "two"
