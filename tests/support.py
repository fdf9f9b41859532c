"""Helpers for tests: build a Runner over a scripted model and a real store."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.bwrap.profile import bwrap_choice
from orchestrator.catalog.definitions import Catalog, load_catalog
from orchestrator.config import Settings
from orchestrator.engine.execution import Provision
from orchestrator.engine.runner import Runner
from orchestrator.models import ModelProvider, ScriptedModel
from orchestrator.run import RunRecord
from orchestrator.spec import Limits, RunSpec
from orchestrator.store import SqliteStore
from orchestrator.teams.kinds import KIND, team_driver
from orchestrator.workspaces.registry import tier_config

RUN_DEADLINE_S = 300.0  # no test's run takes this long: it hangs


@dataclass
class Harness:
    root: Path
    store: SqliteStore
    model: ScriptedModel
    runner: Runner
    catalog: Catalog

    def spec(
        self,
        prompt: str = "do the thing",
        *,
        agent: str | None = None,
        isolation: str | None = None,
        max_turns: int | None = None,
        timeout_seconds: float | None = None,
    ) -> RunSpec:
        return RunSpec(
            prompt=prompt,
            agent=agent,
            workdir=self.root,
            workspace=tier_config(isolation) if isolation else None,
            limits=Limits(max_turns=max_turns, timeout_seconds=timeout_seconds),
        )

    def run(self, prompt: str = "do the thing", **kwargs: Any) -> RunRecord:
        """The run, to its end; a run that does not end in RUN_DEADLINE_S fails the test."""
        run = self.runner.run(self.spec(prompt, **kwargs))
        return asyncio.run(asyncio.wait_for(run, RUN_DEADLINE_S))

    def runs(self, chain_id: str) -> list[RunRecord]:
        return self.store.list_runs(chain_id=chain_id)

    def requests_of(self, run_id: str) -> list[Any]:
        return [r for r in self.model.requests if r.run_id == run_id]


def harness(
    root: Path,
    script: dict[str, Any] | str,
    *,
    agents_dirs: list[Path] | None = None,
    provision: Provision | None = None,
    **settings: Any,
) -> Harness:
    text = script if isinstance(script, str) else yaml.safe_dump(script)
    model = ScriptedModel.from_yaml(text, "test-script")
    cfg = Settings(**settings)
    store = SqliteStore.for_project(root)
    catalog = load_catalog(root, agents_dirs=agents_dirs or [])
    provider = ModelProvider(cfg, scripted=model)
    runner = Runner(
        settings=cfg,
        store=store,
        catalog=catalog,
        models=provider,
        provision=provision,
        drivers={KIND: team_driver},
    )
    return Harness(root, store, model, runner, catalog)


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


def need_bwrap(setting: str = "auto") -> str:
    """The path of the bwrap ``setting`` picks (``$ORCH_BWRAP`` wins: the suite sets it to
    "bundled", tests/conftest.py); skips with the reason where it cannot make a sandbox,
    fails instead under CI=true."""
    found = bwrap_choice(setting)
    if found.path is None:
        which = os.environ.get("ORCH_BWRAP") or setting
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the OS sandbox ({which} bwrap) cannot run: {found.reason}")
        pytest.skip(f"the OS sandbox ({which} bwrap) cannot run here: {found.reason}")
    return found.path


def write_script(where: Path, data: dict[str, Any], name: str = "script.yaml") -> Path:
    """A model script next to the project directory (never inside it)."""
    path = where.parent / name
    path.write_text(yaml.safe_dump(data))
    return path


def wait_for(
    pred: Callable[[], Any], timeout: float = 30, what: str = "", interval: float = 0.1
) -> Any:
    """Poll ``pred`` until it returns something truthy, and return that; fail at ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(interval)
    raise AssertionError(
        f"timed out waiting for {what}" if what else "condition not reached in time"
    )


def gone(pid: int, timeout: float = 5.0) -> bool:
    """True once pid has stopped running (a SIGKILLed process takes a moment to exit)."""
    end = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def host_pids(marker: str) -> list[int]:
    """Pids (in this PID namespace) of processes whose command line holds ``marker``.

    Commands run under the OS sandbox in a PID namespace of their own, so ``$$`` and
    ``$!`` written by them are not host pids: tests find them by a unique marker.
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def none_left(marker: str, timeout: float = 5.0) -> bool:
    """True once no process with ``marker`` in its command line runs."""
    end = time.monotonic() + timeout
    while host_pids(marker):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def git(cwd: Path, *args: str) -> str:
    """Run git in ``cwd`` as a user would (tests run under the hermetic-env guards)."""
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()


def init_repo(root: Path, files: dict[str, str] | None = None, *, branch: str = "main") -> Path:
    """A git repository at ``root`` with ``files`` committed on ``branch`` by The User."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in (files or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root, "init", "-q", "-b", branch)
    git(root, "config", "user.name", "The User")
    git(root, "config", "user.email", "user@example.com")
    git(root, "config", "commit.gpgsign", "false")
    git(root, "add", "-A")
    git(root, "commit", "-q", "--allow-empty", "-m", "init")
    return root


SANDBOX_IMAGE = "orch-sandbox:latest"


def _unavailable(why: str) -> None:
    """Skip for ``why``; under CI=true, fail: CI starts every engine the tests need."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {why}")
    pytest.skip(why)


def need_docker() -> None:
    """A reachable Docker engine; skips without one (fails under CI=true)."""
    from orchestrator.errors import OrchError
    from orchestrator.workspaces.container.docker import docker_client

    try:
        docker_client().close()
    except OrchError as e:
        _unavailable(f"no Docker engine is reachable: {e}")


def sandbox_image() -> str:
    """orch-sandbox:latest on a reachable engine; skips without one (fails under CI=true)."""
    need_docker()
    found = subprocess.run(["docker", "image", "inspect", SANDBOX_IMAGE], capture_output=True)
    if found.returncode != 0:
        _unavailable(f"{SANDBOX_IMAGE} is missing: run `orch sandbox build`")
    return SANDBOX_IMAGE


def spy_transactions(store: Any) -> list[list[str]]:
    """From now on, every transaction of a SQL store's dialect, as the statements it ran
    (a list a transaction, in order)."""
    from contextlib import contextmanager

    said: list[list[str]] = []
    transaction = store.dialect.transaction

    @contextmanager
    def spied() -> Any:
        sql: list[str] = []
        said.append(sql)
        with transaction() as q:

            def spy(text: str, args: Any) -> Any:
                sql.append(text)
                return q(text, args)

            yield spy

    store.dialect.transaction = spied
    return said
