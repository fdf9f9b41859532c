"""Runs inside a sandbox container (stdlib only, as ``python3 -c``): programs on request
over one long-lived ``docker exec``, so a call costs no new exec (≈ 45 ms of runc each).

It greets first (a zero length and ``{"hello": "orch-boxserve/1"}``). The host writes a
request: one JSON line ``{"argv": [...], "env": {...}, "stdin": N}``
and N bytes for the program's stdin. The program runs in ``/workspace``, in the server's
process group (killing the exec's group on a timeout or an overflow ends it too). Its
stdout comes back as frames (4-byte big-endian length, then that many bytes), ended by
a zero length and one JSON line ``{"code": C, "err": "..."}`` (its exit
status and up to 64 KiB of its stderr). Then the next request. The host treats all of it
as the sandbox's words: capped, checked, never trusted (``dockerexec.Sandbox``).

A request with ``"session": ID`` is a ``bash`` command (as ``base.run_process`` runs one
on the host): it runs in a session and process group of its own, stdin empty, stdout and
stderr interleaved in the frames; once it exits its output may still come for
``GRACE_S`` (something it left in the background holds the pipe), then its whole group
is killed; its status is reported as a shell does (``128 + n`` for signal n), its trailer
naming ID. On a timeout or a cancel the host kills the session itself
(``channel.kill_sessions``).
"""

import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import IO

ERR_CAP = 64 * 1024
GRACE_S = 0.5  # base.OUTPUT_GRACE_S
CHUNK = 65536  # channel.FRAME_MAX is larger


def _frame(out: IO[bytes], data: bytes) -> None:
    out.write(struct.pack(">I", len(data)) + data)
    out.flush()


def _session(argv: list[str], env: dict[str, str], out: IO[bytes]) -> int:
    """Run a command in a session of its own; its group goes when it ends (see above)."""
    proc = subprocess.Popen(
        argv,
        cwd="/workspace",
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    fd, ended = proc.stdout.fileno(), 0.0
    while True:
        wait = 0.05 if not ended else max(0.0, ended + GRACE_S - time.monotonic())
        if select.select([fd], [], [], wait)[0]:
            chunk = os.read(fd, CHUNK)
            if not chunk:
                break
            _frame(out, chunk)
        if not ended and proc.poll() is not None:
            ended = time.monotonic()
        elif ended and time.monotonic() >= ended + GRACE_S:
            break
    code = proc.wait()  # its output closed: it may work on (the host's timeout bounds it)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.stdout.close()
    return 128 - code if code < 0 else code


def _feed(pipe: IO[bytes], data: bytes) -> None:
    try:
        pipe.write(data)
    except OSError:
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _drain(pipe: IO[bytes], into: list[bytes]) -> None:
    while True:
        chunk = pipe.read(65536)
        if not chunk:
            return
        if len(into[0]) < ERR_CAP:
            into[0] += chunk[: ERR_CAP - len(into[0])]


def main() -> None:
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    out.write(struct.pack(">I", 0) + b'{"hello": "orch-boxserve/1"}\n')  # channel.HELLO
    out.flush()
    while True:
        line = inp.readline(65536)
        if not line:
            return
        req = json.loads(line)
        body = inp.read(int(req.get("stdin", 0))) if req.get("stdin") else b""
        env = dict(os.environ)
        env.update(req.get("env") or {})
        if req.get("session"):
            code = _session(req["argv"], env, out)
            trailer = {"code": code, "err": "", "id": req["session"]}
            out.write(struct.pack(">I", 0) + json.dumps(trailer).encode())
            out.write(b"\n")
            out.flush()
            continue
        proc = subprocess.Popen(
            req["argv"],
            cwd="/workspace",
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        err = [b""]
        feeder = threading.Thread(target=_feed, args=(proc.stdin, body))
        reader = threading.Thread(target=_drain, args=(proc.stderr, err))
        feeder.start()
        reader.start()
        while True:
            chunk = os.read(proc.stdout.fileno(), 1 << 20)
            if not chunk:
                break
            out.write(struct.pack(">I", len(chunk)) + chunk)
            out.flush()
        code = proc.wait()
        feeder.join()
        reader.join()
        trailer = {"code": code, "err": err[0].decode("utf-8", "replace")}
        out.write(struct.pack(">I", 0) + json.dumps(trailer).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
