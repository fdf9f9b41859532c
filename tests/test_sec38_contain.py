"""Every process orch starts is contained by the kernel (issue 38, class 11).

The break: a ``setsid`` + double-forked process outlived a hook's timeout and an
unsandboxed (``sandbox.os = "off"``) command's timeout: its parent exited, the kernel gave
it to init, and nothing orch walked led to it any more (under bubblewrap it died with the
sandbox's PID namespace). Now each command, hook and gate runs under a subreaper of its
own (``orchestrator/reaper.py``): what leaves its parent is re-parented to it, and
everything below it is killed with the command, at its timeout or at its end.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from orchestrator.run import RunStatus
from tests.support import gone, harness, host_pids, none_left, wait_for
from tests.test_hooks import bash, with_config

# fork; the child leaves the session (setsid) and forks again; the grandchild writes its
# pid, lets go of every inherited descriptor and waits: the classic daemon's double fork
ESCAPE = textwrap.dedent(
    """
    import os, sys, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            fd = os.open(os.devnull, os.O_RDWR)
            for n in (0, 1, 2):
                os.dup2(fd, n)
            with open(sys.argv[1] + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(sys.argv[1] + ".tmp", sys.argv[1])
            time.sleep(300)
        os._exit(0)
    os.wait()
    """
)


def _escaper(tmp_path: Path) -> tuple[str, Path]:
    """The shell words that double-fork a process, and the file its pid lands in."""
    script = tmp_path / "escape.py"
    script.write_text(ESCAPE)
    pidfile = tmp_path / f"escaped-{random.randrange(10**9)}.pid"
    words = [sys.executable, str(script), str(pidfile)]
    return " ".join(shlex.quote(w) for w in words), pidfile


def _escaped(pidfile: Path) -> int:
    return int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 10, "the escapee"))


def _kill(pid: int | None) -> None:
    if pid is not None:
        try:
            if b"escape.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _one_turn(*calls: dict[str, Any]) -> dict[str, Any]:
    turns = [{"tool_calls": list(calls)}, {"text": "done"}]
    return {"conversations": [{"depth": 0, "turns": turns}]}


def test_a_double_fork_dies_with_its_hook_at_the_hooks_timeout(
    project: Path, tmp_path: Path
) -> None:
    escape, pidfile = _escaper(tmp_path)
    command = f"{escape}; sleep 100"
    toml = f"[[hooks.PreToolUse]]\ncommand = {json.dumps(command)}\ntimeout_s = 1\n"
    pid = None
    try:
        root = with_config(project, toml, _one_turn(bash("echo never"))).run()
        assert root.status == RunStatus.SUCCEEDED, root.error
        pid = _escaped(pidfile)
        assert gone(pid, 2.0), "a double-forked process outlived its hook's timeout"
    finally:
        _kill(pid)


def test_a_double_fork_dies_with_an_unsandboxed_command_at_its_timeout(
    project: Path, tmp_path: Path
) -> None:
    escape, pidfile = _escaper(tmp_path)
    call = {"tool": "bash", "input": {"command": f"{escape}; sleep 100", "timeout_s": 1}}
    h = harness(project, _one_turn(call), sandbox={"os": "off"})
    pid = None
    try:
        root = h.run()
        assert root.status == RunStatus.SUCCEEDED, root.error
        assert root.workspace["os_sandbox"] == "off"
        pid = _escaped(pidfile)
        assert gone(pid, 2.0), "a double-forked process outlived its command's timeout"
    finally:
        _kill(pid)


# -- variants: other ways to leave, a command that simply ends ------------------------------


def _token() -> str:
    return f"{random.randrange(100, 999)}.{random.randrange(10**8)}"


@pytest.mark.parametrize(
    "leave",
    [
        "setsid -f sleep {t}",  # util-linux forks for it: the sleeper's parent exits
        "nohup sleep {t} >/dev/null 2>&1 & disown",  # daemon(3)-style, the shell gone
        "(setsid sh -c 'sleep {t} &' &)",  # a subshell's background job, in a new session
    ],
    ids=["setsid-f", "nohup-disown", "subshell-setsid"],
)
def test_what_an_unsandboxed_command_leaves_behind_ends_with_it(project: Path, leave: str) -> None:
    token = _token()
    call = bash(leave.format(t=token) + "; echo started")
    h = harness(project, _one_turn(call), sandbox={"os": "off"})
    try:
        root = h.run()
        assert root.status == RunStatus.SUCCEEDED, root.error
        assert none_left(f"sleep {token}", 2.0), "a process outlived the command that left it"
    finally:
        for pid in host_pids(f"sleep {token}"):
            os.kill(pid, signal.SIGKILL)


def test_what_a_hook_leaves_behind_ends_with_it(project: Path) -> None:
    token = _token()
    command = f"setsid -f sleep {token}; nohup sleep {token} >/dev/null 2>&1 & exit 0"
    toml = f"[[hooks.PreToolUse]]\ncommand = {json.dumps(command)}\ntimeout_s = 10\n"
    try:
        root = with_config(project, toml, _one_turn(bash("echo hi"))).run()
        assert root.status == RunStatus.SUCCEEDED, root.error
        assert none_left(f"sleep {token}", 2.0), "a process outlived the hook that left it"
    finally:
        for pid in host_pids(f"sleep {token}"):
            os.kill(pid, signal.SIGKILL)


def test_a_double_fork_dies_with_an_unsandboxed_gate_at_its_timeout(
    tmp_path: Path, hermetic_git: Path
) -> None:
    """The team gate's channel: its command, in the writer's tier (here unsandboxed)."""
    from tests.support import init_repo
    from tests.test_team import BUGGY, team, writer

    repo = init_repo(tmp_path / "proj", {"calc.py": BUGGY})
    escape, pidfile = _escaper(tmp_path)
    h = harness(repo, {"conversations": [writer(BUGGY + "# w\n", "done")]}, sandbox={"os": "off"})
    pid = None
    try:
        result = team(h, gate=f"{escape}; sleep 30", gate_timeout=1, rounds=1)
        [g] = result.gates
        assert g.timed_out and not g.passed
        pid = _escaped(pidfile)
        assert gone(pid, 2.0), "a double-forked process outlived its gate"
    finally:
        _kill(pid)


# -- the subreaper changes nothing else of a command ------------------------------------------


def _run(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Any:
    import asyncio

    from orchestrator.pgroups import reap, spawn

    async def main() -> tuple[int | None, bytes, bytes, int]:
        proc = await spawn(*argv, env=env, cwd=cwd, stdout=PIPE, stderr=PIPE, stdin=DEVNULL)
        out, err = await proc.communicate()
        await reap(proc)
        return proc.returncode, out, err, proc.pid

    return asyncio.run(main())


PIPE, DEVNULL = -1, -3  # (asyncio.subprocess's)


def test_the_command_keeps_its_exit_its_signal_its_environment_and_its_output() -> None:
    assert _run("sh", "-c", "exit 7")[0] == 7
    assert _run("sh", "-c", "kill -TERM $$")[0] == -signal.SIGTERM
    env = {"PATH": os.environ["PATH"], "ONLY": "this"}  # no LC_CTYPE of Python's added
    code, out, _, _ = _run("env", env=env)
    assert code == 0 and sorted(out.decode().split()) == ["ONLY=this", "PATH=" + env["PATH"]]
    # SIGPIPE is the default again (Python ignores it): `yes | head` ends
    assert _run("sh", "-c", "yes | head -1")[1] == b"y\n"
    # output that a background job writes just after the command exits still comes
    assert _run("sh", "-c", "(sleep 0.1; echo late) & echo early")[1] == b"early\nlate\n"


def test_a_program_that_cannot_run_raises_as_before(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        _run("no-such-program-orch-38")
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError):
        _run("./plain", cwd=tmp_path)
    plain.chmod(0o755)
    assert _run("./plain", cwd=tmp_path)[0] == 0


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def test_the_subreapers_command_line_shows_no_word_of_the_command() -> None:
    token = _token()
    import asyncio

    from orchestrator.pgroups import kill_tree, reap, spawn

    async def main() -> None:
        proc = await spawn("sleep", token, stdout=PIPE)
        try:
            wait_for(lambda: len(host_pids(f"sleep {token}")) == 1, 10, "the sleeper")
            assert host_pids(f"sleep {token}") != [proc.pid]  # the sleeper, not the reaper
            assert token.encode() not in _cmdline(proc.pid)
        finally:
            kill_tree(proc.pid)
            await reap(proc)

    asyncio.run(main())
    assert none_left(f"sleep {token}")


def test_after_a_crash_reconcile_kills_what_a_command_double_forked(tmp_path: Path) -> None:
    """The owner died with its command running: the registered group's kill (reconcile's)
    reaches what left the group, below the command's living subreaper."""
    import asyncio

    from orchestrator.pgroups import group_ref, kill_group_ref, reap, spawn

    escape, pidfile = _escaper(tmp_path)
    pid = None

    async def main() -> int:
        proc = await spawn("sh", "-c", f"{escape}; sleep 100", stdout=PIPE)
        found = await asyncio.to_thread(_escaped, pidfile)
        assert kill_group_ref(group_ref(proc.pid)) >= 3  # reaper, shell, escapee (at least)
        await reap(proc)
        return found

    try:
        pid = asyncio.run(main())
        assert gone(pid, 2.0)
    finally:
        _kill(pid or (int(pidfile.read_text()) if pidfile.exists() else None))


