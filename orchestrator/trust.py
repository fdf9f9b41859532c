"""Workspace trust: a repository's own settings that run commands or weaken isolation apply
only after the user trusts that repository, and only as they were when trusted.

A repository brings settings in its ``orch.toml`` and agent files in ``.orch/agents/``,
``.claude/agents/`` and the ``agents_dirs`` its ``orch.toml`` names. Most of them only steer
work that runs inside the sandbox; the ones below do not, and are **gated**: each is
trust-relevant when the repository's value is weaker than what would apply without the
repository's files (orch's defaults plus the user's ``~/.orch/config.toml``):

=========================  =================================================================
``hooks``                  any hook (every event) differing from the user's: they run on the
                           host, and the repository's table replaces the user's hooks
``network``                anything the user's does not reach (``"host"``, or an allow-list
                           entry the user's list does not cover): narrowing needs no trust
``extra_env``              a variable the user's ``extra_env`` does not set to that value
``bash_deny``              drops a rule (pattern or check) of the user's list or the default
``extra_bash_deny``        drops a rule of the user's list
``secret_env_patterns``    drops a pattern of the user's list or the default
``extra_secret_env``       drops a name of the user's list
``store``                  a run store URL differing from the user's: every prompt, output
                           and transcript would go to that server (recorded without password)
``sandbox.os``             ``"off"``
``sandbox.bwrap``          a path (not ``auto``, ``system``, ``bundled``) other than the user's:
                           that program would run on the host
``sandbox.network_mode``   anything but ``"none"`` (or the user's own value)
``sandbox.cap_drop``       drops a capability (``ALL`` by default)
``sandbox.security_opt``   any change (``no-new-privileges`` by default)
``sandbox.read_only``      ``false``
``sandbox.user/uid/gid``   any change
``sandbox.hidden``         drops a path of the user's list
``sandbox.env_whitelist``  adds a variable name
``model``                  a model that plays a script (``scripted:FILE``): orch would read
``model_aliases``          that file on the host (and a line of it could show in an error)
``endpoints``              an entry differing from the user's: prompts, and the key in the
                           variable it names, would go to a server the repository chose
``prices``                 an entry differing from the user's: a lower price would stretch
                           ``max_chain_usd``
``executor``, ``ray``      any change: runs (with the API key) would go to a cluster the
                           repository names
every limit                a numeric setting marked ``LIMIT`` in ``config.py`` (``max_depth``,
                           ``max_chain_runs``, ``max_chain_tokens``, ``max_read_bytes``,
                           ``sandbox.max_per_chain``, ``sandbox.bundle_max_bytes``, the
                           timeouts, sizes...) set higher than the user's (None, or 0 where
                           that means none, is the highest); found generically
                           (:func:`limits`), so a new limit cannot be forgotten
``agents.NAME.isolation``  an agent file of the repository (its ``.orch/agents``,
``agents.NAME.tools``      ``.claude/agents``, ``agents_dirs``) that replaces one of the
``agents.NAME.max_turns``  user's (``~/.orch/agents``, the user's ``agents_dirs``) or a bundled
``agents.NAME.network``    agent of the same name with a weaker ``isolation`` (written, or
                           left out: ``shared``), more tools (or agents it may start), more
                           turns, or a wider network; and any of its agents asking a
                           network the user's settings do not reach; found by
                           ``agent_trust.py``, which sits above
                           ``definitions``
``skills.NAME.replaces``   a skill of the repository (``.orch/skills``, ``.claude/skills``)
``mcp_servers.NAME.        or a server of its ``.mcp.json`` with the name (ignoring case) of
replaces``                 one of the user's (``~/.orch/skills``, ``~/.orch/mcp.json``) or a
                           bundled skill: the user's agent would follow its text, or call it,
                           as its own; value: its SHA-256 (``catalog/shadow.py``)
=========================  =================================================================

(A ``[sandbox]`` table in ``orch.toml`` replaces the user's whole table, so a key it leaves
out counts as set to its default.) Until the user runs ``orch trust``, the gated settings are
left out: a top-level key as if the repository had not set it, a ``sandbox`` key with the
value it would have without the repository's file (so a raised limit stays the user's: an
untrusted repository can lower a limit, never raise it), and a repository agent that would
weaken one of the user's, or a skill or server taking a name of the user's, is left out for
the user's own. Everything else of the
repository's settings applies.

Not gated: ``agents_dirs`` (a repository's list is added after the user's, never instead of
it: ``config.py``; what its agent files could weaken is checked above; a directory it names
is the repository's wherever it points, ``Trust.agents_dirs``, ``catalog/owner.py``),
``sandbox.image``, ``model`` naming a model of an API, ``worktree_include`` (files of the
repository itself): they steer what runs inside the sandbox, never what runs outside.

``orch trust`` records the repository (its resolved root) and the SHA-256 of the canonical
JSON (sorted keys, no spaces, UTF-8) of exactly the gated settings (name → value as validated,
hooks with every field) in ``~/.orch/trusted.json`` (mode 0600 in a 0700 directory, written
atomically under a lock), any change to them changes the hash, untrusted again::

    {"version": 1,
     "trusted": {"/home/me/src/repo": {"sha256": "<64 hex>", "settings": ["hooks", "sandbox.os"],
                                       "trusted_at": "2025-01-01T12:00:00Z"}}}
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from .bwrap.find import KEYWORDS as BWRAP_KEYWORDS
from .egress.rules import Reach
from .errors import UsageError
from .project.truststore import read_store, remember

# The top-level keys of orch.toml that hold gated settings (``sandbox`` for its gated keys).
_GATED_KEYS = (
    "hooks",
    "model",
    "model_aliases",
    "network",
    "extra_env",
    "bash_deny",
    "extra_bash_deny",
    "secret_env_patterns",
    "extra_secret_env",
    "store",
    "endpoints",
    "prices",
    "sandbox",
    "executor",
    "ray",
)


def limits(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """Every field of ``model`` (and of its nested models) marked a limit: dotted name → unit
    (``""``, ``"size"``, ``"zero_is_none"``). A higher value allows more."""
    found: dict[str, str] = {}
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if extra.get("limit") == "max":
            found[prefix + name] = str(extra.get("unit", ""))
        elif isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            found |= limits(info.annotation, f"{prefix}{name}.")
    return found


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([bkmgt]?)i?b?\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def _amount(value: Any, unit: str, other: Any = None) -> float:
    """A limit's value as a number; no limit is infinity, and so is one it cannot read."""
    if value is None:
        return _amount(other, unit) if unit == "size" and other is not None else float("inf")
    if unit == "size":
        m = _SIZE.match(str(value))
        return float(m.group(1)) * _UNITS[m.group(2).lower()] if m else float("inf")
    number = float(value)
    return float("inf") if unit == "zero_is_none" and number <= 0 else number


