"""A throwaway Postgres server for tests: the Debian binaries, a data directory in a fresh
temp directory, run as an unprivileged user (Postgres refuses root), on 127.0.0.1 only.

``initdb`` writes a ``pg_hba.conf`` that lets in TCP connections from 127.0.0.1 only:
the role ``orch_pw`` with its password (scram), every other role without one (trust).
The Unix socket lives in the temp directory. :meth:`PgServer.stop` is ``pg_ctl stop -m
fast`` and removes the directory.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psycopg

PASSWORD_ROLE = "orch_pw"
PASSWORD = "Pg-s3cret-!@#-x"  # odd characters: percent-encoding in the URL must hold too
ROLE = "orch"
HBA = f"""\
local all all trust
host all {PASSWORD_ROLE} 127.0.0.1/32 scram-sha-256
host all all 127.0.0.1/32 trust
"""


class Unavailable(Exception):
    """Postgres cannot run here (the reason is the message)."""


def bindir() -> Path:
    """The newest ``/usr/lib/postgresql/*/bin`` that has initdb, pg_ctl and postgres."""
    found = []
    for initdb in glob.glob("/usr/lib/postgresql/*/bin/initdb"):
        d = Path(initdb).parent
        version = re.search(r"/postgresql/(\d+)", initdb)
        if all((d / b).exists() for b in ("pg_ctl", "postgres")) and version:
            found.append((int(version.group(1)), d))
    if not found:
        raise Unavailable(
            "Postgres server binaries are missing (/usr/lib/postgresql/*/bin/initdb); "
            "apt-get install postgresql"
        )
    return max(found)[1]


def _as_user() -> tuple[list[str], int, int]:
    """The command prefix that runs a program as an unprivileged user, and its uid/gid."""
    if os.getuid() != 0:
        return [], os.getuid(), os.getgid()
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        raise Unavailable(
            "running as root and there is no user 'nobody' to run Postgres as"
        ) from None
    if setpriv := shutil.which("setpriv"):
        uid, gid = nobody.pw_uid, nobody.pw_gid
        prefix = [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
        return prefix, uid, gid
    if runuser := shutil.which("runuser"):
        return [runuser, "-u", "nobody", "--"], nobody.pw_uid, nobody.pw_gid
    raise Unavailable("running as root without setpriv or runuser to drop privileges")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class PgServer:
    root: Path
    bindir: Path
    port: int
    prefix: list[str]

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, dbname: str = "postgres", user: str = "postgres", password: str = "") -> str:
        from urllib.parse import quote

        secret = f":{quote(password, safe='')}" if password else ""
        return f"postgresql://{user}{secret}@127.0.0.1:{self.port}/{dbname}"

    def admin(self) -> psycopg.Connection[tuple[object, ...]]:
        import psycopg  # imported when a server is used: this module loads without it

        return psycopg.connect(self.url(), autocommit=True, connect_timeout=10)

    def create_database(self, name: str, owner: str = ROLE) -> None:
        from psycopg import sql

        with self.admin() as conn:
            conn.execute(
                sql.SQL("CREATE DATABASE {} OWNER {}").format(
                    sql.Identifier(name), sql.Identifier(owner)
                )
            )

    def drop_database(self, name: str) -> None:
        from psycopg import sql

        with self.admin() as conn:
            drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
            conn.execute(drop.format(sql.Identifier(name)))

    def dump(self, dbname: str) -> str:
        """``pg_dump`` of a database as SQL text (schema and data)."""
        dump = subprocess.run(
            [str(self.bindir / "pg_dump"), "--no-owner", self.url(dbname)],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return dump.stdout

    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        subprocess.run(
            [*self.prefix, str(self.bindir / "pg_ctl"), "stop", "-m", "fast", "-D", str(self.data)],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(self.root, ignore_errors=True)


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise Unavailable(f"{what} failed: {' / '.join(tail)}")


def start(*, durable: bool = False) -> PgServer:
    """Start a server (``durable``: keep fsync and synchronous commit, for measurements)."""
    bins = bindir()
    prefix, uid, gid = _as_user()
    root = Path(tempfile.mkdtemp(prefix="orch-pg-"))
    try:
        os.chown(root, uid, gid)
        (root / "sock").mkdir()
        os.chown(root / "sock", uid, gid)
        data = root / "data"
        initdb = "-U postgres -A trust -E UTF8 --locale=C.UTF-8 --no-sync".split()
        _run([*prefix, str(bins / "initdb"), "-D", str(data), *initdb], "initdb")
        (data / "pg_hba.conf").write_text(HBA)
        options = [
            "-c listen_addresses=127.0.0.1",
            f"-c unix_socket_directories={root / 'sock'}",
            "-c max_connections=200",
            "-c shared_buffers=32MB",
        ]
        if not durable:
            options += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
        for attempt in range(3):
            server = PgServer(root, bins, free_port(), prefix)
            try:
                log = ["-l", str(root / "server.log")]
                opts = ["-o", " ".join([*options, f"-c port={server.port}"])]
                ctl = [*prefix, str(bins / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(data)]
                _run([*ctl, *log, *opts], "pg_ctl start")
                break
            except Unavailable:
                if attempt == 2:
                    raise Unavailable(f"pg_ctl start failed: {server.log()[-500:]}") from None
                time.sleep(0.5)
        _setup_roles(server)
        return server
    except BaseException:
        subprocess.run(
            [*prefix, str(bins / "pg_ctl"), "stop", "-m", "immediate", "-D", str(root / "data")],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(root, ignore_errors=True)
        raise


def _setup_roles(server: PgServer) -> None:
    from psycopg import sql

    with server.admin() as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(ROLE)))
        conn.execute("SET password_encryption = 'scram-sha-256'")
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(PASSWORD_ROLE), sql.Literal(PASSWORD)
            )
        )
