"""Egress proxy benchmarks: a request's cost through the bridge and the proxy (as a sandbox's
command pays it: TCP to the bridge, the Unix socket, the proxy's checks, TCP to the
server) against the same request straight to the server; and the bytes a second a CONNECT
tunnel carries against a direct connection to the same loopback server.

The bridge runs here as a plain process (in a sandbox it is the same program in the
sandbox's own network namespace); everything listens on 127.0.0.1."""

from __future__ import annotations

import asyncio
import http.server
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from store import _row  # noqa: E402

from orchestrator.egress import bridge  # noqa: E402
from orchestrator.egress.proxy import EgressProxy  # noqa: E402
from orchestrator.egress.rules import AllowList, Reach  # noqa: E402

BLOB = 256 * 1024 * 1024
CHUNK = 1024 * 1024


class _Small(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, *args: Any) -> None:
        return None


def _blob_server() -> tuple[socket.socket, int]:
    """Sends BLOB bytes to each connection, then closes it."""
    lsn = socket.create_server(("127.0.0.1", 0))
    data = b"x" * CHUNK

    def serve(conn: socket.socket) -> None:
        with conn:
            for _ in range(BLOB // CHUNK):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = lsn.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return lsn, lsn.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, head: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(head)
        got = b""
        while chunk := c.recv(65536):
            got += chunk
        assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"hello"), got[:200]


def _drain(port: int, connect: bytes | None) -> float:
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        if connect is not None:
            c.sendall(connect)
        seen, buf = 0, bytearray(CHUNK)
        while n := c.recv_into(buf):
            seen += n
    took = time.perf_counter() - t0
    assert seen >= BLOB, seen
    return took


def _command_start(samples: int = 30) -> tuple[float, float]:
    """Median ms of `true` in a fresh bubblewrap sandbox without a network, with the bridge
    in front of it (an allow-list run's command made on the spot) and without."""
    from orchestrator.bwrap.find import bwrap_choice

    found = bwrap_choice().path
    if found is None:
        raise RuntimeError("no bwrap here")
    box = [found, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-net"]
    box += ["--unshare-pid", "--die-with-parent", "--"]
    behind = bridge.argv(sys.executable, "token", ["true"])

    def median(argv: list[str]) -> float:
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            subprocess.run(argv, check=True)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1000

    return median([*box, *behind]), median([*box, "true"])


def run(requests: int = 300, blobs: int = 3) -> list[dict[str, Any]]:
    small = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Small)
    threading.Thread(target=small.serve_forever, daemon=True).start()
    lsn, blob_port = _blob_server()
    web = small.server_address[1]
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    proxy = EgressProxy()
    asyncio.run_coroutine_threadsafe(proxy.__aenter__(), loop).result(10)
    allow = AllowList(allow=(f"127.0.0.1:{web}", f"127.0.0.1:{blob_port}"))
    opened = proxy.open_door(Reach.of(allow), lambda event: None)
    door = asyncio.run_coroutine_threadsafe(opened, loop).result(10)
    port = _free_port()
    argv = [sys.executable, "-I", "-S", bridge.__file__, str(port), str(door.socket)]
    relay = subprocess.Popen([*argv, door.token, "--daemon"], stdout=subprocess.PIPE)
    try:
        assert relay.stdout is not None and relay.stdout.readline() == b"ready\n"
        proxied = f"GET http://127.0.0.1:{web}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        plain = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        for _ in range(20):  # warm both paths
            _get(port, proxied)
            _get(web, plain)

        def timed(p: int, head: bytes) -> float:
            t0 = time.perf_counter()
            _get(p, head)
            return time.perf_counter() - t0

        through = statistics.median(timed(port, proxied) for _ in range(requests)) * 1000
        direct = statistics.median(timed(web, plain) for _ in range(requests)) * 1000
        tunnel = f"CONNECT 127.0.0.1:{blob_port} HTTP/1.1\r\n\r\n".encode()
        t_proxy = min(_drain(port, tunnel) for _ in range(blobs))
        t_direct = min(_drain(blob_port, None) for _ in range(blobs))
    finally:
        relay.kill()
        relay.wait()
        loop.call_soon_threadsafe(proxy.close_door, door)
        asyncio.run_coroutine_threadsafe(proxy.__aexit__(None, None, None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        small.shutdown()
        lsn.close()
    mb = BLOB / 1e6
    rate, raw_rate = mb / t_proxy, mb / t_direct
    with_bridge, without = _command_start()
    return [
        _row(
            "egress: a command's sandbox made on the spot, with the bridge (bwrap, `true`)",
            with_bridge,
            without,
            "<= +25 ms",
            with_bridge - without <= 25.0,
        ),
        _row(
            "egress: one HTTP request through bridge + proxy (new connection, median)",
            through,
            direct,
            "<= direct + 2 ms",
            through - direct <= 2.0,
        ),
        _row(
            f"egress: {BLOB >> 20} MiB through a CONNECT tunnel "
            f"({rate:,.0f} MB/s; direct {raw_rate:,.0f} MB/s)",
            t_proxy * 1000,
            t_direct * 1000,
            ">= 100 MB/s",
            rate >= 100,
        ),
    ]


if __name__ == "__main__":
    for row in run():
        print(row)
