"""``orch doctor``'s checks of a project's state: its settings and trust, its run store, and
the warm process and worker host that serve it. They look, and create or start nothing."""

from __future__ import annotations

import contextlib
import os
import shlex
import sqlite3
import stat
import sys
import time
from pathlib import Path

from ..config import Settings, load_settings_with_trust
from ..errors import OrchError
from ..trust import Trust
from .base import Check, Status

PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600


def project_settings(workdir: Path) -> tuple[Settings, Check]:
    """The settings every command of the project would use, and the trust check."""
    from ..catalog.agent_trust import load_trusted
    from ..project.paths import project_root

    root = project_root(workdir)
    here = f" -C {shlex.quote(str(root))}"
    try:
        settings, trust = load_trusted(root)
    except OrchError as e:
        check = Check(
            name="trust",
            status=Status.FAIL,
            detail=str(e),
            fix=f"fix {root / 'orch.toml'} (or ~/.orch/config.toml) as the message says",
            required=True,  # every command stops at it
        )
        try:
            return load_settings_with_trust(None)[0], check
        except OrchError:
            return Settings(), check
    return settings, _trust(root, trust, here)


def _trust(root: Path, trust: Trust, here: str) -> Check:
    if trust.digest is None:
        detail = f"{root}: nothing to trust (its settings need no trust)"
        return Check(name="trust", status=Status.OK, detail=detail)
    names = ", ".join(trust.relevant)
    if trust.trusted:
        detail = f"{root}: trusted ({names}; sha256 {trust.digest[:12]}…)"
        return Check(name="trust", status=Status.OK, detail=detail)
    why = "changed since it was trusted" if trust.recorded is not None else "not trusted"
    return Check(
        name="trust",
        status=Status.WARN,
        detail=f"{root}: {why}, so these of its settings are left out: {names}",
        fix=f"review them with `orch trust --show{here}`, then `orch trust{here}`",
    )


# -- the run store ----------------------------------------------------------------------


def check_store(workdir: Path, settings: Settings) -> Check:
    from ..project.paths import project_root
    from ..store import store_url
    from ..store.base import state_path
    from ..store.sqlite import DB_FILE
    from ..storeurl import SCHEMES

    try:
        url = store_url(settings.store)
    except OrchError as e:
        fix = f"unset ORCH_STORE or give it a {' or '.join(SCHEMES)} URL"
        return Check(name="store", status=Status.FAIL, detail=str(e), fix=fix, required=True)
    if url is not None:
        return _at_url(url)
    where = state_path(project_root(workdir))
    return _sqlite(where, where / DB_FILE)


def _at_url(url: str) -> Check:
    from ..store import open_url
    from ..storeurl import endpoint, redact

    source = "ORCH_STORE" if os.environ.get("ORCH_STORE", "").strip() else "store setting"
    try:
        open_url(url).close()
    except OrchError as e:  # its messages never hold the password
        return Check(
            name="store",
            status=Status.FAIL,
            detail=f"{redact(url)} ({source}): {e}",
            fix=f"start the server at {endpoint(url)} or correct the URL in {source}",
            required=True,
        )
    return Check(name="store", status=Status.OK, detail=f"{redact(url)} ({source})", required=True)


def _mode_problem(path: Path, want: int) -> str | None:
    st = path.stat()
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not you"
    mode = stat.S_IMODE(st.st_mode)
    if mode & ~want:
        return f"{path} has mode {mode:04o}, should be {want:04o}"
    return None


def _sqlite(where: Path, db: Path) -> Check:
    name = "store"
    if not where.exists():
        detail = f"SQLite {db} (not made yet: the first command makes it, mode 0700)"
        return Check(name=name, status=Status.OK, detail=detail, required=True)
    if not where.is_dir():
        fix = f"move {where} aside, or set ORCH_HOME to a directory"
        detail = f"{where} is not a directory"
        return Check(name=name, status=Status.FAIL, detail=detail, fix=fix, required=True)
    problems: list[tuple[Path, int, str]] = []
    for path, want in [(where, PRIVATE_DIR), *((p, PRIVATE_FILE) for p in _db_files(db))]:
        if (why := _mode_problem(path, want)) is not None:
            problems.append((path, want, why))
    if any("belongs to" in why for *_, why in problems):
        detail = "; ".join(why for *_, why in problems)
        fix = "set ORCH_HOME to a directory of your own, or chown the files back to you"
        return Check(name=name, status=Status.FAIL, detail=detail, fix=fix, required=True)
    from ..project.statedir import Refused, checked_dir

    try:  # what every command checks first: made by this user's orch, no link in it
        checked_dir(where)  # (it also sets the directory 0700, as any command)
    except Refused as e:
        fix = f"as it says; if your own older orch made {where}: orch adopt-state"
        return Check(name=name, status=Status.FAIL, detail=str(e), fix=fix, required=True)
    count = _count_runs(db)
    if isinstance(count, str):
        fix = f"move {db} aside (orch then starts an empty store)"
        detail = f"SQLite {db} cannot be read ({count})"
        return Check(name=name, status=Status.FAIL, detail=detail, fix=fix, required=True)
    held = f"{count} runs" if count is not None else "no database yet"
    if problems:
        detail = "; ".join(why for *_, why in problems) + " (it holds every run's prompts)"
        fix = " && ".join(f"chmod {want:o} {shlex.quote(str(path))}" for path, want, _ in problems)
        return Check(name=name, status=Status.WARN, detail=detail, fix=fix, required=True)
    detail = f"SQLite {db} ({held}; dir 0700, files 0600)"
    return Check(name=name, status=Status.OK, detail=detail, required=True)


