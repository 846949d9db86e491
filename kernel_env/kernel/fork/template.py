"""An ipykernel built in the zygote up to its first socket, finished in each forked kernel.

A kernel's start after the fork used to be ipykernel's whole ``IPKernelApp.initialize``,
most of it parsing the command line, reading config and building the
kernel object and its ``InteractiveShell`` (magics, aliases, formatters, completer). None of
that needs a socket, a thread or anything of one kernel's own, so the zygote does it once
(:meth:`KernelTemplate.build`) and every forked kernel inherits the result, copy-on-write.
After the fork, the kernel does only what is its own, in the order ``IPKernelApp.initialize``
does it: :meth:`KernelTemplate.identify` (connection info and session id, which a sandboxed
kernel reads while its sandbox is still being made), then :meth:`KernelTemplate.run` (the zmq
context, sockets and threads, its streams and signal handling, its profile directory, the
kernel_env extension, then the event loop). It runs on one CPU, and its threads get every CPU
back as its first cell begins. It makes fewer sockets and threads than a cold kernel: no
heartbeat, no control or shell channel thread and no debugger (see
:func:`_init_control_alone`).

What the zygote builds holds no socket, thread, event loop or open file (``build`` checks),
so a fork of it is sound; every identity a kernel shows (session id, iopub topic, msg ids)
is made after the fork.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fnmatch
import functools
import gc
import os
import random
import resource
import shutil
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["KernelTemplate", "grow_descriptor_table", "missing_internals", "reseed"]

# What the template calls of ipykernel beyond its documented API (IPKernelApp.initialize's
# steps, the kernel's port and topic helpers): checked before a zygote builds anything, so
# that a release without one starts kernels cold instead of failing them.
_INTERNALS = {
    "ipykernel.kernelapp.IPKernelApp": (
        "_bind_socket", "_run_cmd_line_code", "_run_exec_files", "_run_exec_lines",
        "_run_module", "_run_startup_files", "init_blackhole", "init_control",
        "init_extensions", "init_gui_pylab", "init_io", "init_path", "init_pdb", "init_shell",
        "init_signal", "init_sockets", "load_connection_file", "write_connection_file",
        "kernel_class", "default_extensions",
    ),
    "ipykernel.ipkernel.IPythonKernel": ("_topic", "record_ports"),
}  # fmt: skip

_libc = ctypes.CDLL(None, use_errno=True)


class KernelTemplate:
    """One ``IPKernelApp`` with its kernel and shell, built but not connected."""

    def __init__(self, app: Any, modules: set[str] | None = None) -> None:
        self.app = app
        self.modules = modules  # the names in sys.modules once built (see _init_code)
        self.blank_profile: Any = None  # a ProfileDir with no location yet (see _own_profile)

    @classmethod
    def build(cls, flags: Sequence[str], ipython_dir: str) -> KernelTemplate:
        """Parse ``flags`` (ipykernel's command line, without ``-f``) and build the kernel
        object and its shell, in this (thread-free) process. ``ipython_dir`` is where IPython
        may make its profile while building; each kernel makes its own after the fork."""
        from ipykernel.kernelapp import IPKernelApp
        from IPython.core.application import BaseIPythonApplication
        from IPython.core.profiledir import ProfileDir

        os.environ["IPYTHONDIR"] = ipython_dir
        try:
            _without_debugger()  # before the kernel is built: it then makes no debugger
            app = IPKernelApp.instance()
            # IPKernelApp.initialize, up to its first socket: the command line, profile and
            # config files, then the parts of it that need no socket.
            BaseIPythonApplication.initialize(app, list(flags))
            app.init_pdb()
            app.init_blackhole()
            kernel_class: Any = app.kernel_class
            app.kernel = kernel_class.instance(
                parent=app,
                session=app.session,
                log=app.log,
                profile_dir=app.profile_dir,
                user_ns=app.user_ns,
            )
            if hasattr(kernel_class, "_supports_kernel_subshells"):
                _without_subshells(kernel_class)  # the class every forked kernel takes
            app.init_path()
            app.init_shell()
            app.init_gui_pylab()
            # A silent cell, as every kernel's first (the readiness probe) is: what a cell
            # compiles and caches on first use (tokenize's patterns, IPython's transforms and
            # compiler) is then built once here, not in each kernel. Silent:
            # no history, no execution count, no output; tests compare the namespace.
            app.kernel.shell.run_cell("pass\n", store_history=False, silent=True)
            # The display formatters, built on first use (every step formats the state the
            # host asks for), and a logger that makes no record its handlers would drop
            # (ipykernel logs each message at debug level).
            app.kernel.shell.display_formatter.format(None)
            app.log.setLevel(min((h.level for h in app.log.handlers), default=app.log_level))
            # IPython's own extensions (storemagic: magics, no state of a kernel's own), named
            # by their modules: the kernel's init_extensions then finds them loaded (by the
            # short name it would first look for a module "storemagic" on sys.path)
            # and loads only kernel_env's.
            manager = app.kernel.shell.extension_manager
            for name in app.default_extensions:
                manager.load_extension(name)
            app.default_extensions = sorted(manager.loaded)
            # The patterns of the startup files each kernel looks for (init_code), compiled.
            fnmatch.filter([], "*.py")
            fnmatch.filter([], "*.ipy")
        finally:
            del os.environ["IPYTHONDIR"]
        _check_forkable()
        template = cls(app, set(sys.modules))
        template.blank_profile = ProfileDir()
        gc.collect()
        gc.freeze()  # the collector leaves what every kernel shares untouched (copy-on-write)
        return template

    def run(self) -> None:
        """In a forked kernel, once :meth:`identify` ran: connect the template and serve until
        shutdown. The environment, working directory and descriptors are the kernel's own
        already (what imports set in the environment included)."""
        every_cpu = _start_on_one_cpu()
        self.connect()
        self._own_profile()
        self.own_directory()
        self.app.init_extensions()
        self._init_code()
        _before_the_first_cell(self.app.kernel.shell, every_cpu)
        self.app.start()

    def identify(self, connection_file: str) -> None:
        """Give the kernel the identities of ``connection_file`` (its key, transport and
        socket addresses) and its own session: nothing that opens a socket or starts a
        thread, so a forked kernel may do it before it joins its sandbox."""
        app, kernel = self.app, self.app.kernel
        app.connection_file = connection_file
        # What init_connection_file does with an absolute path that exists, without looking
        # up Jupyter's runtime directory first.
        app.load_connection_file()
        app.session.session = str(uuid.uuid4())  # msg ids and headers of this kernel alone
        app.session.pid = os.getpid()  # a Session sends nothing from a process it was not made in
        kernel.ident = str(uuid.uuid4())

    def connect(self) -> None:
        """Give the identified kernel its sockets, threads and streams (made in this process,
        none inherited)."""
        app, kernel = self.app, self.app.kernel
        _without_debugger()
        kernel.debugpy_stream = kernel.debug_shell_socket = None  # a live fork's parent's
        app.init_control = _init_control_alone.__get__(app)  # what init_sockets calls
        app.init_sockets()
        # No heartbeat (its own zmq context and three threads): the host watches the process
        # itself, and nothing here connects to the heartbeat socket.
        if 0 in (app.shell_port, app.iopub_port, app.stdin_port, app.control_port):
            # Addresses to be chosen: ipykernel's rewrite of the file records them. (The
            # host's file names them all, and a rewrite only read it back.)
            app.write_connection_file()
        app.init_io()
        app.init_signal()
        self._connect_kernel()

    def _connect_kernel(self) -> None:
        """What ``IPKernelApp.init_kernel`` passes to a new kernel, given to the built one."""
        from zmq.eventloop.zmqstream import ZMQStream

        app, kernel = self.app, self.app.kernel
        shell_stream = ZMQStream(app.shell_socket)  # served on the main thread
        # Control on the iopub thread's loop (see _init_control_alone).
        control_stream = ZMQStream(app.control_socket, app.iopub_thread.io_loop)
        kernel.session = app.session
        kernel.control_stream = control_stream
        kernel.shell_stream = shell_stream
        kernel.control_thread = None
        kernel.shell_channel_thread = None
        _serve_shell_on_the_main_thread(kernel)
        kernel.iopub_thread = app.iopub_thread
        kernel.iopub_socket = app.iopub_socket
        kernel.stdin_socket = app.stdin_socket
        kernel._stdout, kernel._stderr = sys.stdout, sys.stderr
        shell = kernel.shell
        shell.displayhook.session = app.session
        shell.displayhook.pub_socket = kernel.iopub_socket
        shell.displayhook.topic = kernel._topic("execute_result")
        shell.display_pub.session = app.session
        shell.display_pub.pub_socket = kernel.iopub_socket
        kernel.record_ports({name + "_port": port for name, port in app._ports.items()})
        app.displayhook.get_execution_count = lambda: kernel.execution_count

    def _init_code(self) -> None:
        """IPython's ``InteractiveShellApp.init_code`` (startup files, exec lines and files,
        hiding the initial namespace, flushing), with the zygote's set of the names in
        ``sys.modules`` (what ``%reset -f --aggressive`` keeps) when no module came since: a
        new set of those names touches strings on ~480 pages of the zygote's memory, which
        copy-on-write then copies into every kernel."""
        app, shell = self.app, self.app.kernel.shell
        app._run_startup_files()
        app._run_exec_lines()
        app._run_exec_files()
        if app.hide_initial_ns:
            shell.user_ns_hidden.update(shell.user_ns)
        app._run_cmd_line_code()
        app._run_module()
        sys.stdout.flush()
        sys.stderr.flush()
        built = self.modules
        same = built is not None and len(built) == len(sys.modules)  # a start never removes
        shell._sys_modules_keys = built if same else set(sys.modules)

    def own_directory(self) -> None:
        """The directory the shell noted as its start while it was built in the zygote."""
        shell = self.app.kernel.shell
        shell.starting_dir = os.getcwd()
        shell.history_manager.dir_hist[:] = [Path.cwd()]  # _dh

    def _own_profile(self) -> None:
        """The profile directory a kernel started cold makes (under its own HOME), made
        with the system calls IPython's ``ProfileDir`` makes, without its trait observers
        (which make each directory twice over)."""
        from IPython.core.profiledir import ProfileDir
        from IPython.paths import get_ipython_dir, get_ipython_package_dir

        app, kernel = self.app, self.app.kernel
        location = os.path.join(get_ipython_dir(), f"profile_{app.profile}")
        names = ("security", "log", "pid", "startup")  # IPython's order (check_dirs)
        dirs = {name: os.path.join(location, name) for name in names}
        with contextlib.suppress(FileExistsError):
            os.mkdir(location, 0o755)
        for name, path in dirs.items():
            made = _mkdir(path, 0o700 if name in ("security", "pid") else 0o777)
            if made and name == "startup":
                readme = Path(get_ipython_package_dir(), "core", "profile", "README_STARTUP")
                with contextlib.suppress(OSError):
                    shutil.copyfile(readme, os.path.join(path, "README"))
        # Built in the zygote, when there is one: making a traitlets object is not cheap.
        profile = self.blank_profile if self.blank_profile is not None else ProfileDir()
        profile._trait_values.update(  # the values ProfileDir(location=...) sets
            location=location,
            _location_isset=True,
            static_dir=os.path.join(location, "static"),
            **{f"{name}_dir": path for name, path in dirs.items()},
        )
        app.profile_dir = kernel.profile_dir = kernel.shell.profile_dir = profile


def missing_internals() -> str | None:
    """The first of ipykernel's internals the template needs that this ipykernel lacks, in
    words, or None."""
    import importlib

    for where, names in _INTERNALS.items():
        module_name, _, class_name = where.rpartition(".")
        try:
            owner = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            return f"this ipykernel has no {where}"
        for name in names:
            if not hasattr(owner, name):
                return f"this ipykernel's {class_name} has no {name}"
    return None


def _mkdir(path: str, mode: int) -> bool:
    """Whether ``path`` was made, with ``mode``, as IPython's profile makes its directories: a
    private one (a ``mode`` other than 0o777) that exists gets that mode too."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if mode != 0o777 and os.stat(path).st_mode & 0o777 != mode:
            os.chmod(path, mode)
        return False
    return True


