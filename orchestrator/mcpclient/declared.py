"""MCP servers as Claude Code declares them: ``.mcp.json``, ``~/.orch/mcp.json``, and an
agent file's ``mcpServers``.

``{"mcpServers": {NAME: {"type": "stdio" | "http" | "sse", "command", "args", "env",
"url", "headers"}}}``. The project's file is read from the user's checkout (where the
catalog comes from, never from a run's workspace), through ``safefs`` (no link followed,
capped); on a name clash the project's entry wins over ``~/.orch/mcp.json``, as Claude Code's
project scope wins over its user scope (the catalog leaves it out for the user's until the
repository is trusted: ``catalog/shadow.py``). A file that cannot be read or parsed, or a bad
entry, is one line naming the file and what to fix; an unknown key is a warning. Nothing
here starts anything: a declared stdio server runs only inside a run's sandbox
(``servers.py``), so a repository's file needs no trust. ``${VAR}`` is not expanded: values
are passed as written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..fs.safefs import Beneath, UnsafePath
from .names import server_name_ok

MAX_FILE_BYTES = 256 * 1024
PROJECT_FILE = ".mcp.json"
USER_FILE = ".orch/mcp.json"  # under $HOME
KEYS = frozenset({"type", "command", "args", "env", "url", "headers"})


class ServerDecl(BaseModel):
    """One declared server."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["stdio", "http", "sse"] = "stdio"
    command: str | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    source: str = ""  # where it was declared (a file, or an agent file's mcpServers)
    user: bool = False  # declared in ~/.orch/mcp.json: the user's (its env may hold secrets)

    @model_validator(mode="after")
    def _complete(self) -> ServerDecl:
        if self.type == "stdio" and not self.command:
            raise ValueError("a stdio server needs 'command'")
        if self.type != "stdio" and not self.url:
            raise ValueError(f"a {self.type} server needs 'url'")
        return self


@dataclass
class Declared:
    """The servers declared for a project, and what was wrong on the way."""

    servers: dict[str, ServerDecl] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def server_decl(name: str, raw: object, where: str, warnings: list[str]) -> ServerDecl:
    """One entry as a ServerDecl; ValueError with what to fix (one line)."""
    if not server_name_ok(name) or len(name) > 40:
        raise ValueError(
            f"server name {name[:60]!r}: use letters, digits, '-' and single '_' (at most 40)"
        )
    if not isinstance(raw, dict):
        raise ValueError(f"server {name!r} must be an object with 'command' or 'url'")
    unknown = sorted(str(k) for k in raw if k not in KEYS)
    if unknown:
        warnings.append(f"{where}: server {name!r}: {', '.join(unknown)} ignored")
    known = {k: v for k, v in raw.items() if k in KEYS}
    try:
        return ServerDecl.model_validate({**known, "source": where})
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        at = ".".join(str(p) for p in err["loc"])
        raise ValueError(
            f"server {name!r}: {at + ': ' if at else ''}{err['msg'].removeprefix('Value error, ')}"
        ) from None


def parse_servers(data: object, where: str, into: Declared, *, user: bool = False) -> None:
    """Add the ``mcpServers`` of one parsed file to ``into`` (names already there kept)."""
    if not isinstance(data, dict) or not isinstance(data.get("mcpServers", {}), dict):
        into.errors.append(f'{where}: expected {{"mcpServers": {{NAME: {{...}}}}}}')
        return
    for name, raw in data.get("mcpServers", {}).items():
        try:
            decl = server_decl(str(name), raw, where, into.warnings)
        except ValueError as e:
            into.errors.append(f"{where}: {e}")
            continue
        into.servers.setdefault(str(name), decl.model_copy(update={"user": user}))


def read_file(root: Path, rel: str, into: Declared, *, user: bool = False) -> None:
    """Read ``root/rel`` beneath ``root`` (no link followed, capped) into ``into``; a
    missing file is nothing."""
    where = str(root / rel)
    try:
        with Beneath(root) as fs:
            data, size = fs.read(rel, MAX_FILE_BYTES)
    except FileNotFoundError:
        return
    except (OSError, UnsafePath) as e:
        into.errors.append(f"{where}: cannot read it ({e})")
        return
    if size > MAX_FILE_BYTES:
        into.errors.append(f"{where}: {size:,} bytes, over the {MAX_FILE_BYTES:,} read")
        return
    try:
        parsed: Any = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        into.errors.append(f"{where}: not JSON ({str(e)[:120]})")
        return
    parse_servers(parsed, where, into, user=user)


def load_declared(project_root: Path | None, home: Path) -> Declared:
    """The servers of ``<project>/.mcp.json`` and then ``~/.orch/mcp.json``."""
    found = Declared()
    if project_root is not None and project_root.is_dir():
        read_file(project_root, PROJECT_FILE, found)
    if home.is_dir():
        read_file(home, USER_FILE, found, user=True)
    return found


def agent_servers(raw: object, where: str, warnings: list[str]) -> dict[str, ServerDecl | None]:
    """An agent file's ``mcpServers``: a list of names (declared elsewhere) and
    ``{NAME: config}`` entries, or one mapping of NAME to config (or null: a reference).
    ValueError (one line) when it is neither."""
    entries: list[tuple[str, object]] = []
    if isinstance(raw, dict):
        entries = [(str(k), v) for k, v in raw.items()]
    elif isinstance(raw, list):
        for item in raw:
            if isinstance(item, str):
                entries.append((item, None))
            elif isinstance(item, dict) and len(item) == 1:
                ((k, v),) = item.items()
                entries.append((str(k), v))
            else:
                raise ValueError(
                    "'mcpServers' entries are server names or {NAME: {command: ...}}, "
                    f"not {str(item)[:60]!r}"
                )
    else:
        raise ValueError("'mcpServers' must be a list of server names or {NAME: config}")
    out: dict[str, ServerDecl | None] = {}
    for name, value in entries:
        if value is None:
            if not server_name_ok(name):
                raise ValueError(f"'mcpServers': {name[:60]!r} is not a server name")
            out[name] = None
        else:
            out[name] = server_decl(name, value, where, warnings)
    return out
