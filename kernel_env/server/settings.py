"""``ServerSettings``: how ``kernel-env serve`` runs, from arguments and ``KERNEL_ENV_*`` variables.

Environment variables are read once, here, at the edge; an explicit argument always wins over
a variable, and a variable over the default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kernel_env.kernel.modes import DEFAULT_KERNEL_USERNAME, SANDBOX_MODES
from kernel_env.server.retention import DEFAULT_KEEP, Keep, parse_keep

__all__ = ["ENV_PREFIX", "LOG_LEVELS", "ServerSettings", "default_episodes"]

ENV_PREFIX = "KERNEL_ENV_"

_MiB = 1024 * 1024
_SECRETS = frozenset({"token", "tokens_file"})  # blank = a start-up error, never "no auth"


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
LOG_FORMATS = ("text", "json")


def _flag(
    default: Any,
    help: str,
    *,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    secret: bool = False,
    repeat: bool = False,
    shown: str | None = None,
) -> Any:
    """A setting that is also a ``kernel-env serve`` flag (``--name-with-dashes``): the CLI
    builds its flags from these fields, and its help names the default. ``repeat``: a list
    flag that may also be given once per item."""
    return field(
        default=default,
        repr=not secret,
        metadata={
            "help": help,
            "metavar": metavar,
            "choices": choices,
            "repeat": repeat,
            "shown": shown,  # the default in --help, when the field's is not the CLI's
        },
    )


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Every knob of the server. Sizes in bytes or characters, times in seconds.

    Each field is a ``KERNEL_ENV_<NAME>`` variable; those made with ``_flag`` are also a
    ``kernel-env serve --<name>`` flag (the others are secrets: variables or files only).
    """

    host: str = _flag("127.0.0.1", "interface to bind")
    port: int = _flag(8000, "port to bind; 0 picks a free one")
    pool_size: int = _flag(4, "kernels kept warm for resets")
    # None: what the machine holds (server/capacity.py), less the warm pool.
    max_sessions: int = _flag(
        None,
        "open sessions at most, one kernel each (none: what this machine's memory, open files "
        "and process ids hold, less pool-size; printed at start)",
        metavar="N",
    )
    # Below the 60 s an OpenEnv client waits for a reply: a step that ran out must still
    # answer (with a timeout observation) before the client gives up, or every later reply
    # on that connection is shifted by one. Worst case ~ step_timeout + interrupt + restart.
    step_timeout: float = _flag(30.0, "seconds a step may run")
    idle_ttl: float = _flag(600.0, "reap sessions idle this many seconds; 0 = never")
    # A session no request has named yet (a bare POST /reset of a stateless HTTP client) is
    # reaped after this, and is the first to go when the server is full (0: idle_ttl only).
    claim_ttl: float = _flag(
        60.0,
        "reap a session no request has named (a bare POST /reset) "
        "after this many seconds; 0 = only --idle-ttl",
    )
    # E2B's pause stops a sandbox's timeout; this bounds how long it may then stay paused.
    paused_ttl: float = _flag(
        86400.0, "reap an E2B sandbox paused this many seconds; 0 = never (only --idle-ttl)"
    )
    drain_timeout: float = _flag(8.0, "on shutdown, seconds in-flight steps may finish")
    token: str | None = field(default=None, repr=False)  # bearer token; None = no auth
    # Per-tenant tokens: a line "name role token" each (docs/security.md#server-auth).
    tokens_file: str | None = _flag(
        None,
        "a file of per-tenant tokens, one line 'name role token' each (role: client, who "
        "sees only its own sessions, or operator)",
        metavar="PATH",
    )
    max_sessions_per_tenant: int | None = _flag(
        None,
        "open sessions one client tenant may hold (none: only --max-sessions)",
        metavar="N",
    )
    max_message_bytes: int = _flag(192 * _MiB, "largest WebSocket frame / HTTP body, bytes")
    max_context_chars: int = _flag(128 * _MiB, "largest reset context, chars")
    max_code_chars: int = _flag(1 * _MiB, "largest code of one step, chars")
    log_level: str = _flag("info", "log level", choices=LOG_LEVELS)
    log_format: str = _flag(
        "text", "log lines, the server's and uvicorn's alike: text or json", choices=LOG_FORMATS
    )
    # Where kernels run: local (sandboxed per `sandbox`), or on a Jupyter (Enterprise) Gateway.
    sandbox: str = _flag(
        "bwrap",
        "local kernels under bubblewrap: bwrap (required: a host where it cannot run "
        "is refused at start), auto (unsandboxed where it cannot run), none",
        choices=SANDBOX_MODES,
    )
    # Local kernels are forked from a process that imported what a kernel needs (and these
    # modules) once; off, or where it cannot run, every kernel starts a new interpreter.
    forkserver: bool = _flag(
        True,
        "start local kernels by forking a preloaded process (false: a new interpreter per kernel)",
        metavar="BOOL",
    )
    preload: tuple[str, ...] = _flag(
        (), "modules the forkserver imports once for every kernel", metavar="numpy,pandas"
    )
    # Local kernels' identical pages merged by the Linux kernel (kernel_env.kernel.merging):
    # opt-in, for its side channel between kernels (docs/security.md).
    merge_pages: bool = _flag(
        False,
        "each local kernel offers its memory to the Linux kernel's same-page merging (KSM, "
        "Linux 6.4+; ksmd must run): a few MiB less per kernel, and a timing side channel "
        "between kernels (docs/security.md)",
        metavar="BOOL",
    )
    kernels: tuple[str, ...] = _flag(
        ("python3",),
        "kernel names a reset may ask for (kernel_name); each but python3 needs its kernelspec "
        "installed (make kernels)",
        metavar="python3,ir,bash,deno",
    )
    gateway_url: str | None = _flag(
        None,
        "run kernels on this Jupyter Kernel Gateway / Enterprise Gateway instead",
        metavar="URL",
    )
    gateway_token: str | None = _flag(
        None,
        "the gateway's auth token (prefer KERNEL_ENV_GATEWAY_TOKEN or _FILE: flags are "
        "visible to other users of this host)",
        metavar="TOKEN",
        secret=True,
    )
    gateway_kernel_name: str | None = _flag(
        None, "the gateway's kernel spec (none: the gateway's python3)", metavar="NAME"
    )
    gateway_env: tuple[str, ...] = _flag(
        (),
        "KERNEL_* variables every gateway kernel is started with (Enterprise Gateway reads "
        f"KERNEL_USERNAME, KERNEL_NAMESPACE, ...; KERNEL_USERNAME={DEFAULT_KERNEL_USERNAME} "
        "unless given); repeatable",
        metavar="NAME=VALUE",
        repeat=True,
    )
    # The model behind the kernels' llm_query (an OpenAI-compatible endpoint). A reset with an
    # hf_token uses Hugging Face's router with that token for that episode instead.
    llm_base_url: str | None = _flag(
        None,
        "OpenAI-compatible endpoint answering the kernels' llm_query (key: KERNEL_ENV_LLM_API_KEY)",
        metavar="URL",
    )
    llm_model: str | None = _flag(None, "model name sent to --llm-base-url", metavar="MODEL")
    llm_api_key: str | None = field(default=None, repr=False)
    hf_router_url: str | None = None  # where hf_token episodes go; None: Hugging Face's router
    llm_max_calls: int | None = _flag(
        None, "LLM calls per episode at most (none: no limit)", metavar="N"
    )
    llm_max_tokens: int | None = _flag(
        None, "LLM tokens per episode at most (none: no limit)", metavar="N"
    )
    llm_allowed_models: tuple[str, ...] = _flag(
        (), "models a cell may name in llm_query(model=...) besides --llm-model", metavar="M1,M2"
    )
    max_prompt_chars: int = _flag(1_000_000, "largest llm_query prompt, chars", metavar="N")
    max_kernels: int | None = _flag(
        None,
        "kernels at most: sessions', warm ones and rlm_query children (none: "
        "max-sessions + pool-size)",
        metavar="N",
    )
    max_connections: int | None = _flag(
        None,
        "HTTP and WebSocket connections at most; a request past it gets 503 (none: what the "
        "open files limit leaves after every kernel's descriptors; at least max-sessions + 64)",
        metavar="N",
    )
    # Browser policy. Host headers accepted (None: the bound address, localhost, 127.0.0.1,
    # [::1]; "*" accepts any), and origins a browser page may call from (CORS; none by default).
    allowed_hosts: tuple[str, ...] | None = _flag(
        None,
        "Host names accepted (none: the bound address, localhost, 127.0.0.1, [::1]; * for any)",
        metavar="H1,H2",
    )
    allowed_origins: tuple[str, ...] = _flag(
        (), "web origins allowed to call the server (CORS)", metavar="O1,O2"
    )
    # Every episode's notebook and index row, kept as it runs (kernel_env.server.store). The
    # default of `kernel-env serve` (from_env) is a directory under the user's state dir; a
    # ServerSettings built in code keeps none unless told.
    episodes: str | None = _flag(
        None,
        "a directory that keeps every episode (each step as it completes, its notebook, an "
        "index to list them); none: keep none",
        metavar="DIR",
        shown="$XDG_STATE_HOME/kernel_env/episodes, or ~/.local/state/kernel_env/episodes",
    )
    episodes_keep: str = _flag(
        DEFAULT_KEEP,
        "how many stored episodes to keep, by count, age and total size (any of them); the "
        "oldest go first, a running one never",
        metavar="count=N,age=30d,size=20GiB",
    )

    def __post_init__(self) -> None:
        if self.max_sessions is None:
            object.__setattr__(self, "max_sessions", self._sessions_the_machine_holds())
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("pool_size", "idle_ttl", "claim_ttl", "paused_ttl"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "max_sessions",
            "step_timeout",
            "drain_timeout",
            "max_message_bytes",
            "max_context_chars",
            "max_code_chars",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("token", "gateway_token", "llm_api_key"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(
                    f"{name} must not be empty or blank (leave it unset for none)"
                    + (": KERNEL_ENV_TOKEN is set but blank" if name == "token" else "")
                )
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        if self.max_prompt_chars <= 0:
            raise ValueError(f"max_prompt_chars must be > 0, got {self.max_prompt_chars}")
        if self.max_sessions_per_tenant is not None and self.max_sessions_per_tenant < 1:
            raise ValueError(
                f"max_sessions_per_tenant must be >= 1, got {self.max_sessions_per_tenant}"
            )
        if self.tokens_file is not None and not self.tokens_file.strip():
            raise ValueError("tokens_file must not be empty (leave it unset for none)")
        for name in ("max_kernels", "max_connections"):
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.merge_pages and self.gateway_url is not None:
            raise ValueError("merge_pages is for local kernels: a gateway's run elsewhere")
        if self.sandbox not in SANDBOX_MODES:
            raise ValueError(f"sandbox must be auto, bwrap or none, got {self.sandbox!r}")
        object.__setattr__(self, "gateway_env", tuple(self.gateway_env))  # a CLI list
        object.__setattr__(self, "kernels", tuple(dict.fromkeys(self.kernels)))
        if not self.kernels or not all(self.kernels):
            raise ValueError(f"kernels must name at least one kernel, got {self.kernels!r}")
        gateway_env_problem(self.gateway_env)
        if self.llm_base_url and not self.llm_model:
            raise ValueError("llm_base_url needs llm_model (the model name to request)")
        for name in ("llm_max_calls", "llm_max_tokens"):
            if (value := getattr(self, name)) is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.episodes is not None and self.episodes.strip().lower() in ("", "none"):
            object.__setattr__(self, "episodes", None)
        parse_keep(self.episodes_keep)  # a ValueError saying what is wrong

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **explicit: Any) -> ServerSettings:
        """Settings from ``explicit`` arguments (None = not given), then ``KERNEL_ENV_<NAME>``
        variables, then the defaults."""
        environ = os.environ if environ is None else environ
        environ = {**environ, **_secrets_from_files(environ)}
        known = {f.name: f for f in fields(cls)}
        unknown = set(explicit) - set(known)
        if unknown:
            raise TypeError(f"unknown setting(s): {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {}
        for name, f in known.items():
            if explicit.get(name) is not None:
                values[name] = explicit[name]
            elif (raw := environ.get(ENV_PREFIX + name.upper())) is not None:
                values[name] = _parse(name, str(f.type), raw)
        if "episodes" not in values:  # unset: a served episode is kept, in the state dir
            values["episodes"] = default_episodes(environ)
        return cls(**values)

    def _sessions_the_machine_holds(self) -> int:
        from kernel_env.server.capacity import machine_capacity

        local = self.gateway_url is None
        kernels = machine_capacity(local=local, forked=self.forkserver).kernels
        if self.max_kernels is not None:
            kernels = min(kernels, self.max_kernels)
        return max(1, kernels - self.pool_size)

    @property
    def keep(self) -> Keep:
        """``episodes_keep``, parsed."""
        return parse_keep(self.episodes_keep)

    @property
    def kernel_limit(self) -> int:
        """Kernels the server may run at once (``max_kernels``, or its default)."""
        return self.max_kernels or self.max_sessions + self.pool_size

    @property
    def step_body_bytes(self) -> int:
        """The largest body of a step (OpenEnv's ``/step``, E2B's ``/execute``): its code,
        JSON-escaped at up to 6 bytes a char, and room for the rest of the request."""
        return min(self.max_message_bytes, 6 * self.max_code_chars + (64 << 10))

    @property
    def secret_files(self) -> tuple[str, ...]:
        """The files holding this server's secrets that a sandboxed kernel must not see (the
        sandbox also hides every file a ``*_FILE`` variable names)."""
        return (self.tokens_file,) if self.tokens_file else ()

    @property
    def host_allowlist(self) -> tuple[str, ...]:
        """The Host names accepted (lower case, without port or brackets)."""
        if self.allowed_hosts is not None:
            return tuple(h.strip().strip("[]").lower() for h in self.allowed_hosts)
        return (self.host.strip("[]").lower(), "localhost", "127.0.0.1", "::1")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


# Secrets may come from files (KERNEL_ENV_TOKEN_FILE, ...: Docker's and Kubernetes' secrets
# convention), which keeps them out of every process environment a kernel could read.
SECRET_SETTINGS = ("token", "gateway_token", "llm_api_key")


def _secrets_from_files(environ: Mapping[str, str]) -> dict[str, str]:
    values = {}
    for name in SECRET_SETTINGS:
        variable = ENV_PREFIX + name.upper()
        path = environ.get(variable + "_FILE")
        if not path:
            continue
        if environ.get(variable):
            raise ValueError(f"set {variable} or {variable}_FILE, not both")
        try:
            with open(path, encoding="utf-8") as f:
                values[variable] = f.read().strip()
        except OSError as exc:
            raise ValueError(f"{variable}_FILE: cannot read {path}: {exc.strerror}") from None
        if not values[variable]:
            raise ValueError(f"{variable}_FILE: {path} is empty")
    return values


def default_episodes(environ: Mapping[str, str]) -> str:
    """Where ``kernel-env serve`` keeps episodes unless told: ``$XDG_STATE_HOME/kernel_env/
    episodes``, or ``~/.local/state/kernel_env/episodes``."""
    home = environ.get("HOME") or os.path.expanduser("~")
    state = environ.get("XDG_STATE_HOME") or os.path.join(home, ".local", "state")
    return os.path.join(state, "kernel_env", "episodes")


def gateway_env_problem(entries: tuple[str, ...]) -> None:
    """Raise ValueError unless every entry is ``KERNEL_<NAME>=VALUE``."""
    for entry in entries:
        name, equals, _ = entry.partition("=")
        if not equals or not name.startswith("KERNEL_") or not name[7:]:
            raise ValueError(
                f"gateway_env: expected KERNEL_<NAME>=VALUE, got {entry!r} (gateways pass only "
                "KERNEL_* variables to kernels)"
            )


def _parse(name: str, type_name: str, raw: str) -> Any:
    """A variable's text as the field's type; an unparseable value is an error, not ignored.
    An empty variable leaves an optional setting unset, except a secret: an empty or blank
    ``KERNEL_ENV_TOKEN`` is an error, never a silent "no auth"."""
    optional = type_name.endswith("| None")
    if optional and not raw.strip() and name not in _SECRETS:
        return None
    base = type_name.removesuffix("| None").strip()
    if base == "bool":
        return parse_bool(raw, f"{ENV_PREFIX}{name.upper()}")
    if base == "tuple[str, ...]":
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    try:
        if base == "int":
            return int(raw)
        if base == "float":
            return float(raw)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}: expected {base}, got {raw!r}") from None
    return raw


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(raw: str, what: str = "value") -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off, any case); anything else is an error."""
    text = raw.strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{what}: expected true or false, got {raw!r}")
