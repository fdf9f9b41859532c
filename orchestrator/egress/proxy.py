"""The egress proxy: one per orch process, on a Unix socket, between every run whose
network is an allow-list and the world.

A sandbox reaches it only through its bridge (:mod:`.bridge`), which says the run's token
first: the token is the run's :class:`Door` (its :class:`~.rules.Reach` and where its
``egress`` events go), so one socket serves every run of the process and a run cannot
borrow another's list. After the token comes one HTTP request head: ``CONNECT host:port``
(a tunnel: HTTPS, or anything else to an allowed port) or a plain-HTTP request in absolute
form (``GET http://host/...``; sent on with ``Connection: close``). The host name is checked
against the list, resolved here (``resolve``: the system's resolver unless a test gives
one), and each address it gives checked again (:meth:`Reach.check_address`); the proxy
connects to the address it checked, never resolving twice. A refusal is a ``403`` whose
body is one line saying why. Each request is one ``egress`` event: host, port, allowed or
not, the reason, the address, bytes each way (a run's first ``MAX_EVENTS``; the rest are
counted in one last event when its door closes).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

from . import bridge as bridge_program
from .rules import Reach, as_address, normal_name

Resolver = Callable[[str, int], Awaitable[list[str]]]
Report = Callable[[dict[str, Any]], None]

BRIDGE_PORT = 3128  # the bridge's port inside every sandbox (its own network namespace)
SOCKET_INSIDE = "/run/orch-egress.sock"  # where a sandbox sees the proxy's socket
HEAD_MAX = 64 * 1024
HELLO_S = 10.0  # the bridge's token line
HEAD_S = 30.0  # the request head
RESOLVE_S = 10.0
CONNECT_S = 10.0
CHUNK = 256 * 1024
LOOPBACK = {4: ipaddress.ip_network("127.0.0.0/8"), 6: ipaddress.ip_network("::1/128")}
MAX_EVENTS = 1000  # a run's egress events; more are counted, not stored
MAX_OPEN = 256  # a run's connections open at once (each holds two of our descriptors)
MAX_CONNECTIONS = 2048  # the process's, said hello or not


async def system_resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass
class Door:
    """One run's way through the proxy: made with its spec (``Door.new``), open while the
    run's workspace is (``Egress.opened`` sets ``socket``)."""

    token: str
    socket: Path
    reach: Reach
    report: Report
    events: int = 0
    unreported: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def env(self) -> dict[str, str]:
        """The proxy variables of the run's commands (upper and lower case: tools read
        either). Loopback goes around the proxy (to the sandbox's own) unless the list names
        a loopback address: then it is the host's, through the proxy."""
        url = f"http://127.0.0.1:{BRIDGE_PORT}"
        loop = any(
            r.network is not None and r.network.overlaps(LOOPBACK[r.network.version])
            for layer in self.reach.layers
            for r in layer
        )
        no_proxy = "" if loop else "localhost,127.0.0.1,::1"
        out: dict[str, str] = {}
        for name, value in [("http_proxy", url), ("https_proxy", url), ("all_proxy", url)]:
            out[name] = out[name.upper()] = value
        out["no_proxy"] = out["NO_PROXY"] = no_proxy
        return out

    @classmethod
    def new(cls, reach: Reach, report: Report) -> Door:
        return cls(secrets.token_urlsafe(24), Path(), reach, report)

    def wrap(self, argv: list[str], python: str) -> list[str]:
        """``argv`` behind the bridge (a host tier's command): ``python`` runs it."""
        bridge = str(Path(bridge_program.__file__).resolve())
        return [
            python,
            "-I",
            "-S",
            bridge,
            str(BRIDGE_PORT),
            SOCKET_INSIDE,
            self.token,
            "--",
            *argv,
        ]

    def daemon(self, python: str = "python3") -> list[str]:
        """The bridge as a container starts it once (its source as ``-c``)."""
        source = Path(bridge_program.__file__).read_text()
        return [
            python,
            "-I",
            "-S",
            "-c",
            source,
            str(BRIDGE_PORT),
            SOCKET_INSIDE,
            self.token,
            "--daemon",
        ]

    def note(self, event: dict[str, Any]) -> None:
        if self.events >= MAX_EVENTS:
            self.unreported += 1
            return
        self.events += 1
        with contextlib.suppress(Exception):  # a store hiccup never breaks a connection
            self.report(event)


