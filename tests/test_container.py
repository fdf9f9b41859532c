"""Container isolation against the real Docker engine: lockdown, limits, files and git inside the
sandbox, work out as a branch, cleanup after success / failure / cancel, the warm pool,
errors and the CLI. The escape classes are in ``test_container_boundary.py``.

Without a reachable engine the module is skipped, except under ``CI=true`` where it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from orchestrator.cli.sandbox import sandbox_app
from orchestrator.config import SandboxSettings, load_settings
from orchestrator.errors import OrchError, UsageError
from orchestrator.run import RunStatus, new_run_id
from orchestrator.workspaces.base import RunOutcome, WorkspaceSpec
from orchestrator.workspaces.container import ContainerPool, ContainerWorkspace
from orchestrator.workspaces.container import docker as docker_mod
from orchestrator.workspaces.container.docker import (
    create_container,
    docker_client,
    owner_labels,
    reap_by_label,
    remove_container,
)
from tests.support import harness, init_repo, wait_for

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("hermetic_git")]

ROOT = Path(__file__).resolve().parents[1]
SANDBOX = "orch-sandbox:latest"
BUSYBOX = "orch-test-busybox:latest"
UID = 10001  # the sandbox user: sandbox.uid, whoever runs orch


# -- engine and images -------------------------------------------------------------------


def _have_image(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0


@pytest.fixture(scope="module", autouse=True)
def engine() -> Iterator[None]:
    """The engine, and the busybox test image (built in ~2 s when missing)."""
    try:
        docker_client().close()
    except OrchError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but no Docker engine is reachable: {e}")
        pytest.skip(f"no Docker engine reachable: {e}")
    if not _have_image(BUSYBOX):
        subprocess.run(["bash", str(ROOT / "sandboxes/build-test-image.sh")], check=True)
    yield


@pytest.fixture(scope="module")
def sandbox_image() -> str:
    """orch-sandbox:latest (bash, git, python3); built under CI when missing (~1 min, once)."""
    if not _have_image(SANDBOX):
        if os.environ.get("CI") != "true":
            pytest.skip(f"{SANDBOX} is missing: run `orch sandbox build`")
        # never pull: reuse the local debootstrap base, or debootstrap one (~1 min)
        base = "orch-base:bookworm"
        args = [] if _have_image(base) else ["--rebuild-base"]
        env = {**os.environ, "BASE": base}
        script = str(ROOT / "sandboxes/build.sh")
        subprocess.run(["bash", script, *args], env=env, check=True, timeout=900)
    return SANDBOX


def sh(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    files = {"README.md": "# demo\n", "src/app.py": "def main() -> int:\n    return 42\n"}
    return init_repo(tmp_path / "proj", files)


def spec_for(repo: Path, sink: Any = None, **sandbox: Any) -> WorkspaceSpec:
    extra = {"sink": sink} if sink is not None else {}
    return WorkspaceSpec(
        new_run_id(),
        "c-test",
        "coder",
        "test run",
        repo,
        sandbox=SandboxSettings(**sandbox),
        **extra,
    )


def labelled(label: str) -> list[str]:
    out = subprocess.run(
        ["docker", "ps", "-aq", "--no-trunc", "--filter", f"label={label}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.split()


def leftovers(repo: Path) -> list[str]:
    """orch's leftovers in the repository: temp refs, worktrees, slot directories."""
    refs = sh(repo, "for-each-ref", "--format=%(refname)", "refs/orch/").split()
    trees = [p.name for p in (repo / ".orch").glob("*/*") if p.parent.name in ("worktrees",
             "sandboxes")]  # fmt: skip
    return sorted(refs + trees)


def inside(container_id: str, command: str) -> str:
    return subprocess.run(["docker", "exec", container_id, "sh", "-c", command],
                          capture_output=True, text=True).stdout  # fmt: skip


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def register_resource(self, run_id: str, kind: str, ref: str) -> None:
        self.events.append(("register", kind, ref))

    def release_resource(self, run_id: str, kind: str, ref: str) -> None:
        self.events.append(("release", kind, ref))


SECRETS = {"ANTHROPIC_API_KEY": "sk-ant-SECRET", "MY_TOKEN": "tok-SECRET", "HOST_ONLY": "h-SECRET"}


