"""OpenEnv's tool-calling step actions, ``list_tools`` and ``call_tool``, on a session.

The tools are ``jupyter_env``'s five, the same code MCP's ``tools/call`` runs
(:mod:`kernel_env.server.tools`), on the session's episode. ``list_tools`` answers OpenEnv's
``ListToolsObservation`` (``tools``: name, description, ``input_schema``); ``call_tool`` its
``CallToolObservation``: ``result`` (``content``, ``structured_content``, ``data``,
``is_error``) when the tool ran, else ``error`` (``error_type``: ``tool_not_found``,
``invalid_args`` or ``execution_error``, and ``message``), with the episode's ``reward`` and
``done`` (``final_answer`` ends it). A reset's ``setup`` commands run after it; its ``verify``
commands are what ``final_answer`` scores the episode with.
"""

from __future__ import annotations

import weakref
from typing import Any

from kernel_env.errors import EpisodeError
from kernel_env.server import tools
from kernel_env.server.openenv.protocol import CallToolAction, ListToolsAction, tool_payload
from kernel_env.server.sessions import Session

__all__ = ["ToolSteps"]


class ToolSteps:
    """The door's tool steps: each session's notebook (its verify commands and last cells),
    which dies with its session."""

    def __init__(self) -> None:
        self._notebooks = weakref.WeakKeyDictionary[Session, tools.Notebook]()

    async def reset(
        self, session: Session, setup: tuple[str, ...], verify: tuple[str, ...], timeout: float
    ) -> None:
        """After a reset: a new notebook, and the setup commands run (one failing: an
        :class:`EpisodeError` that says which)."""
        self._notebooks[session] = tools.Notebook(verify=list(verify))
        failure = await tools.prepare(session, list(setup), timeout)
        if failure is not None:
            raise EpisodeError(failure)

    async def step(
        self,
        session: Session,
        action: ListToolsAction | CallToolAction,
        timeout: float,
        **metadata: Any,
    ) -> dict[str, Any]:
        """The step's payload (:func:`~.protocol.tool_payload`)."""
        if isinstance(action, ListToolsAction):
            listed = [
                {"name": t["name"], "description": t["description"], "input_schema": schema}
                for t in tools.TOOLS
                for schema in [t["inputSchema"]]
            ]
            return tool_payload({"tools": listed}, None, False, **metadata)
        observation = await self.call(session, action.tool_name, action.arguments, timeout)
        state = session.state()  # the episode's reward and end, as the tool left them
        return tool_payload(observation, state.reward, state.done, **metadata)

    async def call(
        self, session: Session, name: str, arguments: Any, timeout: float
    ) -> dict[str, Any]:
        """One tool call on ``session``'s episode, as OpenEnv's ``CallToolObservation``
        (``tool_name``, and ``result`` or ``error``): what a ``call_tool`` step answers, and
        the ``tools/call`` of OpenEnv's dialect of ``/mcp`` (:mod:`kernel_env.server.mcp`)."""
        problem = tools.check_arguments(name, arguments)
        if problem is not None:
            kind = "tool_not_found" if problem.startswith("Unknown tool") else "invalid_args"
            return _called(name, error={"error_type": kind, "message": problem})
        notebook = self._notebooks.setdefault(session, tools.Notebook())
        try:
            text, failed = await tools.call_tool(session, notebook, name, arguments, timeout)
        except Exception as exc:
            said = tools.failure_text(exc)
            if said is None:
                raise
            return _called(name, error={"error_type": "execution_error", "message": said})
        result = {
            "content": [{"type": "text", "text": text}],
            "structured_content": {"result": text},
            "data": text,
            "is_error": failed,
        }
        return _called(name, result=result)


def _called(
    name: str, result: dict[str, Any] | None = None, error: dict[str, str] | None = None
) -> dict[str, Any]:
    return {"tool_name": name, "result": result, "error": error}
