"""Helpers for tests: build a Delegator over a scripted model and a real store."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from orchestrator.config import Settings
from orchestrator.definitions import Catalog, load_catalog
from orchestrator.delegation import Delegator
from orchestrator.models import ModelProvider, ScriptedModel
from orchestrator.run import RunRecord
from orchestrator.store import Store


@dataclass
class Harness:
    root: Path
    store: Store
    model: ScriptedModel
    delegator: Delegator
    catalog: Catalog

    def run(self, prompt: str = "do the thing", **kwargs: Any) -> RunRecord:
        return asyncio.run(self.delegator.run_root(prompt, workdir=self.root, **kwargs))

    def runs(self, chain_id: str) -> list[RunRecord]:
        return self.store.list_runs(chain_id=chain_id)

    def requests_of(self, run_id: str) -> list[Any]:
        return [r for r in self.model.requests if r.run_id == run_id]


def harness(
    root: Path,
    script: dict[str, Any] | str,
    *,
    agents_dirs: list[Path] | None = None,
    **settings: Any,
) -> Harness:
    text = script if isinstance(script, str) else yaml.safe_dump(script)
    model = ScriptedModel.from_yaml(text, "test-script")
    cfg = Settings(**settings)
    store = Store.for_project(root)
    catalog = load_catalog(root, agents_dirs=agents_dirs or [])
    provider = ModelProvider(cfg, scripted=model)
    delegator = Delegator(settings=cfg, store=store, catalog=catalog, models=provider)
    return Harness(root, store, model, delegator, catalog)


def task_call(prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "tool": "task",
        "input": {"description": extra.pop("description", "sub"), "prompt": prompt, **extra},
    }


def tool_results(request: Any) -> list[dict[str, Any]]:
    """The tool_result blocks of a request's last message."""
    content = request.messages[-1]["content"]
    return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]


def alive(pid: int) -> bool:
    """True while pid runs (a zombie waiting to be reaped by init does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def orch(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a child process, without any ANTHROPIC_* variable."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def write_script(where: Path, data: dict[str, Any], name: str = "script.yaml") -> Path:
    """A model script next to the project directory (never inside it)."""
    path = where.parent / name
    path.write_text(yaml.safe_dump(data))
    return path


def gone(pid: int, timeout: float = 5.0) -> bool:
    """True once pid has stopped running (a SIGKILLed process takes a moment to exit)."""
    end = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True