def _raises(theirs: Any, base: Any, name: str, unit: str) -> tuple[Any, bool]:
    """The repository's value of the limit ``name``, and whether it is above the user's."""

    def get(settings: Any, dotted: str) -> Any:
        for part in dotted.split("."):
            settings = getattr(settings, part)
        return settings

    t, b = get(theirs, name), get(base, name)
    if name == "sandbox.memswap_limit":  # None: equal to mem_limit
        t_other, b_other = theirs.sandbox.mem_limit, base.sandbox.mem_limit
    else:
        t_other = b_other = None
    return t, _amount(t, unit, t_other) > _amount(b, unit, b_other)


@dataclass(frozen=True)
class TrustCap:
    """The most another process may honour: the digest a run's launcher honoured, or None
    (nothing). A detached worker gets its launcher's, so it never applies more."""

    digest: str | None


@dataclass(frozen=True)
class AgentFloor:
    """A repository's agent file that weakens what it replaces, or asks a network the
    user's settings do not reach; or (``kind`` "teams") a team file that asks such a
    network or a model that reads a host file; or (``kind`` "skills", "mcp_servers") a
    skill or MCP server that takes the name of one of the user's (``catalog/shadow.py``).

    ``key`` is what it weakens (``isolation``, ``tools``, ``network``, ``models``...) and
    ``value`` its own value of that; ``replaces`` the file of the user's (or bundled) agent
    it replaces, or None for a definition of the repository's own."""

    name: str
    path: Path
    key: str
    value: Any
    replaces: Path | None = None
    bundled: bool = False  # ``replaces`` is a bundled agent
    kind: Literal["agents", "teams", "skills", "mcp_servers"] = "agents"