def _without_debugger() -> None:
    """This process's kernel has no debugger. ipykernel's (debugpy's) serves a Jupyter
    frontend's debug requests, and nothing reaches a forked kernel's control channel but its
    host, which sends none. Without it a kernel makes two sockets, a connection to its own
    shell socket, a debugger object and a task on its control thread fewer; its
    ``kernel_info`` offers no debugger, and a debug request gets an empty reply, as in an
    ipykernel without debugpy."""
    import importlib

    for name in ("ipykernel.debugger", "ipykernel.ipkernel", "ipykernel.kernelbase"):
        module = importlib.import_module(name)
        if hasattr(module, "_is_debugpy_available"):  # ipykernel 6 imports it by name
            module._is_debugpy_available = False  # type: ignore[attr-defined]


def _init_control_alone(app: Any, context: Any) -> None:
    """ipykernel's ``IPKernelApp.init_control``: the control socket alone, without the
    debugger's two sockets (see :func:`_without_debugger`), a control thread or a shell
    channel thread.

    Control messages are served on the iopub thread's event loop (``_connect_kernel``): what
    a control thread is for is answering while the main thread runs a cell (an interrupt
    request), and the iopub thread is free then too; its handlers are short. A thread and an
    event loop fewer to make.

    Shell messages go straight to the main thread. ipykernel 7 relays each one through a
    thread of its own, for subshells (concurrent cells, which an episode does not run): a
    thread hop and a second parse per message, and one more thread (and event loop) to make.
    The kernel serves its shell channel itself, as ipykernel 6 did."""
    import zmq

    app.control_socket = context.socket(zmq.ROUTER)
    app.control_socket.linger = 1000
    curve = getattr(app, "_apply_curve_server_options", None)  # ipykernel 7
    if curve is not None:
        curve(app.control_socket)
    app.control_port = app._bind_socket(app.control_socket, app.control_port)
    if hasattr(zmq, "ROUTER_HANDOVER"):
        app.control_socket.router_handover = 1  # as ipykernel does (ipykernel#270)
    app.debugpy_socket = app.debug_shell_socket = None
    app.control_thread = app.shell_channel_thread = None


