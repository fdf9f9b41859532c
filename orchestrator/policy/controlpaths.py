"""Control paths: what a merge of an agent's branch never takes without
``--allow-control-files`` (``branches.py``), and what a reviewer is shown first.

Files that configure orch, git, hooks or CI; that make an editor or an agent client run
commands on the host (MCP servers, tasks run on opening a folder, dev containers); or that
steer the next agent (memory and rule files). Anything named ``.git*`` (``.github/``,
``.gitattributes``, ``.gitmodules``) and the repository's hook directories too.
"""

from __future__ import annotations

from collections.abc import Sequence

CONTROL_FILES = frozenset(
    [
        ".cursorrules",
        ".envrc",
        ".mcp.json",
        ".pre-commit-config.yaml",
        ".travis.yml",
        ".windsurfrules",
        ".worktreeinclude",
        "AGENTS.md",
        "CLAUDE.local.md",
        "CLAUDE.md",
        "GEMINI.md",
        "Jenkinsfile",
        "azure-pipelines.yml",
        "bitbucket-pipelines.yml",
        "orch.toml",
    ]
)
CONTROL_DIRS = frozenset(
    [
        ".buildkite",
        ".circleci",
        ".claude",
        ".codex",
        ".cursor",
        ".devcontainer",
        ".gemini",
        ".githooks",
        ".husky",
        ".idea",
        ".orch",
        ".vscode",
    ]
)


def is_control_path(path: str, hooks_dirs: Sequence[str] = ()) -> bool:
    """Whether a changed path is a control path (:data:`CONTROL_FILES`, :data:`CONTROL_DIRS`,
    anything named ``.git*``, the repository's hook directories)."""
    parts = path.split("/")
    if any(p.startswith(".git") for p in parts):  # .gitattributes/.gitmodules/.github/...
        return True
    if parts[-1] in CONTROL_FILES or any(p in CONTROL_DIRS for p in parts):
        return True
    return any(d and (path == d or path.startswith(d.rstrip("/") + "/")) for d in hooks_dirs)
