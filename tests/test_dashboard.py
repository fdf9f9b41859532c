"""`orch dashboard` in a real browser: headless Chromium (Debian's) through Playwright.

The runs are real: background `orch task` runs on a scripted model, watched from the page
while the worker host runs them. Screenshots go to docs/ with ORCH_DOCS_SCREENSHOTS=1.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.dashboard.guard import csrf_for
from orchestrator.dashboard.server import Served
from orchestrator.run import RunRecord, RunStatus, Usage
from orchestrator.store import open_store
from tests.support import task_call

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "docs" / "dashboard"
XSS = '<img src=x onerror="window.__pwned=1">'


def chromium() -> str:
    found = os.environ.get("ORCH_CHROMIUM") or shutil.which("chromium")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but no chromium: apt-get install chromium")
        pytest.skip("no chromium (apt-get install chromium)")
    return found


def start(served: Served) -> threading.Thread:
    """The dashboard served by a thread of its own, once it answers."""
    thread = threading.Thread(target=served.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not served.server.started:
        assert time.monotonic() < deadline, "the dashboard did not start"
        time.sleep(0.02)
    return thread


@contextlib.contextmanager
def serving(project: Path) -> Iterator[Served]:
    """A dashboard of the project's store, served until the block ends."""
    store = open_store(project, None)
    served = Served(store, project)
    thread = start(served)
    try:
        yield served
    finally:
        served.stop()
        thread.join(10)
        store.close()


@pytest.fixture
def dashboard(project: Path) -> Iterator[Served]:
    with serving(project) as served:
        yield served


@pytest.fixture
def page(dashboard: Served) -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport={"width": 1200, "height": 700})
        finally:
            browser.close()


def shot(page: Any, name: str, tmp: Path) -> None:
    if os.environ.get("ORCH_DOCS_SCREENSHOTS") == "1":
        SHOTS.mkdir(exist_ok=True)
        page.screenshot(path=str(SHOTS / f"{name}.png"))
    else:
        page.screenshot(path=str(tmp / f"{name}.png"))


def background(project: Path, script: dict[str, Any], prompt: str, *extra: str) -> str:
    """A background `orch task` on a scripted model; its run id."""
    path = project.parent / f"script-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(script))
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "task", prompt, "--background", "--json",
         "--model", f"scripted:{path}", *extra],
        cwd=project, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["run_id"])


def http(served: Served, path: str, **headers: str) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{served.port}{path}", headers=headers)
    if headers.pop("method", None):
        request.method = "POST"
    try:
        with urllib.request.urlopen(request, timeout=10) as res:
            return res.status, res.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# -- who may look ------------------------------------------------------------------------


def test_a_page_without_the_token_is_refused(dashboard: Served, page: Any) -> None:
    base = f"http://127.0.0.1:{dashboard.port}"
    assert page.goto(base + "/").status == 401
    assert page.goto(base + "/api/runs").status == 401
    assert page.goto(base + "/?token=wrong").status == 403
    auth = f"Bearer {dashboard.token}"
    assert http(dashboard, "/api/runs", Authorization=auth)[0] == 200
    # DNS rebinding: another name for this address is refused, token or not
    assert http(dashboard, "/api/runs", Authorization=auth, Host="evil.example")[0] == 403
    # an action needs the page's same-origin token, and no foreign Origin
    post = {"Authorization": auth, "method": "POST"}
    assert http(dashboard, "/api/run/r-x/cancel", **post)[0] == 403
    csrf = csrf_for(dashboard.token)
    assert http(dashboard, "/api/run/r-x/cancel", **post, **{"X-Orch-Csrf": csrf,
                "Origin": "http://evil.example"})[0] == 403  # fmt: skip
    assert http(dashboard, "/api/run/r-x/cancel", **post, **{"X-Orch-Csrf": csrf})[0] == 404
    # the URL it prints lets the browser in, and the token leaves the address bar
    assert page.goto(dashboard.url).status == 200
    assert "token" not in page.url and page.title() == "orch dashboard"


