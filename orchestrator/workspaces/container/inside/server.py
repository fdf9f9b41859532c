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
"""

import json
import os
import struct
import subprocess
import sys
import threading
from typing import IO

ERR_CAP = 64 * 1024


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
