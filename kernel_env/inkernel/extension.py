"""The code that runs *inside* an episode's IPython kernel, as an IPython extension.

Loaded at kernel start (``--ext kernel_env.inkernel.extension``) or by ``%load_ext
kernel_env``. It defines the helpers an agent's code sees (``context``, ``answer``, ``FINAL``,
``FINAL_VAR``, ``SHOW_VARS``, ``llm_query`` and friends), caps output inside the kernel, and
makes ``input()`` fail at once.

The kernel never holds credentials and needs no network route to the host: ``llm_query`` asks
the host through the Jupyter stdin channel (or, in a kernel a plain Jupyter frontend drives,
on the host's call socket), in the requests of :mod:`kernel_env.inkernel.contract`, which also
names the setup's metadata key and the state expression the host reads after each cell.

This module depends on the standard library, IPython and the contract only, so that its
source and the contract's can be sent to a remote kernel that lacks the package (it then
registers itself in ``sys.modules`` under the contract's ``EXTENSION_MODULE``).
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import functools
import getpass
import json
import os
import random
import reprlib
import socket
import sys
import termios
import threading
import time
from collections.abc import Callable
from typing import Any

# ``from ... import``, never ``import kernel_env.inkernel.contract``: a gateway's kernel
# without the package has the contract in sys.modules alone, without its parent packages.
from kernel_env.inkernel.contract import (
    CALL_SOCKET_ENV,
    DEFAULT_DISPLAY_CHARS,
    DEFAULT_DISPLAY_COUNT,
    DEFAULT_OUTPUT_CAP,
    EXTENSION_MODULE,
    PROBE_REPLY,
    RECORDED_MAGIC,
    REQUEST_TAG,
    SETUP_METADATA,
    failure_text,
    recorded_failure,
    take_recorded,
    unsent_marker,
)

# An episode kernel's input request to a host whose stdin socket has not connected yet is
# refused, and asked again this often, for this long (see _insist_on_a_stdin_peer).
_STDIN_RETRY = 0.002  # seconds
_STDIN_WAIT = 10.0
_TAIL_KEEP = 20_000  # chars kept from the end of an over-cap stream
_SNAPSHOT_MAX_VARS = 100
_SNAPSHOT_REPR_CHARS = 500
# A stream's flush this soon after a full one, with nothing written since, is skipped.
_FLUSH_AGAIN = 0.005  # seconds
# How long a cell's last flush waits for what was written to the process's descriptor to be
# read by ipykernel's thread that watches it (a writer that never stops costs this a cell).
_DRAIN_WAIT = 0.25  # seconds

HELPER_NAMES = (
    "FINAL",
    "FINAL_VAR",
    "SHOW_VARS",
    "llm_query",
    "llm_query_batched",
    "llm_batch",
    "rlm_query",
    "rlm_query_batched",
)


class HostCallError(RuntimeError):
    """A helper failed on the host side (LLM error, budget exhausted, bad request)."""


class _Episode:
    """Per-kernel state the helpers share; one instance per loaded extension."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.output_cap = DEFAULT_OUTPUT_CAP
        self.display_cap = _DisplayCap()
        self.final: str | None = None
        self.restored: list[str] = []
        self.unsent: dict[str, int] = {}  # chars of the last cell's streams not sent, by name
        self.helpers: dict[str, Any] = {}
        self.host_lock = threading.Lock()
        # Notebook modes, when no episode host answers: a model called from the kernel itself
        # (register_llm, or KERNEL_ENV_LLM_* variables), else recorded (prompt, response) pairs.
        self.local_llm: Callable[[str], str] | None = None
        self.replay: list[list[str]] | None = None
        self.setup_params: dict[str, Any] = {}
        # The token of the last setup a request carried, and why it failed (see state()).
        self.setup_token: str | None = None
        self.setup_error: str | None = None
        # True once a kernel_env host set up an episode here: only then does llm_query ask over
        # stdin (in a user's notebook that would pop an input box in the frontend).
        self.hosted = False
        # A provisioned kernel's helpers ask on this socket instead (the contract's
        # CALL_SOCKET_ENV); its frontend's stdin, and so input(), stays the person's.
        self.call_socket: str | None = None

    # -- the host call over the stdin channel ----------------------------------------------

    def call_host(self, op: str, **args: Any) -> Any:
        __tracebackhide__ = True
        if self.local_llm is not None:
            return _call_local(self.local_llm, args)
        if self.replay is not None:
            return self._replay(op, args)
        request = REQUEST_TAG + json.dumps({"op": op, "args": args})
        if self.call_socket is not None:
            raw = _ask_socket(self.call_socket, op, request)
        elif self.hosted:
            raw = self._ask_stdin(op, request)
        else:
            raise HostCallError(
                f"{op}: no model is configured in this notebook. Call "
                "kernel_env.inkernel.extension.register_llm(fn), or set "
                "KERNEL_ENV_LLM_BASE_URL and KERNEL_ENV_LLM_MODEL (and KERNEL_ENV_LLM_API_KEY) "
                "before %load_ext kernel_env."
            )
        try:
            reply = json.loads(raw)
        except ValueError as exc:
            raise HostCallError(f"{op}: the host sent an unreadable reply") from exc
        if not reply.get("ok"):
            raise HostCallError(str(reply.get("error") or f"{op} failed"))
        return reply.get("result")

    def _ask_stdin(self, op: str, request: str) -> str:
        kernel = getattr(self.shell, "kernel", None)
        raw_input = getattr(kernel, "raw_input", None)
        if raw_input is None:
            raise HostCallError(f"{op}: no kernel_env host is attached to this kernel")
        # Concurrent input() from several threads corrupts the stdin socket: one at a time.
        with self.host_lock:
            try:
                raw = raw_input(request)
                while raw == PROBE_REPLY:  # not ours: ask again
                    raw = raw_input(request)
            except Exception as exc:  # StdinNotImplementedError: frontend has no stdin
                raise HostCallError(f"{op}: the frontend does not answer input requests") from exc
        return str(raw)

    def _replay(self, op: str, args: dict[str, Any]) -> Any:
        """A call answered from the notebook's recording; a recorded failure fails the same
        way (a single call raises, a batch answers ``Error: ...`` in its place)."""
        if "prompts" not in args:
            answer = self._replay_one(op, args["prompt"])
            if (failure := recorded_failure(answer)) is not None:
                raise HostCallError(failure_text(failure, batched=False))
            return answer
        answers = [self._replay_one(op, p) for p in args["prompts"]]
        return [
            answer
            if (failure := recorded_failure(answer)) is None
            else failure_text(failure, batched=True)
            for answer in answers
        ]

    def _replay_one(self, op: str, prompt: str) -> Any:
        response = take_recorded(self.replay or [], prompt)
        if response is not None:
            return response
        raise HostCallError(f"{op}: no recorded response for this prompt: {prompt[:80]!r}")

    def check_prompt(self, prompt: Any) -> str:
        """The prompt as text, refused here (not sent) when over the host's limit; the host
        checks again, this only saves sending megabytes to be refused."""
        __tracebackhide__ = True
        text = str(prompt)
        limit = self.setup_params.get("max_prompt_chars")
        if self.hosted and isinstance(limit, int) and len(text) > limit:
            raise HostCallError(
                f"prompt of {len(text):,} chars exceeds the limit of {limit:,}; split it "
                "(llm_query_batched) or shorten it"
            )
        return text

    # -- per-cell bookkeeping ----------------------------------------------------------------

    def restore_helpers(self) -> None:
        """Put back helper functions that user code rebound or deleted (reported in the next
        state). ``context`` and ``answer`` are the user's data, as upstream: never restored."""
        ns = self.shell.user_ns
        for name, helper in self.helpers.items():
            if ns.get(name) is not helper:
                ns[name] = helper
                self.restored.append(name)

    def state(self) -> dict[str, Any]:
        ns = self.shell.user_ns
        hidden = self.shell.user_ns_hidden
        names = sorted(
            k for k in ns if not k.startswith("_") and k not in hidden and k not in self.helpers
        )
        answer = ns.get("answer")
        state = {
            "final": self.final,
            "answer": _answer_state(answer),
            "names": names,
            "snapshot": _snapshot(ns, names),
            "restored": self.restored,
            "setup": self.setup_token,
        }
        if self.setup_error is not None:
            state["setup_error"] = self.setup_error
        if self.unsent:
            state["unsent"] = self.unsent
        self.final = None
        self.restored = []
        self.unsent = {}
        return state