def _start_on_one_cpu() -> Callable[[], None]:
    """Keep this process, and every thread it starts, on the CPU it runs on; what gives each
    thread back every CPU it may use.

    A kernel's start hands work from thread to thread (its main thread, zmq's I/O thread,
    iopub's, the threads it starts and waits for), and copies pages from the zygote while
    those threads run. Spread over CPUs, each hand-off wakes another CPU and each copied page
    flushes the other CPUs' TLBs (an interrupt each, costly in a virtual machine). On one CPU
    a forked kernel's start takes less CPU and its first reply comes sooner
    (``benchmarks/README.md``). Call while this process has one thread."""
    allowed = os.sched_getaffinity(0)
    cpu = _libc.sched_getcpu()
    if len(allowed) < 2 or cpu not in allowed:
        return lambda: None
    os.sched_setaffinity(0, {cpu})

    def every_cpu() -> None:
        for thread in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(thread), allowed)

    return every_cpu


def _before_the_first_cell(shell: Any, action: Callable[[], None]) -> None:
    """Run ``action`` once, as the kernel's first cell begins (silent cells included; an
    empty one runs no code and no hook)."""

    def once() -> None:
        shell.events.unregister("pre_execute", once)
        action()

    shell.events.register("pre_execute", once)


class _MainThreadServesShell:
    """Stands for ipykernel's shell channel thread in a kernel that has none: false (no
    thread to start, stop or relay through), and its ``parent_thread``, which ipykernel reads
    for a cell with top-level ``await`` (SIGINT may cancel such a cell on that thread), is
    the main thread, which serves shell here."""

    def __bool__(self) -> bool:
        return False

    @property
    def parent_thread(self) -> threading.Thread:
        return threading.main_thread()


