"""The bubblewrap sandbox, with real bwrap: every test runs real commands through ``wrap()``.

The suite's bwrap is the bundled one (tests/conftest.py); the core confinement tests run
again with the system's (``each_bwrap``). Skipped when that bwrap cannot work here, except
under ``CI=true`` where that fails.
The commands are started with the test's full environment on purpose: nothing of
it may reach the sandbox except the whitelisted variables.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import socket
import statistics
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.bwrap import find as bwrapfind
from orchestrator.bwrap import profile as osbox
from orchestrator.bwrap.profile import (
    ENV_WHITELIST,
    FIX,
    BwrapChoice,
    OsSandbox,
    SandboxUnavailable,
    available,
    default_hidden,
    sandbox_env,
)
from orchestrator.fs import hostprograms
from orchestrator.workspaces.base import NullSink, run_process

IN_CI = os.environ.get("CI") == "true"
CHAIN = {"ORCH_CHAIN_ID": "chain-1"}
USER = ["-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "commit.gpgsign=false"]


def need_bwrap() -> None:
    reason = available()
    if reason is not None:
        if IN_CI:
            pytest.fail(f"CI=true but the OS sandbox cannot run: {reason}")
        pytest.skip(reason)


def make(workspace: Path, **kw: Any) -> OsSandbox:
    """A sandbox for a test that runs real commands (skips without a working bwrap)."""
    need_bwrap()
    box = OsSandbox(workspace=workspace, env=sandbox_env(os.environ, CHAIN), **kw)
    assert box.wrap(["true"], workspace)[2] == osbox.bwrap_choice().path  # env -i BWRAP ...
    return box


def sh(box: OsSandbox, script: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = box.wrap(["bash", "-c", script], cwd or box.workspace)
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def git(*args: str, cwd: Path) -> str:
    out = subprocess.run(["git", *USER, *args], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def make_repo(path: Path) -> Path:
    path.mkdir(parents=True)
    git("init", "-q", "-b", "main", cwd=path)
    (path / "README.md").write_text("hello\n")
    git("add", "README.md", cwd=path)
    git("commit", "-qm", "init", cwd=path)
    return path


@pytest.fixture(params=["tmp", "var-tmp"])
def base(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """Where the workspace lives: under /tmp (the private tmpfs covers its parents)
    or elsewhere (its parents are the host's, read-only), like a real project."""
    if request.param == "tmp":
        return tmp_path
    where: Path = request.getfixturevalue("outside_tmp")
    return where


def under_tmp(path: Path) -> bool:
    return path.resolve().is_relative_to("/tmp")


# -- filesystem ------------------------------------------------------------------------


@pytest.mark.usefixtures("each_bwrap")
def test_writes_stay_in_the_workspace(base: Path) -> None:
    ws = base / "a" / "ws"
    sibling = base / "sibling"
    ws.mkdir(parents=True)
    sibling.mkdir()
    box = make(ws)
    ok = sh(box, "echo in > inside.txt && mkdir -p d && echo x > d/f && rm inside.txt")
    assert ok.returncode == 0, ok.stderr
    assert (ws / "d" / "f").read_text() == "x\n" and not (ws / "inside.txt").exists()

    name = f"orch-osbox-{uuid.uuid4().hex}"
    home = Path(os.environ["HOME"])
    attempts = {
        "parent": (f"echo x > ../{name}", ws.parent / name),
        "up-three": (f"cd ../../.. && echo x > {name}", (ws / "../../..").resolve() / name),
        "etc": (f"echo x > /etc/{name}", Path("/etc") / name),
        "home": (f"echo x > $HOME/{name}", home / name),
        "sibling": (f"echo x > {sibling}/{name}", sibling / name),
    }
    try:
        for kind, (script, host) in attempts.items():
            out = sh(box, script)
            assert not host.exists(), f"{kind}: {host} was written on the host"
            # Under /tmp the workspace's parents are scaffolding in the private tmpfs, so a
            # write there may land in it (and vanish); anywhere else it must fail.
            if not under_tmp(ws) or kind in ("etc", "home", "sibling"):
                assert out.returncode != 0, f"{kind}: write outside the workspace succeeded"
    finally:
        for _script, host in attempts.values():
            host.unlink(missing_ok=True)


@pytest.mark.usefixtures("each_bwrap")
def test_read_only_within_cannot_be_changed(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / ".git" / "hooks").mkdir(parents=True)
    (ws / ".git" / "config").write_text("[core]\n")
    (ws / "sub").mkdir()
    (ws / "sub" / ".git").write_text("gitdir: /somewhere/.git/worktrees/sub\n")
    (ws / "a" / "b" / ".git").mkdir(parents=True)
    box = make(ws, read_only_within=(ws / ".git", ws / "sub" / ".git", ws / "a" / "b" / ".git"))
    for script in (
        "mv .git x",
        "echo evil > .git/hooks/post-commit",
        "printf '[core]\\nfsmonitor = evil\\n' >> .git/config",
        "rm -rf .git",
        "rm -rf .git/hooks",
        "mv sub/.git sub/x",
        "echo 'gitdir: /evil' > sub/.git",
        "rm -f sub/.git",
        "ln -sf /evil sub/.git",
        "mv sub sub2",  # the way to a read-only path is pinned too
        "rm -rf sub",
        "mv a z",
        "mv a/b a/c",
        "rm -rf a",
    ):
        out = sh(box, script)
        assert out.returncode != 0, f"{script!r} succeeded"
    assert sorted(p.name for p in ws.iterdir()) == [".git", "a", "sub"]
    assert (ws / "a" / "b" / ".git").is_dir()
    assert sorted(p.name for p in (ws / ".git").iterdir()) == ["config", "hooks"]
    assert not any((ws / ".git" / "hooks").iterdir())
    assert (ws / ".git" / "config").read_text() == "[core]\n"
    assert (ws / "sub" / ".git").read_text() == "gitdir: /somewhere/.git/worktrees/sub\n"
    assert sh(box, "echo fine > sub/file").returncode == 0  # the rest stays writable


@pytest.mark.usefixtures("each_bwrap")
def test_hidden_paths_show_nothing(tmp_path: Path) -> None:
    home = Path(os.environ["HOME"])  # a tmp dir (conftest); made visible below on purpose
    secret = f"secret-{uuid.uuid4().hex}"
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_rsa").write_text(secret)
    (home / ".netrc").write_text(secret)
    (home / "notes.txt").write_text("visible\n")
    (home / ".docker").mkdir()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(home / ".docker" / "docker.sock"))
    listener.listen()
    ws = tmp_path / "ws"
    (ws / ".orch").mkdir(parents=True)
    (ws / ".orch" / "orch.db").write_text(secret)
    box = make(
        ws, extra_writable=(home,), hidden=default_hidden(home, ws / ".orch", home / "missing")
    )
    connect = (
        "python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); "
        's.connect(sys.argv[1])\' "$HOME/.docker/docker.sock"'
    )
    try:
        out = sh(box, f"cat ~/.ssh/id_rsa ~/.netrc .orch/orch.db; ls -A ~/.ssh .orch; {connect}")
        assert secret not in out.stdout + out.stderr
        assert out.returncode != 0
        assert sh(box, "cat ~/notes.txt").stdout == "visible\n"  # HOME itself is visible here
        listing = sh(box, "ls -A ~/.ssh .orch /run")
        assert listing.returncode == 0
        assert [line for line in listing.stdout.splitlines() if line and ":" not in line] == []
        for script in ("echo x > ~/.ssh/planted", "echo x > .orch/planted", "echo x > ~/.netrc"):
            assert sh(box, script).returncode != 0, script
        assert sh(box, connect).returncode != 0
    finally:
        listener.close()
    assert sorted(p.name for p in (home / ".ssh").iterdir()) == ["id_rsa"]
    assert sorted(p.name for p in (ws / ".orch").iterdir()) == ["orch.db"]
    assert (home / ".netrc").read_text() == secret


