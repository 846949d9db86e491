"""OpenEnv 0.10's ``MCPToolClient``, as it is, run against a server: the script
tests/test_mcp.py runs in the ``openenv`` venv (tests/venvs.py; ``openenv`` 0.10 cannot share
the dev venv).

    python openenv_tool_client.py URL TOKEN < PLAN

PLAN is a JSON list of operations, run in order on one client (its sync wrapper, as
``jupyter_env``'s quick start uses it); the outcomes are printed as one JSON list:

- ``{"op": "reset", "kwargs": {...}}``: ``reset(**kwargs)`` (over ``/ws``): its reward,
  ``done`` and observation;
- ``{"op": "list_tools"}``: the names ``list_tools()`` answers (over ``/mcp``);
- ``{"op": "call_tool", "name": ..., "kwargs": {...}}``: ``call_tool(name, **kwargs)`` (over
  ``/mcp``): its result, or the error it raised;
- ``{"op": "step", "name": ..., "kwargs": {...}}``: ``step(CallToolAction(...))`` (over
  ``/ws``): the observation's result or error, the reward and ``done``;
- ``{"op": "state"}``: ``state()``'s episode id and step count.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.mcp_client import MCPToolClient


def _run(env: Any, op: dict[str, Any]) -> Any:
    kind, kwargs = op["op"], op.get("kwargs", {})
    if kind == "reset":
        result = env.reset(**kwargs)
        return {"reward": result.reward, "done": result.done,
                "observation": result.observation.model_dump()}  # fmt: skip
    if kind == "list_tools":
        return [tool.name for tool in env.list_tools(use_cache=False)]
    if kind == "call_tool":
        try:
            return {"result": env.call_tool(op["name"], **kwargs)}
        except RuntimeError as exc:
            return {"error": str(exc)}
    if kind == "step":
        result = env.step(CallToolAction(tool_name=op["name"], arguments=kwargs))
        observation = result.observation
        error = observation.error.message if observation.error is not None else None
        result_data = getattr(observation.result, "data", observation.result)
        if isinstance(result_data, dict):
            result_data = result_data.get("data", result_data)
        return {"result": result_data, "error": error, "reward": result.reward,
                "done": result.done}  # fmt: skip
    if kind == "state":
        state = env.state()
        return {"episode_id": state.episode_id, "step_count": state.step_count}
    raise ValueError(f"unknown op {kind!r}")


def main() -> None:
    url, token = sys.argv[1], sys.argv[2]
    plan = json.load(sys.stdin)
    client = MCPToolClient(base_url=url, headers={"Authorization": f"Bearer {token}"})
    outcomes = []
    with client.sync() as env:
        for op in plan:
            outcomes.append(_run(env, op))
    print(json.dumps(outcomes))


if __name__ == "__main__":
    main()
