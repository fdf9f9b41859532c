"""`orch doctor` through the CLI, against real components: a bubblewrap that fails, a
loopback HTTP server for the model endpoint, a store with loose modes, an untrusted
repository, the Docker engine and a warm process."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import gone, init_repo, need_docker, orch, wait_for

NAMES = "python imports git bwrap docker image api endpoint store trust warm worker-host".split()
NO_DOCKER = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}  # fast, and no engine call


def doctor(cwd: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, Any]:
    r = orch("doctor", "--json", *args, cwd=cwd, env={**NO_DOCKER, **(env or {})})
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout)


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"]}


def user_config(text: str) -> None:
    """~/.orch/config.toml of the test's own HOME."""
    path = Path(os.environ["HOME"]) / ".orch" / "config.toml"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def repo(project: Path, hermetic_git: Path) -> Path:
    return init_repo(project)


def test_json_is_a_stable_list_and_a_healthy_project_exits_0(repo: Path) -> None:
    code, report = doctor(repo, "--offline")
    assert code == 0 and report["ok"] is True
    assert [c["name"] for c in report["checks"]] == NAMES
    for c in report["checks"]:
        assert set(c) == {"name", "status", "detail", "fix", "required"}
        assert c["status"] in {"ok", "warn", "fail", "skip"}
        assert (c["fix"] is not None) == (c["status"] in {"warn", "fail"}), c
    checks = by_name(report)
    assert checks["git"]["status"] == "ok" and "git version" in checks["git"]["detail"]
    assert checks["bwrap"]["status"] == "ok" and "bubblewrap" in checks["bwrap"]["detail"]
    assert checks["docker"]["status"] == "warn" and checks["image"]["status"] == "skip"
    assert checks["api"]["status"] == "warn" and "ANTHROPIC_API_KEY" in checks["api"]["fix"]
    assert checks["endpoint"]["status"] == "skip"
    assert checks["warm"]["detail"] == "off (ORCH_WARM_IDLE=0)"
    assert not (repo / ".orch").exists()  # doctor only looks: no state dir made


def test_text_output_names_each_fix_and_a_summary(repo: Path) -> None:
    r = orch("doctor", "--offline", cwd=repo, env=NO_DOCKER)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith("warn  docker") for line in lines)
    assert any("fix:" in line and "systemctl start docker" in line for line in lines)
    assert lines[-1].startswith("the default tiers can run; to look at:")


# -- bubblewrap ----------------------------------------------------------------------------


