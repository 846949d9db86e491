"""The kernel side of :class:`kernel_env.integrations.dspy.KernelInterpreter`: DSPy's tools and
``SUBMIT`` in an episode kernel.

The host loads this module into the kernel and calls :func:`prepare` (small variables, pasted
as a literal) or :func:`prepare_file` (large ones, staged in a file the host wrote) before each
of DSPy's ``execute`` calls; either parses everything before it changes anything, so a
preparation that fails leaves the session as it was. A tool is a stub here that asks the host
over the Jupyter stdin channel, as ``llm_query`` does, in the requests of
:mod:`kernel_env.inkernel.contract` (``DSPY_TOOL_TAG``); the host runs the tool and replies.
No host callable ever enters the kernel.

Standard library, IPython and the contract only, like :mod:`kernel_env.inkernel.extension`.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from typing import Any

from kernel_env.inkernel.contract import DSPY_TOOL_TAG, EXTENSION_MODULE

_NOTHING: Any = object()


class Submitted(BaseException):
    """Ends the cell at ``SUBMIT(...)`` (a BaseException: a user's ``except Exception`` must
    not swallow it)."""


class _Session:
    """What DSPy configured for the next cell."""

    def __init__(self) -> None:
        self.tools: list[str] = []
        self.output_fields: list[dict[str, Any]] | None = None
        self.final: Any = _NOTHING
        self.lock = threading.Lock()  # one stdin request at a time, whatever the thread


_session = _Session()


class _JSON:
    """Carries a value through the display formatter as exact JSON text."""

    def __init__(self, payload: Any) -> None:
        self._text = json.dumps(payload, default=repr)

    def __repr__(self) -> str:
        return self._text


def _shell() -> Any:
    from IPython import get_ipython

    return get_ipython()


def prepare(payload_json: str) -> None:
    """Bind the tools and SUBMIT, inject the variables, forget the last outcome."""
    payload = json.loads(payload_json)
    tools, variables = list(payload["tools"]), dict(payload.get("variables") or {})
    ns = _shell().user_ns
    for old in _session.tools:
        ns.pop(old, None)
    _session.tools = tools
    _session.output_fields = payload.get("output_fields")
    _session.final = _NOTHING
    _release_episode_helpers(_session.tools)
    for name in _session.tools:
        ns[name] = _tool(name)
    ns["SUBMIT"] = submit
    ns.update(variables)


def prepare_file(path: str) -> None:
    """:func:`prepare` with the payload the host staged at ``path``."""
    with open(path, encoding="utf-8") as staged:
        payload_json = staged.read()
    prepare(payload_json)


def _release_episode_helpers(names: list[str]) -> None:
    # The extension puts its own llm_query & co. back before each cell; DSPy's tools of the
    # same names must stay.
    episode_side = sys.modules.get(EXTENSION_MODULE)
    release: Callable[[list[str]], None] | None = getattr(episode_side, "release_helpers", None)
    if release is not None:
        release(names)


def _tool(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        request = DSPY_TOOL_TAG + json.dumps({"name": name, "args": args, "kwargs": kwargs})
        with _session.lock:
            raw = _shell().kernel.raw_input(request)
        reply = json.loads(raw)
        if not reply.get("ok"):
            raise RuntimeError(str(reply.get("error") or f"tool {name} failed"))
        return reply.get("value")

    call.__name__ = call.__qualname__ = name
    return call


def submit(*args: Any, **kwargs: Any) -> None:
    """End the run with the output fields' values (positional in field order, or by name)."""
    __tracebackhide__ = True
    fields = _session.output_fields
    if fields is None:
        if len(args) != 1 or kwargs:
            raise TypeError("SUBMIT requires one output value")
        _session.final = {"output": args[0]}
        raise Submitted
    names = [field["name"] for field in fields]
    if args and kwargs:
        raise TypeError("SUBMIT accepts positional or keyword values, not both")
    values = dict(zip(names, args, strict=False)) if args else dict(kwargs)
    if set(values) != set(names) or len(args) > len(names):
        raise TypeError(f"SUBMIT fields do not match the output fields: {', '.join(names)}")
    _session.final = values
    raise Submitted


def outcome() -> _JSON:
    """``{"submitted": bool, "value": ...}`` for the host (the contract's
    ``DSPY_OUTCOME_EXPRESSION``): SUBMIT's values, or the value of the last cell's bare last
    expression (``value`` left out when it had none), as JSON where it can be, else its
    ``repr``."""
    if _session.final is not _NOTHING:
        return _JSON({"submitted": True, "value": _jsonable(_session.final)})
    last = getattr(_shell(), "last_execution_result", None)
    value = getattr(last, "result", None)
    if value is None:
        return _JSON({"submitted": False})
    return _JSON({"submitted": False, "value": _value(value)})


def _value(value: Any) -> Any:
    """A bare expression's value as DSPy's own interpreters return it: itself if it is JSON,
    else its ``repr``."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return repr(value)
    return value


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        if isinstance(value, dict):
            return {str(k): _jsonable(v) for k, v in value.items()}
        return repr(value)
    return value
