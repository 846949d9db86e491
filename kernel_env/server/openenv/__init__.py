"""OpenEnv's protocol on ``kernel-env serve``: HTTP (``/reset``, ``/step``, ``/state``, the
info routes, kernel_env's session routes) and ``WS /ws``, over the session core
(:mod:`kernel_env.server.sessions`). The modules, by concept:

- :mod:`.routes`: the route table, and ``add_openenv(app)``, which mounts it;
- :mod:`.info`: ``/health``, ``/metadata``, ``/schema``;
- :mod:`.episodes`: ``/reset``, ``/step``, ``/state``, a session's close and fork;
- :mod:`.exports`: a session's episode as a notebook, or zipped;
- :mod:`.websocket`: ``/ws``, one socket one session, its loop;
- :mod:`.protocol`: the ``/ws`` frames as plain data (no I/O);
- :mod:`.failures`: exceptions -> HTTP statuses and error frames, in one place.

docs/openenv-wire.md is the contract these follow; docs/server-protocol.md the user's guide.
"""