def _answer_state(answer: Any) -> dict[str, Any] | None:
    if not isinstance(answer, dict):
        return None
    return {"content": str(answer.get("content", "")), "ready": bool(answer.get("ready"))}


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = _repr.maxlong = _SNAPSHOT_REPR_CHARS


def _snapshot(ns: dict[str, Any], names: list[str]) -> dict[str, str]:
    out = {}
    for name in names[:_SNAPSHOT_MAX_VARS]:
        if name == "context":
            continue  # the host already knows it; a repr of 100 MB is not a summary
        try:
            out[name] = _repr.repr(ns[name])[:_SNAPSHOT_REPR_CHARS]
        except Exception as exc:  # a user __repr__ may raise anything
            out[name] = f"<repr failed: {type(exc).__name__}>"
    return out


class _JSONState:
    """Carries the state through the display formatter as exact JSON text."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self._text = json.dumps(payload, default=str)

    def __repr__(self) -> str:
        return self._text


def _call_local(fn: Callable[[str], str], args: dict[str, Any]) -> Any:
    if "prompts" not in args:
        return str(fn(args["prompt"]))

    def one(prompt: str) -> str:
        try:
            return str(fn(prompt))
        except Exception as exc:
            return f"Error: {exc}"

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(one, args["prompts"]))


def _openai_compatible(base_url: str, model: str, api_key: str | None) -> Callable[[str], str]:
    """A minimal chat-completions call (stdlib only), for a user's own notebook."""
    import urllib.request

    def complete(prompt: str) -> str:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}]})
        request = urllib.request.Request(
            base_url.rstrip("/") + "/chat/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json"},
        )
        if api_key:
            request.add_header("Authorization", f"Bearer {api_key}")
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.load(response)
        return str(reply["choices"][0]["message"]["content"])

    return complete