# -- watching ------------------------------------------------------------------------------


def test_a_background_childs_description_appears_and_its_status_changes_live(
    project: Path, dashboard: Served, page: Any, tmp_path: Path
) -> None:
    page.goto(dashboard.url)
    page.wait_for_selector("#live:has-text('live')")
    script = {"conversations": [
        {"depth": 0, "turns": [
            {"tool_calls": [task_call("count the files", description="count files in the "
                                      "background", run_in_background=True)]},
            {"text": "asked for a count"},
            {"expect_result": "there are 3 files", "text": "the count came back: 3 files"},
        ]},
        {"depth": 1, "turns": [{"text": "there are 3 files", "latency_s": 3}]},
    ]}  # fmt: skip
    root = background(project, script, "Count the files")
    desc = page.locator("td.desc", has_text="count files in the background")
    child = page.locator("tr", has=desc)
    child.wait_for(timeout=20_000)
    assert "running" in child.locator("td.status").inner_text()
    shot(page, "list", tmp_path)
    page.wait_for_function(
        "() => [...document.querySelectorAll('tr')].some(r => r.querySelector('td.desc')?."
        "textContent === 'count files in the background' && r.querySelector('td.status')"
        ".textContent === 'succeeded')",
        timeout=30_000,
    )  # no reload: the stream changed it
    assert page.evaluate("performance.getEntriesByType('navigation').length") == 1
    rec = open_store(project, None).require_run(root)
    assert rec.status == RunStatus.SUCCEEDED, rec.error
    page.goto(f"http://127.0.0.1:{dashboard.port}/run/{root}")
    page.wait_for_selector("text=the count came back: 3 files")
    shot(page, "run", tmp_path)


def test_cancel_from_the_page_stops_the_run(project: Path, dashboard: Served, page: Any) -> None:
    script = {"conversations": [{"turns": [{"text": "never", "latency_s": 60}]}]}
    run_id = background(project, script, "Wait a long time")
    store = open_store(project, None)
    deadline = time.monotonic() + 30
    while store.require_run(run_id).status != RunStatus.RUNNING:
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.1)
    page.goto(dashboard.url)
    page.goto(f"http://127.0.0.1:{dashboard.port}/run/{run_id}")
    page.click("#cancel")
    page.wait_for_selector("#status:has-text('cancelled')", timeout=20_000)
    assert store.require_run(run_id).status == RunStatus.CANCELLED


def test_an_xss_attempt_in_a_description_renders_as_text(
    project: Path, dashboard: Served, page: Any
) -> None:
    store = open_store(project, None)
    record = RunRecord(run_id="r-0123456789ab", chain_id="c-xss", description=XSS,
                       prompt=XSS, status=RunStatus.FAILED, error=XSS)  # fmt: skip
    store.create_run(record)
    store.add_event(record.run_id, "assistant_text", {"text": XSS})
    store.flush()
    page.goto(dashboard.url)
    cell = page.locator("td.desc", has_text="<img src=x")
    cell.wait_for(timeout=10_000)
    assert cell.inner_text() == XSS
    assert page.locator("main img").count() == 0
    page.goto(f"http://127.0.0.1:{dashboard.port}/run/{record.run_id}")
    page.wait_for_selector("text=assistant_text")
    assert page.locator("main img").count() == 0
    assert page.evaluate("window.__pwned") is None


