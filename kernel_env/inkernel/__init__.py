"""The code that runs *inside* a kernel, and the one contract it keeps with the host.

- ``contract``: every request tag, metadata key, MIME type, module name and expression that
  the host and the kernel share, and the small pure functions both sides use;
- ``extension``: an episode kernel's IPython extension (the agent's helpers, the output caps,
  the stdin guard, the episode's setup and state), shipped as source, with the contract's, to
  a remote kernel that lacks the package;
- ``tuning``: the per-cell tuning of ipykernel, an IPython extension of its own;
- ``envd``: E2B's file and process operations, called by the server's E2B door;
- ``dspy``: DSPy's tools and ``SUBMIT``, for
  :class:`kernel_env.integrations.dspy.KernelInterpreter`;
- ``bash_kernel``: bash_kernel with the stdin bridge for the shell's helpers (the bash
  kernel's own process);
- ``shims/``: the helpers of other languages (R, Bash, Deno), sent as code or sourced.

Import rule (``tests/test_layers.py``): modules here import the standard library, what the
kernel has (IPython, ipykernel, zmq; bash_kernel in the bash kernel) and this package only;
``tuning`` also reads the tested releases (``kernel_env.kernel.versions``, standard library
alone). The host imports ``contract`` and nothing else of this package, except where it
registers the extensions (``kernel_env.load_ipython_extension``) or ships their source
(``kernel.gateway``); ``kernel.fork.live``, which runs in the kernel but belongs to the
forkserver, calls the extension and the tuning in a live fork's copy. This package imports
nothing: its modules load on first use.
"""
