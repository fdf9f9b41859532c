"""The warm process (``orchestrator/warm/``): real processes end to end.

The first command runs in its own process and starts a warm process; later ones with the
same environment are forked from it, in the caller's directory and with its streams,
exit status and signals. Processes in other namespaces (a sandbox) are refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.process import inherit, warmhome
from orchestrator.store import open_store
from orchestrator.warm import client as warm
from tests.fakeapi import FakeAPI, serve, text_reply, tool_reply
from tests.support import alive, gone, host_pids, init_repo, need_bwrap, none_left, wait_for

SLEEP = "sleep 47.25"  # a marker: no other process runs exactly this


def _script(path: Path, *turns: dict[str, object]) -> Path:
    path.write_text(json.dumps({"conversations": [{"turns": list(turns)}]}))
    return path


class Warm:
    def __init__(self, repo: Path, home: Path) -> None:
        self.repo, self.home = repo, home
        base = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
        self.env = base | {"HOME": str(home), "ORCH_WARM_IDLE": "30"}

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "orchestrator", *args], cwd=self.repo, env=self.env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        proc = self.popen(*args)
        out, err = proc.communicate(timeout=60)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def sockets(self) -> list[Path]:
        where = self.home / ".orch" / "warm"
        return sorted(where.glob("*.sock")) if where.is_dir() else []

    def pids(self) -> list[int]:
        return [pid for path in self.sockets() if (pid := warmhome.owner(path)) is not None]

    def started(self) -> int:
        """Start a warm process (a first command) and return its pid once it answers."""
        before = set(self.pids())
        r = self.run("ps")
        assert r.returncode == 0, r.stderr
        [pid] = wait_for(lambda: set(self.pids()) - before, 30, "the warm process")
        return int(pid)


@pytest.fixture
def w(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Warm]:
    repo = init_repo(tmp_path / "proj", {"a.txt": "alpha\n"})
    helper = Warm(repo, tmp_path / "home")
    helper.home.mkdir()
    monkeypatch.setenv("HOME", str(helper.home))  # the same user: the store is ours here too
    yield helper
    for pid in helper.pids():
        os.kill(pid, signal.SIGTERM)
        assert gone(pid, 10)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_command_runs_in_the_warm_process_as_it_would_alone(w: Warm, tmp_path: Path) -> None:
    cold = w.run("result", "r-000000000000")  # cold: runs alone, starts the warm process
    assert cold.returncode != 0 and cold.stderr.count("\n") == 1
    zygote = w.started()
    # the same bad input, warm: same one-line error, same exit status, no traceback
    again = w.run("result", "r-000000000000")
    assert (again.returncode, again.stdout, again.stderr) == (
        cold.returncode, cold.stdout, cold.stderr
    )  # fmt: skip
    usage = w.run("ps", "--bogus")
    assert usage.returncode == 2 and "python -m orchestrator ps" in usage.stderr
    # a run, with a model script named relative to the caller's directory
    _script(w.repo.parent / "s.yaml",
            {"tool_calls": [{"tool": "bash", "input": {"command": f"cat a.txt; {SLEEP}"}}]},
            {"text": "WARM-DONE"})  # fmt: skip
    long_prompt = "go " + "x" * 120_000  # more than one read of the socket
    proc = w.popen("task", long_prompt, "--model", "scripted:../s.yaml")
    store = open_store(w.repo)
    [run] = wait_for(lambda: [r for r in store.list_runs() if r.pid], 30, "the run")
    assert _parent(run.pid) == zygote  # forked from the warm process
    assert store.require_run(run.run_id).prompt == long_prompt
    assert wait_for(lambda: not none_left(SLEEP, 0), 30, "the agent's command")
    os.kill(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: relayed to the command
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err, err
    assert store.require_run(run.run_id).status.value == "cancelled"
    assert none_left(SLEEP)
    # the next one finishes normally, its output on the caller's stdout
    _script(w.repo.parent / "s.yaml",
            {"tool_calls": [{"tool": "bash", "input": {"command": "cat a.txt"}}]},
            {"expect_result": "alpha", "text": "WARM-DONE"})  # fmt: skip
    done = w.run("task", "go", "--json", "--model", "scripted:../s.yaml")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"] == "WARM-DONE"
    assert w.pids() == [zygote]  # one warm process served them all


def _sleeping(w: Warm) -> tuple[subprocess.Popen[str], int]:
    """An `orch task` through the warm process whose agent's command sleeps; the pid of the
    command forked for it."""
    w.started()
    _script(w.repo.parent / "s.yaml",
            {"tool_calls": [{"tool": "bash", "input": {"command": SLEEP}}]},
            {"text": "never"})  # fmt: skip
    proc = w.popen("task", "go", "--model", "scripted:../s.yaml")
    store = open_store(w.repo)
    [run] = wait_for(lambda: [r for r in store.list_runs() if r.pid], 30, "the run")
    assert run.pid is not None
    return proc, run.pid


def test_a_caller_killed_takes_its_command_with_it(w: Warm) -> None:
    proc, pid = _sleeping(w)
    wait_for(lambda: not none_left(SLEEP, 0), 30, "the agent's command")
    proc.kill()
    proc.communicate(timeout=30)
    assert gone(pid, 15)  # the command went with its caller
    r = w.run("ps", "--all", "--json")  # and, as for any dead owner, reconcile cleans up
    assert [x["status"] for x in json.loads(r.stdout)] == ["interrupted"]
    assert none_left(SLEEP, 15), [(p, _parent(p)) for p in host_pids(SLEEP)]


def test_a_different_environment_gets_a_warm_process_of_its_own(w: Warm) -> None:
    first = w.started()
    w.env["ORCH_SOMETHING"] = "else"
    second = w.started()
    assert len(w.sockets()) == 2 and set(w.pids()) == {first, second}


def test_it_leaves_when_idle(w: Warm) -> None:
    w.env["ORCH_WARM_IDLE"] = "1"
    pid = w.started()
    assert gone(pid, 15)
    assert w.sockets() == []


def test_none_starts_when_turned_off(w: Warm) -> None:
    for off in ({"ORCH_WARM_IDLE": "0"}, {"ORCH_WORKER_HOST": "0"}):
        env = w.env | off
        r = subprocess.run([sys.executable, "-m", "orchestrator", "ps"], cwd=w.repo, env=env,
                           capture_output=True, text=True)  # fmt: skip
        assert r.returncode == 0, r.stderr
    time.sleep(1)
    assert w.sockets() == []


def _attack(sock_path: Path) -> str:
    """Python that connects to the warm socket and asks it for a command that would leave a
    file behind: what it got back, or the error."""
    return f"""
