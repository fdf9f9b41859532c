"""orch as an MCP client: servers a run's agent names, started inside its sandbox.

``names.py``: the ``mcp__server__tool`` grants (what an agent asks for, what a child may
have); ``declared.py``: the servers declared in ``.mcp.json``, ``~/.orch/mcp.json`` and an
agent's ``mcpServers``; ``transport.py``: a started server's pipes as the SDK's streams, a
line capped; ``servers.py``: a run's servers opened and closed with the run, their tools.
The SDK (``mcp``) is imported only by ``transport.py`` and ``servers.py``, when a run has a
server to start.
"""
