"""A started server's pipes as the MCP SDK's streams, every message a capped line.

The SDK's own stdio client starts the process itself (on the host) and reads a line of any
length; this one takes a process its run's tier started (``Runtime.start``: under bubblewrap
or in the container) and reads at most ``max_line`` bytes a message. A line over the cap,
one that is not JSON-RPC, or the end of its output breaks the link: :class:`Link` keeps the
one line that says why, the server is stopped at once, and the session's requests end
(``servers.py`` turns them into that line). Nothing the server sends grows memory past the
cap.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import mcp.types as types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from ..workspaces.piped import Piped

Streams = tuple[
    MemoryObjectReceiveStream[SessionMessage | Exception], MemoryObjectSendStream[SessionMessage]
]


class Link:
    """One server's link: why it broke (None while it works)."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.why: str | None = None

    def fail(self, why: str) -> None:
        if self.why is None:
            self.why = why


def _last_words(piped: Piped) -> str:
    lines = [ln.strip() for ln in piped.stderr_tail().splitlines() if ln.strip()]
    return f" (its stderr: {lines[-1][:200]})" if lines else ""


@asynccontextmanager
async def piped_streams(piped: Piped, link: Link, *, max_line: int) -> AsyncIterator[Streams]:
    """The (read, write) streams of a ``ClientSession`` over ``piped``."""
    read_send, read_recv = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_send, write_recv = anyio.create_memory_object_stream[SessionMessage](0)

    async def broken(why: str) -> None:
        link.fail(why)
        await piped.stop()

    async def reader() -> None:
        buf = bytearray()
        async with read_send:
            while chunk := await piped.receive():
                buf += chunk
                while (end := buf.find(b"\n")) >= 0:
                    line = bytes(buf[:end])
                    del buf[: end + 1]
                    if len(line) > max_line:
                        return await broken(f"it sent a message over {max_line:,} bytes")
                    if not line.strip():
                        continue
                    try:
                        msg = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                    except (ValidationError, ValueError):
                        return await broken("it sent a line that is not a JSON-RPC message")
                    try:
                        await read_send.send(SessionMessage(msg))
                    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                        return None
                if len(buf) > max_line:
                    return await broken(f"it sent a message over {max_line:,} bytes")
            await broken(f"it exited{_last_words(piped)}")

    async def writer() -> None:
        async with write_recv:
            async for message in write_recv:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                try:
                    await piped.send(data.encode() + b"\n")
                except (ConnectionError, OSError):
                    await broken(f"it stopped reading its input{_last_words(piped)}")
                    await read_send.aclose()
                    return

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(reader)
        tasks.start_soon(writer)
        try:
            yield read_recv, write_send
        finally:
            tasks.cancel_scope.cancel()
            for stream in (read_recv, write_send):
                await stream.aclose()
