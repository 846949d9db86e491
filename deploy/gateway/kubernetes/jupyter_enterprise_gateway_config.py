# Enterprise Gateway's settings for kernel-env's kernels (mounted as a ConfigMap; the
# Deployment points JUPYTER_CONFIG_DIR at it).
c = get_config()  # noqa: F821 (traitlets' config loader defines it)

# Notice a dead kernel within a second (the default polls every 3 s), so that kernel-env
# replaces it and its step says the state was lost.
c.KernelRestarter.time_to_dead = 1.0
# A kernel that ignores the shutdown request is ended after 1 s, not 2.5 s.
c.KernelManager.shutdown_wait_time = 1.0
