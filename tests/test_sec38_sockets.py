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
