"""The five tools of OpenEnv's ``jupyter_env``, over one session's episode: what MCP's
``tools/call`` (:mod:`.mcp`) and OpenEnv's ``call_tool`` steps (:mod:`.openenv`) both run.

The same names, arguments and result text as ``jupyter_env``'s: a code cell answers its
stdout, its results' text, a note of its images and ``ERROR:`` with the traceback, or
``(no output)``; ``get_notebook_state`` shows the last cells, each as ``[Cell n] code`` and
``  → output``; ``final_answer`` says ``Answer submitted: ...`` and, with verify commands,
``Verification: p/t passed; reward=r``.

Code runs as the episode's steps (recorded, exported, shown on ``/web``); shell commands
(``execute_shell_command``, the reset's setup and verify commands) run beside the kernel, each
a process of its own in its sandbox (:meth:`Session.run_command`), so no cell can change what
verification runs or what it reports. The reward is the verify commands' pass rate, unless
one writes a number to :data:`REWARD_FILE` (removed before they run); without verify
commands, the episode's rubric scores the answer (``expected_answer``).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from kernel_env.errors import EpisodeError, InvalidInput, KernelCallError, KernelError
from kernel_env.models import REPLAction, REPLObservation
from kernel_env.server.sessions import CommandRun, Session

__all__ = [
    "REWARD_FILE",
    "TOOLS",
    "Notebook",
    "call_tool",
    "check_arguments",
    "failure_text",
    "prepare",
    "split_reset",
]

REWARD_FILE = "/home/user/logs/verifier/reward.txt"
_SHOWN_CELLS = 10  # cells get_notebook_state shows (and all the door keeps of them)
_CODE_PREVIEW, _OUTPUT_PREVIEW = 120, 300


def _tool(name: str, description: str, arg: str | None, about: str = "") -> dict[str, Any]:
    properties = {arg: {"type": "string", "description": about}} if arg else {}
    schema = {"type": "object", "properties": properties, "required": [arg] if arg else []}
    return {"name": name, "description": description, "inputSchema": schema}


TOOLS: list[dict[str, Any]] = [
    _tool(
        "add_and_execute_code_cell",
        "Execute code in a new cell of the stateful notebook; variables, imports and files "
        "persist between calls. Returns stdout, results, a note of images, or the traceback.",
        "code",
        "The code to run (several lines allowed).",
    ),
    _tool(
        "edit_and_execute_current_cell",
        "Replace the last code cell with new code and run it (to fix an error).",
        "code",
        "The replacement code.",
    ),
    _tool(
        "execute_shell_command",
        "Run a shell command in the sandbox (its workspace is /home/user). Returns stdout "
        "and stderr, and the exit status if it failed.",
        "command",
        "The shell command.",
    ),
    _tool(
        "get_notebook_state",
        "A summary of the last cells and their outputs.",
        None,
    ),
    _tool(
        "final_answer",
        "Submit the final answer; runs the task's verify commands and ends the episode.",
        "answer",
        "The final answer.",
    ),
]
_ARGUMENT = {t["name"]: (t["inputSchema"]["required"] or [None])[0] for t in TOOLS}


@dataclass
class Cell:
    count: int
    code: str
    output: str
    error: str | None


@dataclass
class Notebook:
    """What a door keeps of one session's episode: its verify commands and its last
    cells (for ``get_notebook_state``)."""

    verify: list[str] = field(default_factory=list)
    cells: collections.deque[Cell] = field(
        default_factory=lambda: collections.deque(maxlen=_SHOWN_CELLS)
    )
    count: int = 0


def _commands(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidInput(f"{name} must be a string or a list of strings")
    return [v for v in value if v.strip()]


def split_reset(options: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """The reset's own options, and its setup and verify commands (``setup`` /
    ``setup_scripts``, ``verify`` / ``verify_scripts``)."""
    rest = dict(options)
    setup = _commands(rest.pop("setup", None), "setup") + _commands(
        rest.pop("setup_scripts", None), "setup_scripts"
    )
    verify = _commands(rest.pop("verify", None), "verify") + _commands(
        rest.pop("verify_scripts", None), "verify_scripts"
    )
    return rest, setup, verify


async def prepare(session: Session, setup: list[str], timeout: float) -> str | None:
    """Run the setup commands in order; the first failure's account, or None."""
    for command in setup:
        run = await session.run_command(command, timeout=timeout)
        if not run.ok:
            return f"setup command failed: {command}\n{_shell_text(run)}"
    return None


async def call_tool(
    session: Session, notebook: Notebook, name: str, arguments: dict[str, Any], timeout: float
) -> tuple[str, bool]:
    """The tool's text, and whether it is an error result (``isError``). Arguments are
    checked by :func:`check_arguments` first."""
    if name == "get_notebook_state":
        return _summary(notebook), False
    value = arguments[_ARGUMENT[name]]
    if name in ("add_and_execute_code_cell", "edit_and_execute_current_cell"):
        observation = await session.step(REPLAction(code=value))
        text, error = _cell_text(observation)
        if name == "edit_and_execute_current_cell" and notebook.cells:
            notebook.count -= 1
            notebook.cells.pop()
        notebook.count += 1
        notebook.cells.append(Cell(notebook.count, value, _cell_output(observation), error))
        return text, False
    if name == "execute_shell_command":
        run = await session.run_command(value, timeout=timeout)
        notebook.count += 1
        notebook.cells.append(Cell(notebook.count, f"$ {value}", _shell_text(run), None))
        return _shell_text(run), False
    return await _final_answer(session, notebook, value, timeout), False