_ROOM_PATIENCE = 5.0  # seconds a call waits for room on the host's call socket


def _ask_socket(path: str, op: str, request: str) -> str:
    """The reply to ``request`` from the host's call socket (see the contract). A connection
    closed unanswered is the host's refusal for room (as many connections as it serves at
    once are open: this kernel's own, or ones it has closed that the host has not seen close
    yet): asked again, for a few seconds."""
    deadline, pause = time.monotonic() + _ROOM_PATIENCE, 0.002
    while not (reply := _ask_socket_once(path, op, request)):
        if time.monotonic() > deadline:
            raise HostCallError(
                f"{op}: the kernel_env host had no room for this call for {_ROOM_PATIENCE:g} s "
                "(too many connections to its call socket are open)"
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.1)
    return reply


def _ask_socket_once(path: str, op: str, request: str) -> str:
    """The reply, or "" when the host closed the connection unanswered."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            sock.sendall(request.encode() + b"\n")
            chunks = []
            while data := sock.recv(1 << 16):
                chunks.append(data)
    except (BrokenPipeError, ConnectionResetError):  # closed before it read the request
        return ""
    except OSError as exc:
        raise HostCallError(f"{op}: the kernel_env host does not answer: {exc}") from exc
    return b"".join(chunks).decode("utf-8", "replace").removesuffix("\n")


def release_helpers(names: list[str]) -> None:
    """Stop putting these helpers back before each cell: an integration binds its own (DSPy's
    ``llm_query`` tool, for one)."""
    if _episode is not None:
        for name in names:
            _episode.helpers.pop(name, None)


def register_llm(fn: Callable[[str], str] | None) -> None:
    """Answer ``llm_query`` & co. in this kernel with ``fn(prompt) -> str`` (None: unset)."""
    if _episode is None:
        raise RuntimeError("load the extension first: %load_ext kernel_env")
    _episode.local_llm = fn


def _llm_from_environ() -> Callable[[str], str] | None:
    base_url = os.environ.get("KERNEL_ENV_LLM_BASE_URL")
    model = os.environ.get("KERNEL_ENV_LLM_MODEL")
    if not (base_url and model):
        return None
    return _openai_compatible(base_url, model, os.environ.get("KERNEL_ENV_LLM_API_KEY"))


# -- output cap ---------------------------------------------------------------------------


def _drain_watched_descriptor(stream: Any) -> None:
    """Wait (at most :data:`_DRAIN_WAIT`) until the pipe behind the process's descriptor 1
    or 2 is empty: ipykernel's thread that watches it has read what ``os.write`` or a
    subprocess put there, and (given the interpreter a moment) written it into ``stream``.
    Else, on a loaded machine, the thread reads it after the cell's idle, and it is lost."""
    pipe = getattr(stream, "_fid", None)
    if pipe is None or not getattr(stream, "_should_watch", False):
        return
    deadline = time.monotonic() + _DRAIN_WAIT
    waited = False
    unread = bytearray(4)
    while True:
        try:
            fcntl.ioctl(pipe, termios.FIONREAD, unread)
        except OSError:
            return
        if not int.from_bytes(unread, sys.byteorder) or time.monotonic() > deadline:
            break
        waited = True
        time.sleep(0.001)
    if waited:
        time.sleep(0.001)  # the thread, past its read, takes the GIL to write what it read