def _db_files(db: Path) -> list[Path]:
    found = [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]
    return [p for p in found if p.exists()]


def _count_runs(db: Path) -> int | str | None:
    """How many runs the database holds (read-only), None if it does not exist, or why not."""
    if not db.exists():
        return None
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            row = conn.execute("SELECT count(*) FROM runs").fetchone()
        finally:
            conn.close()
    except sqlite3.Error as e:
        return str(e)
    return int(row[0])


# -- the warm process and the worker host ------------------------------------------------


def check_hosts(workdir: Path, settings: Settings) -> list[Check]:
    return [_warm(), _worker_host(workdir, settings)]


def _off() -> str | None:
    if sys.platform != "linux":
        return "off (needs Linux)"
    if os.environ.get("ORCH_WORKER_HOST", "1") == "0":
        return "off (ORCH_WORKER_HOST=0)"
    return None


def _listener(sock: Path) -> int | None:
    from ..process.warmhome import owner

    if not sock.exists():
        return None
    with contextlib.suppress(OSError):
        return owner(sock)
    return None


def _warm() -> Check:
    from ..process import warmhome as warm

    if (off := _off()) is not None:
        return Check(name="warm", status=Status.OK, detail=off)
    idle = warm.idle_seconds()
    if idle <= 0:
        return Check(name="warm", status=Status.OK, detail="off (ORCH_WARM_IDLE=0)")
    home = os.environ.get("HOME")
    if not home:
        return Check(name="warm", status=Status.OK, detail="off (HOME is not set)")
    where = Path(home) / ".orch" / "warm"
    key = warm.warm_key()
    pid = _listener(where / f"{key}.sock")
    if pid is not None:
        detail = f"running (pid {pid}) for this environment; it exits after {idle:g} s idle"
        return Check(name="warm", status=Status.OK, detail=detail)
    failed = where / f"{key}.failed"
    with contextlib.suppress(OSError):
        if time.time() - failed.stat().st_mtime < warm.FAILED_FOR_S:
            why = failed.read_text(errors="replace").strip().splitlines()
            return Check(
                name="warm",
                status=Status.WARN,
                detail=f"could not start here: {why[0] if why else 'see ' + str(failed)}",
                fix=f"fix the cause, then rm {shlex.quote(str(failed))} (ORCH_WARM_IDLE=0 "
                "turns the warm process off)",
            )
    detail = f"none running: the next command starts one (it exits after {idle:g} s idle)"
    return Check(name="warm", status=Status.OK, detail=detail)


def _worker_host(workdir: Path, settings: Settings) -> Check:
    from ..process.detach import host_key, paths
    from ..project.paths import project_root
    from ..store.base import state_path

    if (off := _off()) is not None:
        return Check(name="worker-host", status=Status.OK, detail=off)
    try:
        key = host_key(settings.store)
    except OrchError as e:  # a bad ORCH_STORE: the store check says it
        return Check(name="worker-host", status=Status.SKIP, detail=f"not checked ({e})")
    state = state_path(project_root(workdir))
    if not state.is_dir():
        detail = "none running: the next background run starts one"
        return Check(name="worker-host", status=Status.OK, detail=detail)
    try:
        sock, _ = paths(state, key)
    except OrchError as e:  # a state dir orch refuses: the store check says why
        return Check(name="worker-host", status=Status.SKIP, detail=f"not checked ({e})")
    pid = _listener(sock)
    if pid is not None:
        detail = f"running (pid {pid}) for this state dir and environment"
        return Check(name="worker-host", status=Status.OK, detail=detail)
    detail = "none running: the next background run starts one"
    return Check(name="worker-host", status=Status.OK, detail=detail)


def check_imports(workdir: Path) -> Check:
    """orch's interpreter loads nothing an agent of the project could write: the door every
    command that opens the project passes (``process/interpreter.py``)."""
    from ..process.interpreter import refusal
    from ..project.paths import project_root

    why = refusal(project_root(workdir))
    if why is None:
        detail = f"orch's Python loads nothing from this project ({sys.prefix})"
        return Check(name="imports", status=Status.OK, detail=detail, required=True)
    detail, _, fix = why.rpartition("; ")
    return Check(name="imports", status=Status.FAIL, detail=detail, fix=fix, required=True)
