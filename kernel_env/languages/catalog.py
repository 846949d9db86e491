"""Which kernels an episode may run in, what each language's shim offers, and where kernels
of a given name come from.

A reset names its kernel (``kernel_name``, Jupyter's term; default ``python3``). Each name
has a :class:`Language`: what its episodes expose, how their setup reaches the kernel, how
their final answer is found. Python (:data:`PYTHON`) keeps kernel_env's extension and the
forkserver: its setup rides on a request, its kernel reports the episode's state after each
cell. The other languages below get a shim (``inkernel/shims/``) sent as the episode's setup
cell, and end with a display; any other installed kernelspec runs plain steps, without
helpers (:attr:`Language.lacks` says which). Host side.
"""

from __future__ import annotations

import functools
import json
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel

from kernel_env.errors import InvalidInput
from kernel_env.inkernel.contract import (
    BASH_KERNEL_MODULE,
    EXTENSION,
    SETUP_METADATA,
    SHIMS,
    STATE_EXPRESSION,
)
from kernel_env.kernel.base import Kernel, KernelSource
from kernel_env.kernel.factory import describe_limits, local_kernel_class
from kernel_env.kernel.isolation.sandbox import GiB, SandboxLimits, describe_memory
from kernel_env.kernel.pool import KernelPool
from kernel_env.kernel.sandboxed import SandboxedKernel

__all__ = [
    "DEFAULT_KERNEL",
    "LANGUAGES",
    "PYTHON",
    "PYTHON_HELPERS",
    "KernelMenu",
    "Language",
    "describe_served_limits",
    "installed_kernels",
    "language_for",
    "local_kernel_source",
    "served_kernels",
    "set_up",
]

DEFAULT_KERNEL = "python3"
# What a Python episode has (kernel_env.inkernel.extension); other languages say which they lack.
PYTHON_HELPERS = (
    "context", "answer", "llm_query", "llm_query_batched", "rlm_query", "rlm_query_batched",
    "FINAL", "FINAL_VAR", "SHOW_VARS",
)  # fmt: skip
_RELAY = Path(__file__).with_name("relay.py")
RELAY_PLACEHOLDER = "{tcp_connection_file}"  # relay.PLACEHOLDER: the relay runs by path
_SHIM_HELPERS = ("context", "task_prompt", "llm_query", "llm_query_batched", "FINAL", "FINAL_VAR")


