"""Serving the dashboard: on loopback only, on a port of its own, with a fresh token.

:func:`listen` binds the socket first (``port=0``: a free one), so the URL printed names
the real port; :func:`serve` runs uvicorn on it until interrupted.
"""

from __future__ import annotations

import asyncio
import html
import ipaddress
import os
import secrets
import socket
from pathlib import Path

import uvicorn

from ..errors import UsageError
from ..fs import private
from ..store import RunStore
from .app import Dashboard

LOOPBACK_NAMES = {"localhost"}


def loopback(host: str) -> str:
    """``host`` if it is a loopback address (UsageError otherwise: use an SSH forward)."""
    if host in LOOPBACK_NAMES:
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is not None and str(address) in ("127.0.0.1", "::1"):
        return str(address)
    raise UsageError(
        f"the dashboard listens on loopback only (127.0.0.1 or ::1), not {host!r}; from "
        "another machine use "
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
        self.app.guard.allow_port(self.port, self.host)
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

    def close(self) -> None:
        """The socket, when the server never ran (it closes it when it did)."""
        self.sock.close()

    def run(self) -> None:
        asyncio.run(self.serve())

    def opener(self) -> Path:
        """A page of the user's own (mode 0600, in orch's private root: hidden from every
        sandbox, never under ``TMPDIR``) that sends the browser to the dashboard with a
        one-time code, not the token: the token is in no process's command line and in no
        file, and the code opens one session, once (the page is removed when it is used)."""
        where = private.private_dir("dashboard")
        path = where / f"open-{secrets.token_hex(8)}.html"
        code = self.app.guard.one_time_code(lambda: path.unlink(missing_ok=True))
        shown = f"[{self.host}]" if ":" in self.host else self.host
        url = f"http://{shown}:{self.port}/?code={code}"
        page = (
            '<!doctype html><meta charset="utf-8"><meta name="referrer" content="no-referrer">'
            f'<meta http-equiv="refresh" content="0;url={html.escape(url)}">'
            f'<p><a href="{html.escape(url)}">Open the orch dashboard</a></p>'
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(page)
        return path
