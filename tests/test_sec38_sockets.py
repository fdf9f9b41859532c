"""Issue 38, class 9: orch's sockets authenticate both ways and stay out of reach.

Break 9: the warm client sent its whole environment (the API key with it) and its
terminal's descriptors to whatever listened at the predictable socket path. Now a server
proves itself (a MAC under the user's socket key, bound to its pid as the kernel gives it)
before a client sends anything, the client proves itself before the server reads on, and
no environment value leaves a client (only a digest, and the shell's volatile names).
"""

from __future__ import annotations

import array
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.process import unixsock
from tests.support import gone, init_repo
from tests.test_warm import Warm

USER_KEY = "sk-ant-USERKEY-0123456789abcdef"


class Planted:
    """A listener an agent put at a socket path: everything it is sent, bytes and fds."""

    def __init__(self, path: Path, bait: bytes = b"") -> None:
        self.path, self.bait = path, bait
        self.got = b""
        self.fds: list[int] = []
        self.connections = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with unixsock.address(path) as addr:
            self.sock.bind(addr)
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.settimeout(0.5)
            answered = False
            end = time.monotonic() + 8
            with conn:
                while time.monotonic() < end and not self.stopped.is_set():
                    try:
                        data, anc, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(16 * 4))
                    except TimeoutError:
                        if self.bait and not answered:  # a proof-shaped answer, to bait it
                            conn.sendall(self.bait)
                            answered = True
                        continue
                    except OSError:
                        break
                    for level, kind, raw in anc:
                        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                            fds = array.array("i")
                            fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
                            self.fds += list(fds)
                            for fd in fds:  # (held, they would keep the caller's pipes open)
                                os.close(fd)
                    if not data:
                        break
                    self.got += data
                    if self.bait and not answered:
                        conn.sendall(self.bait)
                        answered = True

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def w(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Warm]:
    repo = init_repo(tmp_path / "proj", {"a.txt": "alpha\n"})
    helper = Warm(repo, tmp_path / "home")
    helper.home.mkdir()
    helper.env["ANTHROPIC_API_KEY"] = USER_KEY
    monkeypatch.setenv("HOME", str(helper.home))
    yield helper
    for pid in helper.pids():
        os.kill(pid, signal.SIGTERM)
        assert gone(pid, 10)


def _take_over(w: Warm) -> Path:
    """The user's warm process is gone (idle); the predictable path is free for a listener."""
    pid = w.started()
    [path] = w.sockets()
    os.kill(pid, signal.SIGTERM)
    assert gone(pid, 10)
    path.unlink(missing_ok=True)
    return path


@pytest.mark.parametrize("bait", [b"", b"00" * 16 + b" " + b"ab" * 32 + b"\n"])
def test_break9_a_listener_at_the_warm_socket_gets_no_key_and_no_terminal(
    w: Warm, bait: bytes
) -> None:
    path = _take_over(w)
    planted = Planted(path, bait)
    try:
        r = w.run("ps")  # the user's next command
    finally:
        planted.close()
    assert planted.connections >= 1  # it did knock (the path is predictable)
    assert b"sk-ant-" not in planted.got and USER_KEY.encode() not in planted.got
    assert planted.fds == []  # no terminal, no working directory
    assert r.returncode == 0, r.stderr  # it ran, in its own process
    assert b"ANTHROPIC" not in planted.got and b"PATH" not in planted.got
    assert planted.got.startswith(unixsock.HELLO) and planted.got.count(b"\n") == 1
    if bait:
        assert "not orch's" in r.stderr


# -- no orch socket is reachable from any sandbox ------------------------------------------

PROBE = r"""
import json, socket, sys
targets, key = json.loads(sys.argv[1]), sys.argv[2]
for name, path in sorted(targets.items()):
    for how, addr in (("path", path), ("abstract", "\0" + path)):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(3)
        try:
            s.connect(addr)
            print("REACHED", name, how)
        except OSError as e:
            print("NO", name, how, e.errno)
        finally:
            s.close()
try:
    open(key).read()
    print("READ key")
except OSError as e:
    print("NO key", e.errno)
"""
NETWORKS: dict[str, object] = {
    "none": "none",
    "host": "host",
    "allow": {"allow": ["pkgs.example.org"]},
}


