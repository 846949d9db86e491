"""``kernel-env``: the command line.

    kernel-env serve     the OpenEnv-compatible server (HTTP + WebSocket)
    kernel-env mcp       MCP over stdin/stdout: an episode here, or a server's (--url)
    kernel-env run       one RLM episode driven by a model, with live progress
    kernel-env export    a served episode as .ipynb (or a notebook as HTML)
    kernel-env replay    a notebook's code cells re-run as a fresh episode, compared cell by cell
    kernel-env ps        the episodes a server is running
    kernel-env episodes  the episodes a server kept: ls, show, export, replay, dataset

Every ``serve`` flag also reads a ``KERNEL_ENV_<NAME>`` variable (e.g. ``KERNEL_ENV_POOL_SIZE``);
a flag given on the command line wins. The bearer token is read from ``KERNEL_ENV_TOKEN`` only:
a flag would show it to anyone who can list processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import difflib
import ipaddress
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kernel_env import __version__
from kernel_env.errors import KernelEnvError
from kernel_env.kernel.modes import SANDBOX_MODES
from kernel_env.text import shorten

if TYPE_CHECKING:
    from kernel_env.server.settings import ServerSettings

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    _honour_sigint()
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _unrecognized(args.command_parser if args.command else parser, unknown)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        status: int = args.run(args)
    except KeyboardInterrupt:
        print("kernel-env: interrupted", file=sys.stderr)
        return 130
    return status


def _honour_sigint() -> None:
    """Ctrl-C (SIGINT) stops kernel-env at any point, also where it started with SIGINT
    ignored, as a job started in the background inherits it (CI, ``cmd &`` in a script):
    uvicorn honours SIGINT once it serves whatever the start said, so a SIGINT during the
    start-up, with the socket already listening, must not be lost. Python's own handler, then,
    as for a start with SIGINT at its default (``serve`` puts its own once it has a server)."""
    in_main = threading.current_thread() is threading.main_thread()
    if in_main and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def _sigint_deferred(then: Sequence[Callable[[int, Any], None]] = ()) -> Iterator[None]:
    """Ctrl-C during the block takes effect at its end, as KeyboardInterrupt. Raised inside
    the import of a compiled extension (pydantic-core, connectrpc's pyqwest), it would be
    turned into that extension's panic: a traceback and exit 1 instead of exit 130.

    ``then``: a SIGINT handler the block puts there takes over at its end, with no moment
    under Python's own in between (see :class:`_StopOnSignal`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, then[0] if then and not caught else previous)
    if caught:
        raise KeyboardInterrupt


class _StopOnSignal:
    """A server's SIGINT and SIGTERM from the moment it is built: each only asks uvicorn to
    stop (its own handler, which takes over while it serves, does the same and puts this one
    back at its end). Never Python's KeyboardInterrupt, which a SIGINT raises wherever the
    interpreter is, a finalizer included (``__del__``, a weakref callback), where the
    exception is printed and dropped: the SIGINT was lost and the server served on."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.signals: list[int] = []

    def __call__(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)
        self.server.handle_exit(signum, frame)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kernel-env",
        description="REPL environments for language-model agents, in real IPython kernels.",
    )
    parser.add_argument("--version", action="version", version=f"kernel-env {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(commands)
    _add_mcp(commands)
    _add_run(commands)
    _add_export(commands)
    _add_replay(commands)
    _add_ps(commands)
    _add_capacity(commands)
    _add_episodes(commands)
    _add_kernelspec(commands)
    for command in commands.choices.values():
        command.set_defaults(command_parser=command)
    return parser


def _unrecognized(parser: argparse.ArgumentParser, unknown: list[str]) -> NoReturn:
    """Exit with the command's own usage (not the top level's) and, for a mistyped flag, the
    nearest one it has."""
    flags = [flag for action in parser._actions for flag in action.option_strings]
    near = difflib.get_close_matches(unknown[0].split("=")[0], flags, n=1)
    hint = f" (did you mean {near[0]}?)" if near else ""
    parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def _number(convert: Callable[[str], float], ok: Callable[[float], bool], rule: str) -> Any:
    """An argparse type: ``convert`` the text, then require ``ok`` (the same rules as
    ``serve``'s settings), saying ``rule`` when it fails."""
    kind = "a whole number" if convert is int else "a number"

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


_positive = _number(float, lambda v: 0 < v < float("inf"), "a number greater than 0")
_at_least_one = _number(int, lambda v: v >= 1, "at least 1")


def _d(text: str, default: object = None) -> str:
    """Help text naming the flag's default, as every flag's does."""
    return f"{text} (default: {_shown(default)})"


def _fail(command: str, problem: object) -> int:
    print(f"kernel-env {command}: {problem}", file=sys.stderr)
    return 2


def _add_serve(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the OpenEnv-compatible HTTP + WebSocket server",
        description="Serve episodes over OpenEnv's protocol (HTTP and WS /ws). Each flag "
        "defaults to its KERNEL_ENV_<NAME> variable, then to the built-in default. "
        "Set KERNEL_ENV_TOKEN to require a bearer token (an operator's), or give each client "
        "a token of its own with --tokens-file.",
    )
    _add_settings_flags(serve)
    serve.set_defaults(run=_serve)


def _names(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _bool(text: str) -> bool:
    from kernel_env.server.settings import parse_bool

    try:
        return parse_bool(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}") from None


_FLAG_TYPES: dict[str, Any] = {"int": int, "float": float, "bool": _bool, "tuple[str, ...]": _names}


def _shown(default: object) -> str:
    """A default as a user would type it: 30 for 30.0, none for None or ()."""
    if isinstance(default, tuple):
        return ",".join(default) or "none"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, float):
        return f"{default:g}"
    return "none" if default is None else str(default)


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per ``ServerSettings`` field that has CLI help (the settings are the one list):
    ``--pool-size`` for ``pool_size``. Flags default to None, so that a flag not given leaves
    the ``KERNEL_ENV_*`` variable, then the field's default, to decide."""
    from kernel_env.server.settings import ServerSettings

    for f in dataclasses.fields(ServerSettings):
        if "help" not in f.metadata:
            continue
        kind = str(f.type).removesuffix("| None").strip()
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=_FLAG_TYPES.get(kind, str),
            choices=f.metadata["choices"],
            metavar=f.metadata["metavar"],
            help=f"{f.metadata['help']} (default: {f.metadata.get('shown') or _shown(f.default)})",
            # A list flag given twice: both lists (comma-separated items in each).
            action="extend" if f.metadata.get("repeat") else "store",
        )


