"""orch's egress bridge, run inside a sandbox: ``127.0.0.1:PORT`` of the sandbox's own
network namespace, relayed to the egress proxy's Unix socket (mounted in).

The sandbox has no network of its own (bubblewrap's ``--unshare-net``, Docker's
``network_mode=none``): its programs reach the proxy only through this listener, which
opens the socket and says its run's token before the client's first byte. The proxy
decides everything; this program holds no policy, and a command that kills or replaces it
only loses its own way out.

Standard library only: it runs as ``python3 -I -S`` (the host's interpreter in a host
tier, the image's in a container). Usage:

- ``bridge.py PORT SOCKET TOKEN -- COMMAND...``: listen, run COMMAND, relay until it
  exits, exit with its status (a host tier's command);
- ``bridge.py PORT SOCKET TOKEN --daemon``: listen, print ``ready``, relay until killed (a
  container's, once: a long-lived exec, as the container's program server is).

TOKEN is the run's own (it opens only that run's list); a program of the same sandbox may
read it, no other sandbox can.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

CHUNK = 256 * 1024


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _serve(conn: socket.socket, path: str, hello: bytes) -> None:
    with conn:
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with up:
            try:
                up.connect(path)
                up.sendall(hello)
            except OSError:
                return
            back = threading.Thread(target=_pump, args=(up, conn), daemon=True)
            back.start()
            _pump(conn, up)
            back.join()


def _accept(listener: socket.socket, path: str, hello: bytes) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            time.sleep(0.05)  # out of descriptors: try again soon
            continue
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_serve, args=(conn, path, hello), daemon=True).start()


def _quiet() -> None:
    """Let go of stdin, stdout and stderr: their readers see the command's end, not ours."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def main(argv: list[str]) -> int:
    mode = argv[3] if len(argv) > 3 else ""
    if mode not in ("--", "--daemon") or (mode == "--" and len(argv) < 5):
        print("usage: bridge.py PORT SOCKET TOKEN (-- COMMAND... | --daemon)", file=sys.stderr)
        return 2
    port, path, command = int(argv[0]), argv[1], argv[4:]
    hello = b"ORCH-EGRESS " + argv[2].encode() + b"\n"
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(512)
    except OSError as e:
        print(f"orch egress bridge: cannot listen on 127.0.0.1:{port}: {e}", file=sys.stderr)
        return 126
    if mode == "--daemon":
        print("ready", flush=True)
        _accept(listener, path, hello)
        return 0
    pid = os.fork()
    if pid == 0:
        listener.close()
        try:
            os.execvp(command[0], command)
        except OSError as e:
            print(f"orch egress bridge: {command[0]}: {e}", file=sys.stderr)
        os._exit(127)
    _quiet()
    threading.Thread(target=_accept, args=(listener, path, hello), daemon=True).start()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