def test_a_path_named_several_ways_is_mounted_once(tmp_path: Path) -> None:
    """A store directory reached by three names (a run's store, its state, a link) is one
    hidden mount, not three."""
    ws = tmp_path / "ws"
    (ws / ".orch").mkdir(parents=True)
    (tmp_path / "link").symlink_to(ws / ".orch")
    box = make(ws, hidden=(ws / ".orch", ws / "." / ".orch", tmp_path / "link"))
    pairs = list(itertools.pairwise(box.mounts()))
    assert pairs.count(("--tmpfs", str(ws / ".orch"))) == 1
    assert pairs.count(("--remount-ro", str(ws / ".orch"))) == 1


# -- environment and processes ------------------------------------------------------------


@pytest.mark.usefixtures("each_bwrap")
def test_environment_shows_no_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = f"marker-{uuid.uuid4().hex}"
    monkeypatch.setenv("ORCH_TEST_SECRET", marker)
    monkeypatch.setenv("ANTHROPIC_API_KEY", marker)
    monkeypatch.setenv("SOME_OTHER_VAR", marker)
    box = make(tmp_path)
    out = sh(
        box,
        "cat /proc/1/environ /proc/$PPID/environ /proc/self/environ; "
        'for f in /proc/*/environ /proc/*/cmdline; do cat "$f"; done; echo; '
        "echo ENV-FOLLOWS; env",
    )
    assert out.returncode == 0, out.stderr
    assert marker not in out.stdout + out.stderr
    names = {line.split("=", 1)[0] for line in out.stdout.split("ENV-FOLLOWS\n", 1)[1].splitlines()}
    by_the_shell = {"PWD", "OLDPWD", "SHLVL", "_"}
    assert names - by_the_shell <= ENV_WHITELIST | set(CHAIN)
    assert "ORCH_CHAIN_ID" in names and "PATH" in names


