"""`orch demo` leaves nothing behind, however it ends, unless --keep (orchestrator/demo/)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from orchestrator.demo import demo_project
from tests.support import orch, wait_for


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    """The demo's TMPDIR: empty, and watched."""
    where = tmp_path / "tmp"
    where.mkdir()
    return where


def _env(tmp: Path) -> dict[str, str]:
    return {"TMPDIR": str(tmp)}


def test_the_demo_runs_and_leaves_nothing(tmp: Path, tmp_path: Path) -> None:
    r = orch("demo", cwd=tmp_path, env=_env(tmp))
    assert r.returncode == 0, r.stderr
    assert "Test framework: pytest" in r.stdout and "`orch demo --keep` keeps it" in r.stdout
    assert list(tmp.iterdir()) == []
    j = orch("demo", "--json", cwd=tmp_path, env=_env(tmp))
    assert j.returncode == 0, j.stderr
    assert json.loads(j.stdout)["project"] is None and list(tmp.iterdir()) == []


def test_keep_keeps_it_and_says_where(tmp: Path, tmp_path: Path) -> None:
    r = orch("demo", "--keep", cwd=tmp_path, env=_env(tmp))
    assert r.returncode == 0, r.stderr
    (kept,) = tmp.iterdir()
    assert kept.name.startswith("orch-demo-") and (kept / "pyproject.toml").is_file()
    assert f"demo project (kept): {kept.resolve()}\n" in r.stdout  # whole, to copy
    run_id = json.loads(orch("ps", "--json", "-C", str(kept), cwd=tmp_path).stdout)[0]["run_id"]
    t = orch("tree", run_id, "-C", str(kept), cwd=tmp_path)  # what the hint says to run
    assert t.returncode == 0 and "explorer" in t.stdout, t.stderr


def test_a_failing_demo_leaves_nothing(tmp: Path, tmp_path: Path) -> None:
    config = Path(os.environ["HOME"]) / ".orch" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("max_turns = 1\n")  # the demo's parent needs two
    r = orch("demo", cwd=tmp_path, env=_env(tmp))
    assert r.returncode == 1 and "max_turns" in r.stderr, r.stderr
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_demo_leaves_nothing(tmp: Path, tmp_path: Path, sig: signal.Signals) -> None:
    started = tmp_path / "tool-started"
    config = Path(os.environ["HOME"]) / ".orch" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(  # the first tool call waits: the signal lands mid-run
        f"[[hooks.PreToolUse]]\ncommand = 'touch {started}; sleep 60'\ntimeout_s = 90\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "demo"], cwd=tmp_path, env={**env, **_env(tmp)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(started.exists, timeout=60, what="the demo's first tool call")
        assert "orch-demo-" in [p.name[:10] for p in tmp.iterdir()]
        time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.returncode is None:  # it failed before the end: no process or pipe left
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 130 and "interrupted" in err, err
    assert list(tmp.iterdir()) == []


def test_the_temp_dir_goes_even_when_read_only_inside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an agent leaves (a read-only directory, a symlink out) neither keeps the
    directory nor reaches outside it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    mode = outside.stat().st_mode
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(KeyboardInterrupt), demo_project() as (root, script):
        assert script.is_file() and root.parent == tmp_path.resolve()
        locked = root / "locked"
        (locked / "sub").mkdir(parents=True)
        (locked / "sub" / "f").write_text("x")
        (locked / "out").symlink_to(outside)
        locked.chmod(0o500)
        raise KeyboardInterrupt
    assert not root.exists()
    assert (outside / "keep.txt").read_text() == "mine" and outside.stat().st_mode == mode
    with demo_project(tmp_path / "mine") as (named, _):  # a directory the user named stays
        pass
    assert named.is_dir() and (named / "pyproject.toml").is_file()
