"""Issue 20, classes 1 and 2: orch acts only on state its user's orch made, and follows no
link in its state directory. Each test plays the attack through the real CLI."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.pgroups import process_start
from orchestrator.project.statedir import sign
from orchestrator.run import RunRecord, RunStatus, now
from orchestrator.store import RunStore, SqliteStore
from tests.support import _unavailable, git, init_repo, need_docker, orch, wait_for, write_script

IMAGE = "orch-test-busybox:latest"
DEAD_PID = 4_000_000  # above pid_max: no owner lives there


_PROCS: list[subprocess.Popen[bytes]] = []


def _sleeper() -> int:
    """A live process group (``setsid sleep 300``) of this user; its pgid (the fixture
    ``sleepers`` ends it)."""
    proc = subprocess.Popen(["setsid", "sleep", "300"], stdin=subprocess.DEVNULL)
    _PROCS.append(proc)
    wait_for(lambda: process_start(proc.pid), 10, "the sleeper to start")
    return proc.pid


def _alive(pid: int, start: int | None) -> bool:
    return start is not None and process_start(pid) == start


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    for proc in _PROCS:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    _PROCS.clear()


def _docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()  # fmt: skip


@pytest.fixture
def containers() -> Iterator[list[str]]:
    """Containers a test made, removed after it; skips where no Docker engine answers or the
    test image is missing (a Docker CLI alone is not an engine; fails under CI=true)."""
    need_docker()
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode:
        _unavailable(f"{IMAGE} is missing: run sandboxes/build-test-image.sh")
    made: list[str] = []
    yield made
    for cid in made:
        subprocess.run(["docker", "rm", "-f", "-v", cid], capture_output=True, timeout=60)


def _victim_container(made: list[str], **labels: str) -> str:
    """A running container labelled as orch's (a user's work, or a pool's)."""
    alive = {
        "orch.owner_pid": str(os.getpid()),
        "orch.owner_start": str(process_start(os.getpid())),
    }
    # (a live owner: `orch sandbox prune` elsewhere on a shared engine leaves it alone)
    flags = [f"--label={k}={v}" for k, v in {"orch.managed": "true", **alive, **labels}.items()]
    cid = _docker("run", "-d", *flags, IMAGE, "sleep", "300")
    made.append(cid)
    return cid


def _running(cid: str) -> bool:
    got = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", cid],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    return got.stdout.strip() == "true"


def _plant_run(db: Path | RunStore, refs: list[tuple[str, str]], run_id: str = "r-planted") -> None:
    """A "running" run whose owner is gone, owning ``refs`` (kind, ref)."""
    store = SqliteStore(db) if isinstance(db, Path) else db
    store.create_run(RunRecord(run_id=run_id, chain_id="c-" + run_id, status=RunStatus.RUNNING,
                               pid=DEAD_PID, pid_start=1, node=socket.gethostname(),
                               created_at=now(), started_at=now()))  # fmt: skip
    for kind, ref in refs:
        store.register_resource(run_id, kind, ref)
    store.close()


def _refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode != 0, result.stdout
    err = result.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for word in words:
        assert word in err, err


def _attacker_repo(tmp_path: Path, pgid: int, cid: str) -> Path:
    """A repository committing a store a real orch made, planted with a "running" run
    whose resources are a live process group and a container (by its id)."""
    repo = init_repo(tmp_path / "attacker", {"README.md": "hi\n"})
    assert orch("ps", cwd=repo).returncode == 0  # a real store
    _plant_run(repo / ".orch" / "orch.db", [("pgroup", f"{pgid}:{process_start(pgid)}"),
                                            ("container", cid)])  # fmt: skip
    git(
        repo,
        "add",
        "-f",
        ".orch/orch.db",
        *([".orch/owner"] if (repo / ".orch/owner").exists() else []),
    )
    git(repo, "commit", "-q", "-m", "state")
    return repo


@pytest.mark.docker
def test_a_store_committed_to_the_repository_is_refused(
    tmp_path: Path, sleepers: list[int], containers: list[str]
) -> None:
    pgid = _sleeper()
    sleepers.append(pgid)
    start = process_start(pgid)
    cid = _victim_container(containers)
    attacker = _attacker_repo(tmp_path, pgid, cid)
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(attacker), str(clone))
    assert (clone / ".orch" / "orch.db").is_file()

    results = [orch(*c, cwd=clone) for c in (["ps"], ["ps", "--all"], ["tree", "r-planted"])]
    assert _alive(pgid, start), "the planted store's process group was killed"
    assert _running(cid), "the planted store's container was removed"
    for result in results:
        _refused(result, "came with the repository", "orch did not create it")


