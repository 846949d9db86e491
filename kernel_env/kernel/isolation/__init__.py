"""What separates a local kernel from the host and from other kernels: the bubblewrap sandbox
(``sandbox``), a cgroup per kernel (``cgroups``), a uid per kernel (``privilege``), private
runtime directories (``runtime``) and the seccomp filter (``seccomp``).

Import rule (``tests/test_layers.py``): these are mechanisms, not kernels. A module here
imports the standard library, ``kernel_env.errors`` and the other modules of this folder,
never a kernel backend, the driver or ``jupyter_client``; ``seccomp`` imports the standard
library alone, since the zygote loads it (:mod:`kernel_env.kernel.fork`). The backends that
use them are :mod:`kernel_env.kernel.local` and :mod:`kernel_env.kernel.sandboxed`.
"""
