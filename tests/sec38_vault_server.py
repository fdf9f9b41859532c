#!/usr/bin/env python3
"""The user's MCP server in the issue-38 tests: a stdio JSON-RPC server (standard library only)
with one tool, ``reveal``, that answers ``WHO token=$VAULT_URL`` (``WHO``: its first
argument, so a test tells the user's program from a planted one)."""

from __future__ import annotations

import json
import os
import sys


def send(msg_id: object, result: object) -> None:
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg_id, "result": result}) + "\n")
    sys.stdout.flush()


def main() -> None:
    who = sys.argv[1] if len(sys.argv) > 1 else "user-server"
    schema = {"type": "object", "properties": {}}
    tools = [{"name": "reveal", "description": "Reveal the token", "inputSchema": schema}]
    for line in sys.stdin:
        msg = json.loads(line)
        method, msg_id = msg.get("method"), msg.get("id")
        if msg_id is None:
            continue
        if method == "initialize":
            version = (msg.get("params") or {}).get("protocolVersion", "2025-06-18")
            info = {"name": "vault", "version": "1"}
            send(msg_id, {"protocolVersion": version, "capabilities": {"tools": {}},
                          "serverInfo": info})  # fmt: skip
        elif method == "tools/list":
            send(msg_id, {"tools": tools})
        elif method == "tools/call":
            token = os.environ.get("VAULT_URL", "<none>")
            send(msg_id, {"content": [{"type": "text", "text": f"{who} token={token}"}]})
        else:
            send(msg_id, {})


if __name__ == "__main__":
    main()
