"""The kernel forkserver and live forks: kernels forked from a preloaded process, and copies
of a running kernel. Its modules run in four processes:

- ``server``: in the host. It starts the zygote and asks it for kernels.
- ``zygote``: the preloaded process, which builds a kernel from ``template`` and forks it.
  It must never start a thread (a fork copies locks held by threads the child lacks).
- ``spawner``: a small process of the zygote's, run by path (``python -I -S``), which starts
  each kernel's launch (sandbox, uid, cgroups).
- ``live``: inside a running kernel, which forks copies of itself (``template`` finishes
  each copy into a kernel of its own).

Import rule (``tests/test_layers.py``): ``server`` imports the host's modules it needs
(``kernel.launch``, ``kernel.versions``) and ``spawner``'s line protocol. ``spawner``
imports the standard library alone. ``zygote`` and ``template`` import the standard library,
what every kernel preloads (ipykernel, IPython, zmq, ...), each other, ``spawner``,
``kernel.isolation.seccomp`` and ``kernel.versions``: nothing of the host. ``live`` may also
import what runs in every kernel (``kernel_env.inkernel.extension``, ``.tuning``). ``live``
stays here, not in ``kernel_env.inkernel``: it runs in the kernel, but it is the forkserver's
other half, built on ``template`` and ``spawner``, which the zygote runs too.
"""
