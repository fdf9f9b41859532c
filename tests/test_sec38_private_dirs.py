"""Issue 38, class 2: no security-relevant path in an environment-chosen place.

orch forced ``core.hooksPath`` (and git's ``HOME``) to a directory it made under
``$TMPDIR``; with ``TMPDIR`` inside the checkout an agent rewrote it and orch's next host
git command ran the planted hook. Git now gets settings that need no directory at all
(``core.hooksPath=/dev/null``, ``HOME=/dev/null``); the other private paths (the sockets'
key, the dashboard's opener, the egress proxy's doors) live in orch's private root
(``process/private.py``), never under ``$TMPDIR``, hidden from every sandbox.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from orchestrator.project import gitprocess
from orchestrator.run import RunStatus
from tests.support import harness, init_repo, task_call

pytestmark = pytest.mark.bwrap

HOOKS = ("post-checkout", "pre-commit", "post-commit", "reference-transaction", "pre-auto-gc")


def bash(command: str) -> dict[str, Any]:
    return {"tool": "bash", "input": {"command": command}}


@pytest.fixture
def tmpdir_in_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A checkout whose ``TMPDIR`` lies inside it (a user's ``export TMPDIR=$PWD/tmp``), and
    a fresh orch process's git state (nothing made before this test)."""
    repo = init_repo(tmp_path / "proj", {"README.md": "# the user's\n", ".gitignore": "tmp/\n"})
    tmp = repo / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    for name in ("_user", "_git_exe"):
        if hasattr(gitprocess, name):
            monkeypatch.setattr(gitprocess, name, type(getattr(gitprocess, name))())
    return repo, tmp_path / "HOOK-RAN"


def _plant(where: str, mark: Path) -> str:
    """An agent's bash: every hooks directory orch could have forced, under ``where``,
    made writable and given every hook git runs on a host command."""
    hooks = " ".join(HOOKS)
    return (
        f"for d in $(find {where} -type d -name hooks 2>/dev/null); do chmod -R u+w $d; "
        f"for h in {hooks}; do printf '#!/bin/sh\\ntouch {mark}\\n' > $d/$h; chmod +x $d/$h; "
        "done; echo planted $d; done; true"
    )


def test_break2_a_hooks_dir_under_tmpdir_in_the_checkout_is_never_run(
    tmpdir_in_checkout: tuple[Path, Path],
) -> None:
    repo, mark = tmpdir_in_checkout
    script = {
        "conversations": [
            {"depth": 0, "turns": [
                {"tool_calls": [task_call("prepare", isolation="worktree")]},
                {"tool_calls": [bash(_plant("tmp", mark))]},
                {"tool_calls": [task_call("then", isolation="worktree")]},
                {"text": "done"},
            ]},
            {"depth": 1, "turns": [{"tool_calls": [bash("echo x > x.txt")]}, {"text": "ok"}]},
        ]
    }  # fmt: skip
    h = harness(repo, script)
    root = h.run(isolation="shared")
    assert root.status == RunStatus.SUCCEEDED, root.error
    # orch's host git ran (two worktrees made and committed) and never ran a planted hook
    assert len(h.runs(root.chain_id)) == 3
    assert not mark.exists()
    # and made no directory for git under the agent-writable TMPDIR at all
    assert [p.name for p in (repo / "tmp").iterdir()] == []


def test_git_needs_no_private_directory() -> None:
    env = gitprocess.hardened_env()
    forced = {
        env[f"GIT_CONFIG_KEY_{n}"]: env[f"GIT_CONFIG_VALUE_{n}"]
        for n in range(int(env["GIT_CONFIG_COUNT"]))
    }
    assert forced["core.hooksPath"] == "/dev/null"
    assert env["HOME"] == "/dev/null"


# -- break 10: the dashboard's opener page -------------------------------------------------