def _serve(args: argparse.Namespace) -> int:
    stop: list[_StopOnSignal] = []
    with _sigint_deferred(then=stop):
        # Imported here: `kernel-env --help` should not pay for FastAPI and uvicorn.
        from kernel_env.server.runner import build_server, return_freed_memory
        from kernel_env.server.settings import ServerSettings

        explicit = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(ServerSettings)}
        try:
            settings = ServerSettings.from_env(**explicit)
            server, sock, settings = build_server(settings, own_logs=True)
        except (ValueError, OSError, RuntimeError) as exc:
            return _fail("serve", _for_make_too(str(exc)))
        stop.append(_StopOnSignal(server))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop[0])
    return_freed_memory()
    # The event loop gives up the GIL in every zmq and socket call, and a worker thread (a
    # uid lease, a cgroup's removal, a fork request) may then hold it for a whole switch
    # interval (5 ms by default); a tenth of that shortens resets under load (figures:
    # benchmarks/README.md, "The figures behind the code's choices").
    sys.setswitchinterval(0.0005)
    _guard_secrets()
    print(_status_line(settings), file=sys.stderr, flush=True)
    warning = _open_to_all(settings)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    if stop[0].signals:
        # Ctrl-C is how a server in a terminal is stopped: once it has shut down cleanly, a
        # normal end (with 130, `make serve` would add "make: *** Error 130").
        print("kernel-env serve: stopped", file=sys.stderr, flush=True)
    return 0


def _add_mcp(commands: argparse._SubParsersAction) -> None:
    mcp = commands.add_parser(
        "mcp",
        help="speak MCP over stdin/stdout (for a client that spawns its server)",
        description="MCP's stdio transport, for a desktop client to spawn: one session, its "
        "episode in a kernel this process starts (with serve's settings flags and "
        "KERNEL_ENV_* variables, its socket's aside), or a server's with --url (its token "
        "from KERNEL_ENV_TOKEN). Only JSON-RPC goes to stdout; logs go to stderr. EOF on "
        "stdin, SIGINT or SIGTERM end it and free its kernel.",
    )
    mcp.add_argument(
        "--url", help=_d("bridge to this server's /mcp instead (e.g. http://host:8000)", None)
    )
    _add_settings_flags(mcp)
    mcp.set_defaults(run=_mcp)


def _mcp(args: argparse.Namespace) -> int:
    with _sigint_deferred():
        from kernel_env.client import TOKEN_VARIABLE
        from kernel_env.remote import http_url
        from kernel_env.server.mcp import stdio
        from kernel_env.server.settings import ServerSettings

        explicit = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(ServerSettings)}
        if explicit["pool_size"] is None and "KERNEL_ENV_POOL_SIZE" not in os.environ:
            explicit["pool_size"] = 0  # one session: its kernel starts at initialize
        token = os.environ.get(TOKEN_VARIABLE) or None
        try:
            url = http_url(args.url) if args.url else None
            settings = ServerSettings.from_env(**explicit)
        except (ValueError, OSError) as exc:
            return _fail("mcp", exc)
    _guard_secrets()
    return stdio.run(url, token, settings)


def _for_make_too(problem: str) -> str:
    """A busy port's "choose another with --port" also for `make serve`, which takes PORT=."""
    return problem.replace(
        "choose another with --port", "choose another with --port N (make serve PORT=N)"
    )


def _guard_secrets() -> None:
    """Once the settings hold them: drop the secrets from this process's environment (no
    child inherits them), and make the process non-dumpable, so that no process of another
    uid, and none of this uid without ptrace rights, can read its memory or
    ``/proc/<pid>/environ``."""
    from kernel_env.server.settings import ENV_PREFIX, SECRET_SETTINGS

    for name in SECRET_SETTINGS:
        os.environ.pop(ENV_PREFIX + name.upper(), None)
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        pr_set_dumpable = 4
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0)


def _status_line(settings: ServerSettings) -> str:
    from kernel_env.kernel.factory import describe_backend
    from kernel_env.languages.catalog import describe_served_limits

    auth = "bearer token required" if settings.token else "no auth"
    if settings.tokens_file:
        auth = f"per-tenant tokens from {settings.tokens_file}" + (
            " and KERNEL_ENV_TOKEN (operator default)" if settings.token else ""
        )
    if settings.llm_base_url:
        llm = f"llm_query -> {settings.llm_model} at {settings.llm_base_url}"
    else:
        llm = "llm_query: no model configured (a reset may bring an hf_token)"
    return (
        f"kernel-env: serving {settings.url} (WebSocket {settings.url.replace('http', 'ws', 1)}"
        f"/ws); warming {settings.pool_size} kernel(s); max {settings.max_sessions} sessions, "
        f"step timeout {settings.step_timeout:g} s, idle TTL {settings.idle_ttl:g} s, {auth}\n"
        f"kernel-env: {describe_backend(settings)}; {llm}"
        f"\nkernel-env: kernels start: {_start_mode(settings)}"
        + "".join(
            f"\nkernel-env:   {name}: {value}"
            for name, value in describe_served_limits(settings).items()
        )
        + _merging(settings)
        + f"\nkernel-env:   {_descriptors(settings)}"
        + f"\nkernel-env:   {_capacity(settings)}"
        + f"\nkernel-env: {_episodes_kept(settings)}"
    )


def _merging(settings: ServerSettings) -> str:
    if not settings.merge_pages:
        return ""
    from kernel_env.kernel.merging import describe_merging

    return f"\nkernel-env:   {describe_merging()}"


def _capacity(settings: ServerSettings) -> str:
    from kernel_env.server.capacity import describe, machine_capacity

    local = settings.gateway_url is None
    return describe(machine_capacity(local=local, forked=settings.forkserver))


def _episodes_kept(settings: ServerSettings) -> str:
    if settings.episodes is None:
        return "episodes: not kept (--episodes none)"
    return f"episodes: kept in {settings.episodes} ({settings.episodes_keep})"