class _CappedStream:
    """Wraps the kernel's stdout/stderr: at most ``cap`` chars a cell cross the wire, then only
    the tail is kept and sent with a marker when the cell ends (a 1 GB print stays in the kernel).
    """

    def __init__(self, inner: Any, episode: _Episode, name: str) -> None:
        self._inner = inner
        self._episode = episode
        self._name = name
        self._closed = False
        self._flushed = 0.0  # when the inner stream's last full flush ended
        self.reset()

    def reset(self) -> None:
        self._written = 0
        self._dropped = 0
        self._tail: list[str] = []
        self._tail_len = 0

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        size = len(text)
        room = max(self._episode.output_cap - self._written, 0)
        if room:
            head = text[:room] if size > room else text
            self._inner.write(head)
            self._written += len(head)
        if size > room:
            # Slice only the ends: copying the rest of a 1 GB string costs seconds.
            self._dropped += size - room
            self._keep_tail(text[max(room, size - _TAIL_KEEP) :])
        return size

    def _keep_tail(self, text: str) -> None:
        # Amortized O(1) a write: ten million small prints must not copy the tail each time.
        self._tail.append(text)
        self._tail_len += len(text)
        if self._tail_len > 2 * _TAIL_KEEP:
            joined = "".join(self._tail)[-_TAIL_KEEP:]
            self._tail, self._tail_len = [joined], len(joined)

    def finish_cell(self) -> None:
        if self._dropped:
            tail = "".join(self._tail)[-_TAIL_KEEP:]
            unsent = self._dropped - len(tail)
            self._episode.unsent[self._name] = unsent  # the host reports the printed size
            self._inner.write(unsent_marker(unsent))
            self._inner.write(tail)
            self._inner.flush()
        self.reset()
        self._flushed = 0.0  # the next flush, the reply's, is the barrier: never skipped

    def flush(self) -> None:
        # ipykernel's flush hands the stream to its IO thread and waits for it (two thread
        # wake-ups), and a request flushes each stream twice: before its reply and before its
        # idle status. The first is the barrier that lets the thread capturing the process's
        # descriptor deliver what a subprocess wrote (it waits for the GIL meanwhile); the
        # second finds nothing new unless something was written since, which ipykernel marks
        # before write returns (a stream without the mark is always flushed).
        if self._flushed == 0.0:  # the barrier: what the descriptor holds is read first
            _drain_watched_descriptor(self._inner)
        if getattr(self._inner, "_flush_pending", True) or (
            time.monotonic() - self._flushed > _FLUSH_AGAIN
        ):
            self._inner.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        # User code closing sys.stdout must not break every later cell.
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _install_streams(episode: _Episode) -> None:
    for name in ("stdout", "stderr"):
        current = getattr(sys, name)
        if isinstance(current, _CappedStream) and not current.closed:
            continue
        inner = episode.__dict__.setdefault(f"_{name}_inner", current)
        # ipykernel told the stream which request it serves only if it was installed then;
        # without this, the output goes out under the previous cell's msg_id.
        kernel = getattr(episode.shell, "kernel", None)
        if kernel is not None and hasattr(inner, "set_parent"):
            inner.set_parent(kernel.get_parent("shell"))
        setattr(sys, name, _CappedStream(inner, episode, name))


def _finish_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, _CappedStream):
            stream.finish_cell()
    if _episode is not None:
        _finish_display(_episode)


def _cap_display(shell: Any, episode: _Episode) -> None:
    """Cap string values of rich outputs too (``'x' * 10**9`` as a cell's last expression)."""
    formatter = shell.display_formatter
    original = formatter.format

    def format(obj: Any, include: Any = None, exclude: Any = None) -> Any:
        if type(obj) is _JSONState:  # the host's state, after every cell: its text is all
            data, metadata = {"text/plain": repr(obj)}, {}  # (not a try of each formatter)
        else:
            data, metadata = original(obj, include=include, exclude=exclude)
        cap = episode.output_cap
        for mime, value in data.items():
            if isinstance(value, str) and len(value) > cap:
                data[mime] = value[:cap] + f"\n... (kernel_env: {len(value) - cap} chars cut) ..."
        return data, metadata

    formatter.format = format


