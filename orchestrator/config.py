"""Settings: every default in one place.

Precedence, lowest first: the defaults below, ``~/.orch/config.toml``,
``<project>/orch.toml``, environment (``ORCH_MODEL``, ``ORCH_MAX_DEPTH``), then
command-line flags. Unknown keys are an error, so a typo never goes unnoticed.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import UsageError

Isolation = Literal["shared", "worktree", "container"]
ISOLATIONS: tuple[str, ...] = ("shared", "worktree", "container")


class DenyRule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pattern: str  # regex, searched in each simple command of a bash line
    reason: str


DEFAULT_DENY: list[DenyRule] = [
    DenyRule(
        pattern=r"^(sudo\s+)?rm\s+(-[a-zA-Z]*\s+)*-[a-zA-Z]*[rR][a-zA-Z]*\s+(-[a-zA-Z]+\s+)*(/|~|\$HOME|/\*|\.\.?/?)(\s|$)",
        reason="recursive delete of /, ~, . or ..",
    ),
    DenyRule(pattern=r"^(sudo\s+)?mkfs(\.|\s|$)", reason="formats a filesystem"),
    DenyRule(pattern=r"^(sudo\s+)?dd\s+.*\bof=/dev/", reason="writes a raw device"),
    DenyRule(
        pattern=r"^(sudo\s+)?(shutdown|reboot|halt|poweroff)(\s|$)", reason="stops the machine"
    ),
    DenyRule(pattern=r"^sudo(\s|$)", reason="privilege escalation"),
    DenyRule(
        pattern=r"^git\s+(.*\s)?push\s+(.*\s)?(-f|--force)",
        reason="force push rewrites shared history",
    ),
    DenyRule(pattern=r"^git\s+(.*\s)?reset\s+(.*\s)?--hard", reason="discards uncommitted work"),
    DenyRule(pattern=r"^git\s+(.*\s)?clean\s+(.*\s)?-[a-zA-Z]*f", reason="deletes untracked files"),
    DenyRule(
        pattern=r"^git\s+(.*\s)?(-c\s*\S*(core\.|alias\.|credential\.|include\.)|--config-env|-c\s*\S*=)",
        reason="git config injection (-c / --config-env) can run arbitrary commands",
    ),
    DenyRule(
        pattern=r"^chmod\s+(-[a-zA-Z]*R[a-zA-Z]*\s+)\S+\s+/(\s|$)", reason="recursive chmod of /"
    ),
    DenyRule(pattern=r":\(\)\s*\{", reason="fork bomb"),
    DenyRule(
        pattern=r"^(curl|wget)\b.*\|\s*(ba|z|da)?sh\b", reason="pipes a download into a shell"
    ),
]

DEFAULT_SECRET_PATTERNS: list[str] = [
    "*KEY*",
    "*TOKEN*",
    "*SECRET*",
    "*PASSWORD*",
    "*PASSWD*",
    "*CREDENTIAL*",
    "ANTHROPIC_*",
    "AWS_*",
]


class HookCommand(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: str
    matcher: str = ".*"  # regex on the tool name (or agent name for Subagent* events)
    timeout_s: float = 30.0


class Hooks(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    pre_tool_use: list[HookCommand] = Field(default_factory=list, alias="PreToolUse")
    post_tool_use: list[HookCommand] = Field(default_factory=list, alias="PostToolUse")
    subagent_start: list[HookCommand] = Field(default_factory=list, alias="SubagentStart")
    subagent_stop: list[HookCommand] = Field(default_factory=list, alias="SubagentStop")


class SandboxSettings(BaseModel):
    """Container isolation (``[sandbox]`` in orch.toml): the image and its lockdown.

    The defaults are the locked-down ones; ``orch sandbox config`` prints the effective values.
    """

    model_config = ConfigDict(extra="forbid")

    image: str = "orch-sandbox:latest"
    network_mode: str = "none"
    cap_drop: list[str] = Field(default_factory=lambda: ["ALL"])
    security_opt: list[str] = Field(default_factory=lambda: ["no-new-privileges"])
    read_only: bool = True  # root filesystem; /tmp and $HOME are tmpfs
    tmp_size: str = "512m"
    home: str = "/home/agent"
    home_size: str = "256m"
    pids_limit: int = Field(default=256, ge=16)
    mem_limit: str = "2g"
    memswap_limit: str | None = None  # None: equal to mem_limit (no swap)
    cpus: float = Field(default=1.0, gt=0)
    init: bool = True
    uid: int = Field(default=10001, ge=1)  # the sandbox user when orch runs as root
    gid: int = Field(default=10001, ge=1)
    user: str | None = None  # "uid:gid" override; never 0
    env_whitelist: list[str] = Field(
        default_factory=lambda: ["LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ", "NO_COLOR"]
    )
    path: str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    shell: str = "bash"
    ttl_s: int = Field(default=6 * 3600, ge=10)  # the container's main process: sleep <ttl_s>
    pool_size: int = Field(default=0, ge=0)


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = "sonnet"
    model_aliases: dict[str, str] = Field(
        default_factory=lambda: {
            "sonnet": "claude-sonnet-4-5",
            "opus": "claude-opus-4-5",
            "haiku": "claude-haiku-4-5",
        }
    )
    max_tokens: int = 8192
    max_depth: int = Field(default=3, ge=0)
    max_turns: int = Field(default=30, ge=1)
    timeout_seconds: float | None = None  # per run; None: no limit
    max_parallel_children: int = Field(default=20, ge=1)
    bash_timeout_s: float = 120.0
    tool_timeout_s: float = 300.0  # any other tool call (bash: its own timeout + 15 s)
    tool_output_limit: int = 50_000
    child_output_limit: int = 32_000
    bash_deny: list[DenyRule] = Field(default_factory=lambda: list(DEFAULT_DENY))
    secret_env_patterns: list[str] = Field(default_factory=lambda: list(DEFAULT_SECRET_PATTERNS))
    extra_secret_env: list[str] = Field(default_factory=list)
    hooks: Hooks = Field(default_factory=Hooks)
    auto_background_after: float = 120.0  # seconds; 0 turns it off
    stall_timeout: float = 600.0
    worktree_include: list[str] = Field(default_factory=list)
    agents_dirs: list[str] = Field(default_factory=list)
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)

    def resolve_model(self, name: str | None) -> str:
        name = name or self.model
        return self.model_aliases.get(name, name)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path}: not valid TOML ({e}); fix or remove the file") from e
    return data.get("orch", data) if "orch" in data else data


def load_settings(project_root: Path | None = None, **overrides: Any) -> Settings:
    merged: dict[str, Any] = {}
    sources: list[Path] = [Path.home() / ".orch" / "config.toml"]
    if project_root is not None:
        sources.append(project_root / "orch.toml")
    for path in sources:
        if path.is_file():
            merged.update(_read_toml(path))
    if env_model := os.environ.get("ORCH_MODEL"):
        merged["model"] = env_model
    if env_depth := os.environ.get("ORCH_MAX_DEPTH"):
        merged["max_depth"] = env_depth
    merged.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Settings.model_validate(merged)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UsageError(
            f"bad setting {where!r}: {first['msg']} (check orch.toml, ~/.orch/config.toml or flags)"
        ) from e