@dataclass(frozen=True)
class Trust:
    """The trust decision for one project: what is gated, its hash, and whether it applies."""

    root: Path | None = None
    relevant: dict[str, Any] = field(default_factory=dict)  # gated name → canonical value
    digest: str | None = None  # sha256 of canonical JSON of ``relevant``; None if it is empty
    recorded: str | None = None  # the digest the trust store holds for ``root``
    honoured: bool = False  # the gated settings apply (trusted, and within any cap)
    floors: tuple[AgentFloor, ...] = ()
    # the ``agents_dirs`` the repository's settings name and the user's do not: their
    # definitions are the repository's wherever they point (``catalog/owner.py``)
    agents_dirs: tuple[str, ...] = ()

    @property
    def trusted(self) -> bool:
        return self.digest is not None and self.recorded == self.digest

    @property
    def left_out(self) -> list[str]:
        """The names of the gated settings left out (empty when trusted or none exist)."""
        return [] if self.honoured else list(self.relevant)

    @property
    def honoured_digest(self) -> str | None:
        return self.digest if self.honoured else None

    def notice(self) -> str | None:
        """The one line saying what was left out and how to trust, or None."""
        if not self.left_out or self.root is None:
            return None
        names = ", ".join(self.left_out)
        where = "" if _inside(Path.cwd(), self.root) else f" -C {shlex.quote(str(self.root))}"
        if self.trusted:  # trusted now, but capped: its launcher ran without them
            why, again = f"this run was started while {self.root} was not trusted", " again"
        elif self.recorded is not None:
            why, again = f"the settings of {self.root} changed since you trusted them", " again"
        else:
            why, again = f"{self.root} is not a trusted repository", ""
        return (
            f"orch: {why}, so these of its settings were left out: {names}; review them with "
            f"`orch trust --show{where}`, then trust them{again} with `orch trust{where}`"
        )


# -- the gate -------------------------------------------------------------------------


def gate(
    root: Path | None,
    user: dict[str, Any],
    repo: dict[str, Any],
    view: Callable[[dict[str, Any]], Any],
    *,
    cap: TrustCap | None = None,
    floors: Sequence[AgentFloor] = (),
) -> tuple[dict[str, Any], Trust]:
    """The repository's settings (``repo``, its orch.toml as read) to merge, and the decision.

    ``user`` is the user's ``~/.orch/config.toml`` as read; ``view`` validates a dict of
    settings into a ``Settings`` (None if it cannot); ``floors`` are the repository's agent
    files that weaken an agent (``agent_trust.agent_floors``). Untrusted gated settings are
    taken out of what is returned.
    """
    if root is None:
        return repo, Trust()
    root = root.resolve()
    named = theirs_dirs(user, repo)
    bounds = limits(type(view({})))
    keys = dict.fromkeys([*_GATED_KEYS, *(name.split(".")[0] for name in bounds)])
    base = view({k: user[k] for k in keys if k in user}) or view({})
    theirs = view({k: repo[k] for k in keys if k in repo})
    if theirs is None:  # cannot be compared: every gated key it sets is gated (fail closed)
        relevant = {k: _jsonable(repo[k]) for k in keys if k in repo}
    else:
        relevant = _weaker(theirs, base, set(repo))
        for name, unit in bounds.items():
            if name.split(".")[0] in repo:
                value, raised = _raises(theirs, base, name, unit)
                if raised:
                    relevant[name] = _jsonable(value)
    for f in floors:
        relevant[f"{f.kind}.{f.name}.{f.key}"] = {"file": _shown_path(f.path, root), f.key: f.value}
    if not relevant:
        return repo, Trust(root=root, agents_dirs=named)
    digest = digest_of(relevant)
    recorded = read_store().get(str(root), {}).get("sha256")
    honoured = recorded == digest and (cap is None or cap.digest == digest)
    trust = Trust(root, relevant, digest, recorded, honoured, tuple(floors), named)
    if honoured:
        return repo, trust
    kept = {k: v for k, v in repo.items() if k not in relevant}
    for table in ("sandbox", "mcp"):  # a table's gated keys go back to the user's, one by one
        subs = [k.removeprefix(f"{table}.") for k in relevant if k.startswith(f"{table}.")]
        if subs:
            without = getattr(base, table).model_dump(mode="json")
            kept[table] = {**repo[table], **{k: without[k] for k in subs}}
    return kept, trust


def theirs_dirs(user: dict[str, Any], repo: dict[str, Any]) -> tuple[str, ...]:
    """The ``agents_dirs`` entries of the repository's settings the user's do not name."""

    def named(settings: dict[str, Any]) -> list[str]:
        dirs = settings.get("agents_dirs")
        return [str(d) for d in dirs] if isinstance(dirs, list) else []

    mine = named(user)
    return tuple(dict.fromkeys(d for d in named(repo) if d not in mine))


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


