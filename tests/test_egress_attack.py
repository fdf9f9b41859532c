"""Attacks on the network allow-list (egress proxy, bridge, rules), end to end.

Each test plays one attack from an agent's bash commands (the scripted model) and asserts
that it is refused; every test here fails on the code it was written against. Everything
stays on this machine: the servers listen on 127.0.0.1, the sandboxes have network
namespaces of their own, and names are answered by a stand-in for the system resolver
(never real DNS).

Two runs "at once" are two root runs of one Runner (one process, one egress proxy), both
in the shared tier, so they share the project directory: the attacker writes a marker file
there once its attack is in place, and the victim waits for it.
"""

from __future__ import annotations

import asyncio
import json
import resource
import shlex
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.egress import proxy as proxy_module
from orchestrator.run import RunRecord
from tests.support import harness, init_repo, task_call
from tests.test_egress import PY, bash, fetch, outputs

pytestmark = pytest.mark.bwrap


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return init_repo(tmp_path / "proj", {"README.md": "# the user's\n"})


def py(code: str) -> str:
    return f"{PY} -c {shlex.quote(code)}"


# waits (up to 30 s) for the attacker's marker file in the shared project directory
WAIT = (
    "import os, time\n"
    "for _ in range(600):\n"
    "    if os.path.exists('attack-in-place'): break\n"
    "    time.sleep(0.05)\n"
    "print('SAW', os.path.exists('attack-in-place'))\n"
)


def side_by_side(h: Any, *prompts: str) -> list[RunRecord]:
    """Root runs of one Runner (one process, one egress proxy) at once, to their ends."""

    async def all_of() -> list[RunRecord]:
        runs = [h.runner.run(h.spec(p)) for p in prompts]
        return list(await asyncio.wait_for(asyncio.gather(*runs), 120))

    return asyncio.run(all_of())


def conversation(prompt: str, *commands: str) -> dict[str, Any]:
    turns: list[dict[str, Any]] = [{"tool_calls": [bash(c)]} for c in commands]
    return {"prompt": prompt, "turns": [*turns, {"text": "ok"}]}


# -- 1. unauthenticated connections: one run takes every slot of the process -------------

# connections to the mounted proxy socket that never say a token: they hold a slot of the
# process (MAX_CONNECTIONS) for HELLO_S each, and count against no run
HOLD = r"""
import resource, socket, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held, stalled = [], time.monotonic()
while len(held) < COUNT and time.monotonic() - stalled < 1.5:
    c = socket.socket(socket.AF_UNIX)
    c.setblocking(False)
    try:
        c.connect("/run/orch-egress.sock")
    except BlockingIOError:  # the backlog is full: the proxy is behind (or out of descriptors)
        c.close()
        time.sleep(0.01)
        continue
    held.append(c)
    stalled = time.monotonic()
open("attack-in-place", "w").write(str(len(held)))
time.sleep(6)
print("HELD", len(held))
"""


def test_one_runs_silent_connections_do_not_starve_another_runs_egress(
    repo: Path, servers: tuple[int, int]
) -> None:
    """An allow-list run opens 2,100 connections to /run/orch-egress.sock and says
    nothing: each holds one of the process's 2,048 slots for 10 s (renewable), counted
    against no run (MAX_OPEN counts only after the token). Another run's request to its own
    allowed server is then cut without an answer."""
    allowed, _ = servers
    script = {
        "conversations": [
            conversation("attacker", py(HOLD.replace("COUNT", "2100"))),
            conversation("victim", py(WAIT) + "; " + fetch(f"http://127.0.0.1:{allowed}/v")),
        ]
    }
    h = harness(repo, script, network={"allow": [f"127.0.0.1:{allowed}"]})
    attacker, victim = side_by_side(h, "attacker", "victim")
    said = outputs(h, victim.run_id)[0]
    assert "SAW True" in said, said
    assert f"BODY hello from {allowed} /v" in said, (said, outputs(h, attacker.run_id))


# -- 2. file descriptors: the proxy's budget is not the process's ------------------------


def test_one_runs_egress_connections_cannot_exhaust_the_process_descriptors(
    repo: Path, servers: tuple[int, int]
) -> None:
    """With the usual soft limit of 1,024 open files (most Linux logins), 1,100 silent
    connections to the proxy's socket from one run's sandbox exhaust orch's descriptors:
    another run's next bash command fails with EMFILE (as would a store write, a worktree's
    git, a container's API call). MAX_CONNECTIONS (2,048) and MAX_OPEN (256 a run, two
    descriptors each) are not derived from RLIMIT_NOFILE."""
    allowed, _ = servers
    script = {
        "conversations": [
            conversation("attacker", py(HOLD.replace("COUNT", "1100"))),
            conversation("victim", py(WAIT), "echo second-command-ran"),
        ]
    }
    h = harness(repo, script, network={"allow": [f"127.0.0.1:{allowed}"]})
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, before[1]), before[1]))
    try:
        attacker, victim = side_by_side(h, "attacker", "victim")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)
    assert "SAW True" in outputs(h, victim.run_id, 1)[0]
    second = outputs(h, victim.run_id, 2)[0]
    assert "Too many open files" not in second, (second, outputs(h, attacker.run_id))
    assert "second-command-ran" in second


# -- 3. name resolution: one run's slow names block every lookup of the process ----------