def _descriptors(settings: ServerSettings) -> str:
    from kernel_env.server.capacity import DESCRIPTORS_PER_KERNEL
    from kernel_env.server.runner import connection_cap, open_files_limit

    open_files = open_files_limit()  # as build_server raised it
    return (
        f"open files: {open_files} ({settings.kernel_limit} kernels at "
        f"{DESCRIPTORS_PER_KERNEL} each); connections at most "
        f"{connection_cap(settings, open_files)}, past them 503"
    )


def _open_to_all(settings: ServerSettings) -> str | None:
    """The warning for a server that other hosts can reach and that asks no token."""
    if settings.token or settings.tokens_file or _is_loopback(settings.host):
        return None
    return (
        f"kernel-env: WARNING: no token is set and {settings.host}:{settings.port} is reachable "
        "from other hosts: anyone who can connect to that port runs code on this machine.\n"
        "kernel-env: to require a token, start the server with KERNEL_ENV_TOKEN set, e.g. "
        "KERNEL_ENV_TOKEN=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))') "
        "(clients send it as 'Authorization: Bearer <token>', or token= in Python), or give "
        "each client its own with --tokens-file; or serve on --host 127.0.0.1"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def _start_mode(settings: ServerSettings) -> str:
    if settings.gateway_url:
        return "on the gateway"
    if not settings.forkserver:
        return "cold, a new interpreter each (--forkserver false)"
    preload = f", preloading {','.join(settings.preload)}" if settings.preload else ""
    return f"forked from a preloaded forkserver{preload} (cold if it cannot start: logged)"


# -- export ------------------------------------------------------------------------------


def _add_export(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export",
        help="download a served episode as .ipynb, or turn a notebook into HTML",
        description="SOURCE is a session id on a kernel-env server (--url), or the id of its "
        "episode (state().episode_id, the web view's; `kernel-env ps` lists both): the "
        "session's current or last episode is written as a notebook, with its context file "
        "and child episodes beside it. Or SOURCE is an .ipynb file and --html writes it as a "
        "web page. The server's token is read from KERNEL_ENV_TOKEN.",
    )
    export.add_argument(
        "source", metavar="SOURCE", help="a session id or an episode id, or an .ipynb file"
    )
    export.add_argument(
        "-o",
        "--output",
        metavar="PATH",
        help="where to write (default: SOURCE.ipynb, or SOURCE.html)",
    )
    export.add_argument(
        "--url",
        default=os.environ.get("KERNEL_ENV_URL", _DEFAULT_URL),
        help=f"the server (default $KERNEL_ENV_URL or {_DEFAULT_URL})",
    )
    export.add_argument(
        "--html",
        action="store_true",
        help="also write an HTML page (needs nbconvert: kernel-env[html])",
    )
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="replace files of the same names (refused by default)",
    )
    export.set_defaults(run=_export)


_DEFAULT_URL = "http://127.0.0.1:8000"


def _export(args: argparse.Namespace) -> int:
    from kernel_env.notebook import write_html

    source = Path(args.source)
    try:
        if source.suffix == ".ipynb":
            if not source.is_file():
                return _fail("export", f"no such notebook: {source}")
            if not args.html:
                return _fail("export", f"{source} is already a notebook; add --html for a web page")
            print(write_html(source, args.output))
            return 0
        notebook = _download(
            args.url,
            args.source,
            Path(args.output or f"{args.source}.ipynb"),
            overwrite=args.overwrite,
        )
        print(notebook)
        if args.html:
            print(write_html(notebook))
    except (OSError, ValueError, RuntimeError, KernelEnvError) as exc:
        return _fail("export", exc)
    return 0


def _download(url: str, session_id: str, target: Path, *, overwrite: bool) -> Path:
    """Fetch a session's export.zip and unpack it beside ``target`` (only the episode's own
    files: see kernel_env.archive)."""
    from kernel_env.archive import extract_export
    from kernel_env.remote import fetch_export

    if not target.name.endswith(".ipynb"):
        target = target.with_name(target.name + ".ipynb")
    from kernel_env.client import TOKEN_VARIABLE
    from kernel_env.errors import ArchiveError

    token = os.environ.get(TOKEN_VARIABLE) or None
    data = asyncio.run(fetch_export(url, session_id, target.name, token=token, cli=True))
    try:
        extract_export(data, target.parent, stem=target.stem, overwrite=overwrite)
    except ArchiveError as exc:  # Python's overwrite=True is the command line's --overwrite
        raise ArchiveError(str(exc).replace("pass overwrite=True", "add --overwrite")) from None
    return target


# -- capacity ----------------------------------------------------------------------------


def _add_capacity(commands: argparse._SubParsersAction) -> None:
    capacity = commands.add_parser(
        "capacity",
        help="print how many kernels this machine holds (serve's default limit)",
        description="The kernels this machine can hold now, from its memory, open files, "
        "process ids and kernel uids: what `serve` takes when not given --max-sessions "
        "(less its warm pool), and a node's slots for Ray: ray start --resources "
        '"{\\"kernel_env\\": $(kernel-env capacity)}". The figure on stdout, what bounds it '
        "on stderr.",
    )
    capacity.add_argument(
        "--no-forkserver",
        action="store_true",
        help="kernels started as new interpreters (serve --forkserver false)",
    )
    capacity.set_defaults(run=_capacity_command)


def _capacity_command(args: argparse.Namespace) -> int:
    from kernel_env.server.capacity import describe, machine_capacity

    found = machine_capacity(forked=not args.no_forkserver)
    print(found.kernels)
    print(f"kernel-env: {describe(found)}", file=sys.stderr)
    return 0


# -- kernelspec --------------------------------------------------------------------------


