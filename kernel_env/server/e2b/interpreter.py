"""E2B's code interpreter API (the sandbox's port 49999): ``POST /execute`` and the contexts.

``/execute`` streams one JSON document a line, as E2B's server does: ``stdout`` / ``stderr``
(with a timestamp), ``result`` (a MIME bundle spread over E2B's fields: ``text``, ``html``,
``png``, ``json``, ... and ``is_main_result`` for the cell's value), ``error`` (name, value,
traceback), ``number_of_executions``, then ``end_of_execution``. The cell is a step of the
sandbox's episode, so it is in the episode's record and its notebook, and ``llm_query``
works in it.

The default context is the sandbox's kernel; a context made with ``create_code_context`` is
a kernel of its own (its own session), so unlike E2B's contexts it does not share the
default context's files. A context's language is one of :data:`LANGUAGES` (E2B's names) whose
kernel the server offers (``--kernels``); ``run_code(language=...)`` runs in that language's
default context, made at its first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Send

from kernel_env.errors import KernelEnvError, LanguageRefused, SessionError
from kernel_env.models import REPLAction
from kernel_env.server.e2b.door import sandbox_in
from kernel_env.server.e2b.failures import refused, step_failure
from kernel_env.server.e2b.kernelcalls import set_envs
from kernel_env.server.e2b.sandboxes import UNLIMITED_EPISODE, Sandbox, Sandboxes
from kernel_env.server.sessions import Session, SessionManager

__all__ = ["JUPYTER_PORT", "ROUTES", "e2b_output", "interpreter_app"]

log = logging.getLogger(__name__)

JUPYTER_PORT = "49999"
HOME = "/home/user"  # E2B's default cwd, reported for contexts
# E2B's language names -> the kernel that runs them (kernel_env.languages).
LANGUAGES = {
    "python": "python3",
    "python3": "python3",
    "r": "ir",
    "bash": "bash",
    "javascript": "deno",
    "js": "deno",
    "typescript": "deno",
    "ts": "deno",
}

# MIME type -> E2B's Result field; what is not here goes to ``extra``.
_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


def e2b_output(event: dict[str, Any]) -> dict[str, Any] | None:
    """E2B's line for one output event (:mod:`kernel_env.streaming`), or None."""
    kind = event.get("output_type")
    if kind == "stream":
        name = event.get("name")
        if name not in ("stdout", "stderr"):
            return None
        return {"type": name, "text": event.get("text") or "", "timestamp": _now()}
    if kind in ("display_data", "execute_result"):
        return _result(dict(event.get("data") or {}), kind == "execute_result")
    if kind == "error":
        return {
            "type": "error",
            "name": event.get("ename") or "",
            "value": event.get("evalue") or "",
            "traceback": "\n".join(event.get("traceback") or []),
        }
    return None


def _result(bundle: dict[str, Any], main: bool) -> dict[str, Any]:
    line: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in bundle.items():
        field = _FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            line[field] = value
    text = line.get("text")
    # E2B shows a string's value, not its repr: 'abc' -> abc.
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        line["text"] = text[1:-1]
    if extra:
        line["extra"] = extra
    return line


def _now() -> int:
    return time.time_ns()  # the SDK's OutputMessage.timestamp: nanoseconds since the epoch


class Contexts:
    """A sandbox's extra contexts: each a session of its own, closed with the sandbox; and
    each language's default context (by kernel name), made by ``run_code(language=...)``."""

    def __init__(self) -> None:
        self.by_sandbox: dict[str, dict[str, tuple[Session, str, str]]] = {}
        self.defaults: dict[str, dict[str, str]] = {}  # sandbox id -> kernel -> context id

    def of(self, sandbox: Sandbox) -> dict[str, tuple[Session, str, str]]:
        return self.by_sandbox.setdefault(sandbox.id, {})

    def default(self, sandbox: Sandbox, kernel: str) -> Session | None:
        found = self.of(sandbox).get(self.defaults.get(sandbox.id, {}).get(kernel, ""))
        return found[0] if found is not None and found[0].closed is None else None


