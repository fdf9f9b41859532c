"""Readers while the run store is away (issue 45, point 5), with a real Postgres server
stopped (``pg_ctl stop -m fast``) and started again: one-shot commands say one line naming
the store and what to do, and exit non-zero; ``watch``, ``logs --follow`` and ``result
--wait`` say "store unreachable, retrying" once and go on by themselves; the dashboard's
API answers 503 with a one-line JSON error and its stream says the store is away, then
back; an MCP tool answers an ``is_error`` result of one line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from orchestrator.dashboard.server import Served
from orchestrator.store import open_url
from tests.pgserver import PgServer
from tests.support import orch, wait_for, write_script
from tests.test_dashboard import http, start
from tests.test_store_outage import DOWN_S, _ensure_up, pg_down, pg_up

RETRYING = "store unreachable, retrying"


def _one_line(stderr: str, port: int) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    assert f"Postgres run store at 127.0.0.1:{port}" in lines[0], lines[0]
    assert "check that the server runs" in lines[0] or "check the server" in lines[0], lines[0]
    return lines[0]


def _slow_run(project: Path, env: dict[str, str], latency: float) -> str:
    script = {
        "conversations": [{"turns": [{"text": "WAITED-FOR", "latency_s": latency}]}],
    }
    path = write_script(project, script)
    r = orch(
        "task", "x", "--background", "--json", "--model", f"scripted:{path}", cwd=project, env=env
    )
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["run_id"])


def _popen(project: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    full.update(env, COLUMNS="200")
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=project,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.postgres
def test_one_shot_readers_say_one_line_and_exit_non_zero(
    pg_server: PgServer, pg_url: str, project: Path
) -> None:
    env = {"ORCH_STORE": pg_url}
    assert orch("ps", cwd=project, env=env).returncode == 0
    pg_down(pg_server)
    try:
        for args in (["ps"], ["ps", "--json"], ["logs", "r-x"], ["result", "r-x"], ["tree", "c"]):
            r = orch(*args, cwd=project, env=env)
            assert r.returncode != 0, (args, r.stdout)
            _one_line(r.stderr, pg_server.port)
    finally:
        _ensure_up(pg_server)


@pytest.mark.postgres
def test_waiting_readers_say_it_once_and_go_on_when_postgres_is_back(
    pg_server: PgServer, pg_url: str, project: Path
) -> None:
    env = {"ORCH_STORE": pg_url}
    run_id = _slow_run(project, env, latency=DOWN_S + 4)
    store = open_url(pg_url)
    wait_for(lambda: store.require_run(run_id).status.value == "running")
    store.close()
    waiters = {
        "watch": _popen(project, env, "watch", run_id, "--interval", "0.2"),
        "follow": _popen(project, env, "logs", run_id, "--follow"),
        "wait": _popen(project, env, "result", run_id, "--wait"),
    }
    try:
        time.sleep(1.0)  # each reading the store
        pg_down(pg_server)
        time.sleep(DOWN_S)
    finally:
        _ensure_up(pg_server)
    outs = {}
    for name, proc in waiters.items():
        out, err = proc.communicate(timeout=60)
        outs[name] = out
        assert proc.returncode == 0, (name, out, err)
        assert "Traceback" not in err, (name, err)
        assert err.count(RETRYING) == 1, (name, err)
        assert err.count("store answers again") == 1, (name, err)
        said = next(ln for ln in err.splitlines() if RETRYING in ln)
        assert "Postgres run store at 127.0.0.1" in said, said
    assert "WAITED-FOR" in outs["wait"], outs["wait"]


@pytest.mark.postgres
def test_a_waiting_reader_started_while_postgres_is_down_waits_for_it(
    pg_server: PgServer, pg_url: str, project: Path
) -> None:
    env = {"ORCH_STORE": pg_url}
    run_id = _slow_run(project, env, latency=0)
    store = open_url(pg_url)
    wait_for(lambda: store.require_run(run_id).status.ended)
    store.close()
    pg_down(pg_server)
    try:
        proc = _popen(project, env, "result", run_id, "--wait")
        time.sleep(DOWN_S)
        assert proc.poll() is None  # still waiting
    finally:
        pg_up(pg_server)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, (out, err)
    assert "WAITED-FOR" in out
    assert err.count(RETRYING) == 1 and err.count("store answers again") == 1, err
    assert "Traceback" not in err


def _stream(served: Served, got: list[str], stop: threading.Event) -> None:
    auth = {"Authorization": f"Bearer {served.token}"}
    url = f"http://127.0.0.1:{served.port}/api/stream"
    with urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=30) as res:
        while not stop.is_set():
            line = res.readline().decode()
            if not line:
                return
            got.append(line.rstrip("\n"))


def _store_said(got: list[str]) -> list[dict[str, Any]]:
    said = []
    for i, line in enumerate(got[:-1]):
        if line == "event: store" and got[i + 1].startswith("data: "):
            said.append(json.loads(got[i + 1][len("data: ") :]))
    return said


@pytest.mark.postgres
def test_the_dashboard_answers_503_and_its_stream_says_away_then_back(
    pg_server: PgServer, pg_url: str, project: Path
) -> None:
    store = open_url(pg_url)
    served = Served(store, project)
    thread = start(served)
    got: list[str] = []
    stop = threading.Event()
    reader = threading.Thread(target=_stream, args=(served, got, stop), daemon=True)
    auth = {"Authorization": f"Bearer {served.token}"}
    try:
        assert http(served, "/api/runs", **auth)[0] == 200
        reader.start()
        wait_for(lambda: got, what="the stream")
        pg_down(pg_server)
        try:
            for path in ("/api/runs", "/api/run/r-x"):
                code, body = http(served, path, **auth)
                assert code == 503, (path, code, body)
                error = json.loads(body)["error"]
                assert "\n" not in error and "Postgres run store at 127.0.0.1" in error, error
            assert http(served, "/", **auth)[0] == 200  # the page: it shows the banner
            wait_for(lambda: _store_said(got), what="the stream saying the store is away")
        finally:
            _ensure_up(pg_server)
        wait_for(lambda: len(_store_said(got)) >= 2, timeout=30, what="the store back")
        said = _store_said(got)
        assert [s["state"] for s in said] == ["away", "back"], said
        assert said[0]["error"].startswith(RETRYING), said
        assert http(served, "/api/runs", **auth)[0] == 200
    finally:
        stop.set()
        served.stop()
        thread.join(10)
        store.close()


@pytest.mark.postgres
def test_an_mcp_tool_answers_one_line_is_error_while_postgres_is_away(
    pg_server: PgServer, pg_url: str, project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_mcp_server import server, text

    monkeypatch.setenv("ORCH_STORE", pg_url)
    script = write_script(project, {"conversations": [{"turns": [{"text": "x"}]}]})

    async def play() -> tuple[Any, Any]:
        async with server(project, script) as session:
            assert not (await session.call_tool("list_runs", {})).is_error
            await asyncio.to_thread(pg_down, pg_server)
            try:
                down = await session.call_tool("list_runs", {})
            finally:
                await asyncio.to_thread(pg_up, pg_server)
            return down, await session.call_tool("list_runs", {})

    try:
        down, back = asyncio.run(play())
    finally:
        _ensure_up(pg_server)
    assert down.is_error
    said = text(down)
    assert "\n" not in said and "Postgres run store at 127.0.0.1" in said, said
    assert not back.is_error, text(back)


@pytest.mark.postgres
def test_the_dashboard_page_shows_a_text_banner_while_postgres_is_away(
    pg_server: PgServer, pg_url: str, project: Path
) -> None:
    """In Chromium: the banner says "store unreachable, retrying" with the store's line,
    as text, and goes once the store answers; the list is live again."""
    from tests.test_dashboard import chromium

    sync_api = pytest.importorskip("playwright.sync_api")
    store = open_url(pg_url)
    served = Served(store, project)
    thread = start(served)
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
            try:
                page = browser.new_page()
                page.goto(served.url)
                page.wait_for_selector("#live:has-text('live')")
                assert page.locator("#banner").is_hidden()
                pg_down(pg_server)
                try:
                    banner = page.locator("#banner")
                    banner.wait_for(state="visible", timeout=20_000)
                    said = banner.inner_text()
                    assert said.startswith(RETRYING) and "Postgres run store" in said, said
                    assert page.locator("#banner *").count() == 0  # text only
                    assert "store unreachable" in page.locator("#live").inner_text()
                    late = browser.new_page()  # a page opened while it is away: its 503
                    late.goto(served.url)
                    late.locator("#banner").wait_for(state="visible", timeout=20_000)
                    assert late.locator("#banner").inner_text().startswith(RETRYING)
                finally:
                    _ensure_up(pg_server)
                for shown in (page, late):
                    shown.locator("#banner").wait_for(state="hidden", timeout=30_000)
                    shown.wait_for_selector("#live:has-text('live')")
                late.wait_for_selector("table")  # the list, asked again
            finally:
                browser.close()
    finally:
        served.stop()
        thread.join(10)
        store.close()