@pytest.fixture
def failing_bwrap(tmp_path: Path) -> dict[str, str]:
    """A `bwrap` first on PATH that cannot make a sandbox (as where userns are off); the
    suite's $ORCH_BWRAP (conftest.py) cleared, so that the settings choose."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    fake = bindir / "bwrap"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "bubblewrap 0.0.1"; exit 0; fi\n'
        'echo "bwrap: No permissions to create new namespace" >&2\nexit 1\n'
    )
    fake.chmod(0o755)
    return {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "ORCH_BWRAP": ""}


def test_a_failing_system_bwrap_fails_and_exits_1(
    repo: Path, failing_bwrap: dict[str, str]
) -> None:
    user_config('[sandbox]\nbwrap = "system"\n')
    code, report = doctor(repo, "--offline", env=failing_bwrap)
    bwrap = by_name(report)["bwrap"]
    assert code == 1 and report["ok"] is False
    assert bwrap["status"] == "fail" and bwrap["required"] is True
    assert "/fakebin/bwrap" in bwrap["detail"] and 'sandbox.os = "off"' in bwrap["fix"]
    r = orch("doctor", "--offline", cwd=repo, env={**NO_DOCKER, **failing_bwrap})
    assert r.returncode == 1
    assert "cannot run: bwrap" in r.stdout.splitlines()[-1]


def test_orch_bwrap_wins_and_is_named(repo: Path, failing_bwrap: dict[str, str]) -> None:
    code, report = doctor(repo, "--offline", env={**failing_bwrap, "ORCH_BWRAP": "system"})
    bwrap = by_name(report)["bwrap"]
    assert code == 1 and bwrap["status"] == "fail"
    code, report = doctor(repo, "--offline", env={**failing_bwrap, "ORCH_BWRAP": "bundled"})
    bwrap = by_name(report)["bwrap"]
    assert code == 0 and "$ORCH_BWRAP = 'bundled'" in bwrap["detail"]


def test_auto_passes_over_a_failing_system_bwrap(repo: Path, failing_bwrap: dict[str, str]) -> None:
    code, report = doctor(repo, "--offline", env=failing_bwrap)
    bwrap = by_name(report)["bwrap"]
    assert code == 0 and bwrap["status"] == "ok"
    assert failing_bwrap["PATH"].split(os.pathsep)[0] not in bwrap["detail"]


def test_sandbox_os_off_is_a_warning_not_a_failure(
    repo: Path, failing_bwrap: dict[str, str]
) -> None:
    user_config('[sandbox]\nos = "off"\nbwrap = "system"\n')
    code, report = doctor(repo, "--offline", env=failing_bwrap)
    bwrap = by_name(report)["bwrap"]
    assert code == 0 and bwrap["status"] == "warn" and "unsandboxed" in bwrap["detail"]


def test_no_git_fails(repo: Path, tmp_path: Path) -> None:
    bindir = tmp_path / "nogit"
    bindir.mkdir()  # only what the CLI itself needs on PATH: no git
    code, report = doctor(repo, "--offline", env={"PATH": str(bindir)})
    git = by_name(report)["git"]
    assert code == 1 and git["status"] == "fail" and "apt-get install git" in git["fix"]


# -- the model endpoint --------------------------------------------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, dict[str, str]]] = []

    def _answer(self) -> None:
        self.seen.append((self.command, dict(self.headers)))
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _answer  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[tuple[int, list[tuple[str, dict[str, str]]]]]:
    seen: list[tuple[str, dict[str, str]]] = []
    handler = type("Handler", (_Recorder,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


SECRET = "sk-ant-test-do-not-print-0123456789"


def test_endpoint_answering_is_ok_and_no_secret_is_sent_or_shown(
    repo: Path, endpoint: tuple[int, list[tuple[str, dict[str, str]]]]
) -> None:
    port, seen = endpoint
    env = {
        "ANTHROPIC_API_KEY": SECRET,
        "ANTHROPIC_BASE_URL": f"http://me:hunter2@127.0.0.1:{port}/v1?token=abc",
    }
    r = orch("doctor", "--json", cwd=repo, env={**NO_DOCKER, **env})
    for text in (SECRET, "hunter2", "abc", "me@"):
        assert text not in r.stdout + r.stderr
    checks = by_name(json.loads(r.stdout))
    assert checks["api"]["status"] == "ok" and "ANTHROPIC_API_KEY set" in checks["api"]["detail"]
    assert f"http://127.0.0.1:{port}/v1" in checks["api"]["detail"]
    assert checks["endpoint"]["status"] == "ok", checks["endpoint"]
    assert len(seen) == 1
    method, headers = seen[0]
    assert method == "HEAD"
    assert not {"x-api-key", "authorization"} & {h.lower() for h in headers}


def test_endpoint_refusing_fails_fast_but_does_not_fail_the_tiers(repo: Path) -> None:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"ANTHROPIC_API_KEY": SECRET, "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}"}
    t0 = time.monotonic()
    code, report = doctor(repo, env=env)
    assert time.monotonic() - t0 < 20
    ep = by_name(report)["endpoint"]
    assert ep["status"] == "fail" and "refused" in ep["detail"].lower()
    assert "--offline" in ep["fix"] and code == 0


def test_offline_sends_nothing(
    repo: Path, endpoint: tuple[int, list[tuple[str, dict[str, str]]]]
) -> None:
    port, seen = endpoint
    env = {"ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}"}
    code, report = doctor(repo, "--offline", env=env)
    assert by_name(report)["endpoint"]["status"] == "skip" and seen == []
    assert by_name(report)["api"]["status"] == "ok"  # a base URL alone: a server that needs no key


# -- the store -----------------------------------------------------------------------------


def test_loose_store_modes_warn_with_the_chmod_that_fixes_them(repo: Path) -> None:
    assert orch("ps", cwd=repo).returncode == 0  # makes .orch/ and orch.db
    state, db = repo / ".orch", repo / ".orch" / "orch.db"
    state.chmod(0o755)
    db.chmod(0o644)
    code, report = doctor(repo, "--offline")
    store = by_name(report)["store"]
    assert code == 0 and store["status"] == "warn"
    assert "0755" in store["detail"] and "0644" in store["detail"]
    subprocess.run(["sh", "-c", store["fix"]], check=True)  # the fix, as printed
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    store = by_name(doctor(repo, "--offline")[1])["store"]
    assert store["status"] == "ok" and "0 runs" in store["detail"]


def test_a_postgres_store_is_named_without_its_password(repo: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql://orch:hunter2@127.0.0.1:{port}/runs?password=hunter2"
    code, report = doctor(repo, "--offline", env={"ORCH_STORE": url})
    store = by_name(report)["store"]
    assert "hunter2" not in json.dumps(report)
    assert store["status"] == "fail" and code == 1
    assert f"postgresql://orch@127.0.0.1:{port}/runs" in store["detail"]
    assert f"127.0.0.1:{port}" in store["fix"]


# -- trust ---------------------------------------------------------------------------------


def test_an_untrusted_repository_warns_with_the_trust_commands(repo: Path) -> None:
    (repo / "orch.toml").write_text('network = "host"\n')
    code, report = doctor(repo, "--offline")
    trust = by_name(report)["trust"]
    assert code == 0 and trust["status"] == "warn"
    assert "not trusted" in trust["detail"] and "network" in trust["detail"]
    assert "orch trust --show" in trust["fix"]
    assert orch("trust", cwd=repo).returncode == 0
    trust = by_name(doctor(repo, "--offline")[1])["trust"]
    assert trust["status"] == "ok" and "trusted" in trust["detail"]
    (repo / "orch.toml").write_text('network = "host"\n[sandbox]\nos = "off"\n')
    trust = by_name(doctor(repo, "--offline")[1])["trust"]
    assert trust["status"] == "warn" and "changed" in trust["detail"]


def test_a_broken_orch_toml_fails(repo: Path) -> None:
    (repo / "orch.toml").write_text("max_turns = [\n")
    code, report = doctor(repo, "--offline")
    trust = by_name(report)["trust"]
    assert code == 1 and trust["status"] == "fail" and "orch.toml" in trust["fix"]


# -- Docker --------------------------------------------------------------------------------


@pytest.mark.docker
def test_the_engine_and_the_sandbox_image(repo: Path) -> None:
    need_docker()
    env = {"DOCKER_HOST": os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")}
    user_config('[sandbox]\nimage = "orch-test-busybox:latest"\n')
    inspect = ["docker", "image", "inspect", "orch-test-busybox:latest"]
    if subprocess.run(inspect, capture_output=True).returncode != 0:
        pytest.skip("orch-test-busybox:latest is not built (sandboxes/build-test-image.sh)")
    checks = by_name(doctor(repo, "--offline", env=env)[1])
    assert checks["docker"]["status"] == "ok" and "Docker engine" in checks["docker"]["detail"]
    assert checks["image"]["status"] == "ok"
    user_config('[sandbox]\nimage = "orch-no-such-image:0"\n')
    image = by_name(doctor(repo, "--offline", env=env)[1])["image"]
    assert image["status"] == "warn" and "docker pull orch-no-such-image:0" in image["fix"]


# -- the warm process and the worker host ---------------------------------------------------


def test_a_running_warm_process_is_named(repo: Path) -> None:
    env = {"ORCH_WARM_IDLE": "30"}
    first = by_name(doctor(repo, "--offline", env=env)[1])["warm"]
    assert first["status"] == "ok" and first["detail"].startswith("none running")

    def running() -> str | None:
        detail: str = by_name(doctor(repo, "--offline", env=env)[1])["warm"]["detail"]
        return detail if detail.startswith("running") else None

    detail = wait_for(running, timeout=30, what="the warm process", interval=0.5)
    pid = int(detail.split("pid ")[1].split(")")[0])
    os.kill(pid, signal.SIGTERM)
    assert gone(pid, timeout=10)


def test_worker_host_off(repo: Path) -> None:
    checks = by_name(doctor(repo, "--offline", env={"ORCH_WORKER_HOST": "0"})[1])
    assert checks["worker-host"]["detail"] == "off (ORCH_WORKER_HOST=0)"
    assert checks["warm"]["detail"] == "off (ORCH_WORKER_HOST=0)"


def test_a_state_directory_orch_did_not_make_fails_the_store_check(
    repo: Path, tmp_path: Path
) -> None:
    """A store copied in from elsewhere (a new inode: no owner mark of ours) is what every
    command refuses; doctor says so, with the way out, and exits 1."""
    assert orch("ps", cwd=repo).returncode == 0  # a real store, ours
    other = tmp_path / "copy"
    other.mkdir()
    init_repo(other)
    subprocess.run(["cp", "-a", str(repo / ".orch"), str(other / ".orch")], check=True)
    code, report = doctor(other, "--offline")
    store = by_name(report)["store"]
    assert code == 1 and store["status"] == "fail", store
    assert "did not create it" in store["detail"] and "adopt-state" in store["fix"]
