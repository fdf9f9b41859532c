"""Control paths: what a merge of an agent's branch never takes without
``--allow-control-files`` (``branches.py``), and what every diff a person or a reviewer
sees lists first (``teams/review.py``).

The rule is inverted: not a list of the files known to be dangerous, but everything that is
not plainly the project's own program. A path is a control path when

- any of its parts is a dot-name (``.mcp.json``, ``.github/``, ``lib/.envrc``,
  ``.gitattributes``, ``.vscode/``, ``.husky/``, ``.npmrc``...): dot-files and
  dot-directories at any level are where tools keep the settings they act on by themselves;
- its name (case-insensitively: a case-insensitive file system opens ``claude.md`` as
  ``CLAUDE.md``) is one of :data:`CONTROL_NAMES`, starts with one of
  :data:`CONTROL_PREFIXES` or ends with one of :data:`CONTROL_SUFFIXES`: the maintained list
  of configuration without a dot;
- it lies in a hook directory the repository's git config names (``core.hooksPath``);
- or it is a manifest whose *install-time* parts changed (:func:`control_content`):
  ``package.json``'s lifecycle scripts and git-hook keys, ``pyproject.toml``'s build system
  and package indexes, ``composer.json``'s scripts and repositories.

What the list holds, and the line it draws: configuration that makes a tool run a command
or reach a host *by itself*, without the user choosing to run the project: CI and deploy
services (run with the repository's secrets on a push), agent clients (rules the next agent
obeys, MCP servers it starts), editors (tasks on opening a folder), shell environment loaders
(direnv, mise, devbox), git-hook managers (lefthook, lint-staged), package managers
(registries, lifecycle scripts, toolchains they download and run), the Python interpreter's
own start-up files (``sitecustomize.py``, ``*.pth``), and orch's own settings. The project's
build and test code (``Makefile``, ``setup.py``, ``build.rs``, ``CMakeLists.txt``,
``conftest.py``) and its dependency lists are program: what a reviewer reads as code (a gate
with ``gate_from = "base"`` keeps the base's tests, ``teams/gatefrom.py``).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from typing import Any

CONTROL_NAMES = frozenset(
    [
        # orch
        "orch.toml",
        # CI and deploy services
        "azure-pipelines.yml",
        "azure-pipelines.yaml",
        "bitbucket-pipelines.yml",
        "appveyor.yml",
        "appveyor.yaml",
        "cloudbuild.yaml",
        "cloudbuild.yml",
        "cloudbuild.json",
        "buildspec.yml",
        "buildspec.yaml",
        "codemagic.yaml",
        "bitrise.yml",
        "wercker.yml",
        "action.yml",  # a repository's own GitHub Action (`uses: ./`)
        "action.yaml",
        "netlify.toml",
        "vercel.json",
        "now.json",
        "render.yaml",
        "fly.toml",
        "app.json",  # Heroku: scripts run at deploy
        "procfile",
        "renovate.json",
        "renovate.json5",
        # agent clients: rules the next agent obeys, servers it starts
        "agents.md",
        "agent.md",
        "claude.md",
        "claude.local.md",
        "gemini.md",
        "qwen.md",
        "crush.md",
        "warp.md",
        "opencode.json",
        "opencode.jsonc",
        # shell environment loaders and git-hook managers
        "mise.toml",
        "mise.local.toml",
        "devbox.json",
        "lefthook.yml",
        "lefthook.yaml",
        "lefthook.json",
        "lefthook.toml",
        "lefthook-local.yml",
        "lefthook-local.yaml",
        "lint-staged.config.js",
        "lint-staged.config.mjs",
        "lint-staged.config.cjs",
        "lint-staged.config.ts",
        "simple-git-hooks.js",
        "simple-git-hooks.cjs",
        "simple-git-hooks.json",
        # package managers: registries, toolchains they fetch and run, preloads
        "bunfig.toml",
        "pnpm-workspace.yaml",
        "uv.toml",
        "poetry.toml",
        "pdm.toml",
        "pip.conf",
        "pip.ini",
        "nuget.config",
        "rust-toolchain",
        "rust-toolchain.toml",
        "gradle-wrapper.properties",
        "gradle.properties",
        # the Python interpreter's own start-up files
        "sitecustomize.py",
        "usercustomize.py",
    ]
)
CONTROL_PREFIXES = ("jenkinsfile",)  # Jenkinsfile, Jenkinsfile.release
CONTROL_SUFFIXES = (".code-workspace", ".sublime-project", ".sublime-build", ".pth")

# manifests that are control paths when what they run at install (or where they fetch
# from) changes: the file's name -> the keys (dotted, top-level tables) compared
MANIFEST_KEYS: dict[str, tuple[str, ...]] = {
    "package.json": (
        *(f"scripts.{s}" for s in ("preinstall", "install", "postinstall", "dependencies")),
        *(f"scripts.{s}" for s in ("prepublish", "preprepare", "prepare", "postprepare")),
        *(f"scripts.{s}" for s in ("prepack", "postpack")),
        "husky",
        "simple-git-hooks",
        "gitHooks",
        "ghooks",
        "pre-commit",
        "lint-staged",
        "packageManager",
        "publishConfig",
    ),
    "pyproject.toml": (
        "build-system",
        "tool.uv",
        "tool.poetry.source",
        "tool.pdm.source",
        "tool.hatch.build.hooks",
    ),
    "composer.json": ("scripts", "repositories"),
}
MANIFEST_BYTES = 1_000_000  # a larger manifest counts as a control path whole


def is_control_path(path: str, hooks_dirs: Sequence[str] = ()) -> bool:
    """Whether a changed path is a control path by its name alone (see the module)."""
    parts = path.split("/")
    if any(p.startswith(".") for p in parts):
        return True
    name = parts[-1].casefold()
    if (
        name in CONTROL_NAMES
        or name.startswith(CONTROL_PREFIXES)
        or name.endswith(CONTROL_SUFFIXES)
    ):
        return True
    return any(d and (path == d or path.startswith(d.rstrip("/") + "/")) for d in hooks_dirs)


def manifest_kind(path: str) -> str | None:
    """The manifest :func:`control_content` judges ``path`` by, if it is one."""
    name = path.rsplit("/", 1)[-1].casefold()
    return name if name in MANIFEST_KEYS else None


def _parsed(kind: str, data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return {}
    try:
        text = data.decode("utf-8")
        value = tomllib.loads(text) if kind.endswith(".toml") else json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _at(data: dict[str, Any], dotted: str) -> Any:
    value: Any = data
    for key in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def control_content(path: str, old: bytes | None, new: bytes | None) -> bool:
    """Whether a manifest's change (``old``/``new``: its bytes, None where it is missing)
    touches what runs at install or where packages come from. A manifest that is too large
    or does not parse on either side counts (what a tool would make of it is unknown)."""
    kind = manifest_kind(path)
    if kind is None:
        return False
    if any(d is not None and len(d) > MANIFEST_BYTES for d in (old, new)):
        return True
    before, after = _parsed(kind, old), _parsed(kind, new)
    if before is None or after is None:
        return True
    return any(_at(before, k) != _at(after, k) for k in MANIFEST_KEYS[kind])
