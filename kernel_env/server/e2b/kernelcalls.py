"""envd's operations, run in a sandbox's kernel (:mod:`kernel_env.inkernel.envd`) from the host.

Each call is one kernel call of the sandbox's session (:meth:`Session.kernel_call`): a silent
request between its cells, not part of the episode, so nothing of it enters the record or the
notebook. A kernel without kernel_env (a gateway's) cannot serve them.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from kernel_env.errors import KernelCallError
from kernel_env.inkernel.contract import ENVD_MODULE
from kernel_env.server.sessions import Session

__all__ = ["KernelCallError", "in_kernel", "set_envs"]

_TIMEOUT = 30.0


async def in_kernel(session: Session, name: str, *, activity: bool = True, **args: Any) -> Any:
    """The result of the envd operation ``name`` in ``session``'s kernel (``activity``: as
    :meth:`Session.kernel_call`'s)."""
    call = f"__import__({ENVD_MODULE!r}, fromlist=['call']).call"
    expression = f"{call}({name!r}, {json.dumps(args)!r})"
    reply = await session.kernel_call(expression, timeout=_TIMEOUT, activity=activity)
    if reply.get("status") != "ok":
        name_, value = reply.get("ename", "?"), reply.get("evalue", "")
        if name_ == "ModuleNotFoundError":
            raise KernelCallError(
                "unimplemented", "files and commands need a kernel with kernel_env installed"
            )
        raise KernelCallError("internal", f"{name_}: {value}")
    try:
        answer = json.loads(reply.get("data", {}).get("text/plain", ""))
    except ValueError:
        raise KernelCallError("internal", "the kernel's answer is not JSON") from None
    if "error" in answer:
        raise KernelCallError(answer["error"]["code"], answer["error"]["message"])
    return answer.get("ok")


async def set_envs(session: Session, kernel_name: str, envs: dict[str, str]) -> None:
    """E2B's ``envs`` as variables of ``session``'s kernel (and so of what it starts): through
    envd's call in Python, a silent cell of the kernel's language in R, Bash and Deno."""
    if kernel_name not in _ENV_CELLS:
        await in_kernel(session, "set_envs", envs=envs)
        return
    await session.silent_cell(_ENV_CELLS[kernel_name](envs), timeout=_TIMEOUT)


def _r_cell(envs: dict[str, str]) -> str:
    pairs = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in envs.items())
    return f"invisible(do.call(Sys.setenv, list({pairs})))"


def _bash_cell(envs: dict[str, str]) -> str:
    return "\n".join(f"export {shlex.quote(f'{k}={v}')}" for k, v in envs.items())


def _deno_cell(envs: dict[str, str]) -> str:
    return f"for (const [k, v] of Object.entries({json.dumps(envs)})) Deno.env.set(k, v);"


_ENV_CELLS = {"ir": _r_cell, "bash": _bash_cell, "deno": _deno_cell}