import json, os, socket
s = socket.socket(socket.AF_UNIX)
try:
    s.connect({str(sock_path)!r})
    cwd = os.open("/", os.O_RDONLY)
    msg = json.dumps({{"argv": ["task", "x", "--model", "scripted:/nonexistent",
                                "--json"], "env": {{}}}}).encode() + b"\\n"
    try:
        socket.send_fds(s, [msg], [cwd, 0, 1, 2])
    except BrokenPipeError:  # refused before it read a byte: its answer may be waiting
        pass
    print("GOT", s.recv(4096).decode().strip() or "nothing")
except OSError as e:
    print("ERR", e)
"""


def test_a_process_inside_a_sandbox_is_refused(w: Warm, tmp_path: Path) -> None:
    w.started()
    [sock_path] = w.sockets()
    code = _attack(sock_path)
    # the warm socket is there to be reached (bound in), but the caller is in other
    # mount, pid and network namespaces: refused before anything is read
    bwrap = [need_bwrap(), "--bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
             "--unshare-pid", "--unshare-net", "--die-with-parent"]  # fmt: skip
    r = subprocess.run(
        [*bwrap, sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert "GOT" in r.stdout and "refused" in r.stdout, (r.stdout, r.stderr)
    # an agent's bash in the host tier's sandbox does not even see ~/.orch
    (w.repo / "attack.py").write_text(code)
    _script(w.repo.parent / "attack.yaml",
            {"tool_calls": [{"tool": "bash", "input": {"command":
                "python3 attack.py > attack.out 2>&1"}}]},
            {"text": "tried"})  # fmt: skip
    agent = w.run("task", "go", "--json", "--model", "scripted:../attack.yaml")
    assert agent.returncode == 0, agent.stderr
    said = (w.repo / "attack.out").read_text()
    assert "GOT" not in said and "ERR" in said, said
    assert len(open_store(w.repo).list_runs()) == 1  # the agent's own; none by the attack
    assert all(alive(pid) for pid in w.pids())


def test_the_key_changes_with_what_a_command_inherits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "m.py").write_text("x = 1\n")
    monkeypatch.setattr(inherit, "CODE", code)
    base = warmhome.warm_key()
    monkeypatch.setenv("PWD", "/elsewhere")  # volatile: the same warm process
    assert warmhome.warm_key() == base
    monkeypatch.setenv("ORCH_MODEL", "haiku")
    assert warmhome.warm_key() != base
    monkeypatch.delenv("ORCH_MODEL")
    assert warmhome.warm_key() == base
    os.utime(code / "m.py", ns=(1, 1))  # orch's code changed: a new warm process
    assert warmhome.warm_key() != base


def test_the_warm_directory_must_be_closed_to_others(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert warmhome.warm_dir() == tmp_path / ".orch" / "warm"
    (tmp_path / ".orch" / "warm").chmod(0o755)
    assert warmhome.warm_dir() is None  # then every command runs in its own process
    assert warm.run(["ps"]) is None


def test_a_warm_process_that_cannot_start_is_not_tried_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from orchestrator.warm import server as warmserve

    def broken() -> None:
        raise ImportError("no module named 'anthropic'")

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("ORCH_WARM_IDLE", "30")
    monkeypatch.setattr(warmserve, "preload", broken)
    k = warmhome.warm_key()
    lock = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT)
    warmserve.serve(k, lock, list(sys.path), [])  # returns: nothing is served
    os.close(lock)
    where = tmp_path / ".orch" / "warm"
    assert "anthropic" in (where / f"{k}.failed").read_text()
    assert list(where.glob("*.sock")) == []
    assert warm.run(["ps"]) is None  # the command runs alone, and starts nothing
    assert not (where / f"{k}.lock").exists()


def _sleeping_run(w: Warm, *prefix: str) -> tuple[subprocess.Popen[str], int]:
    """A foreground `orch task` whose agent sleeps: its caller and its command's pid."""
    _script(w.repo.parent / "s.yaml",
            {"tool_calls": [{"tool": "bash", "input": {"command": SLEEP}}]},
            {"text": "never"})  # fmt: skip
    argv = [*prefix, sys.executable, "-m", "orchestrator", "task", "go",
            "--model", "scripted:../s.yaml"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=w.repo, env=w.env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    store = open_store(w.repo)
    [run] = wait_for(lambda: [r for r in store.list_runs() if r.pid], 30, "the run")
    wait_for(lambda: not none_left(SLEEP, 0), 30, "the agent's command")
    assert run.pid is not None
    return proc, run.pid


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_signals_the_caller_ignores_stay_ignored(w: Warm) -> None:
    zygote = w.started()
    # nohup-like: SIGHUP ignored by the caller is ignored by the command too
    proc, pid = _sleeping_run(w, "sh", "-c", 'trap "" HUP; exec "$@"', "sh")
    assert _parent(pid) == zygote
    proc.send_signal(signal.SIGHUP)
    time.sleep(1)
    assert alive(pid) and proc.poll() is None
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err


def test_ctrl_z_stops_the_command_and_fg_goes_on(w: Warm) -> None:
    w.started()
    proc, pid = _sleeping_run(w)
    proc.send_signal(signal.SIGTSTP)
    wait_for(lambda: _state(pid) == "T" and _state(proc.pid) == "T", 10, "both stopped")
    proc.send_signal(signal.SIGCONT)
    wait_for(lambda: _state(pid) != "T" and _state(proc.pid) != "T", 10, "both going on")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err


def test_a_refused_caller_runs_the_command_itself_with_its_signals(w: Warm) -> None:
    zygote = w.started()
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("no network namespace here (unshare --net)")
    proc, pid = _sleeping_run(w, "unshare", "--net")  # another namespace: refused
    assert _parent(pid) != zygote and pid != zygote  # it runs in the caller's own process
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert "interrupted" in err and proc.returncode in (130, 2), (proc.returncode, err)


def test_limits_and_priority_are_part_of_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    base = warmhome.warm_key()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512) - 1, hard))
    try:
        assert warmhome.warm_key() != base  # `ulimit -n` differs: another warm process
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert warmhome.warm_key() == base


