"""Generated: see kernel_env.server.e2b.proto."""