@pytest.mark.docker
def test_a_copied_or_foreign_store_is_refused(
    tmp_path: Path, sleepers: list[int], containers: list[str]
) -> None:
    pgid = _sleeper()
    sleepers.append(pgid)
    start = process_start(pgid)
    cid = _victim_container(containers)
    ours = init_repo(tmp_path / "ours", {"a.txt": "a\n"})
    assert orch("ps", cwd=ours).returncode == 0
    _plant_run(ours / ".orch" / "orch.db", [("pgroup", f"{pgid}:{start}"), ("container", cid)])

    copy = init_repo(tmp_path / "copy", {"a.txt": "a\n"})  # copied, with our own mark
    shutil.copytree(ours / ".orch", copy / ".orch", symlinks=True)
    copied = orch("ps", cwd=copy)
    plain = tmp_path / "plain"  # not a repository, marked or not
    plain.mkdir()
    shutil.copytree(ours / ".orch", plain / ".orch", symlinks=True)
    (plain / ".orch" / "owner").unlink(missing_ok=True)
    unmarked = orch("ps", cwd=plain)
    assert _alive(pgid, start) and _running(cid)
    _refused(copied, "owner mark that is not this user's", "adopt-state")
    _refused(unmarked, "without this user's owner mark")

    if os.geteuid() == 0:  # another user's store (chown needs root)
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        shutil.copytree(ours / ".orch", theirs / ".orch", symlinks=True)
        subprocess.run(["chown", "-R", "nobody", str(theirs / ".orch")], check=True)
        foreign = orch("ps", cwd=theirs)
        assert _alive(pgid, start) and _running(cid)
        _refused(foreign, "belongs to uid")
    # the user vouches for a store an older orch made: then it is used (and reconciled)
    adopted = orch("adopt-state", cwd=plain)
    assert adopted.returncode == 0, adopted.stderr
    assert orch("ps", cwd=plain).returncode == 0


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.mark.docker
@pytest.mark.parametrize("backend", BACKENDS)
def test_reconcile_kills_and_removes_only_what_it_can_prove(
    tmp_path: Path,
    sleepers: list[int],
    containers: list[str],
    backend: str,
    request: pytest.FixtureRequest,
) -> None:
    """In the user's own store, SQLite or a shared Postgres one (where other users' rows
    live): forged resource rows prove nothing."""
    repo = init_repo(tmp_path / "proj", {"a.txt": "a\n"})
    env: dict[str, str] = {}
    if backend == "postgres":
        from orchestrator.store.postgres import PostgresStore

        env = {"ORCH_STORE": request.getfixturevalue("pg_url")}
        store: RunStore = PostgresStore(env["ORCH_STORE"])
    assert orch("ps", cwd=repo, env=env).returncode == 0
    if backend == "sqlite":
        store = SqliteStore(repo / ".orch" / "orch.db")
    zero, wrong, unsigned, ours = _sleeper(), _sleeper(), _sleeper(), _sleeper()
    sleepers.extend([zero, wrong, unsigned, ours])
    starts = {p: process_start(p) for p in (zero, wrong, unsigned, ours)}
    uid = str(os.getuid())
    token = {"orch.owner_uid": uid, "orch.token": "a" * 32}
    bare = _victim_container(containers)  # orch's label, no token
    tokened = _victim_container(containers, **token)
    other_uid = _victim_container(containers, **{**token, "orch.owner_uid": "65534"})
    rid = "r-planted"
    _plant_run(store, [
        ("pgroup", sign(rid, "pgroup", f"{zero}:0")),  # start time 0: no proof
        ("pgroup", sign(rid, "pgroup", f"{wrong}:{(starts[wrong] or 0) + 1}")),  # not its start
        ("pgroup", f"{unsigned}:{starts[unsigned]}"),  # exact, but not signed by our key
        ("pgroup", sign(rid, "pgroup", f"{ours}:{starts[ours]}")),  # proven: killed
        ("container", sign(rid, "container", bare)),
        ("container", sign(rid, "container", f"{bare} {'a' * 32}")),  # no such label
        ("container", sign(rid, "container", f"{tokened} {'c' * 32}")),  # a guessed token
        ("container", f"{tokened} {'a' * 32}"),  # the token, but not signed by our key
        ("container", sign(rid, "container", f"{other_uid} {'a' * 32}")),  # another uid's
    ])  # fmt: skip

    done = orch("ps", "--all", "--json", cwd=repo, env=env)
    assert done.returncode == 0, done.stderr
    assert all(_alive(p, starts[p]) for p in (zero, wrong, unsigned))
    wait_for(lambda: not _alive(ours, starts[ours]), 10, "the proven group to be killed")
    assert all(_running(c) for c in (bare, tokened, other_uid))
    try:
        record = store.require_run(rid)  # (closed after planting: reopened, as by another process)
    finally:
        store.close()
    assert record.status == RunStatus.INTERRUPTED, record
    assert (record.error or "").count("left container") == 5, record.error
    assert "left pgroup" in (record.error or ""), record.error


