"""Network by allow-list, end to end: agents in the shared, worktree and container tiers
reach an allowed loopback server through orch's egress proxy, and nothing else.

Every server here listens on 127.0.0.1 of this machine; an agent's commands run in a
sandbox with a network namespace of its own, so the only way to that server is the
bridge to the proxy. Clients in the sandbox are python3's urllib (it reads http_proxy and
no_proxy as curl and pip do) and a raw socket for the way around the proxy.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import SandboxSettings
from orchestrator.egress.proxy import Egress
from orchestrator.run import RunStatus
from tests.support import (
    git,
    harness,
    init_repo,
    orch,
    sandbox_image,
    task_call,
    tool_results,
    write_script,
)

pytestmark = pytest.mark.bwrap

PY = "python3"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return init_repo(tmp_path / "proj", {"README.md": "# the user's\n"})


def fetch(url: str) -> str:
    """A command that GETs ``url`` through the environment's proxy, printing the body or
    the HTTP error with its first body line."""
    code = (
        "import urllib.request as u, urllib.error as e\n"
        f"try: print('BODY', u.urlopen({url!r}, timeout=10).read().decode())\n"
        "except e.HTTPError as x: print('HTTP', x.code, x.read().decode().strip())\n"
        "except Exception as x: print('FAIL', type(x).__name__, x)\n"
    )
    return f"{PY} -c {shlex.quote(code)}"


def direct(port: int) -> str:
    """A command that connects straight to 127.0.0.1:port (the host's, around the proxy)."""
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), 3); print('DIRECT-REACHED')\n"
        "except OSError as x: print('DIRECT-FAILED', x)\n"
    )
    return f"{PY} -c {shlex.quote(code)}"


def bash(command: str) -> dict[str, Any]:
    return {"tool": "bash", "input": {"command": command}}


def outputs(h: Any, run_id: str, turn: int = 1) -> list[str]:
    return [r["content"] for r in tool_results(h.requests_of(run_id)[turn])]


def probes(allowed: int, other: int) -> list[dict[str, Any]]:
    return [
        bash(fetch(f"http://127.0.0.1:{allowed}/a")),
        bash(fetch(f"http://127.0.0.1:{other}/b")),
        bash(direct(allowed)),
    ]


def check_probes(said: list[str], allowed: int, other: int) -> None:
    assert f"BODY hello from {allowed} /a" in said[0]
    assert "HTTP 403" in said[1] and f"127.0.0.1:{other} is not in the run's network" in said[1]
    assert "DIRECT-FAILED" in said[2]


def egress_events(h: Any, run_id: str) -> list[dict[str, Any]]:
    return [e["data"] for e in h.store.events(run_id) if e["kind"] == "egress"]


@pytest.mark.parametrize("isolation", ["shared", "worktree"])
def test_an_allowed_port_is_reached_through_the_proxy_and_nothing_else(
    repo: Path, servers: tuple[int, int], isolation: str
) -> None:
    allowed, other = servers
    script = {
        "conversations": [{"turns": [{"tool_calls": probes(allowed, other)}, {"text": "ok"}]}]
    }
    h = harness(repo, script, network={"allow": [f"127.0.0.1:{allowed}"]})
    root = h.run(isolation=isolation)
    assert root.status == RunStatus.SUCCEEDED, root.error
    check_probes(outputs(h, root.run_id), allowed, other)
    assert root.workspace is not None
    assert root.workspace["network"] == {"allow": [f"127.0.0.1:{allowed}"]}
    events = egress_events(h, root.run_id)
    by_port = {e["port"]: e for e in events}  # the calls ran at once: in either order
    assert len(events) == 2 and by_port[allowed]["allowed"] and not by_port[other]["allowed"]
    assert by_port[allowed]["received"] > 0 and by_port[allowed]["sent"] > 0
    assert "not in the run's network allow-list" in by_port[other]["reason"]


