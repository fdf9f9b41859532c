"""The host tiers' execution: commands under the OS sandbox, files opened race-free.

:func:`confined` wraps a host-tier command in bubblewrap (``osbox``; ``spare.Shell``
runs it, in a sandbox made ahead where it can): the filesystem read-only but the workspace,
``.git`` read-only, a private ``/tmp`` and ``/proc`` (orch's process is not visible), no
network unless ``network = "host"`` (an allow-list: only orch's egress proxy, through a
bridge in the sandbox: ``egress``), a whitelisted environment (never an API key), secret
paths and the store hidden. Without bwrap it fails closed, unless ``sandbox.os = "off"``.

Every file operation goes through :mod:`orchestrator.fs.safefs`: the path is opened
beneath the workspace root's directory descriptor, no symlink is followed and
hard links, FIFOs and devices are refused, so a process that shares the
workspace (a leftover of an agent's command) cannot swap a directory for a
symlink between a check and the open. Reads are capped before any byte is
loaded. Commands run through the workspace's own ``exec`` (the tier decides
how: plain, under the OS sandbox, or in a container).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import stat
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from ..bwrap.profile import (
    OsSandbox,
    SandboxUnavailable,
    available,
    bwrap_choice,
    default_hidden,
    sandbox_env,
)
from ..errors import OrchError
from ..fs.safefs import Beneath, UnsafePath
from .base import FileRead, ProcessResult, WorkspaceSpec
from .hiding import hidden_reason, private_paths
from .piped import Piped
from .saved import BwrapUsed

SKIP_DIRS = frozenset({".git", ".orch", "node_modules", "__pycache__", ".venv"})
GREP_FILE_BYTES = 2 * 1024 * 1024  # a larger file is searched in its first 2 MiB only
GREP_LINE_CHARS = 300

Exec = Callable[..., Awaitable[ProcessResult]]
Start = Callable[[list[str], Mapping[str, str], Mapping[str, str]], Awaitable[Piped]]
CHAIN_ENV = ("ORCH_CHAIN_ID", "ORCH_PARENT_RUN_ID", "ORCH_DEPTH")
# orch's interpreter and package, read-only inside the sandbox even where the private /tmp
# would cover them, so an `orch` started by a command finds itself (and joins the chain)
ORCH_ITSELF = (Path(sys.prefix), Path(__file__).resolve().parents[2])
ALLOW_NEEDS_SANDBOX = (
    'a network allow-list needs the OS sandbox: set sandbox.os = "bwrap" (or network = '
    '"host" to run unsandboxed on the whole network)'
)


def os_sandbox_mode(spec: WorkspaceSpec) -> str:
    """How the run's host-tier commands are confined: "bwrap" or "off" (unsandboxed); raises
    SandboxUnavailable (the fix in one line) when bwrap is asked for and cannot run here: a
    host tier fails closed at start."""
    mode = spec.sandbox.os
    if mode == "bwrap" and (reason := available(spec.sandbox.bwrap)) is not None:
        raise SandboxUnavailable(reason)
    if mode == "off" and spec.network.mode == "allow":
        raise OrchError(ALLOW_NEEDS_SANDBOX)
    return mode


def confinement(spec: WorkspaceSpec) -> dict[str, Any]:
    """The saved word (``saved.Confined``) on how a host tier's commands run: ``os_sandbox``
    ("bwrap" or "off"), ``bwrap`` (which one ran; None when off) and ``network``."""
    bwrap = None
    if spec.sandbox.os == "bwrap":
        choice = bwrap_choice(spec.sandbox.bwrap)
        bwrap = BwrapUsed(path=choice.path, version=choice.version, source=choice.source)
    return {"os_sandbox": spec.sandbox.os, "bwrap": bwrap, "network": spec.network.info()}


def confined(
    argv: list[str],
    *,
    spec: WorkspaceSpec,
    workspace: Path,
    read_only_within: tuple[Path, ...],
    env: Mapping[str, str],
    hidden_within: tuple[Path, ...] = (),
    more: Mapping[str, str] | None = None,
) -> tuple[list[str], Mapping[str, str]]:
    """``argv`` in ``workspace`` under the run's OS sandbox: the argv and the environment to
    start it with; ``hidden_within``: the workspace's own hidden paths (``hiding.hidden_rels``)
    as host paths; ``more``: set inside as given (an MCP server's declared ``env``: the
    repository's own values, never the host's), except orch's ``ORCH_*`` marks. Unchanged
    when ``sandbox.os = "off"``."""
    cfg = spec.sandbox
    if cfg.os == "off":
        if spec.egress is not None:  # nothing would keep its commands to the list
            raise OrchError(ALLOW_NEEDS_SANDBOX)
        return argv, env
    chain = {k: env[k] for k in CHAIN_ENV if k in env}
    box_env = {**sandbox_env(env, chain), **spec.extra_env}
    box_env |= {k: v for k, v in (more or {}).items() if not k.startswith("ORCH_")}
    home = Path(env.get("HOME") or "/")
    hidden = [home / p[2:] if p.startswith("~/") else Path(p) for p in cfg.hidden]
    if spec.state_dir is not None:
        hidden.append(spec.state_dir)
    hidden += hidden_within
    hidden += spec.store_paths  # every store it reaches
    hidden += private_paths()  # orch's private root (sockets' key, egress doors): issue 38
    # ~/.orch (the warm process's socket, user config) is hidden; a path that does not
    # exist cannot be, and would show once made during the command: make it now
    with contextlib.suppress(OSError):
        (Path(os.environ.get("HOME") or home) / ".orch").mkdir(mode=0o700, exist_ok=True)
    door = spec.egress
    if door is not None:  # no network of its own: the bridge to the proxy, and its address
        box_env |= door.env()
        argv = door.wrap(argv, sys.executable)
    box = OsSandbox(
        workspace=workspace,
        read_only_within=(*read_only_within, *ORCH_ITSELF),
        hidden=default_hidden(None, *hidden),
        network=spec.network.mode == "host",
        egress=door.socket if door is not None else None,
        env=box_env,
        bwrap=cfg.bwrap,
    )
    return box.wrap(argv, workspace), box.env


class HostRuntime:
    """Runtime over a host directory; ``exec`` is the tier's command runner. ``hidden``:
    the workspace-relative paths no file operation may open, list or search
    (``hiding.hidden_rels``), enforced by ``Beneath`` on the very path it opens."""

    def __init__(
        self,
        root: Path,
        exec_: Exec,
        hidden: tuple[str, ...] = (".orch",),
        expect: Callable[[Mapping[str, str]], None] | None = None,
        start: Start | None = None,
    ) -> None:
        self.root = root
        self._exec = exec_
        self.hidden = hidden
        self._expect = expect
        self._start = start

    async def start(
        self, argv: list[str], *, env: Mapping[str, str], more: Mapping[str, str]
    ) -> Piped:
        if self._start is None:
            raise OrchError("this workspace cannot start a long-lived process")
        return await self._start(argv, env, more)

    def expect(self, env: Mapping[str, str]) -> None:
        if self._expect is not None:
            self._expect(env)

    def _fs(self) -> Beneath:
        return Beneath(self.root, refuse=lambda rel: hidden_reason(rel, self.hidden))

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str]
    ) -> ProcessResult:
        return await self._exec(command, timeout_s=timeout_s, env=env)

    async def read_file(self, path: str, *, max_bytes: int) -> FileRead:
        def read() -> FileRead:
            with self._fs() as fs:
                data, size = fs.read(path, max_bytes)
            return FileRead(data, size)

        return await asyncio.to_thread(read)

    async def write_file(self, path: str, data: bytes) -> None:
        def write() -> None:
            with self._fs() as fs:
                fs.write(path, data)

        await asyncio.to_thread(write)

    async def glob(self, pattern: str, *, limit: int) -> tuple[list[str], bool]:
        def find() -> tuple[list[str], bool]:
            with self._fs() as fs:
                return fs.glob(pattern, limit=limit, skip_dirs=SKIP_DIRS)

        return await asyncio.to_thread(find)

    async def grep(
        self, pattern: str, *, path: str | None, glob: str | None, limit: int
    ) -> list[str]:
        regex = re.compile(pattern)

        def search() -> list[str]:
            hits: list[str] = []
            with self._fs() as fs:
                try:  # a named path hidden, or through a link, is refused here
                    named = fs.stat(path) if path else None
                except FileNotFoundError:
                    named = None
                if path and named is not None and not stat.S_ISDIR(named.st_mode):
                    fs.read(path, 0)  # one file, named: what is wrong with it is said
                    files = [path]
                else:
                    prefix = (path or "").strip("/")
                    sub = f"{prefix}/**/{glob or '*'}" if prefix else f"**/{glob or '*'}"
                    files, _ = fs.glob(sub, limit=100_000, skip_dirs=SKIP_DIRS)
                for rel in files:
                    try:
                        data, _ = fs.read(rel, GREP_FILE_BYTES)
                    except (OSError, UnsafePath):
                        continue  # unsafe, special or vanished: skipped, as glob skips it
                    if b"\x00" in data[:8192]:
                        continue
                    text = data.decode("utf-8", "replace")
                    for n, line in enumerate(text.splitlines(), 1):
                        if regex.search(line):
                            hits.append(f"{rel}:{n}: {line[:GREP_LINE_CHARS]}")
                            if len(hits) >= limit:
                                return hits
            return hits

        return await asyncio.to_thread(search)
