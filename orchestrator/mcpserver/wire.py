"""The server's stdin and stdout as asyncio pipes, for the SDK's ``stdio_server``.

The SDK reads stdin in a worker thread that nothing can interrupt: a server told to stop
(SIGINT, SIGTERM) while its client keeps stdin open would never finish. Here both ends
are the event loop's own pipes, so stopping is a plain cancellation, and a message is
bounded (:data:`MAX_MESSAGE`): a longer one is dropped, never buffered whole.

As the SDK does, fds 0 and 1 are moved away while serving (0 reads ``/dev/null``, 1 writes
to stderr), so no stray write of a process orch starts can corrupt the wire.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import re
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from ..errors import UsageError

MAX_MESSAGE = 8 * 1024 * 1024  # bytes of one JSON-RPC message from the client
# a JSON escape of a lone UTF-16 surrogate (valid JSON, no valid text: the SDK drops such a
# request without an answer); an escaped backslash is matched first so it is never split
_ESCAPES = re.compile(
    r"(\\\\)|(\\u[dD][89abAB][0-9a-fA-F]{2})(\\u[dD][c-fC-F][0-9a-fA-F]{2})?"
    r"|(\\u[dD][c-fC-F][0-9a-fA-F]{2})"
)


def _no_lone_surrogate(m: re.Match[str]) -> str:
    if m.group(1) or (m.group(2) and m.group(3)):
        return m.group(0)
    return "\\ufffd"


log = logging.getLogger("orch.mcp")


class Lines:
    """What ``stdio_server`` reads: ``async for line in stdin``."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    def __aiter__(self) -> Lines:
        return self

    async def __anext__(self) -> str:
        while True:
            try:
                line = await self.reader.readuntil(b"\n")
            except asyncio.IncompleteReadError as e:
                if not e.partial:
                    raise StopAsyncIteration from None
                line = e.partial
            except asyncio.LimitOverrunError:
                await self._skip_long()
                continue
            text = line.decode("utf-8", errors="replace")
            return _ESCAPES.sub(_no_lone_surrogate, text) if "\\u" in text else text

    async def _skip_long(self) -> None:
        """Drop a message over the limit, up to its newline (never holding it whole)."""
        log.warning("a client message over %d bytes was dropped", MAX_MESSAGE)
        while True:
            try:
                await self.reader.readuntil(b"\n")
                return
            except asyncio.LimitOverrunError as e:
                await self.reader.readexactly(e.consumed)
            except asyncio.IncompleteReadError:
                return


class Out:
    """What ``stdio_server`` writes to: ``await write(text)``, ``await flush()``."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    async def write(self, text: str) -> None:
        self.writer.write(text.encode("utf-8", "replace"))  # a lone surrogate: never a lost answer

    async def flush(self) -> None:
        await self.writer.drain()


def _check_stdin() -> None:
    """A client talks to its server over a pipe (or a socket, or a terminal by hand)."""
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        raise UsageError("orch mcp has no stdin; let an MCP client start it") from None
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(0):
        return
    raise UsageError("orch mcp talks MCP over a pipe from its client, not a file or a device")


def _divert() -> tuple[int, int]:
    """Private copies of fds 0 and 1; 0 then reads /dev/null and 1 writes to stderr."""
    rfd = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    wfd = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    return rfd, wfd


@asynccontextmanager
async def stdio_pipes() -> AsyncIterator[tuple[Any, Any]]:
    """``(stdin, stdout)`` for ``stdio_server(stdin, stdout)``; fds 0 and 1 restored after."""
    _check_stdin()
    saved = (os.dup(0), os.dup(1))
    rfd, wfd = _divert()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_MESSAGE)
    try:
        try:
            rt, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(rfd, "rb", 0)
            )
            wt, wp = await loop.connect_write_pipe(
                asyncio.streams.FlowControlMixin, os.fdopen(wfd, "wb", 0)
            )
        except (ValueError, OSError) as e:  # what _check_stdin let through, and epoll refused
            raise UsageError(
                f"orch mcp cannot read its stdin ({e}); let an MCP client start it"
            ) from None
        writer = asyncio.StreamWriter(wt, wp, None, loop)
        try:
            yield Lines(reader), Out(writer)
        finally:
            rt.close()
            wt.close()
    finally:
        os.dup2(saved[0], 0)
        os.dup2(saved[1], 1)
        os.close(saved[0])
        os.close(saved[1])