def test_a_container_agent_reaches_the_allowed_port_through_the_mounted_proxy(
    repo: Path, servers: tuple[int, int]
) -> None:
    """network_mode stays none; the proxy's socket is mounted and the bridge runs inside."""
    image = sandbox_image()
    allowed, other = servers
    script = {
        "conversations": [{"turns": [{"tool_calls": probes(allowed, other)}, {"text": "ok"}]}]
    }
    h = harness(
        repo,
        script,
        network={"allow": [f"127.0.0.1:{allowed}"]},
        sandbox=SandboxSettings(image=image),
    )
    root = h.run(isolation="container")
    assert root.status == RunStatus.SUCCEEDED, root.error
    check_probes(outputs(h, root.run_id), allowed, other)
    assert root.workspace is not None
    assert root.workspace["network"] == {"allow": [f"127.0.0.1:{allowed}"]}
    assert sorted(e["allowed"] for e in egress_events(h, root.run_id)) == [False, True]


def test_a_name_resolving_to_a_loopback_address_is_refused_unless_that_address_is_listed(
    repo: Path, servers: tuple[int, int]
) -> None:
    """DNS rebinding: the name is allowed, but it resolves to the host's own 127.0.0.1;
    only a list naming that address lets it through (a test resolver gives the answers)."""
    allowed, _ = servers
    answers = {"rebind.test": ["127.0.0.1"], "both.test": ["10.9.9.9", "127.0.0.1"]}

    async def resolve(host: str, port: int) -> list[str]:
        return answers[host]

    calls = [
        bash(fetch(f"http://rebind.test:{allowed}/x")),
        bash(fetch(f"http://both.test:{allowed}/y")),
    ]
    script = {"conversations": [{"turns": [{"tool_calls": calls}, {"text": "ok"}]}]}
    names = [f"rebind.test:{allowed}", f"both.test:{allowed}"]
    h = harness(repo, script, network={"allow": names})
    h.runner.egress = Egress(resolve=resolve)
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    said = outputs(h, root.run_id)
    for text in said:
        assert "HTTP 403" in text and "not a public address" in text, text
    assert f"list '127.0.0.1:{allowed}' to allow it" in said[0]
    # the same names, with the address listed too: reached (both.test's private 10.9.9.9
    # is still not listed, so its loopback answer is the one used)
    h = harness(repo, script, network={"allow": [*names, f"127.0.0.1:{allowed}"]})
    h.runner.egress = Egress(resolve=resolve)
    root = h.run()
    said = outputs(h, root.run_id)
    assert f"BODY hello from {allowed} /x" in said[0] and f"BODY hello from {allowed} /y" in said[1]
    assert {e["address"] for e in egress_events(h, root.run_id)} == {"127.0.0.1"}


def test_a_child_never_gets_a_wider_network_than_its_parent(
    repo: Path, servers: tuple[int, int]
) -> None:
    """The parent may reach one port; a child agent asking the host's network, and one
    asking for both ports, reach that one port only (and say so in their records)."""
    allowed, other = servers
    agents = repo / ".orch" / "agents"
    agents.mkdir(parents=True)
    for name, network in [
        ("wide", "host"),
        ("two", f"{{allow: ['127.0.0.1:{allowed}', '127.0.0.1:{other}']}}"),
    ]:
        (agents / f"{name}.md").write_text(
            f"---\nname: {name}\ndescription: x\ntools: Bash\nnetwork: {network}\n---\nGo.\n"
        )
    orch("trust", cwd=repo)  # the repository's agents may ask for what they ask
    parent = {
        "depth": 0,
        "turns": [
            {
                "tool_calls": [
                    task_call("a", subagent_type="wide"),
                    task_call("b", subagent_type="two"),
                ]
            },
            {"text": "ok"},
        ],
    }
    kids = [
        {
            "depth": 1,
            "agent": a,
            "turns": [{"tool_calls": probes(allowed, other)}, {"text": "done"}],
        }
        for a in ("wide", "two")
    ]
    h = harness(
        repo, {"conversations": [parent, *kids]}, network={"allow": [f"127.0.0.1:{allowed}"]}
    )
    root = h.run()
    assert root.status == RunStatus.SUCCEEDED, root.error
    children = [r for r in h.runs(root.chain_id) if r.depth == 1]
    assert len(children) == 2
    for child in children:
        check_probes(outputs(h, child.run_id), allowed, other)
        assert child.workspace is not None
    by_agent = {c.agent: c.workspace["network"] for c in children if c.workspace}
    assert by_agent["wide"] == {"allow": [f"127.0.0.1:{allowed}"]}
    assert by_agent["two"] == {"allow": [f"127.0.0.1:{allowed}"]}  # its list within the parent's