def test_a_closed_standard_stream_runs_the_command_alone(w: Warm) -> None:
    zygote = w.started()
    r = subprocess.run(["sh", "-c", 'exec "$@" 2>&-', "sh", sys.executable, "-m", "orchestrator",
                        "result", "r-000000000000"], cwd=w.repo, env=w.env,
                       capture_output=True, text=True)  # fmt: skip
    alone = subprocess.run(["sh", "-c", 'exec "$@" 2>&-', "sh", sys.executable, "-m",
                            "orchestrator", "result", "r-000000000000"], cwd=w.repo,
                           env=w.env | {"ORCH_WARM_IDLE": "0"}, capture_output=True,
                           text=True)  # fmt: skip
    assert r.returncode == alone.returncode != 0
    assert w.pids() == [zygote]


_ATTACKER = """
import json, os, sys
from pathlib import Path
from orchestrator.process.unixsock import connect
from orchestrator.warm import client as warm

[path] = sorted(Path({home!r}, ".orch", "warm").glob("*.sock"))  # the user's warm process


def ask(argv, env):
    os.environ.clear()
    os.environ.update(env)
    relay = warm._Relay(connect(path))  # orch's own client, on a socket not its key's
    code = relay.run(argv)
    print("ATTACK " + json.dumps({{"code": code, "forked": relay.pidfd is not None}}), flush=True)


mine = dict(os.environ)
print("ATTACK " + json.dumps({{"key": mine.get("ANTHROPIC_API_KEY"), "parent":
      mine.get("ORCH_PARENT_RUN_ID"), "depth": mine.get("ORCH_DEPTH")}}), flush=True)
own = {{"ANTHROPIC_API_KEY": "sk-attacker", "ANTHROPIC_BASE_URL": {base!r}}}
ask(["task", "INNER-A", "--json"], mine | own)  # deep in the chain: at the depth limit
chain = ("ORCH_CHAIN_ID", "ORCH_PARENT_RUN_ID", "ORCH_DEPTH")
ask(["task", "INNER-B", "--json"], {{k: v for k, v in mine.items() if k not in chain}} | own)
"""