def _serve_shell_on_the_main_thread(kernel: Any) -> None:
    """ipykernel 7 takes any shell channel thread that is not ``None`` as subshell support,
    and reads ``shell_channel_thread.parent_thread`` for a cell with top-level ``await``,
    which with ``None`` failed (the request got no reply). The kernel gets the stand-in, and
    a class that says it has no subshells, as it has none."""
    kernel_class: Any = type(kernel)
    if not hasattr(kernel_class, "_supports_kernel_subshells"):
        return  # ipykernel 6: no subshells, no shell channel thread
    kernel.__class__ = _without_subshells(kernel_class)
    kernel.shell_channel_thread = _MainThreadServesShell()


@functools.cache
def _without_subshells(kernel_class: Any) -> type:
    """``kernel_class``, saying it has no subshells: a subclass, made once in the zygote
    (making a class with traits is not cheap), or the class itself when it says so
    already (a live fork's copy of a forked kernel)."""
    if kernel_class.__dict__.get("_supports_kernel_subshells", None) is False:
        return kernel_class
    return type(
        kernel_class.__name__,
        (kernel_class,),
        {"_supports_kernel_subshells": False, "__module__": kernel_class.__module__},
    )


def _check_forkable() -> None:
    """What the template built must hold nothing a fork would share or lose."""
    import zmq

    problems = []
    if threading.active_count() > 1 or len(os.listdir("/proc/self/task")) > 1:
        problems.append("a thread")
    if zmq.Context._instance is not None:
        problems.append("a zmq context")
    policy = asyncio.get_event_loop_policy()
    if getattr(getattr(policy, "_local", None), "_loop", None) is not None:
        problems.append("an event loop")
    if problems:
        raise RuntimeError(f"building the kernel template started {', '.join(problems)}")


def grow_descriptor_table(size: int = 1024) -> None:
    """Make room for ``size`` descriptors now, while this process has one thread.

    Linux grows a process's descriptor table when a new descriptor does not fit (past 64,
    then 128...) and, when threads share the table, only after an RCU grace period
    (milliseconds), on the first new descriptor of a live fork's copy (its parent's ~60 fill
    the table it inherits) and in a forked kernel's first cells. A table never shrinks, so
    growing it once up front costs a few kilobytes and no wait."""
    top = min(size, resource.getrlimit(resource.RLIMIT_NOFILE)[0]) - 1
    if top > 2:
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        if null != top:
            os.dup2(null, top, inheritable=False)
            os.close(top)
        os.close(null)


def reseed(seed: int | None = None) -> None:
    """New random state for a forked kernel: ``random`` and, if loaded, ``numpy.random``
    (from the OS's entropy, or from ``seed``)."""
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(None if seed is None else seed % 2**32)
