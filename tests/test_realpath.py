"""Kernel symlink resolution (orchestrator/fs/realpath.py) agrees with ``Path.resolve``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.fs.realpath import resolved, resolved_lax


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "real" / "deep").mkdir(parents=True)
    (tmp_path / "real" / "deep" / "f").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "rel").symlink_to("deep")
    (tmp_path / "chain").symlink_to("link/rel")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x")
    (tmp_path / "loop").symlink_to("loop")
    os.mkfifo(tmp_path / "fifo")  # opened O_PATH: never blocks
    return tmp_path


def test_existing_paths_resolve_as_path_resolve_does(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    for name in ("real", "link", "link/deep/f", "chain", "chain/f", "link/../link/rel", "fifo"):
        assert resolved(root / name) == (root / name).resolve(strict=True), name


def test_missing_dangling_and_looping_paths_are_none(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    for name in ("nope", "link/nope", "dangling", "loop", "real/deep/f/below"):
        assert resolved(root / name) is None, name


def test_lax_resolution_of_missing_paths_is_path_resolve(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    for name in ("nope", "link/nope", "chain/nope", "dangling", "link/a/b", "real"):
        assert resolved_lax(root / name) == (root / name).resolve(), name


def test_relative_paths_are_taken_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _tree(tmp_path)
    monkeypatch.chdir(root)
    assert resolved("link/deep") == (root / "real" / "deep").resolve()