@dataclass(frozen=True, kw_only=True)
class Language:
    """How kernel_env runs episodes in one kernel name."""

    kernel_name: str
    language: str
    helpers: tuple[str, ...] = ()
    channel: str = "none: this kernel gets no helpers"  # how helpers reach the host, in words
    shim: str | None = None  # a file of the contract's SHIMS, sent before the setup call
    setup: str | None = None  # the setup call; {context} and {task}: the staged files' paths
    quote: Callable[[str], str] = json.dumps  # a path as a literal of the language
    # A silent cell that asks the host for one line on stdin (the readiness probe of a kernel
    # that serves stdin requests; None: ready once it answers kernel_info).
    probe: str | None = None
    ipykernel_app: bool = False  # started by ipykernel's IPKernelApp (takes its flags)
    interrupt_mode: str = "signal"
    env: Mapping[str, str] = field(default_factory=dict)
    # Per-process address space in the sandbox (None: the sandbox's default, its memory cap).
    # A runtime that reserves far more than it uses (V8) gets a larger one, and its memory
    # cap per process as RLIMIT_DATA instead (see ``sandbox_limits``).
    address_space_bytes: int | None = None
    ready_hint: str = "Call FINAL(answer) when done."
    argv: tuple[str, ...] | None = None  # kernel_env's own command line (else the kernelspec's)
    # An exported notebook's setup call; {params}: its JSON parameters as ``params_literal``
    # writes them (context or context_path, task_prompt, replay).
    notebook: str | None = None
    params_literal: Callable[[str], str] = str
    comment: str = "#"  # a line comment of the language
    # The kernel binds TCP only: it runs behind kernel_env's relay (relay.py), which serves it
    # on the IPC sockets the host connects to.
    tcp_only: bool = False
    # Seconds a cell's output may come after its idle (Deno forwards console output from a
    # task of its own, and gives it 5 ms: under load it comes after the idle).
    idle_grace: float = 0.0
    # The names an episode shows before its kernel reports its namespace.
    names: tuple[str, ...] = ("context",)
    # A user expression whose value (JSON) is the episode's state after each cell: the final
    # answer, ``answer``, the namespace, the setup's token. None: the kernel reports none,
    # and its final answer is a display (protocol.FINAL_MIME) or a printed FINAL(...).
    state_expression: str | None = None
    # A user expression that reads the variable a printed FINAL_VAR(name) names; {name}: the
    # name as a literal (``quote``). None: FINAL_VAR names no variable the host can read.
    lookup: str | None = None
    # The request metadata key that carries the episode's setup into the kernel, checked
    # against the token its state reports; None: the setup is a cell of its own (``setup``).
    setup_key: str | None = None
    # The same setup as a silent cell, for a kernel that ignores the metadata; {params}: its
    # JSON as a literal (``params_literal``).
    setup_fallback: str | None = None
    # Its kernels come from the environment's own source (KernelEnvironment's
    # ``kernel_source``: a warm pool, a tenant's pool, a gateway), not from the menu's.
    own_source: bool = False

    @property
    def lacks(self) -> tuple[str, ...]:
        """Python's helpers this language does not have."""
        return tuple(h for h in PYTHON_HELPERS if h not in self.helpers)

    def command(self, spec: KernelSpec | None) -> list[str]:
        if self.argv is not None:
            return list(self.argv)
        if spec is None:
            raise InvalidInput(f"no kernelspec {self.kernel_name!r} is installed")
        if not self.tcp_only:
            return list(spec.argv)
        inner = [arg.replace("{connection_file}", RELAY_PLACEHOLDER) for arg in spec.argv]
        return [sys.executable, "-I", "-S", str(_RELAY), "{connection_file}", "--", *inner]

    def sandbox_limits(self, limits: SandboxLimits) -> SandboxLimits:
        """``limits`` as this language's sandboxed kernels get them."""
        if self.address_space_bytes is None:
            return limits
        data = limits.data_bytes or limits.address_space_bytes or limits.memory_bytes
        return replace(limits, address_space_bytes=self.address_space_bytes, data_bytes=data)

    def setup_code(self, context_path: str, task_path: str) -> str | None:
        """The episode's setup cell (the shim, then its setup call), or None."""
        if self.setup is None:
            return None
        call = self.setup.format(context=self.quote(context_path), task=self.quote(task_path))
        shim = _shim_text(self.shim) if self.shim else ""
        return f"{shim}\n{call}" if shim else call

    def notebook_setup(self, params: dict[str, Any]) -> str | None:
        """An exported notebook's setup cell: the shim, then the notebook's setup call with
        ``params`` (its recorded llm_query answers replay offline), or None."""
        if self.notebook is None:
            return None
        call = self.notebook.format(params=self.params_literal(json.dumps(params)))
        header = (
            f"{self.comment} kernel_env: restore this episode's `context` and helpers; its "
            "recorded llm_query answers replay offline."
        )
        shim = _shim_text(self.shim) if self.shim else ""
        return "\n".join(part for part in (header, shim, call) if part)

    def lookup_expression(self, name: str) -> str | None:
        """The user expression that reads ``name``'s value, or None."""
        return None if self.lookup is None else self.lookup.format(name=self.quote(name))

    def setup_metadata(self, params: dict[str, Any]) -> dict[str, str] | None:
        """The metadata of a request that carries the setup ``params``, or None."""
        return None if self.setup_key is None else {self.setup_key: json.dumps(params)}

    def setup_fallback_code(self, params: dict[str, Any]) -> str | None:
        """The setup ``params`` as a silent cell of their own, or None."""
        if self.setup_fallback is None:
            return None
        return self.setup_fallback.format(params=self.params_literal(json.dumps(params)))

    def commented(self, code: str, why: str) -> str:
        """``code`` as comments of the language, after a line saying ``why``."""
        lines = [f"{self.comment} kernel_env: {why}"]
        lines += [f"{self.comment} {line}".rstrip() for line in code.splitlines()]
        return "\n".join(lines)

    def describe(self) -> dict[str, Any]:
        return {
            "language": self.language,
            "helpers": list(self.helpers),
            "lacks": list(self.lacks),
            "channel": self.channel,
        }


@functools.cache
def _shim_text(name: str) -> str:
    return (SHIMS / name).read_text()


# kernel_env's extension, as the kernel's own code reaches it.
_EXTENSION = EXTENSION

PYTHON = Language(
    kernel_name=DEFAULT_KERNEL,
    language="python",
    helpers=PYTHON_HELPERS,
    channel="Jupyter stdin: kernel_env's IPython extension (inkernel.extension) asks with input()",
    ipykernel_app=True,
    ready_hint="Use answer['content'] to store your answer, and set answer['ready'] = True "
    "when done.",
    names=("answer", "context"),
    state_expression=STATE_EXPRESSION,
    lookup=f"{_EXTENSION}.lookup({{name}})",
    quote=repr,
    setup_key=SETUP_METADATA,
    setup_fallback=f"{_EXTENSION}.setup({{params}})",
    params_literal=json.dumps,
    own_source=True,
)

