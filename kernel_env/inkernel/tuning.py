"""The per-cell tuning of ipykernel in an episode's kernel: work ipykernel repeats for every
cell, done once, each change measured (``benchmarks/README.md``) and tested for the same
behaviour.

It runs *inside* the kernel, as an IPython extension of its own, loaded after
:mod:`kernel_env.inkernel.extension` (``--ext=kernel_env.inkernel.tuning`` in an episode
kernel's flags; ``%load_ext kernel_env`` loads both). Unlike the helpers, it reaches into
ipykernel's internals, so it holds itself to what was tested: it tunes only an ipykernel
release :mod:`kernel_env.kernel.versions` names, checks each thing it replaces before it
does, and ``KERNEL_ENV_TUNING=off`` in the kernel's environment turns it off (for a local
kernel: ``LocalKernel(extra_env={"KERNEL_ENV_TUNING": "off"})``). An untuned kernel behaves
the same, a little slower.

It also offers the kernel's memory to the Linux kernel's same-page merging (KSM) when its
environment asks (:data:`~kernel_env.inkernel.contract.MERGE_PAGES_ENV` = ``1``: a server's
``--merge-pages``), whether tuned or not: :func:`merge_pages`.

Standard library, IPython, ipykernel and :mod:`kernel_env.kernel.versions` (the releases
tested; standard library alone) only: nothing of the host.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from typing import Any

from kernel_env.inkernel.contract import MERGE_PAGES_ENV
from kernel_env.kernel import versions

__all__ = [
    "SWITCH",
    "after_fork",
    "enabled",
    "load_ipython_extension",
    "merge_pages",
    "tune",
]

SWITCH = "KERNEL_ENV_TUNING"  # "off" in the kernel's environment: no tuning
PR_SET_MEMORY_MERGE = 67  # prctl(2), Linux 6.4+


def enabled() -> bool:
    """Whether this kernel is tuned: not switched off, and an ipykernel release tested."""
    if os.environ.get(SWITCH, "").strip().lower() in ("off", "0", "false", "no"):
        return False
    return versions.untested({"ipykernel": versions.TESTED["ipykernel"]}) is None


def load_ipython_extension(shell: Any) -> None:
    """``--ext=kernel_env.inkernel.tuning``: tune this kernel (see :func:`tune`), and offer
    its memory for merging if asked (:func:`merge_pages`)."""
    merge_pages()
    tune(shell)


def merge_pages() -> bool:
    """When the kernel's environment asks (``MERGE_PAGES_ENV`` = ``1``), mark every page of
    this process, now and later, as one the Linux kernel's ksmd may merge with identical
    pages of other processes (``prctl(PR_SET_MEMORY_MERGE, 1)``, Linux 6.4+; a fork inherits
    it). Forked kernels' copies of the forkserver's pages are often byte for byte the same
    (``benchmarks/README.md``); ksmd runs only where the host's operator turned it on. It is
    done here, in the started kernel: done in the forkserver before its forks, every fork
    stalled. Whether this process is marked now."""
    if os.environ.get(MERGE_PAGES_ENV, "").strip() != "1":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    long = ctypes.c_ulong  # prctl is variadic: whole longs, as the kernel reads them
    return libc.prctl(PR_SET_MEMORY_MERGE, long(1), long(0), long(0), long(0)) == 0


def tune(shell: Any) -> bool:
    """Tune ``shell`` and its kernel, once; whether it is tuned."""
    if not enabled():
        return False
    _ask_once_per_cell(shell)
    kernel = getattr(shell, "kernel", None)
    if kernel is not None:
        _wake_iopub_through_its_loop(kernel)
    return True


def after_fork(kernel: Any) -> None:
    """In a live fork's copy: its iopub thread is a new one, to be woken the same way (and
    its memory offered for merging, as a copy's environment asks)."""
    merge_pages()
    if kernel is not None and enabled():
        _wake_iopub_through_its_loop(kernel)


