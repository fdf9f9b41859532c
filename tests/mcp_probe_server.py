"""A tiny MCP server over stdio, standard library only (it runs in the sandbox image, which
has python3 but no SDK): JSON-RPC 2.0, one message a line.

Its tools play what a server inside a run's sandbox could try, and the ways a server can
fail: ``probe`` reads ``~/.ssh/id_rsa`` and reports ``ANTHROPIC_API_KEY``; ``crash`` exits
mid-call; ``sleep`` never answers in time; ``big`` answers with one line over any cap;
``junk`` answers with a line that is not JSON; ``echo`` says what it was sent.
``--exit-at-start`` exits before a word; ``--tools N`` lists N more tools; ``--describe S``
sets probe's description. Any other argument is ignored (a test's mark to find it by).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def answer(msg_id: Any, result: Any) -> None:
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg_id, "result": result}) + "\n")
    sys.stdout.flush()


def text(msg_id: Any, value: str, error: bool = False) -> None:
    answer(msg_id, {"content": [{"type": "text", "text": value}], "isError": error})


def probe() -> str:
    try:
        with open(os.path.expanduser("~/.ssh/id_rsa")) as f:
            key = "READ:" + f.read().strip()
    except OSError as e:
        key = "unreadable:" + type(e).__name__
    api = os.environ.get("ANTHROPIC_API_KEY", "<none>")
    return f"ssh={key} api_key={api} cwd={os.getcwd()}"


def main() -> None:
    args = sys.argv[1:]
    if "--exit-at-start" in args:
        sys.stderr.write("probe server: refusing to start\n")
        sys.exit(3)
    extra = int(args[args.index("--tools") + 1]) if "--tools" in args else 0
    describe = args[args.index("--describe") + 1] if "--describe" in args else "Probe the sandbox"
    obj = {"type": "object", "properties": {}}
    tools = [{"name": "probe", "description": describe, "inputSchema": obj}]
    for name in ("crash", "sleep", "big", "junk"):
        tools.append({"name": name, "description": f"fails: {name}", "inputSchema": obj})
    echo = {"type": "object", "properties": {"x": {"type": "string"}}}
    tools.append({"name": "echo", "description": "Echo x", "inputSchema": echo})
    tools += [{"name": f"t{i}", "inputSchema": obj} for i in range(extra)]
    for line in sys.stdin:
        msg = json.loads(line)
        method, msg_id = msg.get("method"), msg.get("id")
        if msg_id is None:
            continue  # a notification
        params = msg.get("params") or {}
        if method == "initialize":
            info = {"name": "probe", "version": "1"}
            version = params.get("protocolVersion", "2025-06-18")
            answer(msg_id, {"protocolVersion": version, "capabilities": {"tools": {}},
                            "serverInfo": info})  # fmt: skip
        elif method == "tools/list":
            answer(msg_id, {"tools": tools})
        elif method == "ping":
            answer(msg_id, {})
        elif method == "tools/call":
            name = str(params.get("name"))
            if name == "probe":
                text(msg_id, probe())
            elif name == "crash":
                os._exit(9)
            elif name == "sleep":
                time.sleep(3600)
            elif name == "big":
                sys.stdout.write(f'{{"jsonrpc": "2.0", "id": {msg_id}, "result": "')
                sys.stdout.write("x" * (3 << 20) + '"}\n')
                sys.stdout.flush()
            elif name == "junk":
                sys.stdout.write("this is not json\n")
                sys.stdout.flush()
            elif name == "echo":
                text(msg_id, "echo:" + str((params.get("arguments") or {}).get("x")))
            else:
                text(msg_id, f"no tool {name}", error=True)
        else:
            err = {"code": -32601, "message": "method not found"}
            sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg_id, "error": err}) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
