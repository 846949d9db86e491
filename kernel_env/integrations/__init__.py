"""Adapters that let other agent frameworks run their code on kernel_env kernels.

Each lives in its own module, imported only when used, with its framework as an optional extra:
``kernel_env.integrations.dspy`` (``pip install 'kernel-env[dspy]'``) and
``kernel_env.integrations.rlm`` (``pip install 'kernel-env[rlm]'``). And the other way round,
kernel_env's kernels in a plain Jupyter: ``kernel_env.integrations.provisioner``, the kernel
provisioner ``kernel-env kernelspec install`` names.
"""