def check_arguments(name: str, arguments: Any) -> str | None:
    """What is wrong with a call's name or arguments, or None."""
    if name not in _ARGUMENT:
        return f"Unknown tool: {name[:80]}"
    if not isinstance(arguments, dict):
        return "arguments must be an object"
    wanted = _ARGUMENT[name]
    extra = sorted(set(arguments) - {wanted, "include_images"})
    if extra:
        return f"{name}: unexpected argument {extra[0][:80]!r}"
    if wanted is None:
        return None
    if wanted not in arguments:
        return f"{name}: missing required argument {wanted!r}"
    if not isinstance(arguments[wanted], str):
        return f"{name}: {wanted!r} must be a string, not {type(arguments[wanted]).__name__}"
    return None


async def _final_answer(session: Session, notebook: Notebook, answer: str, timeout: float) -> str:
    if not notebook.verify:
        await session.finish(answer)
        return f"Answer submitted: {answer}"
    folder = REWARD_FILE.rsplit("/", 1)[0]
    cleared = await session.run_command(
        f"mkdir -p {folder} && rm -f {REWARD_FILE}", timeout=timeout
    )
    if not cleared.ok:
        raise InvalidInput(f"the reward file could not be cleared: {_shell_text(cleared)}")
    passed = 0
    for command in notebook.verify:
        passed += (await session.run_command(command, timeout=timeout)).ok
    total = len(notebook.verify)
    written = await session.run_command(f"cat {REWARD_FILE} 2>/dev/null", timeout=timeout)
    reward = _number(written.stdout) if written.ok else None
    reward = passed / total if reward is None else reward
    await session.finish(answer, reward)
    return f"Answer submitted: {answer}\nVerification: {passed}/{total} passed; reward={reward}"


def failure_text(exc: BaseException) -> str | None:
    """The text a model reads for a tool call that ran into the episode (over, not reset,
    the kernel unreachable, a command refused, input over a limit), or None: the door's."""
    if isinstance(exc, (EpisodeError, KernelCallError, InvalidInput)):
        return f"Error: {exc}"
    if isinstance(exc, KernelError):
        return f"Error: kernel unavailable: {exc}"
    return None


def _number(text: str) -> float | None:
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if value == value and abs(value) != float("inf") else None


# -- text ---------------------------------------------------------------------------------


def _cell_parts(observation: REPLObservation) -> tuple[list[str], str | None]:
    """A cell's output parts (stdout, results' text, a note of images) and its error."""
    outputs = observation.result.outputs
    stdout = "".join(
        str(o.get("text", ""))
        for o in outputs
        if o.get("output_type") == "stream" and o.get("name") == "stdout"
    ).strip()
    parts = [stdout] if stdout else []
    images = 0
    for output in outputs:
        data = output.get("data") or {}
        if output.get("output_type") in ("execute_result", "display_data"):
            if "text/plain" in data:
                parts.append(str(data["text/plain"]))
            images += "image/png" in data
    if images:
        parts.append(f"[Image output: {images} image(s) generated]")
    error = next((o for o in outputs if o.get("output_type") == "error"), None)
    text = None
    if error is not None:
        trace = "\n".join(str(line) for line in error.get("traceback") or [])
        text = f"{error.get('ename', '')}: {error.get('evalue', '')}\n{trace}".rstrip()
    elif not observation.result.success:
        text = observation.result.exception or observation.result.stderr or "the cell failed"
    return parts, text


def _cell_text(observation: REPLObservation) -> tuple[str, str | None]:
    parts, error = _cell_parts(observation)
    shown = [*parts, f"ERROR:\n{error}"] if error else parts
    return ("\n".join(shown) if shown else "(no output)"), error


def _cell_output(observation: REPLObservation) -> str:
    return "\n".join(_cell_parts(observation)[0])


def _shell_text(run: CommandRun) -> str:
    parts = [text for text in (run.stdout.strip(), run.stderr.strip()) if text]
    if run.timed_out:
        parts.append("ERROR:\nthe command timed out and was killed")
    elif not run.ok:
        parts.append(f"ERROR:\nexit status {run.exit_code}")
    return "\n".join(parts) if parts else "(no output)"


def _summary(notebook: Notebook) -> str:
    if not notebook.cells:
        return "No cells executed yet."
    lines: list[str] = []
    for cell in notebook.cells:
        lines.append(f"[Cell {cell.count}] {cell.code[:_CODE_PREVIEW].replace(chr(10), ' ↵ ')}")
        if cell.output:
            lines.append(f"  → {cell.output[:_OUTPUT_PREVIEW]}")
        if cell.error:
            lines.append(f"  ✗ {cell.error[:_OUTPUT_PREVIEW]}")
    return "\n".join(lines)