def test_a_child_of_a_parent_without_network_has_none(repo: Path, servers: tuple[int, int]) -> None:
    allowed, _ = servers
    agents = repo / ".orch" / "agents"
    agents.mkdir(parents=True)
    network = f"{{allow: ['127.0.0.1:{allowed}']}}"
    (agents / "netter.md").write_text(
        f"---\nname: netter\ndescription: x\ntools: Bash\nnetwork: {network}\n---\nGo.\n"
    )
    orch("trust", cwd=repo)
    parent = {
        "depth": 0,
        "turns": [{"tool_calls": [task_call("a", subagent_type="netter")]}, {"text": "ok"}],
    }
    kid = {
        "depth": 1,
        "turns": [{"tool_calls": [bash(fetch(f"http://127.0.0.1:{allowed}/"))]}, {"text": "done"}],
    }
    h = harness(repo, {"conversations": [parent, kid]})
    root = h.run()
    (child,) = [r for r in h.runs(root.chain_id) if r.depth == 1]
    assert child.workspace is not None and child.workspace["network"] == "none"
    assert "FAIL" in outputs(h, child.run_id)[0]


def test_an_untrusted_repository_narrows_the_list_but_cannot_widen_it(
    repo: Path, servers: tuple[int, int]
) -> None:
    """The user's settings allow one port; the repository's orch.toml asks for a second:
    refused (and logged, and in the result) until `orch trust`. A narrower list of the
    repository's applies untrusted."""
    allowed, other = servers
    user = Path.home() / ".orch" / "config.toml"
    user.parent.mkdir(parents=True, exist_ok=True)
    user.write_text(f'network = {{ allow = ["127.0.0.1:{allowed}", "localhost:{allowed}"] }}\n')
    (repo / "orch.toml").write_text(
        f'network = {{ allow = ["127.0.0.1:{allowed}", "127.0.0.1:{other}"] }}\n'
    )
    git(repo, "add", "orch.toml")
    git(repo, "commit", "-qm", "wider")
    calls = [
        bash(fetch(f"http://127.0.0.1:{other}/b")),
        bash(fetch(f"http://127.0.0.1:{allowed}/a")),
    ]
    script = write_script(
        repo, {"conversations": [{"turns": [{"tool_calls": calls}, {"text": "ok"}]}]}
    )

    def run() -> tuple[dict[str, Any], str, str]:
        r = orch("task", "x", "--json", "--model", f"scripted:{script}", cwd=repo)
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout)
        logs = orch("logs", result["run_id"], cwd=repo, env={"COLUMNS": "300"}).stdout
        shown = orch("result", result["run_id"], cwd=repo, env={"COLUMNS": "300"}).stdout
        return result, logs, shown

    untrusted, logs, shown = run()
    assert untrusted["workspace"]["network"] == {
        "allow": [f"127.0.0.1:{allowed}", f"localhost:{allowed}"]
    }
    assert untrusted["egress"]["allowed"] == 1 and untrusted["egress"]["refused"] == 1
    assert f"GET 127.0.0.1:{other} refused: 127.0.0.1:{other} is not in the run's network" in logs
    assert f"GET 127.0.0.1:{allowed} (127.0.0.1) allowed" in logs
    assert "network: 2 request(s): 1 allowed, 1 refused" in shown
    assert f"refused: 127.0.0.1:{other}" in shown
    assert "network" in orch("trust", "--show", cwd=repo).stdout
    assert orch("trust", cwd=repo).returncode == 0
    trusted, logs, _ = run()
    assert trusted["egress"]["allowed"] == 2, logs
    # narrower than the user's: applies without trust
    (repo / "orch.toml").write_text(f'network = {{ allow = ["127.0.0.1:{other}"] }}\n')
    user.write_text('network = "host"\n')
    git(repo, "commit", "-qam", "narrower")
    narrowed, _, _ = run()
    assert narrowed["workspace"]["network"] == {"allow": [f"127.0.0.1:{other}"]}
    assert narrowed["egress"]["allowed"] == 1 and narrowed["egress"]["refused"] == 1


