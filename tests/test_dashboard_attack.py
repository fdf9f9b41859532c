"""Attacks on `orch dashboard` (an adversarial review): each test plays one and holds the fix.

Everything talks to 127.0.0.1 only.
"""

from __future__ import annotations

import http.client
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.dashboard.guard import csrf_for
from orchestrator.dashboard.server import Served
from orchestrator.run import RunRecord, RunStatus
from orchestrator.store import open_store
from tests import test_dashboard as base

dashboard = base.dashboard  # the fixtures, shared
start = base.start
page = base.page

XSS = '<img src=x onerror="window.__pwned=1">'


@pytest.fixture
def second(project: Path) -> Iterator[Served]:
    with base.serving(project) as served:
        yield served


def raw(served: Served, method: str, path: str, **headers: str) -> tuple[Any, dict[str, str]]:
    """One request with exactly these headers (Host defaults to the dashboard's own)."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    headers.setdefault("Host", f"127.0.0.1:{served.port}")
    for k, v in headers.items():
        conn.putheader(k, v)
    conn.endheaders()
    try:
        res = conn.getresponse()
        return res.status, {k.lower(): v for k, v in res.getheaders()}
    except (http.client.RemoteDisconnected, ConnectionResetError) as e:
        return repr(e), {}
    finally:  # a streaming response is cut: only its status is read
        conn.close()


# -- the `?token=` entry redirect ------------------------------------------------------------


@pytest.mark.parametrize("path", ["/%5Cevil.example/", "/%09/evil.example/", "/%5C%5Cevil.example"])
def test_the_token_entry_never_redirects_off_the_dashboard(dashboard: Served, path: str) -> None:
    """guard.py `_enter`: `/\\evil.example` and `/<TAB>/evil.example` pass the `//` check, and a
    browser reads both as `//evil.example` (WHATWG: `\\` is `/`, tabs are dropped)."""
    status, headers = raw(dashboard, "GET", f"{path}?token={dashboard.token}")
    assert status == 303
    location = headers["location"]
    assert location == "/" or (
        location.startswith("/") and not any(c in location for c in "\\\t\r\n")
    ), location


def test_the_token_entry_with_a_crlf_path_still_answers(dashboard: Served) -> None:
    """guard.py `_enter` puts the decoded path in `Location`: a CR/LF in it makes h11 throw
    (traceback in the log, connection dropped) instead of a clean answer."""
    status, headers = raw(dashboard, "GET", f"/%0d%0aSet-Cookie:%20x=y?token={dashboard.token}")
    assert status == 303, status
    assert "\n" not in headers["location"] and "x=y" not in headers.get("set-cookie", "")


# -- the cookie ----------------------------------------------------------------------------


def test_another_localhost_apps_cookie_does_not_lock_the_user_out(dashboard: Served) -> None:
    """guard.py `_cookie`: SimpleCookie stops at the first cookie it cannot parse, and cookies
    are shared by every port of 127.0.0.1: a dev server's `prefs={"a": 1}` (or one a hostile
    same-site page sets with document.cookie) makes every dashboard request 401."""
    status, headers = raw(dashboard, "GET", f"/?token={dashboard.token}")
    assert status == 303
    session = headers["set-cookie"].split(";")[0]
    assert session.startswith(f"orch_dashboard_{dashboard.port}=")
    assert dashboard.token not in session  # the browser holds a session, not the token
    cookie = f'prefs={{"theme": "dark"}}; {session}'
    assert raw(dashboard, "GET", "/api/runs", Cookie=cookie)[0] == 200


class _Recorder(http.server.BaseHTTPRequestHandler):
    cookies: list[str] = []

    def do_GET(self) -> None:  # noqa: N802
        _Recorder.cookies.append(self.headers.get("cookie") or "")
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


def test_the_token_cookie_is_not_sent_to_other_ports_of_127_0_0_1(
    dashboard: Served, page: Any
) -> None:
    """guard.py `_enter`: cookies ignore ports, so `orch_dashboard=<token>` goes to every
    server on 127.0.0.1 the user opens (a dev server a run started, with network = "host",
    or any local service): it then holds the token (and the CSRF token, an HMAC of it)."""
    other = http.server.HTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    try:
        page.goto(dashboard.url)
        page.goto(f"http://127.0.0.1:{other.server_address[1]}/")
    finally:
        other.shutdown()
        other.server_close()
        thread.join(5)
    assert _Recorder.cookies and all(dashboard.token not in c for c in _Recorder.cookies)


def test_two_dashboards_on_different_ports_both_stay_open(
    dashboard: Served, second: Served, page: Any
) -> None:
    """guard.py COOKIE is one name for every port: opening a second dashboard (another
    project) replaces the first one's cookie, and the first answers 403 from then on."""
    assert page.goto(dashboard.url).status == 200
    assert page.goto(second.url).status == 200
    assert page.goto(f"http://127.0.0.1:{dashboard.port}/").status == 200


