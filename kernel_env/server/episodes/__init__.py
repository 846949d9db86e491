"""The episode store's protocol on ``kernel-env serve``: the episodes the server kept
(:mod:`kernel_env.server.store`), read back. The modules, by concept:

- :mod:`.routes`: ``GET /episodes`` (a page, newest first, filtered), ``GET /episodes/{id}``
  (one, with its forks and children), ``GET /episodes/{id}/notebook`` and
  ``/export.zip``; ``add_episodes(app)``;
- :mod:`.failures`: exceptions -> HTTP statuses, in one place.

A client tenant sees only its own episodes; another's id is answered as an id no episode has.
"""