def test_a_team_files_network_is_every_members_and_needs_trust_to_widen(
    tmp_path: Path, servers: tuple[int, int]
) -> None:
    """A team file's network: the writer and the gate reach the allowed port (the gate's
    fetch passes only through the proxy); from an untrusted repository, a list the user's
    settings do not cover is refused with one line, until trusted."""
    from tests.test_team import FIXED, review, verdict, writer

    allowed, _ = servers
    repo = init_repo(tmp_path / "team", {"calc.py": "x = 1\n"})
    teams = repo / ".orch" / "teams"
    teams.mkdir(parents=True)
    gate = fetch(f"http://127.0.0.1:{allowed}/gate") + " | grep -q BODY"
    (teams / "net.toml").write_text(
        f'network = {{ allow = ["127.0.0.1:{allowed}"] }}\ngate = {json.dumps(gate)}\n'
    )
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "team")
    r = orch("team", "validate", "net", cwd=repo)
    notice, error = r.stderr.strip().splitlines()  # what is left out, then the refusal
    assert r.returncode != 0 and "teams.net.network" in notice and "orch trust" in notice
    assert "network reaches wider than this machine's settings" in error
    assert orch("trust", cwd=repo).returncode == 0
    assert orch("team", "validate", "net", cwd=repo).returncode == 0
    write = writer(FIXED, "done")
    write["turns"].insert(0, {"tool_calls": [bash(fetch(f"http://127.0.0.1:{allowed}/w"))]})
    conversations = [write, review(verdict("approve", "Good."))]
    script = write_script(repo, {"conversations": conversations})
    r = orch("team", "run", "--team", "net", "fix", "--json", "--model", f"scripted:{script}",
             cwd=repo, timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["approved"], result
    runs = {x["role"]: x["run_id"] for x in result["runs"]}
    for role in ("writer", "gate"):
        record = json.loads(orch("result", runs[role], "--json", cwd=repo).stdout)
        assert record["workspace"]["network"] == {"allow": [f"127.0.0.1:{allowed}"]}, role
        assert record["egress"]["allowed"] == 1, (role, record["egress"])


def test_the_dashboard_shows_what_a_run_reached_and_what_was_refused(
    repo: Path, servers: tuple[int, int], tmp_path: Path
) -> None:
    """A real run (the CLI, a scripted model), its page in headless Chromium: the run's
    network, the summary, and one line a request, refused ones marked."""
    from tests.test_dashboard import chromium, serving, shot

    sync_api = pytest.importorskip("playwright.sync_api")
    allowed, other = servers
    user = Path.home() / ".orch" / "config.toml"
    user.parent.mkdir(parents=True, exist_ok=True)
    user.write_text(f'network = {{ allow = ["127.0.0.1:{allowed}"] }}\n')
    calls = [
        bash(fetch(f"http://127.0.0.1:{allowed}/a")),
        bash(fetch(f"http://127.0.0.1:{other}/b")),
    ]
    script = write_script(
        repo, {"conversations": [{"turns": [{"tool_calls": calls}, {"text": "ok"}]}]}
    )
    r = orch("task", "fetch", "--json", "--model", f"scripted:{script}", cwd=repo)
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    with serving(repo) as served, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(served.url)
            page.goto(f"http://127.0.0.1:{served.port}/run/{run_id}")
            page.wait_for_selector("#egress")
            text = page.locator("section", has=page.locator("#egress")).inner_text()
            page.locator("#egress").scroll_into_view_if_needed()
            shot(page, "network", tmp_path)
        finally:
            browser.close()
    assert f"only 127.0.0.1:{allowed}, through orch's egress proxy" in text
    assert "2 request(s): 1 allowed, 1 refused" in text
    refused = f"GET 127.0.0.1:{other} refused: 127.0.0.1:{other} is not in the run's network"
    assert refused in text and f"GET 127.0.0.1:{allowed} (127.0.0.1) allowed" in text


def test_orch_task_allow_gives_a_run_its_list_and_bad_flags_are_one_line(
    repo: Path, servers: tuple[int, int]
) -> None:
    allowed, other = servers
    calls = [
        bash(fetch(f"http://127.0.0.1:{allowed}/a")),
        bash(fetch(f"http://127.0.0.1:{other}/b")),
    ]
    script = write_script(
        repo, {"conversations": [{"turns": [{"tool_calls": calls}, {"text": "ok"}]}]}
    )
    r = orch("task", "x", "--allow", f"127.0.0.1:{allowed}", "--json", "--background",
             "--model", f"scripted:{script}", cwd=repo)  # fmt: skip
    assert r.returncode == 0, r.stderr
    run_id = json.loads(r.stdout)["run_id"]
    done = json.loads(orch("result", run_id, "--wait", "--json", cwd=repo).stdout)
    assert done["status"] == "succeeded" and done["workspace"]["network"] == {
        "allow": [f"127.0.0.1:{allowed}"]
    }
    assert (done["egress"]["allowed"], done["egress"]["refused"]) == (1, 1)
    for flags, says in [
        (["--allow", "a b"], "--allow: network.allow entry 'a b' is not a host name"),
        (["--allow", "x.org", "--network", "host"], "--network and --allow do not go together"),
    ]:
        r = orch("task", "x", *flags, cwd=repo)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_an_agent_is_told_its_network_and_a_parent_each_agents(repo: Path) -> None:
    agents = repo / ".orch" / "agents"
    agents.mkdir(parents=True)
    (agents / "fetcher.md").write_text(
        "---\nname: fetcher\ndescription: Gets packages.\ntools: Bash\n"
        "network: {allow: [pypi.org, '*.pythonhosted.org']}\n---\nGo.\n"
    )
    listed = ["pypi.org", "*.pythonhosted.org", "127.0.0.1:8080"]
    h = harness(repo, {"conversations": [{"turns": [{"text": "ok"}]}]}, network={"allow": listed})
    root = h.run()
    request = h.requests_of(root.run_id)[0]
    assert (
        "- Network: only pypi.org, *.pythonhosted.org, 127.0.0.1:8080, through orch's egress "
        "proxy. HTTP_PROXY and HTTPS_PROXY are set"
    ) in request.system
    [task] = [t for t in request.tools if t["name"] == "task"]
    assert (
        "- fetcher [network: pypi.org, *.pythonhosted.org]: Gets packages." in task["description"]
    )
    assert "nor with a wider network" in task["description"]


def test_a_team_within_the_users_network_needs_no_trust_whatever_the_repository_narrows(
    tmp_path: Path,
) -> None:
    """The user's settings say host; the repository's orch.toml narrows them to none and its
    team asks pypi.org: within the user's, so validate passes and `orch trust` has nothing
    to trust (one rule, the user's settings as the baseline, for both)."""
    user = Path.home() / ".orch" / "config.toml"
    user.parent.mkdir(parents=True, exist_ok=True)
    user.write_text('network = "host"\n')
    repo = init_repo(tmp_path / "narrow", {"orch.toml": 'network = "none"\n'})
    (repo / ".orch" / "teams").mkdir(parents=True)
    (repo / ".orch" / "teams" / "t.toml").write_text('network = { allow = ["pypi.org"] }\n')
    r = orch("team", "validate", "t", cwd=repo)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert json.loads(orch("trust", "--show", "--json", cwd=repo).stdout)["settings"] == {}
