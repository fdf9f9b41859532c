"""The container tier's :class:`~.base.Runtime`: every tool runs inside the sandbox.

``bash`` is a ``docker exec`` of the shell; ``read_file``, ``write_file``, ``glob`` and
``grep`` run :mod:`.inside.files` (stdlib-only Python) in the container (started by the
container's long-lived :mod:`.inside.server` exec, or by an exec of its own when that one is
gone) with one JSON request on its stdin and take one JSON reply plus raw bytes from its
stdout (the protocol and the path rule are in ``inside.files``'s docstring). Caps are enforced
inside (bytes read, walk entries, reply size) and again here: the host reads at most the
reply cap of a call and kills the call past it. The host never opens a path in the container's tree.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from ...errors import OrchError
from ...fs.safefs import UnsafePath
from ..base import FileRead, ProcessResult
from ..piped import Piped
from .dockerexec import Sandbox
from .inside import files as files_program

CALL_TIMEOUT_S = 120.0
HEADER_MAX = 64 * 1024
_SOURCE: list[str] = []


def files_source() -> str:
    """The text of :mod:`.inside.files`, run in the container as ``python3 -c``."""
    if not _SOURCE:
        _SOURCE.append(Path(files_program.__file__).read_text())
    return _SOURCE[0]


def parse_reply(out: bytes) -> tuple[dict[str, Any], bytes]:
    """The reply header and its raw bytes; OrchError when the program broke its protocol."""
    line, sep, body = out.partition(b"\n")
    try:
        reply = json.loads(line) if sep else None
    except ValueError:
        reply = None
    if not isinstance(reply, dict) or len(body) != int(reply.get("length", 0)):
        raise OrchError("the sandbox's file runtime gave no valid answer")
    return reply, body


def _raise(reply: dict[str, Any]) -> None:
    kind, message = reply.get("kind"), str(reply.get("message", ""))[:500]
    if kind == "not_found":
        raise FileNotFoundError(message)
    if kind == "is_dir":
        raise IsADirectoryError(message)
    if kind == "unsafe":
        raise UnsafePath(message)
    if kind == "bad_request":
        raise ValueError(message)
    raise OSError(message)


class ContainerRuntime:
    """Runtime of a container workspace; ``root`` is ``/workspace`` (what the model sees);
    ``hidden``: the workspace-relative paths the tools refuse (``hiding.hidden_rels``),
    sent with every request and enforced by :mod:`.inside.files` inside."""

    def __init__(
        self,
        box: Sandbox,
        run: Callable[[str, float, Mapping[str, str]], Awaitable[ProcessResult]],
        root: str,
        hidden: tuple[str, ...] = (".orch",),
    ) -> None:
        self.root = Path(root)
        self.box = box
        self._run = run
        self.hidden = hidden

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str]
    ) -> ProcessResult:
        return await self._run(command, timeout_s, env)

    def expect(self, env: Mapping[str, str]) -> None:
        return None  # the container is the sandbox, made at open

    async def start(
        self, argv: list[str], *, env: Mapping[str, str], more: Mapping[str, str]
    ) -> Piped:
        from .piped import start_piped

        return await start_piped(self.box, argv, env, more)

    async def call(
        self, request: dict[str, Any], data: bytes = b"", *, reply_cap: int
    ) -> tuple[dict[str, Any], bytes]:
        head = json.dumps({**request, "hidden": list(self.hidden), "size": len(data)})
        head += "\n"
        got = await self.box.call(
            ["python3", "-c", files_source()],
            head.encode() + data,
            out_cap=reply_cap + HEADER_MAX,
            timeout_s=CALL_TIMEOUT_S,
            via_server=True,
        )
        if got.overflow:
            raise OrchError("the sandbox's file runtime answered more than its cap; refused")
        if got.timed_out:
            raise OrchError(f"the sandbox's file runtime did not answer in {CALL_TIMEOUT_S:g}s")
        if got.code != 0:
            err = got.err.decode("utf-8", "replace").strip().splitlines()
            raise OrchError(f"the sandbox's file runtime failed: {(err or ['?'])[-1][:200]}")
        reply, body = parse_reply(got.out)
        if not reply.get("ok"):
            _raise(reply)
        return reply, body

    async def read_file(self, path: str, *, max_bytes: int) -> FileRead:
        reply, body = await self.call(
            {"op": "read", "path": path, "max_bytes": max_bytes}, reply_cap=max_bytes
        )
        return FileRead(body, int(reply["size"]))

    async def write_file(self, path: str, data: bytes) -> None:
        await self.call({"op": "write", "path": path}, data, reply_cap=0)

    async def glob(self, pattern: str, *, limit: int) -> tuple[list[str], bool]:
        _, body = await self.call(
            {"op": "glob", "pattern": pattern, "limit": limit}, reply_cap=files_program.MAX_REPLY
        )
        found = json.loads(body)
        return [str(p) for p in found["files"]][:limit], bool(found["more"])

    async def grep(
        self, pattern: str, *, path: str | None, glob: str | None, limit: int
    ) -> list[str]:
        request = {"op": "grep", "pattern": pattern, "path": path, "glob": glob, "limit": limit}
        _, body = await self.call(request, reply_cap=files_program.MAX_REPLY + 4096)
        return [str(h) for h in json.loads(body)["hits"]][:limit]

    async def prune(self, files: dict[str, str]) -> list[str]:
        """Delete the include copies whose content is unchanged (sha256 given)."""
        _, body = await self.call(
            {"op": "prune", "files": files}, reply_cap=files_program.MAX_REPLY
        )
        return [str(p) for p in json.loads(body)["removed"]]