# -- the workspace, directly ---------------------------------------------------------------

PROBE = r"""
echo "uid=$(id -u)"
echo "ifaces=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\n' ',')"
grep -E '^(NoNewPrivs|CapEff|CapBnd)' /proc/self/status
for p in /etc/x /usr/x /x; do touch "$p" 2>/dev/null && echo "WROTE $p"; done
echo home > "$HOME/h" && echo "home=ok"
printf '#!/bin/sh\necho tmp-exec\n' > /tmp/s && chmod +x /tmp/s && /tmp/s
for s in /var/run/docker.sock /run/docker.sock; do test -e "$s" && echo "SOCKET $s"; done
echo "dev=$(ls /dev | tr '\n' ',')"
python3 -c '
import socket
s = socket.socket(); s.settimeout(3)
try:
    s.connect(("1.1.1.1", 53)); print("net=open")
except OSError as e:
    print("net=blocked", e)
'
echo "pids=$(cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max)"
echo "--env"; env
"""


def test_lockdown_inside(repo: Path, sandbox_image: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    spec = spec_for(repo, image=sandbox_image)

    async def body() -> tuple[str, dict[str, Any]]:
        async with ContainerWorkspace(spec) as ws:
            env = {**os.environ, "LANG": "C.UTF-8", "PATH": "/host/evil/bin"}
            result = await ws.exec(PROBE, timeout_s=30, env=env)
            assert result.exit_code == 0, result.output
            client = docker_client()
            try:
                attrs = client.api.inspect_container(ws.container_id)
            finally:
                client.close()
            ws.set_outcome(RunOutcome("succeeded"))
            return result.output, attrs

    out, attrs = asyncio.run(body())
    lines = out.splitlines()
    assert f"uid={UID}" in lines and "uid=0" not in lines
    assert "ifaces=lo," in lines  # only the loopback interface
    assert "NoNewPrivs:\t1" in lines and "CapEff:\t0000000000000000" in lines
    assert "WROTE" not in out  # read-only root filesystem
    assert "home=ok" in lines and "tmp-exec" in lines  # tmpfs $HOME and /tmp, exec allowed
    assert "SOCKET" not in out
    dev = next(x for x in lines if x.startswith("dev=")).removeprefix("dev=").split(",")
    assert "null" in dev and not any(d.startswith(("sd", "vd", "nvme", "mem", "kmsg")) for d in dev)
    assert any(x.startswith("net=blocked") for x in lines)
    assert "pids=256" in lines
    env_part = out.split("--env", 1)[1]
    for key, value in SECRETS.items():
        assert key not in env_part and value not in env_part
    assert "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in env_part
    assert "/host/evil" not in env_part and "LANG=C.UTF-8" in env_part
    host = attrs["HostConfig"]
    # no host directory, no volume: the workspace is a size-capped tmpfs of its own
    assert attrs["Mounts"] == [] and not host.get("Binds")
    assert f"size=1g,uid={UID},gid={UID}" in host["Tmpfs"]["/workspace"]
    assert host["NetworkMode"] == "none" and host["CapDrop"] == ["ALL"]
    assert host["SecurityOpt"] == ["no-new-privileges"] and host["ReadonlyRootfs"] is True
    assert host["Memory"] == host["MemorySwap"] == 2 * 1024**3
    assert host["NanoCpus"] == 10**9 and host["PidsLimit"] == 256 and host["Init"] is True
    labels = attrs["Config"]["Labels"]
    assert labels["orch.run_id"] == spec.run_id and labels["orch.chain_id"] == "c-test"
    assert labels["orch.owner_pid"] == str(os.getpid()) and float(labels["orch.created_at"]) > 0
    assert attrs["Config"]["Cmd"] == ["sleep", str(6 * 3600)]
    assert not labelled(f"orch.run_id={spec.run_id}")


def test_files_and_git_inside_the_container(repo: Path, sandbox_image: str) -> None:
    sink = RecordingSink()
    spec = spec_for(repo, sink, image=sandbox_image)
    config_before = (repo / ".git" / "config").read_bytes()
    hooks_before = sorted(p.name for p in (repo / ".git" / "hooks").iterdir())
    head_before = sh(repo, "rev-parse", "HEAD")
    common = repo / ".git"

    async def body() -> ContainerWorkspace:
        async with ContainerWorkspace(spec) as ws:
            rt = ws.runtime()
            assert str(rt.root) == "/workspace"
            await rt.write_file("notes/host.txt", b"from the tool\n")
            r = await ws.exec(
                "cat notes/host.txt && echo appended >> notes/host.txt && echo inside > made.txt"
                " && mkdir -p pkg && echo 1 > pkg/x && chmod +x src/app.py && rm README.md"
                " && git status --short && git log --oneline -1 && git diff --stat",
                timeout_s=30, env={},
            )  # fmt: skip
            assert r.exit_code == 0, r.output
            assert "from the tool" in r.output and "?? made.txt" in r.output
            assert " D README.md" in r.output and "init" in r.output
            got = await rt.read_file("notes/host.txt", max_bytes=1000)
            assert got.data == b"from the tool\nappended\n" and got.size == len(got.data)
            assert await rt.glob("**/*.py", limit=10) == (["src/app.py"], False)
            assert await rt.grep("return", path=None, glob="*.py", limit=5) == [
                "src/app.py:2:     return 42"
            ]
            attack = await ws.exec(
                f"for p in {common}/config {common}/hooks/x {repo}/x; do (echo x >> $p)"
                " 2>/dev/null && echo WROTE $p; done; git config core.fsmonitor 'touch /tmp/m'"
                " && echo CONFIG-SET",
                timeout_s=30, env={},
            )  # fmt: skip
            assert "WROTE" not in attack.output  # the host's repository is not there at all
            assert "CONFIG-SET" in attack.output  # its own clone's config is its own
            ws.set_outcome(RunOutcome("succeeded", "container work"))
        return ws

    ws = asyncio.run(body())
    assert (repo / ".git" / "config").read_bytes() == config_before
    assert sorted(p.name for p in (repo / ".git" / "hooks").iterdir()) == hooks_before
    assert sh(repo, "rev-parse", "HEAD") == head_before
    assert sh(repo, "status", "--porcelain") == ""
    assert (repo / "README.md").exists() and not (repo / "made.txt").exists()
    [art] = ws.artifacts()
    assert art["base"] == head_before and art["files_changed"] == 5
    changed = sh(repo, "diff", "--name-status", head_before, art["branch"]).splitlines()
    assert sorted(changed) == sorted(
        ["D\tREADME.md", "A\tmade.txt", "A\tnotes/host.txt", "A\tpkg/x", "M\tsrc/app.py"]
    )
    assert sh(repo, "ls-tree", art["branch"], "src/app.py").startswith("100755")
    log = sh(repo, "log", "-1", "--format=%an <%ae>%n%B", art["branch"])
    assert log.startswith("orch coder <orch@localhost>\ncontainer work")
    assert f"orch-run: {spec.run_id}" in log and "orch-status: succeeded" in log
    assert [(e[0], e[1]) for e in sink.events] == [("register", "container"),
                                                   ("release", "container")]  # fmt: skip
    assert not labelled(f"orch.run_id={spec.run_id}") and leftovers(repo) == []
    assert sh(repo, "worktree", "list").count("\n") == 0


def test_a_run_without_changes_leaves_no_branch(repo: Path, sandbox_image: str) -> None:
    spec = spec_for(repo, image=sandbox_image)

    async def body() -> ContainerWorkspace:
        async with ContainerWorkspace(spec) as ws:
            r = await ws.exec("cat README.md && git status --short", timeout_s=30, env={})
            assert r.exit_code == 0 and r.output == "# demo\n", r.output
            ws.set_outcome(RunOutcome("succeeded"))
        return ws

    ws = asyncio.run(body())
    assert ws.artifacts() == [] and sh(repo, "branch", "--list", "orch/*") == ""
    assert leftovers(repo) == []


def test_timeout_and_cancel_kill_the_command_inside(repo: Path, sandbox_image: str) -> None:
    spec = spec_for(repo, image=sandbox_image)

    async def body() -> None:
        async with ContainerWorkspace(spec) as ws:
            t0 = time.monotonic()
            r = await ws.exec("sleep 300 & sleep 301; echo never", timeout_s=1, env={})
            assert r.timed_out and r.exit_code is None and "never" not in r.output
            assert time.monotonic() - t0 < 4
            task = asyncio.create_task(ws.exec("sleep 302", timeout_s=60, env={}))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            r = await ws.exec("echo left behind & sleep 303 & echo done", timeout_s=10, env={})
            assert r.exit_code == 0 and "done" in r.output
            ps = await ws.exec("ps -eo args", timeout_s=10, env={})
            assert ps.exit_code == 0
            running = [x for x in ps.output.splitlines() if x.startswith("sleep 30")]
            assert running == []  # timed out, cancelled, and left in the background: all gone
            ws.set_outcome(RunOutcome("succeeded"))

    asyncio.run(body())
    assert not labelled(f"orch.run_id={spec.run_id}")


def test_limits_contain_a_fork_bomb_and_a_memory_hog(repo: Path, sandbox_image: str) -> None:
    spec = spec_for(repo, image=sandbox_image, pids_limit=64, mem_limit="64m")

    async def body() -> None:
        async with ContainerWorkspace(spec) as ws:
            cid = ws.container_id
            await ws.exec("bomb() { bomb | bomb & }; bomb; sleep 2", timeout_s=6, env={})
            host = await asyncio.create_subprocess_exec("true")
            assert await asyncio.wait_for(host.wait(), 30) == 0  # the host can still fork
            assert _refused_forks(cid) != 0  # forks were refused at the limit
            ok = await ws.exec("echo alive", timeout_s=10, env={})
            assert ok.exit_code == 0 and "alive" in ok.output
            hog = await ws.exec(
                "head -c 400000000 /dev/zero | tail -n 1 >/dev/null", timeout_s=30, env={}
            )
            assert hog.exit_code == 137
            assert "out of memory (sandbox mem_limit 64m)" in hog.output
            again = await ws.exec("echo still-here", timeout_s=10, env={})
            assert "still-here" in again.output  # only the hog died
            ws.set_outcome(RunOutcome("succeeded"))

    asyncio.run(body())
    assert not labelled(f"orch.run_id={spec.run_id}")


def _refused_forks(container_id: str) -> int | None:
    events = Path(f"/sys/fs/cgroup/pids/docker/{container_id}/pids.events")  # cgroup v1 host
    return int(events.read_text().split()[1]) if events.exists() else None


# -- through the Runner ---------------------------------------------------------------------


def test_agent_works_in_a_container_on_its_branch(
    repo: Path, sandbox_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    bash = "cat notes.md && echo from-bash > made.txt && id -u && git status --short && env"
    script = {"conversations": [{"turns": [
        {"tool_calls": [{"tool": "write_file",
                         "input": {"path": "notes.md", "content": "from write_file\n"}}]},
        {"tool_calls": [{"tool": "bash", "input": {"command": bash}}]},
        {"expect_result": "from write_file", "text": "done in a container"},
    ]}]}  # fmt: skip
    h = harness(repo, script, sandbox=SandboxSettings(image=sandbox_image))
    rec = h.run("work in a box", isolation="container")
    assert rec.status == RunStatus.SUCCEEDED, rec.error
    assert rec.workspace["isolation"] == "container" and rec.workspace["user"] == f"{UID}:{UID}"
    seen = json.dumps(h.requests_of(rec.run_id)[-1].messages[-1])
    assert f"{UID}\\n" in seen and "?? made.txt" in seen and "?? notes.md" in seen
    for value in SECRETS.values():
        assert value not in seen
    [art] = rec.artifacts
    files = sh(repo, "diff", "--name-only", art["base"], art["branch"]).split()
    assert files == ["made.txt", "notes.md"]
    assert sh(repo, "show", f"{art['branch']}:made.txt") == "from-bash"
    assert sh(repo, "status", "--porcelain") == "" and not (repo / "notes.md").exists()
    assert not labelled(f"orch.run_id={rec.run_id}") and leftovers(repo) == []
    assert rec.workspace["root"] == "/workspace"
    assert h.store.resources(rec.run_id) == []


def test_task_child_with_container_isolation(repo: Path, sandbox_image: str) -> None:
    script = {"conversations": [
        {"depth": 0, "turns": [
            {"tool_calls": [{"tool": "task", "input": {
                "description": "boxed", "prompt": "write c.txt", "isolation": "container"}}]},
            {"expect_result": "child wrote it", "text": "parent done"},
        ]},
        {"depth": 1, "turns": [
            {"tool_calls": [{"tool": "bash", "input": {"command": "echo child > c.txt && pwd"}}]},
            {"expect_result": "/workspace", "text": "child wrote it"},
        ]},
    ]}  # fmt: skip
    h = harness(repo, script, sandbox=SandboxSettings(image=sandbox_image))
    root = h.run("delegate")
    assert root.status == RunStatus.SUCCEEDED, root.error
    [child] = h.store.children(root.run_id)
    assert child.isolation == "container" and child.workspace["container"]
    [art] = child.artifacts
    assert sh(repo, "show", f"{art['branch']}:c.txt") == "child"
    assert not (repo / "c.txt").exists() and not labelled(f"orch.run_id={child.run_id}")


def test_failed_and_cancelled_runs_leave_no_container(repo: Path, sandbox_image: str) -> None:
    cfg = SandboxSettings(image=sandbox_image)
    failing = {"conversations": [{"turns": [
        {"tool_calls": [{"tool": "bash", "input": {"command": "echo half > half.txt"}}]},
        {"tool_calls": [{"tool": "bash", "input": {"command": "true"}}]},
        {"text": "never"},
    ]}]}  # fmt: skip
    h = harness(repo, failing, sandbox=cfg)
    rec = h.run("fail", isolation="container", max_turns=1)
    assert rec.status == RunStatus.FAILED and "max_turns" in (rec.error or "")
    assert not labelled(f"orch.run_id={rec.run_id}")
    assert [a["branch"] for a in rec.artifacts] == [f"orch/general/{rec.run_id[2:10]}"]

    sleeper = {"conversations": [{"turns": [
        {"tool_calls": [{"tool": "bash", "input": {"command": "touch started; sleep 60"}}]},
        {"text": "never"},
    ]}]}  # fmt: skip
    h = harness(repo, sleeper, sandbox=cfg)

    async def cancel_midway() -> str:
        job = asyncio.create_task(h.runner.run(h.spec("x", isolation="container")))

        def its_container() -> tuple[str, str] | None:  # (not another test's: ours by run)
            running = [r.run_id for r in h.store.list_runs() if r.status == RunStatus.RUNNING]
            found = [(rid, cid) for rid in running for cid in labelled(f"orch.run_id={rid}")]
            return found[0] if found else None

        found: tuple[str, str] = await asyncio.to_thread(wait_for, its_container)
        run_id, cid = found
        started = "test -f started && echo yes"
        await asyncio.to_thread(wait_for, lambda: "yes" in inside(cid, started))
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(job, 120)
        return run_id

    run_id = asyncio.run(cancel_midway())
    rec = h.store.require_run(run_id)
    assert rec.status == RunStatus.CANCELLED
    assert [a["branch"] for a in rec.artifacts] == [f"orch/general/{run_id[2:10]}"]  # kept
    assert sh(repo, "show", f"orch/general/{run_id[2:10]}:started") == ""
    assert "orch-status: cancelled" in sh(repo, "log", "-1", f"orch/general/{run_id[2:10]}")
    assert not labelled(f"orch.run_id={run_id}") and leftovers(repo) == []
    assert h.store.resources(run_id) == []


# -- pool, reaping, errors, CLI -------------------------------------------------------------


def test_pool_claim_is_fast_and_leaves_nothing(repo: Path, sandbox_image: str) -> None:
    cfg = SandboxSettings(image=sandbox_image)

    async def body() -> list[float]:
        claims: list[float] = []
        async with ContainerPool(repo, cfg, size=1) as pool:
            for i in range(2):
                async with asyncio.timeout(60):
                    await pool.wait_ready()
                spec = spec_for(repo, image=sandbox_image)
                t0 = time.perf_counter()
                async with ContainerWorkspace(spec) as ws:
                    claims.append(time.perf_counter() - t0)
                    assert ws.pooled
                    r = await ws.exec(
                        f"echo {i} > pooled.txt && git status --short", timeout_s=30, env={}
                    )
                    assert r.exit_code == 0 and "?? pooled.txt" in r.output, r.output
                    ws.set_outcome(RunOutcome("succeeded"))
                [art] = ws.artifacts()
                assert sh(repo, "show", f"{art['branch']}:pooled.txt") == str(i)
            assert pool.claimed == 2
        return claims

    claims = asyncio.run(body())
    assert max(claims) < 1.0, claims  # a claim skips creating and starting the container
    assert leftovers(repo) == []
    assert not labelled(f"orch.owner_pid={os.getpid()}")


def test_reap_by_label_removes_only_containers_of_dead_owners(repo: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait(30)
    cfg = SandboxSettings(image=BUSYBOX)
    client = docker_client()
    try:
        ids = {}
        for who in ("dead", "live"):
            labels = owner_labels(f"r-{who}", "c-reap")
            if who == "dead":
                labels.update({"orch.owner_pid": str(dead.pid), "orch.owner_start": "1"})
            ids[who] = create_container(client, cfg, UID, UID, labels, network_mode="none")
            client.api.start(ids[who])
    finally:
        client.close()
    assert reap_by_label({"r-other"}) == []
    assert reap_by_label() == [ids["dead"]]
    assert labelled("orch.run_id=r-live") == [ids["live"]]
    remove_container(ids["live"])
    remove_container(ids["live"])  # already gone: nothing to do
    assert not labelled("orch.run_id=r-live")


def test_clear_errors(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "orch sandbox build" in str(docker_mod._image_missing(SANDBOX))
    spec = spec_for(repo, image="orch-no-such-image:latest", shell="sh")
    with pytest.raises(OrchError, match=r"image orch-no-such-image:latest not found: build or"):
        asyncio.run(ContainerWorkspace(spec).__aenter__())
    assert sh(repo, "branch", "--list", "orch/*") == "" and leftovers(repo) == []
    # an image without python3 and git: one line naming the fix, nothing left behind
    spec = spec_for(repo, image=BUSYBOX, shell="sh")
    with pytest.raises(OrchError, match=r"^the sandbox image needs python3 and git; run `orch"):
        asyncio.run(ContainerWorkspace(spec).__aenter__())
    assert not labelled(f"orch.run_id={spec.run_id}") and leftovers(repo) == []
    with pytest.raises(UsageError, match="never runs as uid 0"):
        asyncio.run(ContainerWorkspace(spec_for(repo, user="0:0")).__aenter__())
    with pytest.raises(UsageError, match="sandbox.pids_limit"):  # checked once, with the settings
        load_settings(repo, sandbox={"pids_limit": 1})
    monkeypatch.setattr(docker_mod, "_API_VERSION", {})
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(OrchError, match=r"^Docker is not reachable .*start the engine"):
        docker_client()


def test_sandbox_cli(repo: Path, sandbox_image: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(repo)
    runner = CliRunner()
    r = runner.invoke(sandbox_app, ["config", "--json"])
    assert r.exit_code == 0, r.output
    cfg = json.loads(r.output)
    assert cfg["network_mode"] == "none" and cfg["cap_drop"] == ["ALL"]
    assert cfg["read_only"] is True and cfg["memswap_limit"] == cfg["mem_limit"] == "2g"
    assert cfg["effective_user"] == f"{UID}:{UID}" and cfg["pool_size"] == 0
    spec = spec_for(repo, image=sandbox_image)

    async def body() -> list[dict[str, Any]]:
        async with ContainerWorkspace(spec) as ws:
            ps = runner.invoke(sandbox_app, ["ps", "--json"])
            ws.set_outcome(RunOutcome("succeeded"))
        rows: list[dict[str, Any]] = json.loads(ps.output)
        return rows

    rows = asyncio.run(body())
    mine = [x for x in rows if x["run_id"] == spec.run_id]
    assert len(mine) == 1 and mine[0]["owner_alive"] and mine[0]["state"] == "running"
    r = runner.invoke(sandbox_app, ["prune"])
    assert r.exit_code == 0, r.output
    assert "nothing to prune" in runner.invoke(sandbox_app, ["prune"]).output
