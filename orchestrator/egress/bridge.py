"""orch's egress bridge, run inside a sandbox: ``127.0.0.1:PORT`` of the sandbox's own
network namespace, relayed to the egress proxy's Unix socket (mounted in).

The sandbox has no network of its own (bubblewrap's ``--unshare-net``, Docker's
``network_mode=none``): its programs reach the proxy only through this listener, which
opens the socket and says its run's token before the client's first byte. The proxy
decides everything; this program holds no policy, and a command that kills or replaces it
only loses its own run's way out (a host tier's next command has a bridge of its own; a
container's one bridge is gone for the rest of the run).

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

import _socket  # the C module: ``socket`` imports enum and selectors (≈ 10 ms a command)
import _thread
import os
import sys
import time

CHUNK = 256 * 1024
PORT = 3128  # where the bridge listens in every sandbox (its own network namespace)
SOCKET_INSIDE = "/run/orch-egress.sock"  # where a sandbox sees its run's proxy socket
HELLO = b"ORCH-EGRESS "  # then the token and a newline: the first bytes on the socket


def argv(python: str, token: str, then: list[str] | None) -> list[str]:
    """How a sandbox starts the bridge with ``python``: before ``then`` (a host tier's
    command), or alone as a daemon (``then`` None: a container's, the source as ``-c``)."""
    if then is None:
        with open(__file__, encoding="utf-8") as f:
            program = ["-c", f.read()]
        tail = ["--daemon"]
    else:
        program, tail = [os.path.realpath(__file__)], ["--", *then]
    return [python, "-I", "-S", *program, str(PORT), SOCKET_INSIDE, token, *tail]


Socket = _socket.socket


def _pump(src: Socket, dst: Socket, done: _thread.LockType | None = None) -> None:
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(_socket.SHUT_WR)
        except OSError:
            pass
        if done is not None:
            done.release()


def _serve(conn: Socket, path: str, hello: bytes) -> None:
    up = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        up.connect(path)
        up.sendall(hello)
    except OSError:
        up.close()
        conn.close()
        return
    back = _thread.allocate_lock()
    back.acquire()
    _thread.start_new_thread(_pump, (up, conn, back))
    _pump(conn, up)
    back.acquire()  # until the answer's end
    up.close()
    conn.close()


def _accept(listener: Socket, path: str, hello: bytes) -> None:
    while True:
        try:
            fd, _ = listener._accept()  # type: ignore[attr-defined]  # (socket.accept wraps it)
        except OSError:
            time.sleep(0.05)  # out of descriptors: try again soon
            continue
        conn = _socket.socket(fileno=fd)
        conn.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
        _thread.start_new_thread(_serve, (conn, path, hello))


def _quiet() -> None:
    """Let go of stdin, stdout and stderr: their readers see the command's end, not ours."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def main(args: list[str]) -> int:
    mode = args[3] if len(args) > 3 else ""
    if mode not in ("--", "--daemon") or (mode == "--" and len(args) < 5):
        print("usage: bridge.py PORT SOCKET TOKEN (-- COMMAND... | --daemon)", file=sys.stderr)
        return 2
    port, path, command = int(args[0]), args[1], args[4:]
    hello = HELLO + args[2].encode() + b"\n"
    listener = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    try:
        listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
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
    _thread.start_new_thread(_accept, (listener, path, hello))
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