def test_the_browser_is_opened_without_the_token_in_its_command_line(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The URL's token never reaches a process's argv (/proc/*/cmdline is readable by every
    local user): the browser is opened on a page of the user's own that redirects."""
    import webbrowser

    from typer.testing import CliRunner

    from orchestrator.cli.main import app

    opened: list[str] = []

    def open_(url: str) -> bool:
        opened.append(url)
        return True

    monkeypatch.setattr(webbrowser, "open", open_)
    monkeypatch.setattr(Served, "run", lambda self: None)
    r = CliRunner().invoke(app, ["dashboard", "-C", str(project)])
    assert r.exit_code == 0, r.stderr
    token = r.stdout.strip().rsplit("token=", 1)[1]
    [url] = opened
    assert url.startswith("file://") and token not in url
    # the page is gone once the dashboard stops; it was the user's alone while it lived


# -- hosts ---------------------------------------------------------------------------------


def test_only_127_0_0_1_and_its_ipv6_twin_are_served(project: Path) -> None:
    """Another loopback address (127.0.0.2) is refused up front in one line, rather than
    served and then answering 403 to its own URL's Host header."""
    from orchestrator.errors import UsageError

    store = open_store(project, None)
    try:
        with pytest.raises(UsageError, match=r"loopback only \(127.0.0.1 or ::1\)"):
            Served(store, project, host="127.0.0.2")
        served = Served(store, project, host="localhost")
        assert served.host == "127.0.0.1" and f"127.0.0.1:{served.port}" in served.app.guard.hosts
        served.sock.close()
    finally:
        store.close()


# -- the stream ----------------------------------------------------------------------------


@pytest.mark.parametrize("since", ["abc", "0x10"])
def test_a_bad_since_is_a_400_not_a_500(dashboard: Served, since: str) -> None:
    """app.py `stream`: `float(since)` raises ValueError: a 500 and a traceback in the log."""
    status, _ = raw(dashboard, "GET", f"/api/stream?since={since}",
                    Authorization=f"Bearer {dashboard.token}")  # fmt: skip
    assert status == 400


# -- what held (regressions, these pass) ---------------------------------------------------


def test_held_every_rendered_field_is_text(project: Path, dashboard: Served, page: Any) -> None:
    store = open_store(project, None)
    record = RunRecord(
        run_id="r-0123456789ab", chain_id="c-xss", description=XSS, prompt=XSS, agent=XSS,
        model=XSS, node=XSS, isolation=XSS, status=RunStatus.FAILED, error=XSS, output=XSS,
        artifacts=[{"kind": "branch", "branch": XSS, "base": "HEAD", "commit": "HEAD"}],
    )  # fmt: skip
    store.create_run(record)
    store.add_event(record.run_id, XSS, {"text": XSS})
    store.save_transcript(record.run_id, [
        {"role": XSS, "content": XSS},
        {"role": "assistant", "content": [{"type": "text", "text": XSS},
                                          {"type": "tool_use", "name": XSS, "input": {"x": XSS}},
                                          {"type": XSS, "x": XSS}]},
        {"role": "user", "content": [{"type": "tool_result", "content": XSS}]},
    ])  # fmt: skip
    store.flush()
    page.goto(dashboard.url)
    page.locator("td.desc", has_text="<img src=x").wait_for(timeout=10_000)
    page.goto(f"http://127.0.0.1:{dashboard.port}/run/{record.run_id}")
    page.wait_for_selector("#status")
    assert page.locator("main img").count() == 0
    page.goto(f"http://127.0.0.1:{dashboard.port}/run/%3Cimg%20src%3Dx%20onerror%3D1%3E")
    page.wait_for_selector("text=no run")
    assert page.locator("main img").count() == 0
    assert page.evaluate("window.__pwned") is None


def test_held_csrf_origin_null_and_preflight(dashboard: Served) -> None:
    auth = {"Authorization": f"Bearer {dashboard.token}"}
    csrf = {"X-Orch-Csrf": csrf_for(dashboard.token)}
    path = "/api/run/r-x/cancel"
    assert raw(dashboard, "POST", path, **auth, **csrf, Origin="null")[0] == 403
    assert raw(dashboard, "POST", path, **auth, **csrf, Origin="https://127.0.0.1")[0] == 403
    assert raw(dashboard, "OPTIONS", path, Origin="http://evil.example")[0] == 401
    for host in (f"LOCALHOST:{dashboard.port}", f"localhost.:{dashboard.port}", "127.0.0.1"):
        assert raw(dashboard, "GET", "/api/runs", **auth, Host=host)[0] == 403
    for path in ("/static/../guard.py", "/static/..%2fguard.py", "/static/%2e%2e/app.py"):
        assert raw(dashboard, "GET", path, **auth)[0] == 404