def _add_kernelspec(commands: argparse._SubParsersAction) -> None:
    kernelspec = commands.add_parser(
        "kernelspec",
        help="install a kernelspec: kernel_env's sandboxed kernels in JupyterLab, "
        "jupyter execute and every jupyter_client frontend",
        description="Install a kernelspec whose kernels kernel_env's provisioner starts: "
        "sandboxed (no network, a uid of their own under root, limits), with llm_query & "
        "co., answered by the model you name here or in Jupyter's environment "
        "(KERNEL_ENV_LLM_BASE_URL, KERNEL_ENV_LLM_MODEL; the key in KERNEL_ENV_LLM_API_KEY, "
        "read when a kernel starts and never given to it).",
    )
    actions = kernelspec.add_subparsers(dest="action", metavar="ACTION", required=True)
    install = actions.add_parser("install", help="install it (see jupyter kernelspec list)")
    where = install.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user only")
    where.add_argument(
        "--sys-prefix", action="store_true", help=f"in this environment ({sys.prefix})"
    )
    where.add_argument("--prefix", help="under this prefix (as jupyter kernelspec install)")
    install.add_argument("--name", default="kernel-env", help=_d("its name", "kernel-env"))
    install.add_argument(
        "--display-name",
        default="Python 3 (kernel_env, sandboxed)",
        help=_d("what launchers show", "Python 3 (kernel_env, sandboxed)"),
    )
    install.add_argument("--llm-base-url", help="the OpenAI-compatible endpoint of llm_query")
    install.add_argument("--llm-model", help="its model")
    install.add_argument(
        "--memory-mb", type=_at_least_one, help=_d("memory of each kernel, in MiB", 4096)
    )
    install.add_argument("--cpus", type=_positive, help=_d("CPUs of each kernel", 1.0))
    kernelspec.set_defaults(run=_kernelspec)


def _kernelspec(args: argparse.Namespace) -> int:
    from kernel_env.integrations.provisioner import install_kernelspec

    chosen = {
        "llm_base_url": args.llm_base_url,
        "llm_model": args.llm_model,
        "memory_mb": args.memory_mb,
        "cpus": args.cpus,
    }
    config = {name: value for name, value in chosen.items() if value is not None}
    prefix = sys.prefix if args.sys_prefix else args.prefix
    try:
        path = install_kernelspec(
            args.name, user=args.user, prefix=prefix, display_name=args.display_name,
            config=config,
        )  # fmt: skip
    except (OSError, ValueError) as exc:
        return _fail("kernelspec install", exc)
    print(f"installed kernelspec {args.name} in {path}")
    return 0


# -- ps ----------------------------------------------------------------------------------


def _add_ps(commands: argparse._SubParsersAction) -> None:
    ps = commands.add_parser(
        "ps",
        help="list the episodes a kernel-env server is running",
        description="GET /sessions of a server: a line per session, with its episode's id "
        "(either id names it to `kernel-env export`). The token is read from "
        "KERNEL_ENV_TOKEN.",
    )
    ps.add_argument(
        "--url",
        default=os.environ.get("KERNEL_ENV_URL", _DEFAULT_URL),
        help=f"the server (default $KERNEL_ENV_URL or {_DEFAULT_URL})",
    )
    ps.add_argument("--json", action="store_true", help="print the server's JSON as it is")
    ps.set_defaults(run=_ps)


def _ps(args: argparse.Namespace) -> int:
    import httpx

    from kernel_env.client import TOKEN_VARIABLE
    from kernel_env.remote import auth_refused, http_url, unreachable

    token = os.environ.get(TOKEN_VARIABLE) or None
    try:
        root = http_url(args.url)
        with httpx.Client(
            headers={"Authorization": f"Bearer {token}"} if token else {},
            timeout=10,
            trust_env=False,
        ) as client:
            sessions = _every_session(client, f"{root}/sessions")
    except ValueError as exc:
        return _fail("ps", exc)
    except httpx.HTTPError as exc:
        return _fail("ps", unreachable(root, exc))
    except _Refused as refused:
        if refused.status in (401, 403):
            return _fail("ps", auth_refused(root, refused.status, token, cli=True))
        return _fail("ps", f"{root}/sessions: HTTP {refused.status}")
    if args.json:
        print(json.dumps({"sessions": sessions}))
        return 0
    print(
        f"{'SESSION':<32}  {'EPISODE':<36}  {'KIND':<4} {'STATE':<5} {'STEPS':>9} "
        f"{'ELAPSED':>8} {'LLM':>5}  TASK"
    )
    for s in sessions:
        episode = s["episode"] or {}
        steps = f"{episode['steps']}/{episode['max_iterations']}" if episode else "-"
        elapsed = f"{episode['elapsed_s']:.0f} s" if episode else "-"
        calls = str(episode.get("llm_calls", "-"))
        episode_id = shorten(episode.get("episode_id") or "-", 36, one_line=True)
        print(
            f"{s['session_id']:<32}  {episode_id:<36}  {s['kind']:<4} {s['state']:<5} "
            f"{steps:>9} {elapsed:>8} {calls:>5}  {episode.get('task') or ''}"
        )
    print(f"{len(sessions)} session(s)")
    return 0