def test_sandbox_env_whitelist() -> None:
    host = {"PATH": "/bin", "HOME": "/h", "AWS_SECRET_ACCESS_KEY": "s", "ANTHROPIC_API_KEY": "k",
            "GITHUB_TOKEN": "t", "LD_PRELOAD": "x", "ORCH_HOME": "/o", "TERM": "dumb"}  # fmt: skip
    env = sandbox_env(host, {"ORCH_CHAIN_ID": "c", "ORCH_DEPTH": "2"})
    assert env == {"PATH": "/bin", "HOME": "/h", "TERM": "dumb", "ORCH_CHAIN_ID": "c",
                   "ORCH_DEPTH": "2"}  # fmt: skip
    for bad in ("ORCH_API_KEY", "ORCH_TOKEN", "ANTHROPIC_BASE_URL", "LD_PRELOAD", "GIT_DIR"):
        with pytest.raises(ValueError, match=bad):
            sandbox_env(host, {bad: "v"})
    with pytest.raises(ValueError, match="ANTHROPIC_API_KEY"):
        OsSandbox(workspace=Path("/"), env={"ANTHROPIC_API_KEY": "k"})


def sleepers(token: str) -> list[int]:
    """Live processes running exactly ``sleep <token>``."""
    found = []
    want = b"sleep\0" + token.encode() + b"\0"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmdline == want and state != "Z":
            found.append(int(entry.name))
    return found


async def wait_for(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.05)
    return bool(condition())


@pytest.mark.usefixtures("each_bwrap")
def test_killing_the_group_ends_detached_grandchildren(tmp_path: Path) -> None:
    token = f"300.{random.randrange(10**8)}"  # a command line no other process has
    box = make(tmp_path)
    argv = box.wrap(["sh", "-c", f"setsid sleep {token} & echo started; sleep {token}"], tmp_path)

    async def main() -> None:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"started\n"
        assert await wait_for(lambda: len(sleepers(token)) == 2, 10), sleepers(token)
        os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 30)
        assert await wait_for(lambda: not sleepers(token), 10), "a sleeper outlived the group"

    try:
        asyncio.run(main())
    finally:
        for pid in sleepers(token):
            os.kill(pid, signal.SIGKILL)


