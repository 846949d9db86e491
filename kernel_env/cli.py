"""``kernel-env``: the command line. ``serve`` runs the server; more subcommands come later.

Every ``serve`` flag also reads a ``KERNEL_ENV_<NAME>`` variable (e.g. ``KERNEL_ENV_POOL_SIZE``);
a flag given on the command line wins. The bearer token is read from ``KERNEL_ENV_TOKEN`` only:
a flag would show it to anyone who can list processes.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernel_env.server.settings import ServerSettings

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    command: int = args.run(args)
    return command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernel-env",
        description="REPL environments for language-model agents, in real IPython kernels.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(commands)
    # Reserved for later: run (an agent episode), export (.ipynb), replay (a recorded episode).
    return parser


def _add_serve(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    serve = commands.add_parser(
        "serve",
        help="run the OpenEnv-compatible HTTP + WebSocket server",
        description="Serve episodes over OpenEnv's protocol (HTTP and WS /ws). Each flag "
        "defaults to its KERNEL_ENV_<NAME> variable, then to the built-in default. "
        "Set KERNEL_ENV_TOKEN to require a bearer token.",
    )
    add = serve.add_argument
    add("--host", help="interface to bind (default 127.0.0.1)")
    add("--port", type=int, help="port to bind; 0 picks a free one (default 8000)")
    add("--pool-size", type=int, help="kernels kept warm for resets (default 4)")
    add("--max-sessions", type=int, help="open sessions at most, one kernel each (default 64)")
    add("--step-timeout", type=float, help="seconds a step may run (default 30)")
    add(
        "--idle-ttl",
        type=float,
        help="reap sessions idle this many seconds; 0 = never (default 600)",
    )
    add(
        "--drain-timeout",
        type=float,
        help="on shutdown, seconds in-flight steps may finish (default 8)",
    )
    add("--max-message-bytes", type=int, help="largest WebSocket frame / HTTP body")
    add("--max-context-chars", type=int, help="largest reset context")
    add("--max-code-chars", type=int, help="largest code of one step")
    add("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(run=_serve)


def _serve(args: argparse.Namespace) -> int:
    # Imported here: `kernel-env --help` should not pay for FastAPI and uvicorn.
    from kernel_env.server.runner import build_server
    from kernel_env.server.settings import ServerSettings

    explicit = {
        name: getattr(args, name)
        for name in (
            "host",
            "port",
            "pool_size",
            "max_sessions",
            "step_timeout",
            "idle_ttl",
            "drain_timeout",
            "max_message_bytes",
            "max_context_chars",
            "max_code_chars",
            "log_level",
        )
    }
    try:
        settings = ServerSettings.from_env(**explicit)
        server, sock, settings = build_server(settings)
    except (ValueError, OSError) as exc:
        print(f"kernel-env serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    print(_status_line(settings), file=sys.stderr, flush=True)
    if not settings.token and settings.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"kernel-env: WARNING: {settings.host} is reachable from other hosts and no "
              "KERNEL_ENV_TOKEN is set: anyone who can connect can run code",
              file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0


def _status_line(settings: ServerSettings) -> str:
    auth = "bearer token required" if settings.token else "no auth"
    return (
        f"kernel-env: serving {settings.url} (WebSocket {settings.url.replace('http', 'ws', 1)}"
        f"/ws); warming {settings.pool_size} kernel(s); max {settings.max_sessions} sessions, "
        f"step timeout {settings.step_timeout:g} s, idle TTL {settings.idle_ttl:g} s, {auth}"
    )
