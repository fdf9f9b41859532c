"""Executors are chosen by the type of their config: a new one is a module and one line in
``process/executor.py::EXECUTORS``, and the Runner hands it the runs it takes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from orchestrator.config import LocalExecution, RaySettings, Settings
from orchestrator.engine.runner import Runner
from orchestrator.process import executor as executors
from orchestrator.run import RunRecord, RunStatus
from tests.support import RUN_DEADLINE_S, harness, init_repo


class Elsewhere:
    """An executor that ends every run it is handed, with what its config said."""

    made: list[Elsewhere] = []

    def __init__(self, runner: Runner, config: RaySettings) -> None:
        self.runner, self.config = runner, config
        self.connected = False
        self.ran: list[str] = []
        Elsewhere.made.append(self)

    def connect(self) -> None:
        self.connected = True

    def takes(self, record: RunRecord) -> bool:
        return True

    async def run(self, record: RunRecord) -> RunRecord:
        self.ran.append(record.run_id)
        text = f"ran elsewhere with {self.config.num_cpus} cpus"
        ended = self.runner.store.end(record.run_id, RunStatus.SUCCEEDED, output=text)
        assert ended is not None
        return ended


def test_the_settings_choose_the_config_and_its_type_the_executor() -> None:
    assert isinstance(Settings().execution(), LocalExecution)
    chosen = Settings(executor="ray", ray={"num_cpus": 3}).execution()
    assert isinstance(chosen, RaySettings) and chosen.num_cpus == 3
    assert set(executors.EXECUTORS) == {"local", "ray"}
    assert executors.EXECUTORS["local"] is None


def test_a_new_executor_is_one_module_and_one_registry_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(executors.EXECUTORS, "ray", f"{__name__}:Elsewhere")
    root = init_repo(tmp_path / "repo")
    script = {"conversations": [{"depth": 0, "turns": [{"text": "the local loop ran it"}]}]}
    h = harness(root, script, executor="ray", ray={"num_cpus": 2.5})
    executors.attach(h.runner)
    made = Elsewhere.made[-1]
    assert h.runner.executor is made and made.connected and made.config.num_cpus == 2.5
    record = asyncio.run(asyncio.wait_for(h.runner.run(h.spec("hi")), RUN_DEADLINE_S))
    assert made.ran == [record.run_id]
    assert record.status == RunStatus.SUCCEEDED
    assert record.output == "ran elsewhere with 2.5 cpus"  # not the local loop's text


def test_local_execution_attaches_nothing(tmp_path: Path) -> None:
    script = {"conversations": [{"depth": 0, "turns": [{"text": "here"}]}]}
    h = harness(init_repo(tmp_path / "repo"), script)
    assert executors.attach(h.runner).executor is None
    assert h.run("hi").output == "here"
