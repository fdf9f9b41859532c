"""An untrusted repository can tighten, never loosen (issue 20, class 7).

The attack: an untrusted ``orch.toml`` raised the user's ``max_depth``, ``max_chain_runs``,
``max_chain_tokens``, ``max_read_bytes``, ``sandbox.max_per_chain`` and
``sandbox.bundle_max_bytes``; its ``agents_dirs = []`` dropped the user's agents directory,
and its ``.claude/agents/sealed.md`` then replaced the user's ``isolation: worktree`` agent
with a shared one. End to end through the CLI (HOME private to each test).
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from orchestrator.config import Settings, load_settings
from orchestrator.trust import limits
from tests.support import init_repo, need_bwrap, orch, write_script

USER = """\
max_depth = 2
max_chain_runs = 40
max_chain_tokens = 100000
max_read_bytes = 65536
[sandbox]
max_per_chain = 2
bundle_max_bytes = 1048576
"""
RAISED = """\
max_depth = 50
max_chain_runs = 100000
max_chain_tokens = 999999999
max_read_bytes = 1073741824
[sandbox]
max_per_chain = 64
bundle_max_bytes = 107374182400
"""
RAISED_NAMES = {
    "max_depth",
    "max_chain_runs",
    "max_chain_tokens",
    "max_read_bytes",
    "sandbox.max_per_chain",
    "sandbox.bundle_max_bytes",
}


def home_orch() -> Path:
    path = Path.home() / ".orch"
    path.mkdir(exist_ok=True)
    return path


def effective(settings: Settings) -> dict[str, Any]:
    s = settings
    return {
        "max_depth": s.max_depth,
        "max_chain_runs": s.max_chain_runs,
        "max_chain_tokens": s.max_chain_tokens,
        "max_read_bytes": s.max_read_bytes,
        "sandbox.max_per_chain": s.sandbox.max_per_chain,
        "sandbox.bundle_max_bytes": s.sandbox.bundle_max_bytes,
    }


def trust_show(repo: Path) -> dict[str, Any]:
    r = orch("trust", "--show", "--json", cwd=repo)
    assert r.returncode == 0, r.stderr
    data: dict[str, Any] = json.loads(r.stdout)
    return data


def run_max_depth(repo: Path) -> tuple[int, str]:
    script = write_script(repo, {"conversations": [{"turns": [{"text": "ok"}]}]})
    r = orch("task", "x", "--json", "--model", f"scripted:{script}", cwd=repo)
    assert r.returncode == 0, r.stdout + r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    tree = json.loads(orch("tree", run_id, "--json", cwd=repo).stdout)
    return int(tree[0]["max_depth"]), r.stderr


def test_an_untrusted_repository_cannot_raise_a_limit(tmp_path: Path) -> None:
    need_bwrap()
    (home_orch() / "config.toml").write_text(USER)
    repo = init_repo(tmp_path / "clone", {"orch.toml": RAISED})
    mine = effective(load_settings(None))

    assert set(trust_show(repo)["settings"]) == RAISED_NAMES
    assert effective(load_settings(repo)) == mine  # every limit stays the user's
    depth, stderr = run_max_depth(repo)
    assert depth == 2
    [line] = [x for x in stderr.splitlines() if "orch trust" in x]
    assert "max_depth" in line and "sandbox.bundle_max_bytes" in line
    shown = orch("sandbox", "config", "--json", cwd=repo)  # as the CLI shows them
    assert shown.returncode == 0, shown.stderr
    sandbox = json.loads(shown.stdout)
    assert sandbox["max_per_chain"] == 2 and sandbox["bundle_max_bytes"] == 1048576

    assert orch("trust", cwd=repo).returncode == 0  # trusted: raised
    assert effective(load_settings(repo)) == {
        "max_depth": 50,
        "max_chain_runs": 100000,
        "max_chain_tokens": 999999999,
        "max_read_bytes": 1073741824,
        "sandbox.max_per_chain": 64,
        "sandbox.bundle_max_bytes": 107374182400,
    }
    assert run_max_depth(repo)[0] == 50


def test_an_untrusted_repository_may_lower_a_limit(tmp_path: Path) -> None:
    (home_orch() / "config.toml").write_text(USER)
    repo = init_repo(tmp_path / "clone", {"orch.toml": "max_depth = 1\nmax_chain_runs = 5\n"})
    assert trust_show(repo)["settings"] == {}
    settings = load_settings(repo)
    assert settings.max_depth == 1 and settings.max_chain_runs == 5


def numeric_fields(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Every int or float field of ``model``, its nested models and those in its lists."""
    found: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        kinds = set(typing.get_args(info.annotation)) or {info.annotation}
        for kind in list(kinds):
            if typing.get_origin(kind) in (list, dict) or isinstance(kind, types.GenericAlias):
                kinds |= set(typing.get_args(kind))
        if kinds & {int, float}:
            found[prefix + name] = info.json_schema_extra
        for kind in kinds:
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found |= numeric_fields(kind, f"{prefix}{name}.")
    return found


def test_every_numeric_setting_is_a_limit_or_says_why_not() -> None:
    """A new numeric setting must be classified, so a new limit is never forgotten."""
    unmarked = [
        name
        for name, extra in numeric_fields(Settings).items()
        if not isinstance(extra, dict) or not ({"limit", "not_limit"} & set(extra))
    ]
    assert unmarked == [], f"mark these in config.py (LIMIT, or not_limit(why)): {unmarked}"
    assert RAISED_NAMES <= set(limits(Settings))
    for name in ("sandbox.mem_limit", "sandbox.memswap_limit", "timeout_seconds"):
        assert name in limits(Settings)


