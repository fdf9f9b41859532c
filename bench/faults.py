"""Fault injection (issue 45): background worktree runs through faults at random moments.

Each fault is played over ``BENCH_FAULT_RUNS`` runs (rounds of ``ROUND`` concurrent runs)
of the real CLI, ``orch task --background --isolation worktree`` with a scripted model
whose steps write ``work-<i>.txt`` (one bash call), then sleep (another), then answer:
- SIGKILL of the worker host (SQLite store);
- ``pg_ctl stop -m fast`` of a real Postgres store, ``DOWN_S`` down, then ``start``;
- SIGKILL of one run's sandbox (its outer bwrap) in each round (SQLite store).
The moment is random (seeded: ``BENCH_FAULT_SEED``, else the clock; printed). After each
round: every run is waited for (bounded, through ``orch ps``, which reconciles), then
counted: runs ended (not running/queued), results recorded (a succeeded run has its
answer; an interrupted or failed one its ending and error), work on branches (a run that
wrote its file, by its events or a file left anywhere, has it on ``orch/<agent>/<id>``),
processes left (any process whose command line names the project, after a grace).
Goal: all, all, all, none.

Run: ``python bench/faults.py``
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.run import RunStatus  # noqa: E402
from orchestrator.store import open_store  # noqa: E402

RUNS = 12  # a fault's runs: three rounds of four
ROUND = 4
SLEEP_S = 3.0137  # the run's second step (its odd digits mark its process: none may be left)
DOWN_S = 2.0
WAIT_S = 90.0  # a round's runs must end within this
GRACE_S = 10.0  # processes still alive this long after the last run ended are "left"
ANSWER = "FAULT-DONE"


def note(msg: str) -> None:
    print(f"[faults] {msg}", file=sys.stderr, flush=True)


def _script(path: Path) -> Path:
    turns = [
        {"tool_calls": [{"tool": "bash", "input": {"command": "echo written > work.txt"}}]},
        {"tool_calls": [{"tool": "bash", "input": {"command": f"sleep {SLEEP_S}"}}]},
        {"text": ANSWER},
    ]
    path.write_text(yaml.safe_dump({"conversations": [{"runs": "*", "turns": turns}]}))
    return path


def _env(store_url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "ORCH_"))}
    env["ORCH_HOST_IDLE"] = "1"
    if store_url:
        env["ORCH_STORE"] = store_url
    return env


def _orch(project: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=project, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _pids(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmd and state != "Z":
            found.append(int(entry.name))
    return found


def _bwraps(project: Path) -> list[int]:
    return [p for p in _pids(str(project)) if _comm(p) == "bwrap"]


def _hosts(project: Path) -> list[int]:
    return [p for p in _pids(str(project)) if p in set(_pids("orchestrator _host"))]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=False)


def _project(root: Path) -> Path:
    repo = root / "project"
    repo.mkdir(parents=True)
    (repo / "README").write_text("fault bench\n")
    ident = ["-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], [*ident, "commit", "-q", "-m", "x"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    return repo


def _launch(project: Path, env: dict[str, str], script: Path) -> str:
    r = _orch(project, env, "task", "go", "--background", "--json", "--isolation", "worktree",
              "--model", f"scripted:{script}")  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"orch task failed: {r.stderr.strip()[-300:]}")
    return str(json.loads(r.stdout)["run_id"])


def _wait_ended(project: Path, env: dict[str, str], ids: list[str]) -> dict[str, str]:
    """Statuses by ``orch ps --all --json`` (which reconciles) until all ended or WAIT_S."""
    end = time.monotonic() + WAIT_S
    status: dict[str, str] = {}
    while True:
        r = _orch(project, env, "ps", "--all", "--json")
        if r.returncode == 0:
            status = {x["run_id"]: x["status"] for x in json.loads(r.stdout) if x["run_id"] in ids}
        if all(status.get(i) not in (None, "running", "queued") for i in ids):
            return status
        if time.monotonic() > end:
            return status
        time.sleep(0.5)


def _count(project: Path, url: str | None, ids: list[str]) -> dict[str, Any]:
    store = open_store(project, url)
    c: dict[str, Any] = {"runs": len(ids), "ended": 0, "recorded": 0, "wrote": 0,
                         "on_branch": 0, "statuses": {}, "bad": []}  # fmt: skip
    try:
        for rid in ids:
            rec = store.require_run(rid)
            st = rec.status.value
            c["statuses"][st] = c["statuses"].get(st, 0) + 1
            ended = rec.status.ended
            c["ended"] += ended
            if rec.status == RunStatus.SUCCEEDED:
                ok = store.output(rid) == ANSWER
            else:
                ok = ended and rec.ended_at is not None and bool(rec.error)
            c["recorded"] += ok
            events = store.events(rid)
            wrote = any(e["kind"] == "tool_result" for e in events)
            branch = f"orch/{rec.agent}/{rid[2:10]}"
            on_branch = _git(project, "show", f"{branch}:work.txt").stdout.strip() == "written"
            left = list((project / ".orch").glob(f"worktrees/**/{rid[2:10]}*/work.txt"))
            wrote = wrote or on_branch or bool(left)
            c["wrote"] += wrote
            c["on_branch"] += wrote and on_branch
            if not (ended and ok and (on_branch or not wrote)):
                c["bad"].append({"run": rid, "status": st, "error": rec.error,
                                 "output": store.output(rid), "wrote": wrote,
                                 "on_branch": on_branch})  # fmt: skip
    finally:
        store.close()
    return c


def _round(
    root: Path, url: str | None, fault: Callable[[Path, list[str]], str], rng: random.Random
) -> dict[str, Any]:
    project = _project(root / uuid.uuid4().hex[:8])
    env = _env(url)
    script = _script(project.parent / "script.yaml")
    ids = [_launch(project, env, script) for _ in range(ROUND)]
    delay = rng.uniform(0.1, SLEEP_S)  # after the last launch: every run still going
    time.sleep(delay)
    what = fault(project, ids)
    status = _wait_ended(project, env, ids)
    c = _count(project, url, ids)
    end = time.monotonic() + GRACE_S
    marks = (str(project), f"sleep {SLEEP_S}")
    while any(_pids(m) for m in marks) and time.monotonic() < end:
        time.sleep(0.2)
    left = sorted({p for m in marks for p in _pids(m)})
    c["left"] = len(left)
    c["left_comm"] = sorted(_comm(p) for p in left)
    for p in left:  # leave nothing behind ourselves
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    c["fault"] = f"{what} at {delay:.2f} s"
    note(f"round: {c['fault']}: {json.dumps({k: v for k, v in c.items() if k != 'bad'})}")
    for b in c["bad"]:
        note(f"  BAD {json.dumps(b)} (ps said {status.get(b['run'])})")
    return c


def _kill_host(project: Path, ids: list[str]) -> str:
    hosts = _hosts(project)
    for p in hosts:
        os.kill(p, signal.SIGKILL)
    return f"SIGKILL of {len(hosts)} worker host(s)"


def _kill_sandbox(project: Path, ids: list[str]) -> str:
    for _ in range(50):  # between the two steps there may be no bwrap for a moment
        outer = [p for p in _bwraps(project) if _comm(_ppid(p)) != "bwrap"]
        if outer:
            os.kill(outer[0], signal.SIGKILL)
            return "SIGKILL of one run's bwrap"
        time.sleep(0.05)
    return "no bwrap found to kill"


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _fault_row(name: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("runs", "ended", "recorded", "wrote", "on_branch", "left")
    tot = {k: sum(r[k] for r in rounds) for k in keys}
    statuses: dict[str, int] = {}
    for r in rounds:
        for k, v in r["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    met = (tot["ended"] == tot["recorded"] == tot["runs"] and tot["on_branch"] == tot["wrote"]
           and tot["left"] == 0)  # fmt: skip
    good = min(tot["ended"], tot["recorded"])
    measure = (
        f"{name}, {tot['runs']} runs: ended {tot['ended']}, recorded {tot['recorded']}, "
        f"on branches {tot['on_branch']}/{tot['wrote']}, processes left {tot['left']}"
    )
    detail = {**tot, "statuses": statuses, "faults": [r["fault"] for r in rounds],
              "bad": [b for r in rounds for b in r["bad"]]}  # fmt: skip
    return {"measure": measure, "orch_ms": float(good), "raw_ms": float(tot["runs"]),
            "ratio": None, "goal": "all, all, all, none", "met": met, "detail": detail}  # fmt: skip


def _postgres(root: Path, n: int, rng: random.Random) -> list[dict[str, Any]]:
    try:
        import psycopg  # noqa: F401

        from tests.pgserver import Unavailable, start
    except ImportError as e:
        note(f"Postgres restart skipped: {e}")
        return []
    try:
        server = start()
    except Unavailable as e:
        note(f"Postgres restart skipped: {e}")
        return []
    ctl = [*server.prefix, str(server.bindir / "pg_ctl")]
    opts = " ".join([
        "-c listen_addresses=127.0.0.1", f"-c unix_socket_directories={server.root / 'sock'}",
        "-c max_connections=200", "-c shared_buffers=32MB", "-c fsync=off",
        f"-c port={server.port}",
    ])  # fmt: skip

    def restart(project: Path, ids: list[str]) -> str:
        stop = [*ctl, "stop", "-m", "fast", "-w", "-D", str(server.data)]
        subprocess.run(stop, capture_output=True, timeout=60, check=True)
        time.sleep(DOWN_S)
        log = str(server.root / "server.log")
        up = [*ctl, "start", "-w", "-t", "60", "-D", str(server.data), "-l", log, "-o", opts]
        subprocess.run(up, capture_output=True, timeout=90, check=True)
        return f"Postgres stopped {DOWN_S:.0f} s"

    try:
        rounds = []
        for _ in range(max(1, n // ROUND)):
            db = f"b_{uuid.uuid4().hex[:10]}"
            server.create_database(db)
            rounds.append(_round(root, server.url(db, user="orch"), restart, rng))
        return [_fault_row("Postgres store stopped 2 s and started", rounds)]
    finally:
        server.stop()


def run() -> list[dict[str, Any]]:
    n = int(os.environ.get("BENCH_FAULT_RUNS", RUNS))
    seed = int(os.environ.get("BENCH_FAULT_SEED", time.time_ns() % 1_000_000))
    note(f"seed {seed} (BENCH_FAULT_SEED={seed} replays the moments), {n} runs a fault")
    rng = random.Random(seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="orch-faults-") as tmp:
        root = Path(tmp)
        for name, fault in (("SIGKILL of the worker host", _kill_host),
                            ("SIGKILL of a run's sandbox (bwrap)", _kill_sandbox)):  # fmt: skip
            rounds = [_round(root, None, fault, rng) for _ in range(max(1, n // ROUND))]
            rows.append(_fault_row(name, rounds))
        rows.extend(_postgres(root, n, rng))
    for r in rows:
        r["detail"]["seed"] = seed
    return rows


if __name__ == "__main__":
    for r in run():
        print(f"{r['measure']:<100} {'met' if r['met'] else 'NOT MET'}")