def test_costs_show_in_the_list_and_on_the_run_page_and_chain_totals_follow_live(
    project: Path, dashboard: Served, page: Any
) -> None:
    store = open_store(project, None)
    root = RunRecord(run_id="r-c05700000a00", chain_id="c-cost", description="priced root",
                     usage=Usage(input_tokens=1_000, output_tokens=200,
                                 cache_read_input_tokens=9_000, cost_usd=0.0123))  # fmt: skip
    child = RunRecord(run_id="r-c05700000a01", chain_id="c-cost", parent_run_id=root.run_id,
                      depth=1, description="priced child",
                      usage=Usage(input_tokens=10, cost_usd=0.0002))  # fmt: skip
    store.create_run(root)
    store.create_run(child)
    store.flush()
    page.goto(dashboard.url)
    row = page.locator("tr", has=page.locator("td.desc", has_text="priced root"))
    row.wait_for(timeout=10_000)
    assert row.locator("td.cost").inner_text() == "$0.0123"
    assert row.locator("td.chain").inner_text() == (
        "2 runs · 10,210 tokens · cache 9,000 read / 0 written (90% of input read) · $0.0125"
    )  # the server's words: the page adds nothing up
    store.update_run(child.run_id, usage=Usage(input_tokens=10, cost_usd=0.0102))
    store.flush()
    page.wait_for_function(  # a child's cost changes its root's chain totals, live
        "() => [...document.querySelectorAll('td.chain')].some(c => c.textContent.endsWith("
        "'$0.0225'))",
        timeout=10_000,
    )
    page.goto(f"http://127.0.0.1:{dashboard.port}/run/{root.run_id}")
    page.wait_for_selector("#usage")
    said = page.locator("main").inner_text()
    assert "1,000 in · 200 out · cache 9,000 read / 0 written (90% of input read) · $0.0123" in said
    assert "with the runs under it: 2 runs · 10,210 tokens" in said and "$0.0225" in said
    assert "queued · $0.0102: priced child" in said  # each child's own cost
    store.close()


def test_one_dashboard_over_a_postgres_store_shows_every_machines_runs(
    pg_url: str, project: Path
) -> None:
    store = open_store(project, pg_url)
    for node in ("vm-a", "vm-b"):
        store.create_run(RunRecord(run_id=f"r-{node[-1] * 12}", chain_id=f"c-{node}",
                                   node=node, description=f"on {node}"))  # fmt: skip
    store.flush()
    served = Served(store, project)
    thread = start(served)
    with contextlib.ExitStack() as stack:
        stack.callback(store.close)
        stack.callback(thread.join, 10)
        stack.callback(served.stop)
        code, body = http(served, "/api/runs", Authorization=f"Bearer {served.token}")
    assert code == 200
    nodes = {r["node"] for r in json.loads(body)["runs"]}
    assert {"vm-a", "vm-b"} <= nodes


def test_a_team_page_shows_its_gates_and_verdicts(
    project: Path, dashboard: Served, page: Any, tmp_path: Path
) -> None:
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=project, check=True)
    subprocess.run(["git", "add", "."], cwd=project, check=True)
    ident = ["-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", *ident, "commit", "-qm", "init"], cwd=project, check=True)
    verdict = json.dumps({"verdict": "approve", "summary": "Looks right.", "comments": []})
    script = project.parent / "team.yaml"
    script.write_text(yaml.safe_dump({"conversations": [
        {"agent": "writer", "turns": [
            {"tool_calls": [{"tool": "write_file",
                             "input": {"path": "src/app.py", "content": "print(42)\n"}}]},
            {"text": "wrote it"}]},
        {"agent": "reviewer", "turns": [{"text": verdict}]},
    ]}))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "team", "run", "Print 42", "--gate",
         "grep -q 42 src/app.py", "--json", "--model", f"scripted:{script}"],
        cwd=project, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    root = json.loads(done.stdout)["root_run_id"]
    page.goto(dashboard.url)
    page.goto(f"http://127.0.0.1:{dashboard.port}/run/{root}")
    page.wait_for_selector("text=[reviewer] approve: Looks right.")
    assert page.locator("text=gate passed").count() >= 1
    assert page.locator("text=+print(42)").count() == 1  # the branch's diff
    shot(page, "team", tmp_path)


def test_only_loopback_is_served(project: Path) -> None:
    from typer.testing import CliRunner

    from orchestrator.cli.main import app

    for host in ("0.0.0.0", "192.168.1.5", "example.com"):
        r = CliRunner().invoke(app, ["dashboard", "--host", host, "--no-open", "-C", str(project)])
        assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "loopback only" in r.stderr and "ssh -L" in r.stderr
