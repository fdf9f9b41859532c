"""A long-lived process inside a run's container (an MCP server): a ``docker exec -i``.

The exec's socket carries the program's stdin one way and its stdout and stderr back,
multiplexed in docker's frames (8-byte header: stream, length). A task reads the frames
(a frame's length is capped before it is read) into a small queue (the reader waits when
the host is not reading: no buffer grows), stderr into a tail. ``stop`` kills the exec's
process group inside, then closes the socket; the container's removal ends it anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Mapping
from typing import Any

from ...errors import OrchError
from ..lifetime import stopped
from ..piped import Tail
from .channel import kill_exec_group
from .dockerexec import Sandbox, create_exec

FRAME_MAX = 1 << 20  # docker sends at most 32 KiB a frame; more is a broken stream
QUEUE = 16  # chunks of stdout waiting for the host


class ContainerPiped:
    def __init__(self, box: Sandbox, exec_id: str, wrapped: Any) -> None:
        self.box, self.exec_id, self.wrapped = box, exec_id, wrapped
        self.tail = Tail()
        self.out: asyncio.Queue[bytes] = asyncio.Queue(QUEUE)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self._pump: asyncio.Task[None] | None = None
        self._stopped = False
        self._stopping: asyncio.Future[None] | None = None

    async def open(self) -> None:
        sock = getattr(self.wrapped, "_sock", self.wrapped)
        self.reader, self.writer = await asyncio.open_connection(sock=sock)
        self._pump = asyncio.ensure_future(self._frames())

    async def _frames(self) -> None:
        assert self.reader is not None
        try:
            while True:
                header = await self.reader.readexactly(8)
                kind, size = struct.unpack(">BxxxL", header)
                if size > FRAME_MAX:
                    break
                data = await self.reader.readexactly(size)
                if kind == 1:
                    await self.out.put(data)
                else:
                    self.tail.add(data)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            await self.out.put(b"")

    async def send(self, data: bytes) -> None:
        if self.writer is None or self.writer.is_closing() or self._stopped:
            raise ConnectionResetError("the process is gone")
        self.writer.write(data)
        await self.writer.drain()

    async def receive(self) -> bytes:
        if self._stopped:
            return b""
        return await self.out.get()

    def stderr_tail(self) -> str:
        return self.tail.text()

    async def stop(self) -> None:
        """Once, whoever asks first; a cancelled caller leaves it running to its end, and the
        next caller waits for that."""
        self._stopped = True
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        api, cid = self.box.client.api, self.box.container_id
        with contextlib.suppress(Exception):
            info = await asyncio.to_thread(api.exec_inspect, self.exec_id)
            await asyncio.to_thread(kill_exec_group, int(info.get("Pid") or 0), cid)
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()
        if self._pump is not None:
            await stopped(self._pump)
        with contextlib.suppress(Exception):
            self.wrapped.close()


async def start_piped(
    box: Sandbox, argv: list[str], env: Mapping[str, str], more: Mapping[str, str]
) -> ContainerPiped:
    """``argv`` in ``/workspace`` as the sandbox user, with the whitelisted ``env`` and
    ``more`` (its declared environment) inside."""
    if box.dead:
        raise OrchError(box.dead)
    allowed = {k: v for k, v in env.items() if k in box.cfg.env_whitelist}
    allowed |= {k: v for k, v in more.items() if not k.startswith("ORCH_")}
    api, cid = box.client.api, box.container_id

    def create() -> tuple[str, Any]:
        exec_id = create_exec(api, cid, argv, user=box.user, env=allowed)
        return exec_id, api.exec_start(exec_id, socket=True)

    try:
        exec_id, wrapped = await asyncio.to_thread(create)
    except Exception as e:
        raise OrchError(f"the container could not start it ({str(e)[:200]})") from None
    piped = ContainerPiped(box, exec_id, wrapped)
    try:
        await piped.open()
    except BaseException:
        await piped.stop()
        raise
    return piped
