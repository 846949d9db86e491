"""``python -m kernel_env serve``: the same as the ``kernel-env`` command."""

from kernel_env.cli import main

raise SystemExit(main())
