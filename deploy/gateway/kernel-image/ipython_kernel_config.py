# Settings of an episode kernel (the same as kernel_env's local kernels): the agent helpers
# loaded at start, tracebacks without ANSI colours (a model reads them), no history database.
c = get_config()  # noqa: F821  (IPython config file)
c.InteractiveShellApp.extensions = ["kernel_env.inkernel.extension"]
c.InteractiveShell.colors = "nocolor"
c.HistoryManager.enabled = False