class _DisplayCap:
    """Counts one cell's rich outputs; past ``count`` outputs or ``chars`` chars, the rest are
    not sent, and one marker output at the end of the cell says how many were dropped."""

    def __init__(self) -> None:
        self.count = DEFAULT_DISPLAY_COUNT
        self.chars = DEFAULT_DISPLAY_CHARS
        self.reset()

    def reset(self) -> None:
        self.sent = self.sent_chars = self.dropped = self.dropped_chars = 0

    def admit(self, data: Any) -> bool:
        size = sum(len(v) if isinstance(v, str) else len(str(v)) for v in (data or {}).values())
        if self.sent < self.count and self.sent_chars + size <= self.chars:
            self.sent += 1
            self.sent_chars += size
            return True
        self.dropped += 1
        self.dropped_chars += size
        return False

    def marker(self) -> str | None:
        if not self.dropped:
            return None
        return (
            f"[kernel_env: {self.dropped} rich output(s) ({self.dropped_chars:,} chars) not "
            f"sent: a cell may send {self.count} rich outputs and {self.chars:,} chars of "
            "them]"
        )


def _cap_publish(shell: Any, episode: _Episode) -> None:
    """Bound the rich outputs one cell sends (``display(HTML(...))`` in a loop)."""
    publisher = getattr(shell, "display_pub", None)
    if publisher is None:
        return
    original = publisher.publish

    def publish(data: Any, metadata: Any = None, *args: Any, **kwargs: Any) -> None:
        if episode.display_cap.admit(data):
            original(data, metadata, *args, **kwargs)

    def clear_output(wait: bool = False) -> None:
        # The front end drops what was cleared: a redrawn plot may redraw forever.
        episode.display_cap.sent = episode.display_cap.sent_chars = 0
        clear(wait)

    clear = publisher.clear_output
    publisher.publish = publish
    publisher.clear_output = clear_output
    episode.__dict__["_publish"] = original


def _finish_display(episode: _Episode) -> None:
    marker = episode.display_cap.marker()
    episode.display_cap.reset()
    publish = episode.__dict__.get("_publish")
    if marker is not None and publish is not None:
        publish({"text/plain": marker}, {"kernel_env": {"dropped": True}})


# -- input() guard ------------------------------------------------------------------------

_NO_INPUT = (
    "{} is not available in a kernel_env episode: no one is there to type an answer. "
    "Put the data in a variable, or use llm_query() to ask a model."
)


def _no_input(prompt: object = "") -> str:
    __tracebackhide__ = True  # IPython leaves this frame out of the traceback
    raise EOFError(_NO_INPUT.format("input()"))


def _no_getpass(prompt: str = "Password: ", stream: Any = None) -> str:
    __tracebackhide__ = True
    raise EOFError(_NO_INPUT.format("getpass()"))


# -- the helpers --------------------------------------------------------------------------


def _make_helpers(episode: _Episode) -> dict[str, Callable[..., Any]]:
    ns = episode.shell.user_ns

    def FINAL(value: Any) -> str:
        """End the episode with `value` as the final answer."""
        episode.final = str(value)
        return episode.final

    def FINAL_VAR(name: Any) -> str:
        """End the episode with the value of the variable named `name` as the final answer."""
        if isinstance(name, str) and name.strip().isidentifier():
            key = name.strip()
            if key not in ns:
                raise NameError(f"FINAL_VAR: there is no variable named {key!r}")
            value = ns[key]
        else:
            value = name  # FINAL_VAR(x) with the value itself: take it
        episode.final = str(value)
        return episode.final

    def SHOW_VARS() -> dict[str, str]:
        """The variables defined so far, with their types."""
        hidden = episode.shell.user_ns_hidden
        return {
            k: type(v).__name__
            for k, v in ns.items()
            if not k.startswith("_") and k not in hidden and k not in episode.helpers
        }

    def llm_query(prompt: str, model: str | None = None) -> str:
        """Ask a language model; returns its answer as a string."""
        return str(episode.call_host("llm_query", prompt=episode.check_prompt(prompt), model=model))

    def llm_query_batched(prompts: list[str], model: str | None = None) -> list[str]:
        """Ask a model many prompts concurrently. Order is kept; a failed item is "Error: ..."."""
        prompts = [str(p) for p in prompts]
        if not prompts:
            return []
        return list(episode.call_host("llm_query_batched", prompts=prompts, model=model))

    def rlm_query(prompt: str, model: str | None = None) -> str:
        """Ask a recursive sub-agent. Without an agent configured on the host, this is a plain
        llm_query."""
        return str(episode.call_host("rlm_query", prompt=episode.check_prompt(prompt), model=model))

    def rlm_query_batched(prompts: list[str], model: str | None = None) -> list[str]:
        """rlm_query over many prompts concurrently; order kept, failures as "Error: ..."."""
        prompts = [str(p) for p in prompts]
        if not prompts:
            return []
        return list(episode.call_host("rlm_query_batched", prompts=prompts, model=model))

    batched, rlm_batched = _raised_here(llm_query_batched), _raised_here(rlm_query_batched)
    return {
        "FINAL": FINAL,
        "FINAL_VAR": FINAL_VAR,
        "SHOW_VARS": SHOW_VARS,
        "llm_query": _raised_here(llm_query),
        "llm_query_batched": batched,
        "llm_batch": batched,
        "rlm_query": _raised_here(rlm_query),
        "rlm_query_batched": rlm_batched,
    }