# 40 CONNECTs to names whose resolution hangs: each takes a thread of the loop's default
# executor (loop.getaddrinfo) for as long as the resolver hangs; wait_for(RESOLVE_S)
# gives up on the answer but not the thread
FLOOD = r"""
import socket, time
held = []
for i in range(40):
    c = socket.create_connection(("127.0.0.1", 3128), 5)
    c.sendall(b"CONNECT n%d.slow.test:443 HTTP/1.1\r\n\r\n" % i)
    held.append(c)
time.sleep(0.5)
open("attack-in-place", "w").write("x")
time.sleep(3)
print("ASKED", len(held))
"""


@pytest.fixture
def slow_resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The system resolver as orch calls it (socket.getaddrinfo in the loop's executor),
    standing in for DNS: *.slow.test hangs 4 s (an unanswering name server: glibc waits
    5 s a try), victim.test is 127.0.0.1 at once, and any other name does not exist."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else str(host)
        if name.endswith(".slow.test"):
            time.sleep(4)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        if name == "victim.test":
            return real("127.0.0.1", port, *args, **kwargs)
        if name in ("localhost", "127.0.0.1", "::1"):
            return real(host, port, *args, **kwargs)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(proxy_module, "RESOLVE_S", 2.0)  # (10 s in use: the same race)
    yield


def test_one_runs_slow_names_do_not_block_another_runs_lookups(
    repo: Path, servers: tuple[int, int], slow_resolver: None
) -> None:
    """A run whose list has a wildcard asks for 40 names that resolve slowly; another
    run's allowed name (resolving at once) then waits behind them in the shared executor
    (min(32, CPUs + 4) threads, also every asyncio.to_thread of orch: file tools, Docker
    calls) and is refused with 502 'cannot resolve'."""
    allowed, _ = servers
    script = {
        "conversations": [
            conversation("attacker", py(FLOOD)),
            conversation("victim", py(WAIT) + "; " + fetch(f"http://victim.test:{allowed}/v")),
        ]
    }
    names = ["*", f"victim.test:{allowed}", f"127.0.0.1:{allowed}"]
    h = harness(repo, script, network={"allow": names})
    attacker, victim = side_by_side(h, "attacker", "victim")
    said = outputs(h, victim.run_id)[0]
    assert "SAW True" in said, said
    assert f"BODY hello from {allowed} /v" in said, (said, outputs(h, attacker.run_id))


# -- 4. the events: attacker-sized fields --------------------------------------------------

BIG_METHOD = r"""
import socket
c = socket.create_connection(("127.0.0.1", 3128), 5)
c.sendall(b"M" * 60000 + b" http://nowhere.test/ HTTP/1.1\r\n\r\n")
print(c.recv(200).split(b"\r\n")[0].decode())
"""


def test_an_egress_event_does_not_store_an_attacker_sized_method(
    repo: Path, servers: tuple[int, int]
) -> None:
    """The request's method was stored as sent: a head of up to 64 KiB made each egress
    event that large (1,000 events a run: 64 MB of store, sent whole to the dashboard and
    read by every `orch result`). A method must be an HTTP token now (else 400), and the
    event keeps nothing of the request but what the proxy checked."""
    allowed, _ = servers
    script = {"conversations": [conversation("big", py(BIG_METHOD))]}
    h = harness(repo, script, network={"allow": [f"127.0.0.1:{allowed}"]})
    root = h.run("big")
    assert "HTTP/1.1 400" in outputs(h, root.run_id)[0]  # not an HTTP method: refused
    (event,) = [e["data"] for e in h.store.events(root.run_id) if e["kind"] == "egress"]
    assert len(json.dumps(event)) <= 300, len(json.dumps(event))


# -- 5. the socket outside /tmp: visible to sandboxes that have no allow-list -------------

PEEK = r"""
import glob, socket
found = glob.glob("/var/tmp/orch-attack-*/orch-egress-*/*.sock")
print("FOUND", found)
for path in found:
    try:
        socket.socket(socket.AF_UNIX).connect(path)
        print("CONNECTED", path)
    except OSError as e:
        print("REFUSED", e)
"""


def test_a_run_without_network_cannot_reach_the_proxy_socket_when_tmpdir_is_elsewhere(
    repo: Path, servers: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proxy's directory is made in $TMPDIR; only /tmp is private in a host-tier
    sandbox, so with TMPDIR=/var/tmp (or ~/tmp) every sandbox of the process sees the
    socket through the read-only root, its 0700 directory included (same uid): here a
    network = "none" child connects to it (and could hold the slots of test 1)."""
    allowed, _ = servers
    where = tempfile.mkdtemp(prefix="orch-attack-", dir="/var/tmp")
    monkeypatch.setattr(tempfile, "tempdir", where)
    agents = repo / ".orch" / "agents"
    agents.mkdir(parents=True)
    (agents / "offline.md").write_text(
        "---\nname: offline\ndescription: x\ntools: Bash\nnetwork: none\n---\nGo.\n"
    )
    parent = {
        "depth": 0,
        "turns": [{"tool_calls": [task_call("a", subagent_type="offline")]}, {"text": "ok"}],
    }
    kid = {"depth": 1, "turns": [{"tool_calls": [bash(py(PEEK))]}, {"text": "done"}]}
    try:
        h = harness(
            repo, {"conversations": [parent, kid]}, network={"allow": [f"127.0.0.1:{allowed}"]}
        )
        root = h.run()
        (child,) = [r for r in h.runs(root.chain_id) if r.depth == 1]
        assert child.workspace is not None and child.workspace["network"] == "none"
        said = outputs(h, child.run_id)[0]
        assert "CONNECTED" not in said, said
    finally:
        shutil.rmtree(where, ignore_errors=True)