def _api_key(headers: dict[str, str]) -> str | None:
    """The key a request to the Messages API carried (``x-api-key`` or a bearer token)."""
    bearer = headers.get("authorization", "").removeprefix("Bearer ")
    return headers.get("x-api-key") or bearer or None


def test_the_warm_process_gives_a_caller_nothing_it_lacks(w: Warm) -> None:
    """An unsandboxed agent at the depth limit speaks the warm protocol to the user's warm
    process (started with the API key, outside any chain): its commands run with its own
    environment, or none: never with the user's key (issue 38: it is refused outright, as
    its environment is not the warm process's)."""
    attack = w.repo / "attack.py"

    def respond(body: dict[str, object]) -> dict[str, object]:
        first = json.dumps(body["messages"][0])  # type: ignore[index]
        if "INNER" in first:
            return text_reply("INNER-DONE")
        if len(body["messages"]) == 1:  # type: ignore[arg-type]
            command = f"{sys.executable} {attack} > attack.out 2>&1"
            return tool_reply(("bash", {"command": command}))
        return text_reply("OUTER-DONE")

    config = w.home / ".orch" / "config.toml"  # the user's own: unsandboxed, no delegation
    config.parent.mkdir(parents=True)
    config.write_text('max_depth = 0\n[sandbox]\nos = "off"\n')
    api = FakeAPI(respond)
    with serve(api):
        attack.write_text(_ATTACKER.format(home=str(w.home), base=api.base_url))
        w.env |= {"ANTHROPIC_API_KEY": "sk-secret", "ANTHROPIC_BASE_URL": api.base_url}
        zygote = w.started()
        outer = w.run("task", "go", "--json")
        assert outer.returncode == 0, outer.stderr
        assert json.loads(outer.stdout)["summary"] == "OUTER-DONE"
        said = (w.repo / "attack.out").read_text()
        lines = [json.loads(x[7:]) for x in said.splitlines() if x.startswith("ATTACK ")]
        assert len(lines) == 3, said
        seen, in_chain, fresh = lines
        outer_id = json.loads(outer.stdout)["run_id"]
        assert seen == {"key": None, "parent": outer_id, "depth": "0"}, said  # scrubbed
        # neither ran in the warm process: a caller of another environment than its own
        # is refused (its digest differs: issue 38), and nothing of the user's reaches it
        assert in_chain == fresh == {"code": None, "forked": False}, said
        store = open_store(w.repo)
        assert {r.prompt for r in store.list_runs()} == {"go"}, said
        for body, headers in zip(api.requests, api.headers, strict=True):
            assert "INNER" not in json.dumps(body["messages"][0])
            assert _api_key(headers) == "sk-secret"
            assert "task" not in {t["name"] for t in body.get("tools", [])}
        assert w.pids() == [zygote]