def _ask_once_per_cell(shell: Any) -> None:
    """What ipykernel and IPython work out twice for every cell, worked out once.

    For each ``execute_request``, ipykernel's ``do_execute`` transforms the cell (IPython's
    input transformers, which tokenize it twice) to ask whether it needs the asyncio runner,
    then calls ``shell.run_cell``, which transforms the same string again and asks the same
    question again (a ``compile`` of the whole cell each time); and it reads
    ``run_cell_async``'s signature with ``inspect`` to learn which arguments it takes. That
    is a tenth of a short cell's kernel CPU (``benchmarks/README.md``), and grows with the cell's
    length.

    The shell keeps the answer of its last transform and of its last question, for the very
    same string object (``is``, not ``==``), until the call that asks again or the end of
    the cell (``post_execute``); the signature's answer is kept for each function. Nothing
    is kept from one cell to the next, so a cell that changes the transformers or the
    shell's methods changes the next cell's answers, as before (idempotent)."""
    if getattr(shell, "_kernel_env_asks_once", False):
        return
    shell._kernel_env_asks_once = True
    _remember_within_the_cell(shell, "transform_cell", _raw_cell)
    _remember_within_the_cell(shell, "should_run_async", _transformed_cell)
    _remember_signatures()


def _remember_within_the_cell(
    shell: Any, name: str, argument_of: Callable[[tuple[Any, ...], dict[str, Any]], Any]
) -> None:
    """Wrap ``shell.<name>`` so that a second call with the same argument object (the one
    ``argument_of`` picks; ``None`` is never kept) in the same cell returns the first call's
    result. The call that hits forgets it; so does the end of the cell."""
    compute = getattr(shell, name)
    last: list[Any] = []  # [argument, result] of this cell's last call, or empty

    def remembered(*args: Any, **kwargs: Any) -> Any:
        argument = argument_of(args, kwargs)
        if last and last[0] is argument and argument is not None:
            result = last[1]
            last.clear()
            return result
        result = compute(*args, **kwargs)
        last[:] = [argument, result]
        return result

    setattr(shell, name, remembered)
    shell.events.register("post_execute", last.clear)


def _raw_cell(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("raw_cell", kwargs.get("cell"))


def _transformed_cell(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if kwargs.get("preprocessing_exc_tuple") is not None:
        return None  # the answer is "no" then, and is not kept
    return kwargs.get("transformed_cell")


def _remember_signatures() -> None:
    """ipykernel's ``_accepts_parameters(method, names)``, answered once per function."""
    try:
        from ipykernel import ipkernel
    except ImportError:  # an IPython shell without ipykernel
        return
    accepts = getattr(ipkernel, "_accepts_parameters", None)
    if accepts is None or getattr(accepts, "_kernel_env", False):
        return

    @functools.lru_cache(maxsize=64)
    def answer(function: Any, names: tuple[str, ...]) -> dict[str, bool]:
        return accepts(function, list(names))

    def accepts_parameters(method: Any, names: list[str]) -> dict[str, bool]:
        # A bound method is a new object each time: its function is what the signature is of.
        function = getattr(method, "__func__", method)
        if getattr(method, "__self__", None) is None or not callable(function):
            return accepts(method, names)
        try:
            return dict(answer(function, tuple(names)))
        except TypeError:  # an unhashable callable
            return accepts(method, names)

    accepts_parameters._kernel_env = True  # type: ignore[attr-defined]
    ipkernel._accepts_parameters = accepts_parameters


def _wake_iopub_through_its_loop(kernel: Any) -> None:
    """Hand work to ipykernel's iopub thread through its event loop's own wake-up.

    Everything the kernel sends on iopub (outputs, the status, each stream's flush) is a
    function for that thread to run. ipykernel queues it and wakes the thread with an empty
    message on a zmq socket of its own per sending thread, which the thread then reads
    through a ZMQStream: half of the iopub thread's CPU for a short cell (``benchmarks/README.md``).
    The thread's loop (tornado's, on asyncio) has a thread-safe ``add_callback`` that runs
    functions in the order given, as the queue did, and wakes the loop through its own pipe.
    As before, a thread that is not running (a subprocess forked by a cell) runs the
    function itself, and a function given once the loop has closed is dropped."""
    thread = getattr(kernel, "iopub_thread", None)
    if thread is None or not all(hasattr(thread, n) for n in ("schedule", "io_loop", "thread")):
        return  # not an ipykernel this knows

    def schedule(function: Callable[[], Any]) -> None:
        if thread.thread.is_alive():
            thread.io_loop.add_callback(function)
        else:
            function()

    thread.schedule = schedule