class _Refused(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


_PS_PAGE = 1000  # the server's largest page of GET /sessions


def _every_session(client: Any, url: str) -> list[dict[str, Any]]:
    """Every session ``GET /sessions`` lists, page after page (a server that answers one
    list, with no ``next``, is one page)."""
    sessions: list[dict[str, Any]] = []
    after: int | None = 0
    while after is not None:
        response = client.get(url, params={"limit": _PS_PAGE, "after": after})
        if response.status_code != 200:
            raise _Refused(response.status_code)
        body = response.json()
        sessions += body["sessions"]
        after = body.get("next")
    return sessions


# -- episodes ----------------------------------------------------------------------------


def _add_episodes(commands: argparse._SubParsersAction) -> None:
    episodes = commands.add_parser(
        "episodes",
        help="list, show, export and replay the episodes a server kept, or write them as a dataset",
        description="The episodes a kernel-env server kept (GET /episodes of --url, with the "
        "token in KERNEL_ENV_TOKEN), or those of a store directory (--episodes DIR, read "
        "directly: every tenant's).",
    )
    actions = episodes.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = actions.add_parser("ls", help="a line per stored episode, newest first")
    show = actions.add_parser("show", help="one episode, with its forks and children")
    export = actions.add_parser("export", help="one episode's notebook, as a file")
    replay = actions.add_parser(
        "replay",
        help="re-run one episode offline, llm_query answered from its recording",
        description="The episode's files (its export.zip) are fetched into a temporary "
        "directory and replayed as `kernel-env replay NOTEBOOK` replays one: exit status 0 "
        "when every cell's outputs match, 1 when some differ, 2 when it cannot be replayed.",
    )
    dataset = actions.add_parser(
        "dataset",
        help="the episodes as a Hugging Face dataset (JSON Lines, a row per episode)",
        description="Writes OUT/episodes.jsonl (a row per listed episode: its task, reward, "
        "outcome, steps and the path of its notebook), OUT/notebooks/ (those notebooks) and "
        "OUT/README.md, its dataset card; datasets.load_dataset reads either OUT or the JSON "
        "file (docs/notebooks.md).",
    )
    for action in (ls, show, export, replay, dataset):
        action.add_argument(
            "--url",
            default=os.environ.get("KERNEL_ENV_URL", _DEFAULT_URL),
            help=f"the server (default $KERNEL_ENV_URL or {_DEFAULT_URL})",
        )
        action.add_argument("--episodes", metavar="DIR", help="a store directory instead")
    for action in (ls, dataset):
        action.add_argument("--task", help="text in the task")
        action.add_argument("--reward-min", type=float, metavar="R")
        action.add_argument("--reward-max", type=float, metavar="R")
        action.add_argument("--state", choices=("running", "done", "interrupted"))
        action.add_argument("--kernel", metavar="NAME")
    ls.add_argument("--limit", type=_at_least_one, default=100, help=_d("lines at most", 100))
    dataset.add_argument("--limit", type=_at_least_one, help="episodes at most (default: all)")
    dataset.add_argument("out", metavar="OUT", type=Path, help="the dataset's directory")
    for action in (ls, show):
        action.add_argument("--json", action="store_true", help="print the JSON as it is")
    for action in (show, export, replay):
        action.add_argument("episode_id", metavar="EPISODE", help="the episode's id")
    _add_replay_options(replay)
    export.add_argument("-o", "--output", metavar="PATH", help="default: EPISODE.ipynb")
    for action in (export, dataset):
        action.add_argument("--overwrite", action="store_true", help="replace existing files")
    episodes.set_defaults(run=_episodes)


def _episodes(args: argparse.Namespace) -> int:
    from kernel_env.remote import unreachable

    try:
        source = _StoredEpisodes(args.url, args.episodes)
        try:
            return int(getattr(_Episodes, args.action)(args, source))
        finally:
            source.close()
    except ConnectionError as exc:
        return _fail("episodes", str(exc) or unreachable(args.url, exc))
    except (OSError, ValueError, KernelEnvError) as exc:
        return _fail("episodes", exc)


class _StoredEpisodes:
    """A server's stored episodes (``url``), or a store directory's (``directory``)."""

    def __init__(self, url: str, directory: str | None) -> None:
        from kernel_env.client import TOKEN_VARIABLE
        from kernel_env.server.store import StoreReader

        self.url, self.token = url, os.environ.get(TOKEN_VARIABLE) or None
        self.reader = None if directory is None else StoreReader.read(directory)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()

    def list(self, filters: dict[str, Any], limit: int | None) -> list[dict[str, Any]]:
        """The listed episodes, newest first, page after page, ``limit`` at most."""
        from kernel_env.remote import list_episodes
        from kernel_env.server.index import Filters

        if self.reader is None:
            found = list_episodes(self.url, token=self.token, filters=filters, limit=limit)
            return asyncio.run(found)
        rows: list[dict[str, Any]] = []
        cursor = None
        while limit is None or len(rows) < limit:
            size = 1000 if limit is None else min(1000, limit - len(rows))
            page = self.reader.page(Filters(**filters), cursor=cursor, limit=size)
            rows += page.episodes
            if (cursor := page.next_cursor) is None:
                break
        return rows

    def show(self, episode_id: str) -> dict[str, Any]:
        if self.reader is None:
            return dict(json.loads(self._get(f"/episodes/{_quoted(episode_id)}")))
        found = self.reader.episode(episode_id, None)
        if found is None:
            raise ValueError(f"no stored episode has the id {episode_id!r}")
        return found

    def notebook(self, episode_id: str, row: dict[str, Any] | None = None) -> tuple[str, bytes]:
        """An episode's stored notebook (``row``: its row in this store's listing)."""
        from kernel_env.notebook import notebook_name

        if self.reader is None:
            data = self._get(f"/episodes/{_quoted(episode_id)}/notebook")
            return notebook_name(episode_id), data
        return self.reader.notebook(row or self.show(episode_id)["episode"])

    def export_zip(self, episode_id: str) -> bytes:
        """An episode's files, zipped: its notebook, context file and children's notebooks."""
        if self.reader is None:
            return self._get(f"/episodes/{_quoted(episode_id)}/export.zip")
        return self.reader.export_zip(self.show(episode_id)["episode"])[1]

    def _get(self, path: str) -> bytes:
        from kernel_env.remote import http_get

        return asyncio.run(http_get(self.url, path, token=self.token, cli=True))


def _quoted(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


class _Episodes:
    """``kernel-env episodes ACTION``, one static method an action."""

    @staticmethod
    def ls(args: argparse.Namespace, source: _StoredEpisodes) -> int:
        rows = source.list(_episode_filters(args), args.limit)
        if args.json:
            print(json.dumps({"episodes": rows}))
            return 0
        print(f"{'EPISODE':<36}  {'STATE':<11} {'STEPS':>5} {'REWARD':>7}  {'STARTED':<19}  TASK")
        for row in rows:
            reward = "-" if row["reward"] is None else f"{row['reward']:g}"
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["started"]))
            print(
                f"{shorten(row['episode_id'], 36, one_line=True):<36}  {row['state']:<11} "
                f"{row['steps']:>5} {reward:>7}  {started:<19}  "
                f"{shorten(row['task'], 60, one_line=True)}"
            )
        print(f"{len(rows)} episode(s)")
        return 0

    @staticmethod
    def show(args: argparse.Namespace, source: _StoredEpisodes) -> int:
        found = source.show(args.episode_id)
        if args.json:
            print(json.dumps(found))
            return 0
        for name, value in found["episode"].items():
            if name not in ("key", "path"):
                print(f"{name}: {value}")
        for kind in ("forks", "children"):
            for row in found[kind]:
                print(f"{kind[:-1] if kind == 'forks' else 'child'}: {row['episode_id']}")
        return 0

    @staticmethod
    def export(args: argparse.Namespace, source: _StoredEpisodes) -> int:
        name, data = source.notebook(args.episode_id)
        target = Path(args.output or name)
        if target.exists() and not args.overwrite:
            return _fail("episodes", f"{target} exists; add --overwrite to replace it")
        target.write_bytes(data)
        print(target)
        return 0

    @staticmethod
    def replay(args: argparse.Namespace, source: _StoredEpisodes) -> int:
        import tempfile

        from kernel_env.archive import extract_export

        archive = source.export_zip(args.episode_id)
        with tempfile.TemporaryDirectory(prefix="kernel-env-replay-") as scratch:
            # The archive's first notebook is the episode's; its context file is beside it.
            notebook = extract_export(archive, scratch)[0]
            return _replay_notebook(notebook, args, shown=args.episode_id)

    @staticmethod
    def dataset(args: argparse.Namespace, source: _StoredEpisodes) -> int:
        from kernel_env.server.dataset import DatasetWriter, episode_row

        rows = source.list(_episode_filters(args), args.limit)
        skipped = 0
        with DatasetWriter(args.out, overwrite=args.overwrite) as dataset:
            for n, row in enumerate(rows, 1):
                try:
                    notebook = source.notebook(row["episode_id"], row)[1]
                    dataset.write(episode_row(row, notebook), notebook)
                except (KernelEnvError, ValueError) as exc:
                    skipped += 1
                    print(
                        f"kernel-env episodes: {row['episode_id']} skipped: {exc}", file=sys.stderr
                    )
                if n % 100 == 0:
                    print(f"{n}/{len(rows)} episodes read", file=sys.stderr, flush=True)
        print(f"{dataset.rows} episode(s), {skipped} skipped: {dataset.path}", file=sys.stderr)
        print(dataset.path)
        return 0