def _raised_here(helper: Callable[..., Any]) -> Callable[..., Any]:
    """``helper`` raising its host-side failures from one frame, which the shell's handler
    (:func:`_show_host_call_error`) leaves out: the model's traceback ends at its own line."""

    @functools.wraps(helper)
    def model_facing(*args: Any, **kwargs: Any) -> Any:
        try:
            return helper(*args, **kwargs)
        except HostCallError as exc:
            raise HostCallError(str(exc)) from None

    return model_facing


def _show_host_call_error(
    shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: int | None = None
) -> list[str]:
    """The shell's handler of :class:`HostCallError`: the traceback without kernel_env's own
    frames (which name its lines and where it is installed, nothing the model can act on)."""
    shell.showtraceback((etype, value, _before_this_module(tb)), tb_offset=tb_offset)
    return []  # shown above: IPython shows nothing of what a handler returns


def _before_this_module(tb: Any) -> Any:
    """``tb`` cut before its first frame in this module (the model's code calls the helpers)."""
    first, previous = tb, None
    while tb is not None and tb.tb_frame.f_code.co_filename != __file__:
        previous, tb = tb, tb.tb_next
    if previous is not None:
        previous.tb_next = None
    return first


# -- extension entry points ---------------------------------------------------------------

_episode: _Episode | None = None


def load_ipython_extension(shell: Any) -> None:
    """An episode kernel's extension (``--ext=kernel_env.inkernel.extension``): the helpers, and
    input requests that wait for the host's stdin socket rather than get lost."""
    already = _episode is not None and _episode.shell is shell
    install(shell)
    kernel = getattr(shell, "kernel", None)
    if not already and kernel is not None:
        _insist_on_a_stdin_peer(kernel)
        _take_setup_from_requests(kernel)


def install(shell: Any) -> None:
    """Install the helpers into ``shell`` (idempotent)."""
    global _episode
    if _episode is not None and _episode.shell is shell:
        return
    episode = _episode = _Episode(shell)
    sys.modules.setdefault(EXTENSION_MODULE, sys.modules[__name__])
    episode.helpers = _make_helpers(episode)
    shell.push(episode.helpers, interactive=False)  # hidden from %who
    shell.user_ns.setdefault("context", "")
    shell.user_ns.setdefault("answer", {"content": "", "ready": False})
    _show(shell, "context", "answer")
    _install_streams(episode)
    _cap_display(shell, episode)
    _cap_publish(shell, episode)
    shell.register_magic_function(
        _recorded_cell, magic_kind="cell", magic_name=RECORDED_MAGIC.removeprefix("%%")
    )
    shell.events.register("pre_run_cell", _pre_run_cell)
    shell.events.register("post_execute", _finish_streams)
    shell.set_custom_exc((HostCallError,), _show_host_call_error)
    # A user's own notebook may name an endpoint; episode kernels never see these variables.
    episode.local_llm = _llm_from_environ()
    episode.call_socket = os.environ.get(CALL_SOCKET_ENV) or None