def test_a_word_with_a_nul_is_refused_and_a_bwrap_sandbox_is_left_to_its_namespace() -> None:
    from orchestrator.pgroups import in_namespace

    with pytest.raises(ValueError, match="null"):  # never split into two words
        _run("sh", "-c", "touch cut\x00; touch whole")
    assert in_namespace(["/usr/bin/env", "-i", "/opt/x/bwrap", "--unshare-pid", "sh"])
    assert not in_namespace(["/opt/x/bwrap", "--ro-bind", "/", "/", "sh"])  # no PID namespace
    assert not in_namespace(["sh", "-c", "bwrap --unshare-pid sh"])


def test_what_an_mcp_server_double_forks_ends_with_its_run(tmp_path: Path) -> None:
    """The MCP channel: a repository's server (always in the OS sandbox on a host tier)
    that leaves a process behind as it starts; the run ends, so does that process."""
    from tests.support import init_repo, need_bwrap
    from tests.test_mcp_client import SERVER, agent, call, plays, results

    need_bwrap()
    token = _token()
    start = f"setsid -f sleep {token}; exec python3 tools/probe_server.py"
    decl = {"command": "sh", "args": ["-c", start]}
    repo = init_repo(
        tmp_path / "proj",
        {
            "tools/probe_server.py": SERVER.read_text(),
            ".mcp.json": json.dumps({"mcpServers": {"proj": decl}}),
            ".claude/agents/prober.md": agent("prober", "mcp__proj"),
        },
    )
    h = harness(repo, {"conversations": [plays("prober", [call("mcp__proj__probe")])]})
    try:
        root = h.run(agent="prober")
        assert root.status == RunStatus.SUCCEEDED, root.error
        (answer,) = results(h, root)
        assert not answer.get("is_error"), answer  # the server started (and left its sleeper)
        assert none_left(f"sleep {token}", 2.0), "a server's leftover outlived its run"
    finally:
        for pid in host_pids(f"sleep {token}"):
            os.kill(pid, signal.SIGKILL)


def test_without_proc_children_the_subreaper_finds_children_by_parent_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import builtins
    import subprocess

    from orchestrator import reaper

    def no_children(path: str, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith("/children"):
            raise FileNotFoundError(path)
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(reaper, "open", no_children, raising=False)
    kid = subprocess.Popen(["sleep", "30"])
    try:
        assert kid.pid in reaper._children(os.getpid())
    finally:
        kid.kill()
        kid.wait()
