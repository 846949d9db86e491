"""Jupyter Server's kernel API on ``kernel-env serve``: what a Jupyter gateway serves, so
that Jupyter Server (``--gateway-url``), JupyterLab and other Jupyter clients start and drive
kernel_env kernels. A kernel is a session, its episode the kernel's life: sandboxed, from the
server's pool, with the helpers and ``llm_query`` answered by the server's model, in
``/sessions`` and ``/web``, reaped after ``--idle-ttl``. And every episode holding a kernel,
whichever door opened it, is a kernel here for its owner: a person attaches to an agent's
episode, runs cells in it (recorded with their author) and interrupts it. The modules, by
concept:

- :mod:`.routes`: the route table, and ``add_jupyter(app)``, which mounts it;
- :mod:`.kernels`: ``/api`` and ``/api/kernels`` (list, start, get, shut down, interrupt,
  restart);
- :mod:`.kernelspecs`: ``/api/kernelspecs`` and ``/kernelspecs/{name}/{resource}``;
- :mod:`.channels`: ``WS /api/kernels/{id}/channels``, each execute a step of the episode;
- :mod:`.messages`: Jupyter's messages as plain data (no I/O);
- :mod:`.failures`: exceptions -> Jupyter Server's answers, in one place.

Like every door, it speaks to sessions only through the session core's public methods
(:class:`~kernel_env.server.sessions.Session`), never to a kernel. docs/server-protocol.md
("Jupyter's kernel API") is the user's guide.
"""