class OtherRunsDoor:
    """The egress proxy of another orch process, with one run's door open (a thread)."""

    def __init__(self) -> None:
        import asyncio

        from orchestrator.egress.proxy import EgressProxy
        from orchestrator.egress.rules import Reach

        self.loop = asyncio.new_event_loop()
        self.proxy = EgressProxy()
        ready = threading.Event()
        self.path = Path()

        async def main() -> None:
            await self.proxy.__aenter__()
            door = await self.proxy.open_door(
                Reach.from_info({"allow": ["pkgs.example.org"]}), print
            )
            self.path = door.socket
            ready.set()

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(main(), self.loop).result(10)
        assert ready.wait(10)

    def close(self) -> None:
        import asyncio

        done = asyncio.run_coroutine_threadsafe(self.proxy.__aexit__(None, None, None), self.loop)
        done.result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def targets(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], list[Planted]]]:
    """Every orch socket a sandbox might try: the user's real warm process, the worker
    host's socket in the state dir, another run's egress door; and, as a control, an
    abstract socket (reachable where the network namespace is shared: "host")."""
    from orchestrator.process.detach import host_key, paths
    from orchestrator.project.statedir import state_dir

    repo = init_repo(tmp_path / "proj", {"README.md": "# the user's\n"})
    warm = Warm(repo, Path(os.environ["HOME"]))
    pid = warm.started()
    [warm_sock] = warm.sockets()
    host_sock, _ = paths(state_dir(repo), host_key())
    planted = [Planted(host_sock)]
    control = f"/orch-sec38-control-{os.getpid()}-{time.monotonic_ns()}"
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0" + control)
    abstract.listen(4)
    door = OtherRunsDoor()
    try:
        found = {"warm": str(warm_sock), "host": str(host_sock), "door": str(door.path)}
        found["control"] = control
        yield repo, found, planted
    finally:
        door.close()
        abstract.close()
        for p in planted:
            p.close()
        os.kill(pid, signal.SIGTERM)
        assert gone(pid, 10)


@pytest.mark.bwrap
@pytest.mark.parametrize("network", sorted(NETWORKS))
@pytest.mark.parametrize("tier", ["shared", "worktree", "container"])
def test_no_orch_socket_is_reachable_from_any_sandbox(
    tier: str, network: str, targets: tuple[Path, dict[str, str], list[Planted]]
) -> None:
    import json
    import shlex

    from orchestrator.config import SandboxSettings
    from orchestrator.fs.private import private_root, socket_key
    from orchestrator.run import RunStatus
    from tests.support import harness, sandbox_image, tool_results

    repo, found, planted = targets
    sandbox = SandboxSettings(image=sandbox_image()) if tier == "container" else SandboxSettings()
    socket_key()  # (made on first use: here, it is there to be read)
    key = private_root() / "socket.key"
    command = f"python3 -c {shlex.quote(PROBE)} {shlex.quote(json.dumps(found))} {key}"
    script = {"conversations": [{"turns": [
        {"tool_calls": [{"tool": "bash", "input": {"command": command}}]}, {"text": "ok"},
    ]}]}  # fmt: skip
    h = harness(repo, script, network=NETWORKS[network], sandbox=sandbox)
    root = h.run(isolation=tier)
    assert root.status == RunStatus.SUCCEEDED, root.error
    [said] = [r["content"] for r in tool_results(h.requests_of(root.run_id)[1])]
    lines = said.splitlines()
    for name in ("warm", "host", "door"):
        for how in ("path", "abstract"):
            assert any(x.startswith(f"NO {name} {how}") for x in lines), said
    assert any(x.startswith("NO key") for x in lines), said
    # the probe works: where the sandbox shares the host's network namespace, an abstract
    # socket of the host answers (orch has none)
    reached_control = "REACHED control abstract" in lines
    assert reached_control == (network == "host" and tier != "container"), said
    assert all(p.connections == 0 for p in planted)