LANGUAGES: dict[str, Language] = {
    DEFAULT_KERNEL: PYTHON,
    "ir": Language(
        kernel_name="ir",
        language="R",
        helpers=_SHIM_HELPERS,
        channel="Jupyter stdin: IRkernel's readline() sends an input_request",
        shim="ir.R",
        setup=".kernel_env_setup({context}, {task})",
        notebook=".kernel_env_notebook({params})",
        params_literal=json.dumps,  # the JSON text as an R string (ASCII: R reads its escapes)
        # IRkernel has no interrupt_request: in the sandbox a timeout restarts it.
        interrupt_mode="signal",
    ),
    "bash": Language(
        kernel_name="bash",
        language="bash",
        helpers=_SHIM_HELPERS,
        channel="Jupyter stdin: kernel_env's bash_kernel turns a helper's request on the "
        "terminal into an input_request (bash_kernel has none of its own)",
        setup="__kernel_env_setup {context} {task}",
        quote=shlex.quote,
        notebook="__kernel_env_notebook <<'KERNEL_ENV_PARAMS'\n{params}\nKERNEL_ENV_PARAMS",
        probe="__kernel_env_probe",
        ipykernel_app=True,
        argv=(sys.executable, "-m", BASH_KERNEL_MODULE, "-f", "{connection_file}"),
    ),
    "deno": Language(
        kernel_name="deno",
        language="typescript",
        helpers=_SHIM_HELPERS,
        channel="Jupyter stdin: Deno's prompt() sends an input_request",
        shim="deno.ts",
        setup="__kernel_env_setup({context}, {task});",
        notebook="__kernel_env_notebook({params});",
        comment="//",
        interrupt_mode="message",
        tcp_only=True,
        idle_grace=0.05,
        env={"NO_COLOR": "1", "DENO_NO_UPDATE_CHECK": "1", "DENO_NO_PROMPT": "1"},
        # V8 reserves far more address space than it uses (its heap cage, wasm guard
        # regions, PROT_NONE until used): RLIMIT_DATA, which counts only writable private
        # memory, bounds each process instead (a 6 GB Uint8Array fails, a 6 GB heap ends the
        # kernel), beside the cgroup's memory cap where there is one.
        address_space_bytes=1024 * GiB,
    ),
}


def language_for(kernel_name: str, spec: KernelSpec | None = None) -> Language:
    """The language of ``kernel_name``: a known one, or plain steps in any other kernelspec."""
    known = LANGUAGES.get(kernel_name)
    if known is not None:
        return known
    return Language(
        kernel_name=kernel_name,
        language=spec.language if spec else "unknown",
        interrupt_mode=spec.interrupt_mode if spec else "signal",
        # The episode still reads a printed FINAL(...) (kernel_env.answers).
        ready_hint="This kernel has no kernel_env helpers: print FINAL(<answer>) when done.",
    )


def installed_kernels() -> dict[str, KernelSpec]:
    """The kernelspecs this host's jupyter_client finds, by name."""
    manager = KernelSpecManager()
    found = {}
    for name in sorted(manager.find_kernel_specs()):
        try:
            found[name] = manager.get_kernel_spec(name)
        except (NoSuchKernel, OSError, ValueError):
            continue
    return found


def local_kernel_source(
    kernel_name: str,
    spec: KernelSpec | None,
    *,
    sandbox: str = "auto",
    limits: SandboxLimits | None = None,
) -> KernelSource:
    """A new local kernel of ``kernel_name`` per call (sandboxed per ``sandbox``)."""
    language = language_for(kernel_name, spec)
    kind = local_kernel_class(sandbox)
    options: dict[str, Any] = {
        "argv": language.command(spec),
        "extra_env": dict(language.env, **(spec.env if spec else {})),
        "kernel_name": kernel_name,
        "language": language.language,
        "interrupt_mode": language.interrupt_mode,
        "ipykernel_app": language.ipykernel_app,
        "stdin_probe": language.probe,
        "idle_grace": language.idle_grace,
    }
    if kind is SandboxedKernel:
        options["limits"] = language.sandbox_limits(limits or SandboxLimits())

    async def start_language_kernel() -> Kernel:
        kernel = kind(**options)
        await kernel.start()
        return kernel

    return start_language_kernel