def _changed(theirs: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``theirs`` the user's ``base`` does not hold as they are."""
    return {k: v for k, v in theirs.items() if base.get(k) != v}


def _weaker(theirs: Any, base: Any, present: set[str]) -> dict[str, Any]:
    """The gated settings of ``theirs`` (keys in ``present``) weaker than ``base``."""
    found: dict[str, Any] = {}

    def check(name: str, value: Any, weaker: bool) -> None:
        if name.split(".")[0] in present and weaker:
            found[name] = _jsonable(value)

    check("hooks", theirs.hooks, theirs.hooks != base.hooks)
    check("network", theirs.network, not Reach.of(base.network).covers(Reach.of(theirs.network)))
    check("extra_env", theirs.extra_env, not theirs.extra_env.items() <= base.extra_env.items())
    check("bash_deny", theirs.bash_deny, _drops(_rules(base.bash_deny), _rules(theirs.bash_deny)))
    check(
        "extra_bash_deny",
        theirs.extra_bash_deny,
        _drops(_rules(base.extra_bash_deny), _rules(theirs.extra_bash_deny)),
    )
    check(
        "secret_env_patterns",
        theirs.secret_env_patterns,
        _drops(_upper(base.secret_env_patterns), _upper(theirs.secret_env_patterns)),
    )
    check(
        "extra_secret_env",
        theirs.extra_secret_env,
        _drops(_upper(base.extra_secret_env), _upper(theirs.extra_secret_env)),
    )
    from .models.registry import reads_host  # a script: orch reads that file

    check("model", theirs.model, reads_host(theirs.model) and theirs.model != base.model)
    scripts = {
        k: v
        for k, v in theirs.model_aliases.items()
        if reads_host(v) and base.model_aliases.get(k) != v
    }
    check("model_aliases", scripts, bool(scripts))
    check(
        "endpoints",
        _changed(theirs.endpoints, base.endpoints),
        bool(_changed(theirs.endpoints, base.endpoints)),
    )
    check(
        "prices", _changed(theirs.prices, base.prices), bool(_changed(theirs.prices, base.prices))
    )
    check("executor", theirs.executor, theirs.executor != base.executor)
    check("ray", theirs.ray, theirs.ray != base.ray)
    if theirs.store is not None and theirs.store != base.store:
        from .storeurl import redact  # the digest and `orch trust --show`: no password

        check("store", redact(theirs.store), True)
    t, b = theirs.sandbox, base.sandbox
    check("sandbox.os", t.os, t.os == "off" and b.os != "off")
    # a bwrap of the repository's choosing would run on the host: a path, unless it is the user's
    check("sandbox.bwrap", t.bwrap, t.bwrap not in BWRAP_KEYWORDS and t.bwrap != b.bwrap)
    check(
        "sandbox.network_mode",
        t.network_mode,
        t.network_mode != "none" and t.network_mode != b.network_mode,
    )
    check("sandbox.cap_drop", t.cap_drop, _drops(_caps(b.cap_drop), _caps(t.cap_drop)))
    check("sandbox.security_opt", t.security_opt, _opts(t.security_opt) != _opts(b.security_opt))
    check("sandbox.read_only", t.read_only, b.read_only and not t.read_only)
    check("sandbox.user", t.user, t.user != b.user)
    check("sandbox.uid", t.uid, t.uid != b.uid)
    check("sandbox.gid", t.gid, t.gid != b.gid)
    check("sandbox.hidden", t.hidden, _drops(set(b.hidden), set(t.hidden)))
    check(
        "sandbox.env_whitelist", t.env_whitelist, _drops(set(t.env_whitelist), set(b.env_whitelist))
    )
    return found


def _drops(before: set[Any], after: set[Any]) -> bool:
    return not before <= after


def _rules(rules: Iterable[Any]) -> set[tuple[str | None, str | None]]:
    return {(r.pattern, r.check) for r in rules}


def _upper(names: Iterable[str]) -> set[str]:
    return {n.upper() for n in names}


def _caps(caps: Iterable[str]) -> set[str]:
    return {c.upper().removeprefix("CAP_") for c in caps}


def _opts(opts: Iterable[str]) -> set[str]:
    nnp = {"no-new-privileges:true", "no-new-privileges=true"}
    return {"no-new-privileges" if o.strip().lower() in nnp else o.strip() for o in opts}


def digest_of(relevant: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON (sorted keys, no spaces, UTF-8) of the gated settings."""
    text = json.dumps(relevant, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _inside(path: Path, root: Path) -> bool:
    try:
        return path.resolve().is_relative_to(root.resolve())
    except OSError:
        return False


def _shown_path(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


# -- the trust store ----------------------------------------------------------------------


def record(trust: Trust) -> None:
    """Trust ``trust.root`` with exactly ``trust.relevant`` (its digest)."""
    if trust.root is None or trust.digest is None:
        raise UsageError("nothing to trust here: this repository has no gated settings")
    remember(trust.root, trust.digest, list(trust.relevant))
