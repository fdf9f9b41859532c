"""`orch sandbox build` from an installed wheel: the build it runs ships inside the wheel,
and without a registry it turns to the debootstrap base within seconds.

The registry is always a loopback one (a port nobody answers on, or one that accepts and
never answers, as a registry behind a dropping firewall); the builds themselves are
printed (``--dry-run``), not run: a debootstrap build takes minutes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import need_docker

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ["build.sh", "build-base.sh", "build-test-image.sh", "Dockerfile", "test/Dockerfile"]


def _run(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding orch as the wheel built from this checkout (its dependencies
    come from this interpreter's site-packages, read through a .pth: no index is asked)."""
    where = tmp_path_factory.mktemp("wheel")
    dist = where / "dist"
    pip = [sys.executable, "-m", "pip"]
    offline = ["--no-deps", "--no-index", "-q"]
    built = _run(
        [*pip, "wheel", *offline, "--no-build-isolation", str(ROOT), "-w", str(dist)], where
    )
    assert built.returncode == 0, built.stderr
    wheel = next(dist.glob("orch-*.whl"))
    venv = where / "venv"
    assert _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], where).returncode == 0
    py = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([str(py), "-c", purelib], where).stdout.strip())
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = _run([*pip, "--python", str(py), "install", *offline, str(wheel)], where)
    assert install.returncode == 0, install.stderr
    return venv


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "PYTHON"))}
    return env | extra


def _bundled(venv: Path) -> Path:
    found = list(venv.glob("lib/python*/site-packages/orchestrator/_bundled/sandboxes"))
    assert len(found) == 1
    return found[0]


@pytest.mark.slow
def test_the_wheel_ships_the_image_build(installed: Path, tmp_path: Path) -> None:
    sandboxes = _bundled(installed)
    for name in SHIPPED:
        assert (sandboxes / name).read_bytes() == (ROOT / "sandboxes" / name).read_bytes(), name
    r = _run([str(installed / "bin" / "orch"), "sandbox", "build", "--help"], tmp_path, _env())
    assert r.returncode == 0, r.stderr
    assert "--dry-run" in r.stdout and "debootstrap" in r.stdout


@pytest.mark.slow
def test_an_install_without_the_build_says_so_in_one_line(installed: Path, tmp_path: Path) -> None:
    sandboxes = _bundled(installed)
    moved = sandboxes.with_name("sandboxes.away")
    sandboxes.rename(moved)
    try:
        r = _run([str(installed / "bin" / "orch"), "sandbox", "build"], tmp_path, _env())
    finally:
        moved.rename(sandboxes)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "reinstall orch" in r.stderr


# -- no registry: the fast decision -----------------------------------------------------


@pytest.fixture
def silent_registry() -> Iterator[int]:
    """A loopback port that accepts connections and never answers on them."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        for s in held:
            s.close()
        listener.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("registry", ["silent", "refusing"])
def test_without_a_registry_it_turns_to_debootstrap_within_seconds(
    installed: Path, tmp_path: Path, registry: str, silent_registry: int
) -> None:
    need_docker()
    port = silent_registry if registry == "silent" else _closed_port()
    base = f"127.0.0.1:{port}/debian:bookworm-slim"
    argv = [str(installed / "bin" / "orch"), "sandbox", "build", "--dry-run", "--base", base]
    t0 = time.monotonic()
    r = _run(argv, tmp_path, _env(REGISTRY_TIMEOUT="2"), timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert took < 10, f"the registry decision took {took:.1f} s"
    why = "did not answer within 2s" if registry == "silent" else "connection refused"
    assert f"cannot pull {base} (" in r.stdout and why in r.stdout, r.stdout
    assert "would fall back to debootstrap" in r.stderr
    # the builds it would run are the wheel's own files, run from outside any checkout
    sandboxes = _bundled(installed)
    assert "docker build --network host --build-arg BASE=orch-base:bookworm" in r.stdout
    assert str(sandboxes) in r.stdout and str(ROOT / "sandboxes") not in r.stdout