class KernelMenu:
    """The kernels a reset may name: a source and a language per available name, and why
    the others are not available."""

    def __init__(
        self,
        sources: Mapping[str, tuple[KernelSource, Language]],
        unavailable: Mapping[str, str] | None = None,
    ) -> None:
        self._sources = dict(sources)
        self.unavailable = dict(unavailable or {})

    @property
    def names(self) -> list[str]:
        return sorted(self._sources)

    def choose(self, kernel_name: str) -> tuple[KernelSource, Language]:
        """The source and language of ``kernel_name``, or :class:`InvalidInput` naming the
        kernels available."""
        chosen = self._sources.get(kernel_name)
        if chosen is not None:
            return chosen
        why = self.unavailable.get(kernel_name)
        because = f" ({why})" if why else ""
        raise InvalidInput(
            f"kernel_name {kernel_name!r} is not available here{because}; available: "
            f"{', '.join(self.names) or 'none'}"
        )

    def describe(self) -> dict[str, Any]:
        """For ``/metadata``: each available kernel's language and helpers, and why others
        are not available."""
        available = {name: language.describe() for name, (_, language) in self._sources.items()}
        return {"available": dict(sorted(available.items())), "unavailable": dict(self.unavailable)}

    @classmethod
    def local(
        cls,
        python: KernelSource,
        names: list[str] | None = None,
        *,
        sandbox: str = "auto",
        limits: SandboxLimits | None = None,
    ) -> KernelMenu:
        """Python's ``python`` source, and a local source for each of ``names`` installed
        (default: every kernelspec installed)."""
        specs = installed_kernels()
        wanted = names if names is not None else [DEFAULT_KERNEL, *specs]
        sources: dict[str, tuple[KernelSource, Language]] = {}
        unavailable = {}
        for name in dict.fromkeys(wanted):
            spec = specs.get(name)
            language = language_for(name, spec)
            if language.own_source:
                sources[name] = (python, language)
                continue
            if spec is None and name in LANGUAGES:
                unavailable[name] = f"no kernelspec {name!r} installed: run `make kernels`"
                continue
            if spec is None:
                unavailable[name] = f"no kernelspec {name!r} installed"
                continue
            source = local_kernel_source(name, spec, sandbox=sandbox, limits=limits)
            sources[name] = (source, language)
        return cls(sources, unavailable)


async def set_up(kernel: Kernel, language: Language, context: str, task_prompt: str) -> str | None:
    """Run ``language``'s setup cell in ``kernel``: the shim, ``context`` and ``task_prompt``
    (staged as files the kernel reads, never pasted into code). None, or why it failed."""
    if language.setup is None:
        return None
    context_path = await kernel.stage_file(".kernel_env_context.txt", context.encode("utf-8"))
    task_path = await kernel.stage_file(".kernel_env_task.txt", task_prompt.encode("utf-8"))
    code = language.setup_code(context_path, task_path)
    if code is None:
        return None
    result = await kernel.execute(code, silent=True, store_history=False, timeout=60.0)
    if result.success:
        return None
    why = result.stderr.strip() or (json.dumps(result.error) if result.error else "")
    return (why or f"the setup cell ended with status {result.status!r}")[-500:]


def describe_served_limits(settings: Any) -> dict[str, str]:
    """:func:`~kernel_env.kernel.factory.describe_limits` for a server's ``settings``, and the
    memory bound of each kernel it serves (``settings.kernels``) whose sandbox differs from
    Python's, as ``memory (<kernel name>)``."""
    described = describe_limits(settings)
    if described.get("sandbox") != "bubblewrap":
        return described
    base = SandboxLimits()
    for name in getattr(settings, "kernels", None) or [DEFAULT_KERNEL]:
        own = language_for(name).sandbox_limits(base)
        if own != base:
            described[f"memory ({name})"] = describe_memory(own)
    return described


def served_kernels(
    settings: Any, python: KernelSource, *, pool_size: int = 1
) -> tuple[KernelMenu, list[KernelPool]]:
    """A server's kernels: ``settings.kernels`` (python3 from ``python``, its pool), each
    other one installed here with a warm pool of its own (``pool_size`` kernels, started
    cold: only Python's fork), and why the others are not available."""
    names = list(getattr(settings, "kernels", None) or [DEFAULT_KERNEL])
    if getattr(settings, "gateway_url", None):
        others = {n: "a gateway's kernels are python3 only here" for n in names}
        others.pop(DEFAULT_KERNEL, None)
        return KernelMenu({DEFAULT_KERNEL: (python, PYTHON)}, others), []
    hidden = tuple(getattr(settings, "secret_files", ()))
    menu = KernelMenu.local(
        python,
        names,
        sandbox=getattr(settings, "sandbox", "auto") or "auto",
        limits=SandboxLimits(hidden_paths=hidden) if hidden else None,
    )
    if DEFAULT_KERNEL not in names:
        menu.unavailable[DEFAULT_KERNEL] = "not among this server's --kernels"
    limit = getattr(settings, "kernel_limit", None)
    pools = []
    for name, (source, language) in list(menu._sources.items()):
        if language.own_source:  # the caller's source, pooled already
            continue
        pool = KernelPool(source, size=pool_size, max_kernels=limit)
        pools.append(pool)
        menu._sources[name] = (pool.acquire, language)
    return menu, pools