@dataclass
class Request:
    method: str
    host: str
    port: int
    tunnel: bool
    forward: bytes = b""  # a plain-HTTP request's head as the server gets it


class Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


class EgressProxy:
    """The proxy (see the module's doc); ``async with`` it, then open a door per run."""

    def __init__(self, *, resolve: Resolver | None = None) -> None:
        self.resolve = resolve or system_resolve
        self.socket = Path()
        self._dir: str | None = None
        self._server: asyncio.Server | None = None
        self._doors: dict[str, Door] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Self:
        self._dir = tempfile.mkdtemp(prefix="orch-egress-")  # 0700: only we reach it here
        self.socket = Path(self._dir) / "proxy.sock"
        self._server = await asyncio.start_unix_server(
            self._serve, path=str(self.socket), limit=HEAD_MAX
        )
        os.chmod(self.socket, 0o666)  # a container's user connects to the mounted socket
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def open_door(self, reach: Reach, report: Report) -> Door:
        return self.admit(Door.new(reach, report))

    def admit(self, door: Door) -> Door:
        """Let ``door``'s token through, from now until ``close_door``."""
        door.socket = self.socket
        self._doors[door.token] = door
        return door

    def close_door(self, door: Door) -> None:
        """No new connection through ``door``; its open ones are cut."""
        self._doors.pop(door.token, None)
        for task in list(door.tasks):
            task.cancel()
        if door.unreported:
            with contextlib.suppress(Exception):
                door.report({"more": door.unreported, "allowed": None})

    # -- one connection -----------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._tasks) >= MAX_CONNECTIONS:
            writer.transport.abort()
            return
        self._tasks.add(task)
        door: Door | None = None
        try:
            hello = await asyncio.wait_for(reader.readuntil(b"\n"), HELLO_S)
            door = self._doors.get(hello.removeprefix(b"ORCH-EGRESS ").strip().decode("ascii"))
            if door is None or not hello.startswith(b"ORCH-EGRESS "):
                return
            if len(door.tasks) >= MAX_OPEN:
                writer.write(refusal(429, f"more than {MAX_OPEN} connections at once"))
                await writer.drain()  # (a fresh socket takes it whole: abort loses nothing)
                return
            door.tasks.add(task)
            await self._request(door, reader, writer)
        except (OSError, EOFError, ValueError, asyncio.LimitOverrunError, TimeoutError):
            pass  # the client went, or sent no request
        finally:
            self._tasks.discard(task)
            if door is not None:
                door.tasks.discard(task)
            writer.transport.abort()

    async def _request(
        self, door: Door, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_S)
        started = time.monotonic()
        event: dict[str, Any] = {"allowed": False}
        try:
            request = parse_head(head)
            event |= {"method": request.method, "host": request.host, "port": request.port}
            address = await self._decide(door.reach, request)
            event["address"] = address
            up_reader, up_writer = await self._connect(address, request.port)
        except Refused as r:
            event["reason"] = r.reason
            door.note(event)
            writer.write(refusal(r.status, r.reason))
            with contextlib.suppress(OSError):
                await writer.drain()
            return
        event |= {"allowed": True, "sent": 0, "received": 0}
        try:
            if request.tunnel:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                up_writer.write(request.forward)
            sent, received = await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
            event["sent"], event["received"] = sent + len(request.forward), received
        finally:
            up_writer.transport.abort()
            event["ms"] = round((time.monotonic() - started) * 1000, 1)
            door.note(event)

    async def _decide(self, reach: Reach, request: Request) -> str:
        host = request.host
        if (why := reach.check_name(host, request.port)) != "":
            raise Refused(403, why)
        literal = as_address(host)
        if literal is not None:
            candidates = [literal]
        else:
            try:
                found = await asyncio.wait_for(self.resolve(host, request.port), RESOLVE_S)
            except (OSError, TimeoutError) as e:
                raise Refused(502, f"cannot resolve {host}: {e}") from None
            candidates = [a for a in map(as_address, found) if a is not None]
            if not candidates:
                raise Refused(502, f"cannot resolve {host}: no address")
        first = ""
        for address in candidates:
            why = reach.check_address(host, request.port, address)
            if not why:
                return str(address)
            first = first or why
        raise Refused(403, first)

    async def _connect(
        self, address: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(address, port, limit=CHUNK), CONNECT_S
            )
        except (OSError, TimeoutError) as e:
            raise Refused(502, f"cannot connect to {address}:{port}: {e or 'timed out'}") from None


