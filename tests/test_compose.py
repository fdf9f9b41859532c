"""docker-compose.yml: valid, sandboxes without a network, the sandbox image builds."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI") == "true"


def _compose() -> list[str]:
    exe = shutil.which("docker-compose")
    if exe is None:
        if IN_CI:
            pytest.fail("docker-compose is missing under CI=true: .ci/docker-up installs it")
        pytest.skip("docker-compose is not installed (Debian package docker-compose)")
    return [exe, "-f", str(ROOT / "docker-compose.yml")]


def _engine() -> None:
    ok = subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0
    if not ok:
        if IN_CI:
            pytest.fail("no Docker engine under CI=true: .ci/run starts it with .ci/docker-up")
        pytest.skip("no Docker engine reachable")


def test_compose_config_is_valid_and_sandboxes_have_no_network() -> None:
    out = subprocess.run([*_compose(), "config"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    sandbox = config["services"]["sandbox"]
    assert sandbox["network_mode"] == "none"
    assert sandbox["build"]["network"] == "host"  # builds reach the mirrors, never a bridge
    for name, service in config["services"].items():
        volumes = [str(v) for v in service.get("volumes", [])]
        assert not any("docker.sock" in v for v in volumes), f"{name} mounts the Docker socket"
    assert "networks" not in config or not config["networks"]


def test_compose_builds_the_sandbox_image() -> None:
    _engine()
    compose = _compose()
    have = (
        subprocess.run(
            ["docker", "image", "inspect", "orch-base:bookworm"], capture_output=True, check=False
        ).returncode
        == 0
    )
    if not have and IN_CI:
        base = subprocess.run(
            ["bash", str(ROOT / "sandboxes" / "build-base.sh")],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert base.returncode == 0, base.stdout[-2000:] + base.stderr[-2000:]
    elif not have:
        pytest.skip("no local base image (sandboxes/build-base.sh makes one in ~40 s)")
    env = {**os.environ, "ORCH_SANDBOX_BASE": "orch-base:bookworm"}
    out = subprocess.run(
        [*compose, "build", "sandbox"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    check = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "none",
            "orch-sandbox:latest",
            "sh",
            "-c",
            "id -u; git --version; python3 --version",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stderr
    lines = check.stdout.split()
    assert lines[0] != "0" and "git" in check.stdout and "Python 3" in check.stdout


def test_the_cluster_profile_is_valid_and_stays_off_bridge_networks() -> None:
    """`--profile cluster`: a Ray head, two workers and Postgres, built from our own
    Dockerfile, on the host network (no bridge), the store listening on loopback."""
    out = subprocess.run(
        [*_compose(), "--profile", "cluster", "config"],
        capture_output=True, text=True, check=False,
        env={**os.environ, "ORCH_PG_PASSWORD": "example"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    cluster = {"postgres", "ray-head", "ray-worker-1", "ray-worker-2"}
    assert cluster <= set(services)
    for name in cluster:
        service = services[name]
        assert service["network_mode"] == "host", name
        assert not any("docker.sock" in str(v) for v in service.get("volumes", [])), name
    for name in ("postgres", "ray-head"):
        build = services[name]["build"]
        assert build["dockerfile"] == "sandboxes/cluster.Dockerfile"
        assert build["network"] == "host"
    assert services["postgres"]["environment"]["ORCH_PG_LISTEN"] == "127.0.0.1"
    assert '"orch_slots": 0' in services["ray-head"]["command"]
    for name in ("ray-worker-1", "ray-worker-2"):
        assert "--address=127.0.0.1:6379" in services[name]["command"]
        assert '"orch_slots": 4' in services[name]["command"]
    # only with the profile are they started or built
    assert all(services[name].get("profiles") == ["cluster"] for name in cluster)
    assert "profiles" not in services["sandbox"] and "profiles" not in services["orch"]