def _episode_filters(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "task": args.task,
        "reward_min": args.reward_min,
        "reward_max": args.reward_max,
        "state": args.state,
        "kernel": args.kernel,
    }


# -- replay ------------------------------------------------------------------------------


def _add_replay(commands: argparse._SubParsersAction) -> None:
    replay = commands.add_parser(
        "replay",
        help="re-run a notebook's code cells as a fresh episode and compare their outputs",
        description="Each code cell becomes a step of a new local episode; llm_query answers "
        "from the responses recorded in the notebook. Exit status 0 when every cell's outputs "
        "match the recorded ones, 1 when some differ (each shown as a diff), 2 when the "
        "notebook cannot be replayed.",
    )
    replay.add_argument("notebook", type=Path, help="an .ipynb file (e.g. one kernel-env exported)")
    _add_replay_options(replay)
    replay.set_defaults(run=_replay)


def _add_replay_options(replay: argparse.ArgumentParser) -> None:
    replay.add_argument(
        "--step-timeout", type=_positive, default=30.0, help=_d("seconds a cell may run", 30)
    )
    replay.add_argument(
        "--sandbox",
        choices=SANDBOX_MODES,
        default="auto",
        help="run the kernel under bubblewrap (default: auto, where it works)",
    )
    replay.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _replay(args: argparse.Namespace) -> int:
    if not args.notebook.is_file():
        return _fail("replay", f"no such notebook: {args.notebook}")
    return _replay_notebook(args.notebook, args, shown=str(args.notebook))


def _replay_notebook(notebook: Path, args: argparse.Namespace, *, shown: str) -> int:
    """Replays ``notebook`` (named ``shown`` in what is printed) and reports it cell by cell."""
    from kernel_env.kernel.factory import local_source
    from kernel_env.replay import CellReport, read_notebook, replay_notebook

    def show(cell: CellReport) -> None:
        if args.json:
            return
        print(f"  cell {cell.index:>3}  {cell.verdict:<9} {cell.source_head}", flush=True)
        if cell.diff:
            print("\n".join(f"      {line}" for line in cell.diff.splitlines()), flush=True)

    try:
        if "kernel_env" not in read_notebook(notebook).metadata:
            print(
                f"kernel-env replay: warning: {shown} was not exported by kernel-env: "
                "its llm_query calls have no recorded answers, and outputs may differ",
                file=sys.stderr,
                flush=True,
            )
        if not args.json:
            print(f"replaying {shown}", flush=True)
        report = replay_notebook(
            notebook,
            step_timeout=args.step_timeout,
            kernel_source=local_source(args.sandbox),
            on_cell=show,
        )
    except (OSError, ValueError, RuntimeError, KernelEnvError) as exc:
        return _fail("replay", exc)
    report.path = shown
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        counts = ", ".join(f"{n} {verdict}" for verdict, n in sorted(report.counts().items()))
        verdict = "all cells match" if report.all_match else "MISMATCH"
        print(f"{verdict}: {counts or 'no code cells'}")
        if report.final_answer is not None:
            print(f"final answer: {report.final_answer}")
    return 0 if report.all_match else 1


# -- run ---------------------------------------------------------------------------------