def test_run_process_timeout_ends_everything(tmp_path: Path) -> None:
    token = f"300.{random.randrange(10**8)}"
    box = make(tmp_path)
    argv = box.wrap(["sh", "-c", f"setsid sleep {token} & sleep {token}"], tmp_path)
    try:
        result = asyncio.run(
            run_process(argv, cwd=tmp_path, env=box.env, timeout_s=1.0, sink=NullSink(), run_id="r")
        )
        assert result.timed_out
        assert asyncio.run(wait_for(lambda: not sleepers(token), 10))
    finally:
        for pid in sleepers(token):
            os.kill(pid, signal.SIGKILL)


# -- network ----------------------------------------------------------------------------


@pytest.mark.parametrize("network", [False, True])
@pytest.mark.usefixtures("each_bwrap")
def test_network_only_when_allowed(tmp_path: Path, network: bool) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    script = (
        "python3 -c 'import socket; "
        f'socket.create_connection(("127.0.0.1", {port}), timeout=5); print("connected")\''
    )
    try:
        out = sh(make(tmp_path, network=network), script)
    finally:
        listener.close()
    if network:
        assert out.returncode == 0 and out.stdout == "connected\n", out.stderr
    else:
        assert out.returncode != 0 and "connected" not in out.stdout


# -- a normal workflow -------------------------------------------------------------------