def _kernel_of(language: Any) -> str:
    kernel = LANGUAGES.get(str(language).lower())
    if kernel is None:
        raise LanguageRefused(
            f"language {language!r} is not served here; one of {', '.join(sorted(LANGUAGES))}"
        )
    return kernel


def interpreter_app(sandboxes: Callable[[], Sandboxes]) -> Starlette:
    """The code interpreter's app: :data:`ROUTES`, over the server's sandboxes (the one a
    request is for is the one :class:`~.door.E2BDoor` checked)."""
    app = Starlette(routes=ROUTES)
    app.state.sandboxes = sandboxes
    app.state.contexts = Contexts()
    return app


def _registry(request: Request) -> Sandboxes:
    registry: Sandboxes = request.app.state.sandboxes()
    return registry


async def execute(request: Request) -> Response:
    sandbox = sandbox_in(request.scope)
    try:
        body = json.loads(await request.body())
    except ValueError:
        return refused("the body is not JSON")
    code = body.get("code")
    if not isinstance(code, str):
        return refused("code must be a string")
    context_id, language = body.get("context_id"), body.get("language")
    if context_id and language:
        return refused("Only one of context_id or language can be provided")
    if body.get("env_vars"):
        return refused(
            "env_vars per execution are not served here: set envs when the sandbox is created"
        )
    try:
        session = await _context_session(request, sandbox, context_id, language)
    except LanguageRefused as exc:
        return refused(str(exc))
    if session is None:
        return refused(f"Context {context_id} not found", 404)
    manager = _registry(request).sessions
    return _CellStream(_run(session, code, manager), media_type="application/x-ndjson")


async def _context_session(
    request: Request, sandbox: Sandbox, context_id: str | None, language: str | None
) -> Session | None:
    """The session a cell runs in: the sandbox's own, its language's default context (made at
    its first use), or the context it names (None: no such context)."""
    contexts: Contexts = request.app.state.contexts
    if context_id and context_id != sandbox.id:
        found = contexts.of(sandbox).get(context_id)
        return found[0] if found is not None else None
    if language:
        kernel = _kernel_of(language)
        if kernel != sandbox.kernel_name:
            return contexts.default(sandbox, kernel) or await _open_context(
                request, sandbox, kernel, str(language), HOME, default=True
            )
    return sandbox.session


async def _open_context(
    request: Request,
    sandbox: Sandbox,
    kernel: str,
    language: str,
    cwd: str,
    *,
    default: bool = False,
) -> Session:
    """A new context of ``sandbox``: a session whose episode runs ``kernel``."""
    registry, contexts = _registry(request), request.app.state.contexts
    try:
        session = await registry.start_session(sandbox.owner, kernel, sandbox.envs)
    except KernelEnvError as exc:  # a kernel this server does not offer, say
        raise LanguageRefused(f"language {language!r}: {exc}") from None
    contexts.of(sandbox)[session.id] = (session, language, cwd)
    if default:
        contexts.defaults.setdefault(sandbox.id, {})[kernel] = session.id
    manager = registry.sessions
    sandbox.on_kill.append(lambda: manager.close_soon(session))
    return session


async def create_context(request: Request) -> Response:
    sandbox = sandbox_in(request.scope)
    body = json.loads(await request.body() or b"{}")
    language = str(body.get("language") or "python").lower()
    cwd = str(body.get("cwd") or HOME)
    try:
        session = await _open_context(request, sandbox, _kernel_of(language), language, cwd)
    except LanguageRefused as exc:
        return refused(str(exc))
    return JSONResponse({"id": session.id, "language": language, "cwd": cwd})


async def list_contexts(request: Request) -> Response:
    sandbox = sandbox_in(request.scope)
    contexts: Contexts = request.app.state.contexts
    own = next((name for name, k in LANGUAGES.items() if k == sandbox.kernel_name), "python")
    listed = [{"id": sandbox.id, "language": own, "cwd": HOME}]
    listed += [
        {"id": cid, "language": lang, "cwd": cwd}
        for cid, (session, lang, cwd) in contexts.of(sandbox).items()
        if session.closed is None
    ]
    return JSONResponse(listed)


