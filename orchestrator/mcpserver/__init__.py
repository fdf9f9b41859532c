"""orch as an MCP server (``orch mcp``): any MCP client (Claude Code, Codex, Cursor) delegates
into orch's tiers through the same admission, budgets and trust as the CLI.

- ``inputs.py``: what each tool takes (pydantic models: the tools' input schemas);
- ``desk.py``: what each tool does, on the project the server was started in;
- ``server.py``: the SDK's low-level stdio server around the desk.
"""
