"""Serving the dashboard: on loopback only, on a port of its own, with a fresh token.

:func:`listen` binds the socket first (``port=0``: a free one), so the URL printed names
the real port; :func:`serve` runs uvicorn on it until interrupted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
from pathlib import Path

import uvicorn

from ..errors import UsageError
from ..store import RunStore
from .app import Dashboard

LOOPBACK_NAMES = {"localhost"}


def loopback(host: str) -> str:
    """``host`` if it is a loopback address (UsageError otherwise: use an SSH forward)."""
    if host in LOOPBACK_NAMES:
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        pass
    raise UsageError(
        f"the dashboard listens on loopback only, not {host!r}; from another machine use "
        "`ssh -L PORT:127.0.0.1:PORT this-host` (see docs/DASHBOARD.md)"
    )


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port} ({e.strerror}); try --port 0") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


class Served:
    """A dashboard bound to its socket: its URL, and the server to run."""

    def __init__(self, store: RunStore, root: Path, host: str = "127.0.0.1", port: int = 0):
        self.host = loopback(host)
        self.sock = listen(self.host, port)
        self.port = int(self.sock.getsockname()[1])
        self.token = secrets.token_urlsafe(32)
        self.app = Dashboard(store, root, self.token)
        self.app.guard.allow_port(self.port)
        shown = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{shown}:{self.port}/?token={self.token}"
        config = uvicorn.Config(self.app.guard, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)

    async def serve(self) -> None:
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            await self.app.aclose()
            self.sock.close()

    def stop(self) -> None:
        self.server.should_exit = True

    def run(self) -> None:
        asyncio.run(self.serve())