async def remove_context(request: Request) -> Response:
    sandbox = sandbox_in(request.scope)
    context_id = request.path_params["context_id"]
    found = request.app.state.contexts.of(sandbox).pop(context_id, None)
    if found is None:
        return refused(f"Context {context_id} not found", 404)
    await _registry(request).sessions.close_session(found[0])
    return Response(status_code=200)


async def restart_context(request: Request) -> Response:
    """A context's kernel started afresh (its variables gone), as E2B's restart. The
    sandbox's own context is refused: its kernel holds the sandbox's files and commands."""
    sandbox = sandbox_in(request.scope)
    context_id = request.path_params["context_id"]
    if context_id == sandbox.id:
        return refused(
            "the default context is the sandbox's own kernel, with its files and commands: it "
            "is not restarted here; restart a context made with create_code_context()"
        )
    found = request.app.state.contexts.of(sandbox).get(context_id)
    if found is None or found[0].closed is not None:
        return refused(f"Context {context_id} not found", 404)
    session, language, _ = found
    manager = _registry(request).sessions
    try:
        async with manager.request(session):
            await session.reset({**UNLIMITED_EPISODE, "kernel_name": _kernel_of(language)})
        if sandbox.envs:
            await set_envs(session, _kernel_of(language), sandbox.envs)
    except KernelEnvError as exc:
        return refused(f"Context {context_id} could not be restarted: {exc}", 500)
    return Response(status_code=204)


async def health(request: Request) -> Response:
    sandbox_in(request.scope)
    return JSONResponse("OK")


ROUTES = [
    Route("/execute", execute, methods=["POST"]),
    Route("/contexts", create_context, methods=["POST"]),
    Route("/contexts", list_contexts, methods=["GET"]),
    Route("/contexts/{context_id}", remove_context, methods=["DELETE"]),
    Route("/contexts/{context_id}/restart", restart_context, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
]


class _SandboxGone(Exception):
    """The cell's sandbox was closed (killed, timed out, reaped) while the cell ran."""


class _CellStream(StreamingResponse):
    """A cell's lines; cut short, its body left unterminated, if its sandbox goes meanwhile:
    E2B's answer when a sandbox's VM goes, which the SDK reads as the sandbox killed (its
    ``TimeoutException``) once ``is_running`` says so. The server logs the cut response."""

    async def stream_response(self, send: Send) -> None:
        with contextlib.suppress(_SandboxGone):
            await super().stream_response(send)


async def _run(session: Session, code: str, manager: SessionManager) -> AsyncIterator[str]:
    """The cell's lines as they come; the step runs in a task of its own, so a client that
    goes away interrupts the kernel rather than leaving the cell running unseen."""
    lines: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    errored = False
    gone: SessionError | None = None

    def tell(event: dict[str, Any]) -> None:
        nonlocal errored
        line = e2b_output(event)
        if line is None or (line["type"] == "error" and errored):
            return
        errored = errored or line["type"] == "error"
        lines.put_nowait(line)

    async def step() -> None:
        nonlocal gone
        try:
            async with manager.request(session):
                obs = await session.step(REPLAction(code=code), on_output=tell)
            if obs.result.execution_count is not None:
                lines.put_nowait(
                    {"type": "number_of_executions", "execution_count": obs.result.execution_count}
                )
        except SessionError as exc:
            gone = exc
        except KernelEnvError as exc:
            tell(step_failure(exc))
        finally:
            lines.put_nowait(None)

    task = asyncio.ensure_future(step())
    try:
        while (line := await lines.get()) is not None:
            yield json.dumps(line) + "\n"
        if gone is not None:
            log.info(
                "e2b: session %s went during a cell (%s); its answer is cut", session.id[:8], gone
            )
            raise _SandboxGone
        yield json.dumps({"type": "end_of_execution"}) + "\n"
    finally:
        if not task.done():
            await session.interrupt()
        await asyncio.shield(task)
