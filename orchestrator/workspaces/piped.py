"""A long-lived process inside a workspace, with pipes to it (``Runtime.start``).

What an MCP server of a run is to orch: bytes to its stdin, bytes from its stdout, the last
of its stderr (for the one line that says why it died), and ``stop``, which kills it with
its process group. Each tier starts it where its commands run: under the run's bubblewrap
(``spare.Shell.start``) or inside its container (``container.piped``), never on the host.
"""

from __future__ import annotations

from typing import Protocol

STDERR_TAIL = 4096  # bytes of a piped process's stderr kept (the rest is dropped)


class Piped(Protocol):
    async def send(self, data: bytes) -> None:
        """Write to its stdin; ConnectionError once it is gone."""

    async def receive(self) -> bytes:
        """The next bytes of its stdout (at most 64 KiB); b"" at its end."""

    def stderr_tail(self) -> str:
        """The last ``STDERR_TAIL`` bytes of its stderr, decoded."""

    async def stop(self) -> None:
        """Kill it and its process group, and forget it (twice is harmless)."""


class Tail:
    """The last ``STDERR_TAIL`` bytes of a stream."""

    def __init__(self) -> None:
        self.data = b""

    def add(self, chunk: bytes) -> None:
        self.data = (self.data + chunk)[-STDERR_TAIL:]

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")