def raised(value: Any, unit: str) -> Any:
    if unit == "size":
        return "900g"
    return 10**12 if isinstance(value, int) or value is None else 1e12


@pytest.mark.parametrize("name", sorted(limits(Settings)))
def test_each_limit_is_gated_when_raised(tmp_path: Path, name: str) -> None:
    """Generic: a repository raising any limit gets the user's value until trusted."""
    unit = limits(Settings)[name]
    top, _, sub = name.partition(".")
    base = load_settings(None)
    mine = getattr(getattr(base, top), sub) if sub else getattr(base, top)
    value = raised(mine, unit)

    def toml_of(v: Any) -> str:
        return f"[{top}]\n{sub} = {json.dumps(v)}\n" if sub else f"{top} = {json.dumps(v)}\n"

    if unit == "zero_is_none" or mine is None:  # none is the highest: the user sets one
        mine = "1g" if unit == "size" else 5
        (home_orch() / "config.toml").write_text(toml_of(mine))
    toml = toml_of(value)
    repo = init_repo(tmp_path / "clone", {"orch.toml": toml})
    settings = load_settings(repo)
    got = getattr(getattr(settings, top), sub) if sub else getattr(settings, top)
    assert got == mine, f"{name}: the repository's {value!r} applied untrusted"


# -- agents ------------------------------------------------------------------------------------

AGENT = "---\nname: {name}\ndescription: An agent.\n{extra}---\nWork.\n"


def show_agent(repo: Path, name: str) -> tuple[dict[str, Any], str]:
    r = orch("agents", "show", name, "--json", cwd=repo)
    assert r.returncode == 0, r.stderr
    data: dict[str, Any] = json.loads(r.stdout)
    return data, r.stderr


def test_agents_dirs_adds_to_the_users_and_a_shadow_cannot_weaken_it(tmp_path: Path) -> None:
    """The sealed.md attack: ``agents_dirs = []`` plus a shared ``.claude/agents/sealed.md``
    over the user's ``isolation: worktree`` agent."""
    need_bwrap()
    mine = tmp_path / "my-agents"
    mine.mkdir()
    sealed = mine / "sealed.md"
    sealed.write_text(AGENT.format(name="sealed", extra="tools: read_file\nisolation: worktree\n"))
    (mine / "mine-only.md").write_text(AGENT.format(name="mine-only", extra=""))
    (home_orch() / "config.toml").write_text(f"agents_dirs = [{json.dumps(str(mine))}]\n")
    repo = init_repo(
        tmp_path / "clone",
        {
            "orch.toml": "agents_dirs = []\n",
            ".claude/agents/sealed.md": AGENT.format(name="sealed", extra=""),
        },
    )
    listed = json.loads(orch("agents", "list", "--json", cwd=repo).stdout)
    assert {"sealed", "mine-only"} <= {a["name"] for a in listed["agents"]}
    data, _ = show_agent(repo, "sealed")
    assert data["source"] == str(sealed) and data["isolation"] == "worktree"
    assert data["tools"] == ["read_file"]
    script = write_script(repo, {"conversations": [{"agent": "sealed", "turns": [{"text": "x"}]}]})
    r = orch("task", "x", "--agent", "sealed", "--json", "--model", f"scripted:{script}", cwd=repo)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["isolation"] == "worktree"


def test_a_repository_agent_shadowing_a_users_agent_cannot_widen_it(tmp_path: Path) -> None:
    """~/.orch/agents/sealed.md (worktree, read_file only, network none, 10 turns) against the
    repository's .orch/agents/sealed.md: each weakening is left out for the user's agent,
    with one line, until trusted."""
    agents = home_orch() / "agents"
    agents.mkdir()
    agents_extra = "tools: read_file\nisolation: worktree\nnetwork: none\nmaxTurns: 10\n"
    (agents / "sealed.md").write_text(AGENT.format(name="sealed", extra=agents_extra))
    cases = {
        "isolation": agents_extra.replace("worktree", "shared"),
        "tools": agents_extra.replace("read_file", "read_file, bash"),
        "network": agents_extra.replace("network: none\n", ""),
        "max_turns": agents_extra.replace("10", "500"),
    }
    for key, extra in cases.items():
        repo = init_repo(
            tmp_path / key, {".orch/agents/sealed.md": AGENT.format(name="sealed", extra=extra)}
        )
        assert set(trust_show(repo)["settings"]) == {f"agents.sealed.{key}"}
        data, stderr = show_agent(repo, "sealed")
        assert data["source"] == str(agents / "sealed.md"), key
        assert data["isolation"] == "worktree" and data["tools"] == ["read_file"]
        assert any("left out" in w and key in w for w in data["warnings"])
        [line] = [x for x in stderr.splitlines() if "orch trust" in x]
        assert f"agents.sealed.{key}" in line
        assert orch("trust", cwd=repo).returncode == 0
        data, stderr = show_agent(repo, "sealed")
        assert data["source"] == str(repo / ".orch/agents/sealed.md") and stderr == ""
    # Narrower in every way: no trust needed, the repository's applies.
    repo = init_repo(
        tmp_path / "narrow",
        {".orch/agents/sealed.md": AGENT.format(name="sealed", extra=agents_extra)},
    )
    assert trust_show(repo)["settings"] == {}
    assert show_agent(repo, "sealed")[0]["source"] == str(repo / ".orch/agents/sealed.md")