def _take_setup_from_requests(kernel: Any) -> None:
    """Apply the episode's setup an ``execute_request`` carries in its metadata
    (``SETUP_METADATA``), before its code runs, whatever the code (an empty cell included).

    A host that resets an episode sends its setup with the episode's first request rather
    than as a cell of its own: a cell is a round trip and CPU, the kernel's and the host's,
    in an episode of a few steps. Each setup carries a token, applied once: a request that
    carries it again (the host asking for the state after a failed cell) does not set the
    episode up a second time. ``state()`` names the last token applied, or why
    it failed."""
    do_execute = getattr(kernel, "do_execute", None)
    get_parent = getattr(kernel, "get_parent", None)  # ipykernel 6 and later
    if do_execute is None or get_parent is None or getattr(do_execute, "_kernel_env_setup", False):
        return  # the host then sends the setup as a cell

    @functools.wraps(do_execute)  # ipykernel reads its signature for optional arguments
    def do_execute_after_setup(*args: Any, **kwargs: Any) -> Any:
        carried = (get_parent("shell") or {}).get("metadata", {}).get(SETUP_METADATA)
        if isinstance(carried, str):
            _setup_once(carried)
        return do_execute(*args, **kwargs)

    do_execute_after_setup._kernel_env_setup = True  # type: ignore[attr-defined]
    kernel.do_execute = do_execute_after_setup


def _setup_once(params_json: str) -> None:
    episode = _episode
    if episode is None:
        return  # state() says the extension is not loaded
    try:
        params = json.loads(params_json)
        token = params.get("token")
        if token is not None and token == episode.setup_token:
            return
        _set_up(params)
    except Exception as exc:
        episode.setup_error = f"{type(exc).__name__}: {exc}"
    else:
        episode.setup_token, episode.setup_error = token, None


def after_fork() -> None:
    """In a live fork's copy, once ipykernel's streams are its own: wrap those (the parent's
    are abandoned) and drop a lock a parent's thread may have held at the fork."""
    episode = _episode
    if episode is None:
        return
    episode.host_lock = threading.Lock()
    for name in ("stdout", "stderr"):
        episode.__dict__.pop(f"_{name}_inner", None)
    _install_streams(episode)
    kernel = getattr(episode.shell, "kernel", None)
    _refuse_unseen_stdin_peers(kernel)


def _insist_on_a_stdin_peer(kernel: Any) -> None:
    """The kernel's stdin socket is a ROUTER, which drops a message to a peer it has not
    seen: an input request sent before the host's stdin socket connected was lost, and a
    first cell calling ``llm_query`` waited out the step timeout. Here the socket refuses
    such a send instead (``ZMQ_ROUTER_MANDATORY``: EHOSTUNREACH), and the kernel's input
    requests (``input``, ``getpass``, ``llm_query``) ask again every 2 ms until the host's
    socket is there, for at most 10 s."""
    if not _refuse_unseen_stdin_peers(kernel):
        return
    for name in ("raw_input", "getpass"):
        method = getattr(kernel, name, None)
        if method is not None:
            setattr(kernel, name, _until_stdin_connects(method))


def _refuse_unseen_stdin_peers(kernel: Any) -> bool:
    socket = getattr(kernel, "stdin_socket", None)
    if socket is None:
        return False
    import zmq

    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return True


def _until_stdin_connects(ask: Callable[..., str]) -> Callable[..., str]:
    @functools.wraps(ask)
    def asking(*args: Any, **kwargs: Any) -> str:
        __tracebackhide__ = True
        deadline = time.monotonic() + _STDIN_WAIT
        while True:
            try:
                return ask(*args, **kwargs)
            except Exception as exc:
                if getattr(exc, "errno", None) != errno.EHOSTUNREACH:
                    raise
                if time.monotonic() > deadline:
                    raise RuntimeError("no kernel_env host is connected to stdin") from exc
            time.sleep(_STDIN_RETRY)

    return asking


def _recorded_cell(line: str, cell: str) -> None:
    """``%%kernel_env_recorded interrupted|restarted``: a step of an exported episode that
    timed out or killed its kernel. It is not run again (it would hang or crash); after
    ``restarted`` the namespace is emptied as the episode's kernel restart did."""
    how = "killed its kernel" if line.strip() == "restarted" else "timed out"
    print(f"[kernel_env] this step {how} when it was recorded; it is not run again")
    if line.strip() == "restarted" and _episode is not None:
        _episode.shell.reset(new_session=False)
        _episode.shell.push(_episode.helpers, interactive=False)
        _apply_setup(_episode.setup_params)


def _show(shell: Any, *names: str) -> None:
    """Make names visible to ``%who`` and the namespace summary (IPython hides whatever exists
    when the kernel finishes starting, and the extension loads before that)."""
    for name in names:
        shell.user_ns_hidden.pop(name, None)