@pytest.mark.usefixtures("hermetic_git")
def test_git_init_and_commit_in_the_workspace(tmp_path: Path) -> None:
    user = " ".join(USER)
    out = sh(
        make(tmp_path),
        "mkdir proj && cd proj && git init -q && echo a > a && git add a && "
        f"git {user} commit -qm first && git log --format=%s",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "first\n"


@pytest.mark.usefixtures("hermetic_git")
@pytest.mark.usefixtures("each_bwrap")
def test_git_in_a_worktree_with_read_only_git(base: Path) -> None:
    repo = make_repo(base / "repo")
    (repo / ".orch").mkdir()
    (repo / ".orch" / "orch.db").write_text("db")
    wt = repo / ".orch" / "worktrees" / "r1"
    git("worktree", "add", "-q", "-b", "orch/t/r1", str(wt), cwd=repo)
    box = make(
        wt,
        read_only_within=(wt / ".git", repo / ".git"),
        hidden=default_hidden(Path(os.environ["HOME"]), repo / ".orch"),
    )
    out = sh(
        box,
        "echo more >> README.md && git status --porcelain && "
        "git --no-optional-locks status --porcelain && git diff --stat && "
        "git log --format=%s && ls -A .. && ! cat ../../orch.db",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        " M README.md", " M README.md", " README.md | 1 +",
        " 1 file changed, 1 insertion(+)", "init", "r1",
    ]  # fmt: skip
    commit = sh(box, f"git {' '.join(USER)} commit -qam x")  # committing is orch's job
    assert commit.returncode != 0 and "Read-only file system" in commit.stderr
    for script in ("echo evil > ../../../.git/hooks/pre-commit",
                   "git config core.fsmonitor 'touch /tmp/pwned'",
                   "cd ../../.. && echo evil >> README.md"):  # fmt: skip
        sh(box, script)
    assert (repo / "README.md").read_text() == "hello\n"
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()
    assert "fsmonitor" not in (repo / ".git" / "config").read_text()
    assert git("status", "--porcelain", cwd=wt) == " M README.md\n"
    assert git("status", "--porcelain", cwd=repo) == "?? .orch/\n"


@pytest.mark.usefixtures("hermetic_git")
def test_git_status_in_a_shared_repo_with_read_only_git(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    box = make(repo, read_only_within=(repo / ".git",))
    out = sh(box, "echo more >> README.md && git status --porcelain && git diff --stat")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(" M README.md\n")


def test_runtime_basics_and_private_tmp(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "host-only.txt").write_text("x")
    inner = f"orch-osbox-{uuid.uuid4().hex}"
    out = sh(make(ws), f"python3 -c 'print(1)' && ls -A /tmp && echo x > /tmp/{inner}")
    assert out.returncode == 0, out.stderr
    first, *listing = out.stdout.splitlines()
    assert first == "1"
    assert listing == [ws.relative_to("/tmp").parts[0]]  # only the way to the workspace
    assert not (Path("/tmp") / inner).exists()
    assert sh(make(ws), f"cat {tmp_path}/host-only.txt").returncode != 0


def test_latency(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = make(tmp_path).wrap(["bash", "-c", "true"], tmp_path)

    def median_ms(cmd: list[str]) -> float:
        times = []
        for _ in range(20):
            start = time.perf_counter()
            subprocess.run(cmd, check=True)
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)

    plain, wrapped = median_ms(["bash", "-c", "true"]), median_ms(argv)
    with capsys.disabled():
        print(f"\nbash -c true: plain {plain:.1f} ms, wrapped {wrapped:.1f} ms "
              f"(+{wrapped - plain:.1f} ms per call)")  # fmt: skip


# -- argv shape and availability (no bwrap needed) ---------------------------------------


def test_mount_order_parents_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    works = bwrapfind._Chosen(BwrapChoice("/usr/bin/bwrap", "system", "bubblewrap 0.8.0", None))
    monkeypatch.setattr(osbox, "chosen", lambda setting: works)
    repo = tmp_path / "repo"
    wt = repo / ".orch" / "worktrees" / "r1"
    wt.mkdir(parents=True)
    (wt / ".git").write_text("gitdir: x\n")
    (repo / ".git").mkdir()
    (repo / "token").write_text("t")
    box = OsSandbox(
        workspace=wt, read_only_within=(wt / ".git", repo / ".git"),
        hidden=(repo / ".orch", repo / "token", repo / "absent"), env={"PATH": "/bin"},
    )  # fmt: skip
    argv = box.wrap(["bash", "-c", "true"], wt)
    joined = " ".join(argv)
    assert Path(argv[0]).name == "env" and argv[1:3] == ["-i", "/usr/bin/bwrap"]
    assert argv[-4:] == ["--", "bash", "-c", "true"]
    order = [
        "--ro-bind / /", "--tmpfs /tmp", f"--ro-bind {repo}/.git {repo}/.git",
        f"--tmpfs {repo}/.orch", f"--bind {wt} {wt}", f"--ro-bind {wt}/.git {wt}/.git",
        f"--remount-ro {repo}/.orch",
    ]  # fmt: skip
    positions = [joined.index(item) for item in order]
    assert positions == sorted(positions)
    assert f"--ro-bind /dev/null {repo}/token" in joined and "absent" not in joined
    assert "--unshare-net" in argv and "--clearenv" in argv and "--die-with-parent" in argv
    assert "--unshare-net" not in OsSandbox(workspace=wt, network=True).wrap(["true"], wt)


@pytest.fixture
def fresh_choice() -> Iterator[None]:
    """The bwrap choices probed anew in the test, and again after it."""
    bwrapfind.forget()
    yield
    bwrapfind.forget()


@pytest.mark.usefixtures("fresh_choice")
def test_unavailable_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(hostprograms, "host_program", lambda name, workspace=None: None)
    monkeypatch.setattr(bwrapfind, "bundled_bwrap", lambda: None)
    monkeypatch.delenv("ORCH_BWRAP", raising=False)
    choice = osbox.bwrap_choice("auto")
    assert choice.path is None and choice.reason is not None and FIX in choice.reason
    assert "apt-get install bubblewrap" in FIX and 'sandbox.os = "off"' in FIX
    assert available() == choice.reason
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        OsSandbox(workspace=tmp_path).wrap(["true"], tmp_path)