def _add_run(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run",
        help="solve a task over a context file with a model, the RLM way",
        description="A root model sees the context's size and a preview, writes code that runs "
        "in a kernel, and calls llm_query on pieces, until it gives a final answer. Progress "
        "goes to stderr; the answer and the paths of the exported notebook and trajectory to "
        "stdout (or one JSON object with --json). Exit status 0 when the model gave a final "
        "answer, 1 when the run stopped without one, 2 for bad usage. The API key is read "
        "from an environment variable, never a flag.",
    )
    add = run.add_argument
    add("--context", required=True, metavar="FILE", help="a UTF-8 text file, or - for stdin")
    add("--task", required=True, help="what to find out about the context")
    add("--model", required=True, help="the root model")
    default_url = (
        os.environ.get("KERNEL_ENV_LLM_BASE_URL") or os.environ.get("OPENAI_BASE_URL") or _OPENAI
    )
    add(
        "--model-url",
        "--base-url",  # the earlier name, kept as an alias
        dest="model_url",
        metavar="URL",
        default=default_url,
        help="the models' OpenAI-compatible endpoint (default $KERNEL_ENV_LLM_BASE_URL, "
        "$OPENAI_BASE_URL, or OpenAI's)",
    )
    add("--sub-model", metavar="MODEL", help="the model behind llm_query (default: --model)")
    add(
        "--api-key-env",
        metavar="VAR",
        help="variable holding the API key (default: the first set of KERNEL_ENV_LLM_API_KEY, "
        "OPENAI_API_KEY, HF_TOKEN)",
    )
    add("--max-iterations", type=_at_least_one, default=20, help=_d("root-model turns", 20))
    add("--time-limit", type=_positive, metavar="S", help=_d("seconds for the whole run"))
    add("--max-llm-calls", type=_at_least_one, metavar="N", help=_d("llm_query calls at most"))
    add("--max-llm-tokens", type=_at_least_one, metavar="N", help=_d("llm_query tokens at most"))
    add("--step-timeout", type=_positive, default=60.0, help=_d("seconds a cell may run", 60))
    add("--expected-answer", help=_d("score the answer against this (the reward is printed)"))
    add(
        "--output",
        type=Path,
        default=Path("runs"),
        help="directory for the notebook and trajectory (default ./runs)",
    )
    add("--name", help="file name stem of the outputs (default run-<date>-<time>)")
    add(
        "--sandbox",
        choices=SANDBOX_MODES,
        default="auto",
        help="local kernels under bubblewrap (default: auto, where it works)",
    )
    add(
        "--gateway-url",
        metavar="URL",
        help=_d(
            "run the kernel on a Jupyter (Enterprise) Gateway; its token is read from "
            "KERNEL_ENV_GATEWAY_TOKEN"
        ),
    )
    add("--gateway-kernel-name", metavar="NAME", help=_d("the gateway's kernel spec"))
    add("-v", "--verbose", action="store_true", help="also echo every cell and its output")
    add("--json", action="store_true", help="print the outcome as one JSON object on stdout")
    run.set_defaults(run=_run)


_KEY_VARIABLES = ("KERNEL_ENV_LLM_API_KEY", "OPENAI_API_KEY", "HF_TOKEN")
_OPENAI = "https://api.openai.com/v1"  # --model-url when nothing names another
_LOOPBACK = ("localhost", "127.0.0.1", "::1")


def _run(args: argparse.Namespace) -> int:
    from kernel_env.notebook import safe_path

    names = [args.api_key_env] if args.api_key_env else list(_KEY_VARIABLES)
    key = next((os.environ[n] for n in names if os.environ.get(n)), None)
    try:
        context = _read_context(args.context)
        stem = args.name or time.strftime("run-%Y%m%d-%H%M%S")
        args.output.mkdir(parents=True, exist_ok=True)
        notebook = safe_path(args.output, f"{stem}.ipynb")
        trajectory = safe_path(args.output, f"{stem}.trajectory.jsonl")
    except (OSError, ValueError) as exc:
        return _fail("run", exc)
    if key is None and (problem := _keyless(args.model_url, names)) is not None:
        return _fail("run", problem)  # before a kernel starts or a file is written
    return asyncio.run(_run_episode(args, context, key, notebook, trajectory))


def _keyless(model_url: str, names: list[str]) -> str | None:
    """With no API key: a refusal for OpenAI's endpoint (it would only refuse every call),
    a warning for another one off this host (it may need a key), nothing on loopback."""
    from urllib.parse import urlsplit

    variables = ", ".join(names)
    if model_url.rstrip("/") == _OPENAI:
        return (
            f"no API key for {_OPENAI} (the default model endpoint): set {variables} "
            "(or name your variable with --api-key-env), or point --model-url (or "
            "KERNEL_ENV_LLM_BASE_URL) at an endpoint that needs none, such as a local vLLM "
            "or Ollama"
        )
    if (urlsplit(model_url).hostname or "") not in _LOOPBACK:
        _say(f"warning: no API key is set ({variables}): calling {model_url} without one")
    return None