def test_break10_a_sandboxed_agent_cannot_read_the_opener_and_its_code_is_single_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With TMPDIR outside /tmp (the sandbox sees it through the read-only root), an agent
    read the token from the opener page and read another run's prompt through the API.
    Now the page is in orch's private root (hidden), holds a one-time code, not the token,
    and is gone once a browser used it; a second use is refused (real server, Chromium)."""
    import urllib.error
    import urllib.request

    from tests.test_dashboard import chromium, serving

    repo = init_repo(tmp_path / "proj", {"README.md": "# the user's\n"})
    outside = Path(tempfile.mkdtemp(prefix="orch-test-", dir="/var/tmp"))
    monkeypatch.setenv("TMPDIR", str(outside))
    monkeypatch.setattr(tempfile, "tempdir", None)
    try:
        with serving(repo) as served:
            opener = served.opener()
            page = opener.read_text()
            assert served.token not in page and "code=" in page
            from orchestrator.fs.private import private_root

            assert not opener.is_relative_to(outside) and opener.is_relative_to(private_root())
            assert (opener.stat().st_mode & 0o777) == 0o600
            # an agent's bash (shared tier, network "host") looks for it where TMPDIR and
            # the private root are: nothing to read
            look = f"cat {opener} 2>&1; ls -A {outside} {opener.parent} 2>&1; true"
            h = harness(repo, {"conversations": [{"turns": [
                {"tool_calls": [bash(look)]}, {"text": "ok"}]}]}, network="host")  # fmt: skip
            root = h.run(isolation="shared")
            assert root.status == RunStatus.SUCCEEDED, root.error
            from tests.support import tool_results

            [said] = [r["content"] for r in tool_results(h.requests_of(root.run_id)[1])]
            assert "code=" not in said and "orch-dashboard" not in said, said
            # the browser opens it: one session; the page goes
            sync_api = pytest.importorskip("playwright.sync_api")
            with sync_api.sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
                try:
                    tab = browser.new_page()
                    tab.goto(opener.as_uri())
                    tab.wait_for_url(f"http://127.0.0.1:{served.port}/", timeout=15000)
                    assert tab.locator("body").count() == 1
                finally:
                    browser.close()
            assert not opener.exists()
            code = page.split("code=", 1)[1].split('"', 1)[0].split("&", 1)[0]
            again = urllib.request.Request(
                f"http://127.0.0.1:{served.port}/?code={code}",
                headers={"Host": f"127.0.0.1:{served.port}"},
            )
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(again, timeout=10)
            assert refused.value.code == 403
            refused.value.close()
    finally:
        import shutil

        shutil.rmtree(outside, ignore_errors=True)


def test_variant_no_private_dir_of_orch_lands_in_an_agent_writable_tmpdir(
    tmpdir_in_checkout: tuple[Path, Path],
) -> None:
    """Another private directory: the egress proxy's doors (an allow-list run) and the
    container tier's bundle staging, with TMPDIR inside the checkout: none is made there,
    and the agent (which writes the checkout) sees nothing of orch's."""
    from orchestrator.fs.private import private_root
    from orchestrator.workspaces.container.transfer import Staging
    from tests.support import tool_results

    repo, _ = tmpdir_in_checkout
    look = "ls -A tmp; ls -AR ~/.orch/run 2>&1; true"
    h = harness(repo, {"conversations": [{"turns": [
        {"tool_calls": [bash(look)]}, {"text": "ok"}]}]},
        network={"allow": ["pkgs.example.org"]})  # fmt: skip
    root = h.run(isolation="shared")
    assert root.status == RunStatus.SUCCEEDED, root.error
    [said] = [r["content"] for r in tool_results(h.requests_of(root.run_id)[1])]
    assert "egress" not in said and ".sock" not in said and "key" not in said, said
    staging = Staging()
    try:
        assert staging.dir.is_relative_to(private_root())
        assert (staging.dir.stat().st_mode & 0o777) == 0o700
    finally:
        staging.remove()
    assert [p.name for p in (repo / "tmp").iterdir()] == []
