"""MCP on ``kernel-env serve``: OpenEnv ``jupyter_env``'s five tools over streamable HTTP at
``/mcp``, one episode per MCP session, over the session core
(:mod:`kernel_env.server.sessions`) and the tools' code it shares with OpenEnv's
``call_tool`` steps (:mod:`kernel_env.server.tools`). The modules, by concept:

- :mod:`.routes`: ``POST``/``GET``/``DELETE /mcp`` as a route table, ``add_mcp(app)``, and
  the answer to a request without a token;
- :mod:`.openenv_dialect`: OpenEnv's dialect of ``/mcp`` (its ``MCPToolClient``: a session
  created by ``openenv/session/create``, named in the params, shared with ``/ws``);
- :mod:`.protocol`: MCP's JSON-RPC messages as plain data (no I/O);
- :mod:`.failures`: exceptions -> JSON-RPC errors and ``isError`` results, in one place;
- :mod:`.stdio`: MCP's stdio transport (``kernel-env mcp``), a bridge to the routes, of a
  server or of the app run in-process.

docs/mcp.md is the user's guide.
"""
