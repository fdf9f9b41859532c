"""The egress proxy: one per orch process, between every run whose network is an
allow-list and the world.

Each run gets a :class:`Door`: a Unix socket of its own in the proxy's directory (in orch's
private root, ``fs/private.py``: mode 0700, never under ``TMPDIR`` nor ``/tmp``, hidden
from every sandbox), bound into that run's sandbox only, and a random token its bridge
(:mod:`.bridge`) says first; the door holds the run's :class:`~.rules.Reach` and where its
``egress`` events go. A run reaches no other run's door, and what it opens counts against
its own caps (``MAX_OPEN``, derived from the process's descriptor limit), never another's.
After the token comes one request head (:mod:`.heads`). The host name is checked against
the list, resolved here (``resolve``: the system's resolver, in threads of the proxy's own,
a few at a time per run; a test gives its own), and each address it gives checked again
(:meth:`Reach.check_address`); the proxy connects to the address it checked, never
resolving twice. A refusal is a ``403`` whose body is one line saying why. Each request is
one ``egress`` event: host, port, allowed or not, the reason, the address, bytes each way
(a run's first ``MAX_EVENTS``; the rest are counted in one last event when its door
closes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hmac
import os
import resource
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from ..fs import private
from . import bridge
from .heads import Refused, Request, parse_head, refusal
from .rules import Reach, as_address

Resolver = Callable[[str, int], Awaitable[list[str]]]
Report = Callable[[dict[str, Any]], None]

HEAD_MAX = 64 * 1024
HELLO_S = 5.0  # the bridge's token line (it says it at once)
HEAD_S = 30.0  # the request head
RESOLVE_S = 10.0
CONNECT_S = 10.0
CHUNK = 256 * 1024
MAX_EVENTS = 1000  # a run's egress events; more are counted, not stored
MAX_OPEN = 256  # a run's connections at once (each holds two of our descriptors), at most
RESOLVING = 4  # a run's names being resolved at once
DNS_THREADS = 16
WANT_FILES = 65536  # the descriptor limit the proxy raises its process's to, if it may


def open_cap() -> int:
    """A run's connections at once: ``MAX_OPEN``, fewer where the process may hold few
    descriptors (first raised as far as the hard limit lets: ``raise_files``)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN
    return max(8, min(MAX_OPEN, soft // 16))


def raise_files() -> None:
    """The soft descriptor limit up to ``WANT_FILES`` (or the hard limit), as servers do."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = WANT_FILES if hard == resource.RLIM_INFINITY else min(hard, WANT_FILES)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _lookup(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(eq=False)  # a door is itself (hashed by identity)
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
    server: asyncio.Server | None = None
    resolving: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(RESOLVING))

    def env(self) -> dict[str, str]:
        """The proxy variables of the run's commands (upper and lower case: tools read
        either). Loopback goes around the proxy (to the sandbox's own) unless the list names
        a loopback address: then it is the host's, through the proxy."""
        url = f"http://127.0.0.1:{bridge.PORT}"
        no_proxy = "" if self.reach.names_loopback() else "localhost,127.0.0.1,::1"
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
        return bridge.argv(python, self.token, argv)

    def daemon(self, python: str = "python3") -> list[str]:
        """The bridge as a container starts it once."""
        return bridge.argv(python, self.token, None)

    def note(self, event: dict[str, Any]) -> None:
        if self.events >= MAX_EVENTS:
            self.unreported += 1
            return
        self.events += 1
        with contextlib.suppress(Exception):  # a store hiccup never breaks a connection
            self.report(event)


def _bound(path: Path) -> socket.socket:
    """A Unix socket bound at ``path`` (through its directory's descriptor when the path is
    longer than a socket address may be: a long HOME)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if len(os.fsencode(path)) < 100:
            sock.bind(str(path))
        else:
            fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
            try:
                sock.bind(f"/proc/self/fd/{fd}/{path.name}")
            finally:
                os.close(fd)
    except OSError:
        sock.close()
        raise
    return sock


class EgressProxy:
    """The proxy (see the module's doc); ``async with`` it, then admit a door per run."""

    def __init__(self, *, resolve: Resolver | None = None) -> None:
        self.resolve = resolve or self._system_resolve
        self.dir = Path()
        self._doors: set[Door] = set()
        self._dns: concurrent.futures.ThreadPoolExecutor | None = None
        self._cap = MAX_OPEN

    async def __aenter__(self) -> Self:
        # in orch's private root (hidden from every sandbox), never where TMPDIR says: a
        # TMPDIR in a checkout, or outside /tmp, would show every run's door to every sandbox
        self.dir = private.temp_dir("egress", "")  # 0700
        raise_files()
        self._cap = open_cap()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        tasks = [t for door in self._doors for t in door.tasks]
        for door in list(self._doors):
            self.close_door(door)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._dns is not None:
            self._dns.shutdown(wait=False, cancel_futures=True)
        private.remove(self.dir)

    async def open_door(self, reach: Reach, report: Report) -> Door:
        return await self.admit(Door.new(reach, report))

    async def admit(self, door: Door) -> Door:
        """``door``'s socket, listening from now until ``close_door``."""
        door.socket = self.dir / f"{secrets.token_hex(8)}.sock"
        door.server = await asyncio.start_unix_server(
            functools.partial(self._serve, door), sock=_bound(door.socket), limit=HEAD_MAX
        )
        os.chmod(door.socket, 0o666)  # a container's user connects to the mounted socket
        self._doors.add(door)
        return door

    def close_door(self, door: Door) -> None:
        """No new connection through ``door``; its open ones are cut."""
        if door not in self._doors:
            return
        self._doors.discard(door)
        if door.server is not None:
            door.server.close()
        with contextlib.suppress(OSError):
            door.socket.unlink()
        for task in list(door.tasks):
            task.cancel()
        if door.unreported:
            with contextlib.suppress(Exception):
                door.report({"more": door.unreported, "allowed": None})

    async def _system_resolve(self, host: str, port: int) -> list[str]:
        if self._dns is None:  # threads of our own: a slow name holds none of the loop's
            self._dns = concurrent.futures.ThreadPoolExecutor(DNS_THREADS, "orch-egress-dns")
        return await asyncio.get_running_loop().run_in_executor(self._dns, _lookup, host, port)

    # -- one connection -----------------------------------------------------------------

    async def _serve(
        self, door: Door, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        if door not in self._doors:
            writer.transport.abort()
            return
        if len(door.tasks) >= self._cap:
            reason = f"more than {self._cap} connections at once"
            door.note({"allowed": False, "reason": reason})
            writer.write(refusal(429, reason))
            writer.transport.close()  # (a fresh socket takes the answer whole)
            return
        door.tasks.add(task)
        try:
            async with asyncio.timeout(HELLO_S):
                hello = await reader.readuntil(b"\n")
            said = hello.removeprefix(bridge.HELLO).strip()
            if hello.startswith(bridge.HELLO) and hmac.compare_digest(said, door.token.encode()):
                await self._request(door, reader, writer)
        except (OSError, EOFError, ValueError, asyncio.LimitOverrunError, TimeoutError):
            pass  # the client went, or sent no request
        finally:
            door.tasks.discard(task)
            writer.transport.abort()

    async def _request(
        self, door: Door, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        async with asyncio.timeout(HEAD_S):
            head = await reader.readuntil(b"\r\n\r\n")
        started = time.monotonic()
        event: dict[str, Any] = {"allowed": False}
        try:
            request = parse_head(head)
            event |= {"method": request.method, "host": request.host, "port": request.port}
            address = await self._decide(door, request)
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

    async def _decide(self, door: Door, request: Request) -> str:
        reach, host = door.reach, request.host
        if (why := reach.check_name(host, request.port)) != "":
            raise Refused(403, why)
        literal = as_address(host)
        if literal is not None:
            candidates = [literal]
        else:
            try:
                async with door.resolving:  # a few at a time: its slow names are its own
                    async with asyncio.timeout(RESOLVE_S):
                        found = await self.resolve(host, request.port)
            except (OSError, TimeoutError) as e:
                raise Refused(502, f"cannot resolve {host}: {e or 'timed out'}") from None
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
            async with asyncio.timeout(CONNECT_S):
                return await asyncio.open_connection(address, port, limit=CHUNK)
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


class Egress:
    """A process's egress proxy, started by the first run that needs it and stopped when
    the last such run ends (``opened``)."""

    def __init__(self, resolve: Resolver | None = None) -> None:
        self.resolve = resolve
        self._proxy: EgressProxy | None = None
        self._stack = contextlib.AsyncExitStack()  # the running proxy's lifetime
        self._users = 0
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def opened(self, door: Door) -> AsyncIterator[Door]:
        """``door`` open through the process's proxy (started for it if none runs)."""
        async with self._lock:
            if self._proxy is None:
                started = EgressProxy(resolve=self.resolve)
                self._proxy = await self._stack.enter_async_context(started)
            self._users += 1
            proxy = self._proxy
        try:
            await proxy.admit(door)
            yield door
        finally:
            proxy.close_door(door)
            async with self._lock:
                self._users -= 1
                if self._users == 0 and self._proxy is proxy:
                    self._proxy = None
                    await self._stack.aclose()  # the proxy's __aexit__: its directory goes