# -- the worker host: a sandboxed peer is refused unread; an impostor gets nothing ---------

ASK_FROM_INSIDE = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(sys.argv[1])
try:
    s.sendall(b'{"run_id": "r-000000000000", "env": {"ANTHROPIC_API_KEY": "sk-ant-x"}}\n')
except OSError as e:  # refused and closed already: what did it say?
    print("SEND", e)
print("GOT", s.makefile("rb").readline().decode().strip() or "nothing")
"""


@pytest.mark.bwrap
def test_the_worker_host_refuses_a_peer_inside_bubblewrap_before_reading(
    tmp_path: Path,
) -> None:
    """The round-1-3 test's bwrap (the host's socket bound in): the host answers a
    refusal at once, reads nothing, proves nothing (and its log says so)."""
    from tests.support import need_bwrap
    from tests.test_workerhost import _record, _slow_host, _stop

    project = init_repo(tmp_path / "proj", {"a.txt": "alpha\n"})
    rid, host, sock = _slow_host(project)
    try:
        bwrap = [need_bwrap(), "--bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                 "--unshare-pid", "--unshare-net", "--die-with-parent"]  # fmt: skip
        r = subprocess.run([*bwrap, sys.executable, "-c", ASK_FROM_INSIDE, str(sock)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "a process inside a sandbox" in r.stdout, (r.stdout, r.stderr)
        log = (project / ".orch" / "logs" / "host.log").read_text()
        assert "refused a connection from inside a sandbox" in log
        assert "r-000000000000" not in log  # its request was never read
        assert _record(project, rid).status.value == "running"
    finally:
        _stop(project, host)


def test_a_listener_at_the_worker_host_socket_gets_no_environment(tmp_path: Path) -> None:
    """The worker host's socket impersonated (a listener planted at its path while none
    lives): the launcher sends its hello only, and its run gets a worker of its own."""
    from orchestrator.process.detach import host_key, paths
    from orchestrator.project.statedir import state_dir
    from orchestrator.store import open_store
    from tests.support import orch, write_script

    project = init_repo(tmp_path / "proj", {"a.txt": "alpha\n"})
    script = write_script(project, {"conversations": [{"runs": "*", "turns": [{"text": "OK"}]}]})
    env = {"ANTHROPIC_API_KEY": USER_KEY, "ORCH_HOST_IDLE": "0"}
    # the launcher's host key, as it computes it (same environment, same store)
    code = "from orchestrator.process.detach import host_key; print(host_key(None))"
    full = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")} | env
    key = subprocess.run([sys.executable, "-c", code], env=full, cwd=project,
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert key and callable(host_key)  # (imported: the same function)
    sock, lock = paths(state_dir(project), key)
    planted = Planted(sock, b"00" * 16 + b" " + b"ab" * 32 + b"\n")
    lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)  # the impostor holds the lock too
    import fcntl

    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        r = orch("task", "go", "--background", "--json", "--model", f"scripted:{script}",
                 cwd=project, env=env)  # fmt: skip
    finally:
        planted.close()
        os.close(lock_fd)
    assert r.returncode == 0, r.stderr
    assert planted.connections >= 1
    assert b"sk-ant-" not in planted.got and b"ANTHROPIC" not in planted.got
    assert planted.got.startswith(unixsock.HELLO) and planted.got.count(b"\n") == 1
    run_id = r.stdout and __import__("json").loads(r.stdout)["run_id"]
    log = (state_dir(project) / "logs" / f"{run_id}.log").read_text()
    assert "not orch's worker host" in log, log
    store = open_store(project)
    try:
        from tests.support import wait_for

        wait_for(lambda: store.require_run(run_id).status.value == "succeeded", 60, "the run")
    finally:
        store.close()