def _pre_run_cell(info: Any = None) -> None:
    if _episode is None:
        return
    _episode.restore_helpers()
    _install_streams(_episode)
    if _episode.hosted:
        # An episode's host answers only its own stdin requests: ipykernel rebinds input and
        # getpass to the frontend before each cell; take them back. (In a user's own notebook
        # input() keeps working.)
        builtins.input = _no_input
        getpass.getpass = _no_getpass


def state() -> _JSONState:
    """Episode state after a cell, for the host (the contract's ``STATE_EXPRESSION``)."""
    if _episode is None:
        return _JSONState({"error": "kernel_env extension not loaded"})
    return _JSONState(_episode.state())


def setup(params_json: str) -> None:
    """Start an episode in this kernel, with JSON parameters: what a kernel_env host's first
    request of an episode carries (see ``_take_setup_from_requests``; ``token`` names it).

    ``context_path``: a file to read ``context`` from, or ``context``: the text; ``seed``;
    ``output_cap``; ``replay``: recorded ``[prompt, response]`` pairs that answer ``llm_query``
    offline (an exported notebook re-run with no model); ``quiet``: send only the iopub
    messages a kernel_env host reads (see ``_publish_only_what_the_host_reads``).
    """
    _set_up(json.loads(params_json))


def _set_up(params: dict[str, Any]) -> None:
    """``setup``, from the parsed parameters."""
    params = {k: v for k, v in params.items() if k != "token"}
    quiet = bool(params.pop("quiet", False))
    _apply_setup(params)
    if _episode is not None:
        _episode.hosted = True
        if quiet:
            _publish_only_what_the_host_reads(getattr(_episode.shell, "kernel", None))


def _publish_only_what_the_host_reads(kernel: Any) -> None:
    """No ``busy`` status and no ``execute_input`` broadcast. A kernel_env host reads a cell's
    outputs, its ``idle`` status and its reply; the other two are half of a trivial cell's
    messages, each a hop through ipykernel's iopub thread and a message for the host to take
    in (CPU every cell, the kernel's and the host's). A notebook's kernel, or one a
    gateway watches (its culling reads ``busy``), keeps the whole protocol: only a host that
    owns the kernel's iopub asks for this."""
    if kernel is None or getattr(kernel, "_kernel_env_quiet", False):
        return
    publish_status = getattr(kernel, "_publish_status", None)
    if publish_status is None or not hasattr(kernel, "_publish_execute_input"):
        return  # an ipykernel this does not know: it sends the whole protocol, as before

    def _publish_status(status: str, *args: Any, **kwargs: Any) -> None:
        if status != "busy":
            publish_status(status, *args, **kwargs)

    kernel._publish_status = _publish_status
    kernel._publish_execute_input = lambda *args, **kwargs: None
    kernel._kernel_env_quiet = True


def _apply_setup(params: dict[str, Any]) -> None:
    if _episode is None:
        raise RuntimeError("kernel_env extension not loaded")
    _episode.setup_params = {k: v for k, v in params.items() if k != "replay"}
    ns = _episode.shell.user_ns
    if "context_path" in params:
        with open(params["context_path"], encoding="utf-8") as f:
            ns["context"] = f.read()
    elif "context" in params:
        ns["context"] = params["context"]
    ns["answer"] = {"content": "", "ready": False}
    _show(_episode.shell, "context", "answer")
    _episode.output_cap = int(params.get("output_cap", DEFAULT_OUTPUT_CAP))
    _episode.display_cap.count = int(params.get("display_count", DEFAULT_DISPLAY_COUNT))
    _episode.display_cap.chars = int(params.get("display_chars", DEFAULT_DISPLAY_CHARS))
    if "replay" in params:
        _episode.replay = [list(pair) for pair in params["replay"]]
    _episode.final = None
    if params.get("seed") is not None:
        random.seed(params["seed"])
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(params["seed"])


def setup_notebook(**params: Any) -> None:
    """The setup cell of an exported notebook: ``setup`` with keyword arguments; relative paths
    are read from the notebook's directory (nbclient and Jupyter run cells there)."""
    _apply_setup(params)


def lookup(name: str) -> _JSONState:
    """``str()`` of a user variable, for a FINAL_VAR printed rather than called."""
    ns = _episode.shell.user_ns if _episode else {}
    if name not in ns:
        return _JSONState({"found": False})
    return _JSONState({"found": True, "value": str(ns[name])})