async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> int:
    """Copy until ``src`` ends (then end ``dst``'s side); the bytes copied. A broken side
    aborts the other, so its pump ends too."""
    copied = 0
    try:
        while chunk := await src.read(CHUNK):
            dst.write(chunk)
            copied += len(chunk)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except OSError:
        dst.transport.abort()
    return copied


def parse_head(head: bytes) -> Request:
    """The request a head asks for; :class:`Refused` (400) when it is no proxy request."""
    try:
        text = head.decode("latin-1")
        line, *headers = text[:-4].split("\r\n")
        method, target, version = line.split(" ")
    except ValueError:
        raise Refused(400, "not an HTTP proxy request") from None
    if not version.startswith("HTTP/1."):
        raise Refused(400, f"unsupported protocol {version[:20]!r}")
    if method == "CONNECT":
        host, port = split_target(target)
        return Request(method, host, port, tunnel=True)
    url = urlsplit(target)
    if url.scheme not in ("http", "") or (url.scheme == "" and not target.startswith("/")):
        raise Refused(400, f"only http:// is proxied in the clear (use CONNECT for {url.scheme})")
    authority = url.netloc
    if not authority:
        hosts = [h.split(":", 1)[1].strip() for h in headers if h.lower().startswith("host:")]
        authority = hosts[0] if hosts else ""
    host, port = split_target(authority, default=80)
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    hop = ("proxy-connection:", "proxy-authorization:", "connection:", "keep-alive:")
    kept = [h for h in headers if not h.lower().startswith(hop)]
    forward = "\r\n".join([f"{method} {path} {version}", *kept, "Connection: close", "", ""])
    return Request(method, host, port, tunnel=False, forward=forward.encode("latin-1"))


def split_target(target: str, default: int | None = None) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as a normal name and a port; :class:`Refused` (400)."""
    host, port_text = target, ""
    if target.startswith("["):
        inside, _, rest = target[1:].partition("]")
        host, port_text = inside, rest.removeprefix(":")
    elif target.count(":") == 1:
        host, _, port_text = target.partition(":")
    if not port_text and default is not None:
        port_text = str(default)
    name = normal_name(host)
    if name is None or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise Refused(400, f"not a host:port: {target[:100]!r}")
    return name, int(port_text)


def refusal(status: int, reason: str) -> bytes:
    words = {400: "Bad Request", 403: "Forbidden", 429: "Too Many", 502: "Bad Gateway"}[status]
    body = f"orch egress: {reason}\n".encode()
    head = (
        f"HTTP/1.1 {status} {words}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nX-Orch-Egress: refused\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class Egress:
    """A process's egress proxy, started by the first run that needs it and stopped when
    the last such run ends (``opened``)."""

    def __init__(self, resolve: Resolver | None = None) -> None:
        self.resolve = resolve
        self._proxy: EgressProxy | None = None
        self._users = 0
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def opened(self, door: Door) -> AsyncIterator[Door]:
        """``door`` open through the process's proxy (started for it if none runs)."""
        async with self._lock:
            if self._proxy is None:
                self._proxy = await EgressProxy(resolve=self.resolve).__aenter__()
            self._users += 1
            proxy = self._proxy
        proxy.admit(door)
        try:
            yield door
        finally:
            proxy.close_door(door)
            async with self._lock:
                self._users -= 1
                if self._users == 0 and self._proxy is proxy:
                    self._proxy = None
                    await proxy.__aexit__(None, None, None)