def _read_context(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    return Path(source).read_text(encoding="utf-8", errors="replace")


async def _run_episode(
    args: argparse.Namespace, context: str, key: str | None, notebook: Path, trajectory: Path
) -> int:
    from types import SimpleNamespace

    from kernel_env.agent import run_agent
    from kernel_env.client import AsyncKernelEnv
    from kernel_env.environment import EnvConfig
    from kernel_env.kernel.factory import describe_backend, kernel_source_from
    from kernel_env.llm import OpenAIBackend, Usage

    kernels = SimpleNamespace(
        sandbox=args.sandbox,
        gateway_url=args.gateway_url,
        gateway_token=os.environ.get("KERNEL_ENV_GATEWAY_TOKEN") or None,
        gateway_kernel_name=args.gateway_kernel_name,
    )
    root = OpenAIBackend(args.model_url, args.model, api_key=key)
    sub = OpenAIBackend(args.model_url, args.sub_model or args.model, api_key=key)
    config = EnvConfig(
        step_timeout=args.step_timeout,
        llm_max_calls=args.max_llm_calls,
        llm_max_tokens=args.max_llm_tokens,
    )
    env = AsyncKernelEnv(config=config, kernel_source=kernel_source_from(kernels), llm_backend=sub)
    usage = Usage()
    progress = _Progress(env, usage, args.max_iterations, verbose=args.verbose)
    _say(
        f"{len(context):,} characters of context; root model {args.model} at {args.model_url}; "
        f"{describe_backend(kernels)}"
    )
    outcome: Any = None
    interrupted = False
    try:
        heartbeat = asyncio.create_task(progress.heartbeat())
        try:
            outcome = await run_agent(
                env,
                _Watched(root, progress),
                context=context,
                task=args.task,
                max_iterations=args.max_iterations,
                time_limit=args.time_limit,
                usage=usage,
                on_iteration=progress.iteration,
                trajectory_path=trajectory,
                expected_answer=args.expected_answer,
            )
        finally:
            heartbeat.cancel()
    except (KernelEnvError, OSError, ValueError) as exc:
        _say(f"the run failed: {_failure(exc, args.model_url)}")
    except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels this task
        interrupted = True
    except Exception as exc:  # any other failure: still write and name what ran
        _say(f"the run failed: {type(exc).__name__}: {exc}")
    finally:
        progress.clear()
        exported = await _export_quietly(env, notebook)
        await env.close()
        await root.aclose()
        await sub.aclose()
    if trajectory.exists() and trajectory.stat().st_size == 0:
        trajectory.unlink()  # no iteration ran: no trajectory to keep
    if interrupted:
        wrote = exported is not None or trajectory.exists()
        _say("interrupted; what ran so far is written" if wrote else "interrupted: nothing ran")
    status = _report(args, outcome, progress, exported, trajectory)
    return 130 if interrupted else status


def _failure(exc: BaseException, model_url: str) -> str:
    """What went wrong, in the one sentence for an endpoint nobody answers where it is that."""
    from kernel_env.errors import LLMError
    from kernel_env.remote import unreachable

    said = str(exc)
    if isinstance(exc, LLMError) and ("ConnectError" in said or "ConnectTimeout" in said):
        fix = "Start it, or name yours with --model-url or KERNEL_ENV_LLM_BASE_URL"
        return unreachable(model_url, "no connection", what="the model endpoint", fix=fix)
    return said


async def _export_quietly(env: Any, notebook: Path) -> Path | None:
    """The episode as a notebook, if a step ran (a run that failed early has none)."""
    try:
        if (await env.state()).step_count == 0:
            return None
        exported: Path = await env.export_notebook(notebook)
    except (KernelEnvError, OSError, ValueError) as exc:
        _say(f"no notebook written: {exc}")
        return None
    return exported


def _report(
    args: argparse.Namespace,
    outcome: Any,
    progress: _Progress,
    notebook: Path | None,
    trajectory: Path,
) -> int:
    answered = outcome is not None and outcome.stop_reason == "final"
    kept_trajectory = trajectory if trajectory.exists() else None
    if outcome is not None:
        reward = (
            f", reward {outcome.reward:g}"
            if args.expected_answer is not None and outcome.reward is not None
            else ""
        )
        _say(
            f"stopped: {outcome.stop_reason} after {outcome.iterations} iteration(s), "
            f"{outcome.elapsed:.1f} s{reward}; {progress.totals()}"
        )
        if not answered:
            _say("no final answer: the model never gave one within its budget")
    if args.json:
        print(json.dumps(_outcome_json(args, outcome, notebook, kept_trajectory)))
    else:
        if outcome is not None:
            shown = outcome.answer if outcome.answer is not None else "(none)"
            print(f"answer: {shown}" + ("" if answered else "  [no final answer given]"))
        if notebook is not None:
            print(f"notebook: {notebook}")
        if kept_trajectory is not None:
            print(f"trajectory: {kept_trajectory}")
    return 0 if answered else 1


def _outcome_json(
    args: argparse.Namespace, outcome: Any, notebook: Path | None, trajectory: Path | None
) -> dict[str, Any]:
    ran = outcome is not None
    return {
        "answer": outcome.answer if ran else None,
        "final": ran and outcome.stop_reason == "final",
        "stop_reason": outcome.stop_reason if ran else "error",
        "iterations": outcome.iterations if ran else 0,
        "elapsed": round(outcome.elapsed, 3) if ran else None,
        "reward": outcome.reward if ran and args.expected_answer is not None else None,
        "root_usage": outcome.usage.as_dict() if ran else None,
        "notebook": str(notebook) if notebook else None,
        "trajectory": str(trajectory) if trajectory else None,
    }


def _say(message: str) -> None:
    print(f"kernel-env run: {message}", file=sys.stderr, flush=True)


class _Watched:
    """The root model's backend, telling the progress line while a call is waited for."""

    def __init__(self, backend: Any, progress: _Progress) -> None:
        self.backend, self.progress = backend, progress

    async def complete(self, messages: Any, *, model: str | None = None) -> Any:
        self.progress.waiting_since = time.monotonic()
        try:
            return await self.backend.complete(messages, model=model)
        finally:
            self.progress.waiting_since = None

    async def aclose(self) -> None:
        await self.backend.aclose()


class _Progress:
    """One line per iteration on stderr, and while the model thinks a waiting line with the
    time elapsed: redrawn in place each second on a terminal, else every 15 s."""

    HEARTBEAT = 15.0  # seconds between waiting lines when stderr is not a terminal

    def __init__(self, env: Any, usage: Any, max_iterations: int, *, verbose: bool) -> None:
        self.env, self.usage, self.max_iterations = env, usage, max_iterations
        self.verbose = verbose
        self.started = time.monotonic()
        self.last_line = self.started
        self.index = 0
        self.sub_usage: dict[str, Any] = {}
        self.waiting_since: float | None = None
        self.tty = sys.stderr.isatty()
        self._drawn = False

    async def iteration(self, turn: Any) -> None:
        self.index = turn.index
        self.sub_usage = (await self.env.state()).llm_usage
        answer = turn.final_answer
        done = f"; final answer: {shorten(answer, 80, one_line=True)}" if answer else ""
        if turn.kind == "turn":
            head = f"iteration {turn.index}/{self.max_iterations}: {len(turn.code_blocks)} cell(s)"
        else:
            head = "out of iterations: asked the model for its answer"
        self._line(f"{head}; {self.totals()}; {turn.elapsed:.1f} s{done}")
        if self.verbose:
            for code, seen in zip(turn.code_blocks, turn.observations, strict=False):
                self._echo("cell", code)
                self._echo("output", seen)

    def totals(self) -> str:
        sub = self.sub_usage
        return (
            f"root model {self.usage.calls} call(s) / {self.usage.total_tokens:,} tokens, "
            f"sub-calls {sub.get('calls', 0)} / {sub.get('total_tokens', 0):,} tokens"
        )

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            what = (
                "the root model"
                if self.waiting_since is not None
                else f"iteration {self.index + 1}'s cells"
            )
            text = f"waiting for {what}... {now - self.started:.0f} s elapsed"
            if self.tty:
                self._draw(text)
            elif now - self.last_line >= self.HEARTBEAT:
                self._line(text)

    def clear(self) -> None:
        if self._drawn:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
            self._drawn = False

    def _draw(self, text: str) -> None:
        print(f"\r\033[Kkernel-env run: {text}", end="", file=sys.stderr, flush=True)
        self._drawn = True

    def _echo(self, label: str, text: str) -> None:
        body = "\n".join(f"    {line}" for line in (text or "(nothing)").splitlines())
        print(f"  {label}:\n{body}", file=sys.stderr, flush=True)

    def _line(self, text: str) -> None:
        self.clear()
        self.last_line = time.monotonic()
        _say(text)