# -- class 2: no link in the state directory is followed -------------------------------


def _outside(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir()
    return out


def test_links_a_repository_ships_in_orch_are_not_followed(tmp_path: Path) -> None:
    out = _outside(tmp_path)
    repo = init_repo(tmp_path / "attacker", {"a.txt": "a\n"})
    (repo / ".orch" / "logs").mkdir(parents=True)
    os.symlink(out / "gitignore", repo / ".orch" / ".gitignore")
    os.symlink(out / "host.log", repo / ".orch" / "logs" / "host.log")
    git(repo, "add", "-f", ".orch")
    git(repo, "commit", "-q", "-m", "links")
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    script = write_script(clone, {"conversations": [{"turns": [{"text": "done"}]}]})
    for command in (["ps"], ["task", "hi", "--model", f"scripted:{script}", "--background"]):
        _refused(orch(*command, cwd=clone), "came with the repository")
    assert list(out.iterdir()) == []

    git(clone, "rm", "-q", "--cached", ".orch/logs/host.log")  # the fix the message names
    shutil.rmtree(clone / ".orch" / "logs")
    assert orch("ps", cwd=clone).returncode == 0  # .gitignore: a link replaced, not followed
    assert list(out.iterdir()) == [] and not (clone / ".orch" / ".gitignore").is_symlink()


@pytest.mark.parametrize("rel", [".orch", ".orch/orch.db", ".orch/orch.db-wal",
                                 ".orch/logs/host.log", ".orch/worktrees"])  # fmt: skip
def test_a_link_in_the_state_directory_is_refused(tmp_path: Path, rel: str) -> None:
    out = _outside(tmp_path)
    repo = init_repo(tmp_path / "proj", {"a.txt": "a\n"})
    assert orch("ps", cwd=repo).returncode == 0  # our own, marked state directory
    link = repo / rel
    if rel == ".orch":
        shutil.move(repo / ".orch", tmp_path / "moved")
        target = out
    else:
        if link.is_dir():
            shutil.rmtree(link)
        link.unlink(missing_ok=True)
        link.parent.mkdir(exist_ok=True)
        target = out / "dir" if rel.endswith("worktrees") else out / "file"
        if rel.endswith("worktrees"):
            target.mkdir()
    os.symlink(target, link)
    script = write_script(repo, {"conversations": [{"turns": [{"text": "done"}]}]})
    commands = [
        ["ps"],
        ["task", "hi", "--model", f"scripted:{script}", "--background"],
        ["task", "hi", "--model", f"scripted:{script}", "--isolation", "worktree"],
    ]
    for command in commands:
        _refused(orch(*command, cwd=repo), "symlink", "remove it")
    assert [p.name for p in out.rglob("*")] == (["dir"] if rel.endswith("worktrees") else [])


def test_the_state_key_is_made_once_whole_under_racing_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight workspaces opening at once made the key in one thread while another read it
    half written ('state.key is damaged', a CI failure): every racer gets the same key."""
    import threading

    from orchestrator.project import statedir

    home = tmp_path / "home"
    home.mkdir()
    got: list[bytes] = []
    errors: list[BaseException] = []
    start = threading.Barrier(16)

    def take() -> None:
        start.wait(timeout=30)
        try:
            got.append(statedir._key_of.__wrapped__(str(home)))
        except BaseException as e:  # collected: the assertion names it
            errors.append(e)

    for _round in range(20):
        (home / ".orch" / statedir.KEY_FILE).unlink(missing_ok=True)
        got.clear()
        threads = [threading.Thread(target=take) for _ in range(16)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=30)
        assert not errors, errors
        assert len(got) == 16 and len(set(got)) == 1, got