TIGHTER = {
    "limit": "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), min(hard, 256)))",
    "nice": "os.nice(5)",
    "oom": "Path('/proc/self/oom_score_adj').write_text('500')",
}


@pytest.mark.parametrize("how", sorted(TIGHTER))
def test_a_caller_with_tighter_limits_is_refused(w: Warm, how: str) -> None:
    """A process that tightened what it passes on (a lower hard limit, a higher nice
    value or OOM score: none of which it could undo) cannot get the warm process's looser
    ones: it is refused, and runs its command itself."""
    w.started()
    [path] = w.sockets()
    code = f"""
import os, resource
from pathlib import Path
from orchestrator.process.unixsock import connect
from orchestrator.warm import client as warm
{TIGHTER[how]}
relay = warm._Relay(connect(Path({str(path)!r})))
print("GOT", relay.run(["ps"]), relay.pidfd)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=w.repo, env=w.env, capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.stdout.strip() == "GOT None None", (r.stdout, r.stderr)


def _watched(pid: int) -> set[str]:
    """The inodes (hex) every epoll descriptor of ``pid`` watches (``fdinfo``'s ``tfd``)."""
    inodes = set()
    for info in Path(f"/proc/{pid}/fdinfo").iterdir():
        with contextlib.suppress(OSError):
            for line in info.read_text().splitlines():
                if line.startswith("tfd:") and " ino:" in line:
                    inodes.add(line.split(" ino:")[1].split()[0])
    return inodes


def test_a_command_holds_no_descriptor_of_the_warm_process(w: Warm) -> None:
    zygote = w.started()
    proc, pid = _sleeping_run(w)
    try:
        assert _parent(pid) == zygote
        server = {os.readlink(f"/proc/{zygote}/fd/{fd}") for fd in os.listdir(f"/proc/{zygote}/fd")}
        mine = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        shared = {t for t in server & mine if t.startswith(("socket:", "pipe:", "/"))}
        assert shared <= {os.devnull}, shared  # not its listener, lock, pipe or callers
        listener = {f"{int(t[8:-1]):x}" for t in server if t.startswith("socket:")}
        assert not _watched(pid) & listener  # nor its epoll, which watches the listener
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)


def test_the_warm_process_sits_above_the_cli() -> None:
    """The warm process imports the CLI; nothing of the CLI, the engine or ``process/``
    imports it (only the entry point does), and its client needs nothing but the standard
    library and ``process/``'s standard-library modules."""
    import ast

    package = Path(__file__).resolve().parent.parent / "orchestrator"
    importers = set()
    for path in package.rglob("*.py"):
        rel = path.relative_to(package)
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # resolve ``from ..warm import x`` against the module's folder
                    parts = list(rel.parent.parts)[: len(rel.parent.parts) - node.level + 1]
                    base = ".".join(["orchestrator", *parts, *([base] if base else [])])
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n == "orchestrator.warm" or n.startswith("orchestrator.warm.") for n in names):
                importers.add(rel.as_posix())
    assert importers - {"__main__.py"} <= {"warm/client.py", "warm/server.py"}
    assert "__main__.py" in importers
    client = ast.parse((package / "warm" / "client.py").read_text())
    froms = {n.module for n in ast.walk(client) if isinstance(n, ast.ImportFrom) and n.level}
    # process.interpreter: only as it starts a warm process (the isolated argv), after a command
    assert froms == {"process.unixsock", "process.warmhome", "process.interpreter"}


def test_a_command_killed_by_sigkill_leaves_its_caller_killed_too_without_a_traceback(
    w: Warm,
) -> None:
    proc, pid = _sleeping(w)
    os.kill(pid, signal.SIGKILL)  # the forked command, not its caller
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, err)
    assert "Traceback" not in err, err
