"""The RLM agent loop: a root model writes code, a kernel episode runs it, until a final answer.

    result = await run_agent(env, backend, context=text, task="How many ...?")

Each iteration sends the conversation to the root model, runs every ```` ```repl ```` /
```` ```python ```` block of its reply in order (each as one ``env.execute``), and feeds the
outputs back, truncated. The model sees only metadata about ``context`` (its size and a short
preview) and inspects it with code, calling ``llm_query`` & co. on pieces.

It stops at the first final answer: one the env detects (``FINAL``/``FINAL_VAR`` called or
printed, ``answer["ready"]``), or ``FINAL(...)`` / ``FINAL_VAR(name)`` written as text outside
code; or at a limit: iterations (the model is then asked once for its answer), time, the LLM
budget, or the env's own step limit. The helpers here that build prompts and read replies are
plain functions over plain data.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kernel_env.answers import find_final, find_final_var
from kernel_env.llm import Budget, BudgetExceeded, LLMBackend, MeteredBackend, Usage
from kernel_env.models import (
    MAX_ITERATIONS,
    CodeBlockResult,
    REPLAction,
    REPLObservation,
    StepResult,
)
from kernel_env.outputs import truncate
from kernel_env.recursion import CHILD_TASK, ParentLink

if TYPE_CHECKING:
    from kernel_env.environment import KernelEnvironment

__all__ = [
    "SYSTEM_PROMPT",
    "AgentEnv",
    "AgentResult",
    "Iteration",
    "extract_code_blocks",
    "first_messages",
    "format_observation",
    "run_agent",
    "solve_child",
    "text_final",
    "turn_feedback",
]

StopReason = Literal["final", "max_iterations", "time_limit", "budget", "env_limit"]

SYSTEM_PROMPT = """\
You answer a task about a `context` by writing Python code that runs in a Jupyter (IPython) \
kernel. The context is too large to read in this conversation: it is stored in the kernel as the \
variable `context`, and you are shown only its size and first characters. Look at it with code.

How the kernel works (Jupyter semantics):
- Write code in a fenced block marked ```repl (```python works too). Every block in your reply \
runs, in order, as one notebook cell; then you see what each cell showed.
- If a cell's last line is a bare expression, its value is shown, as in a notebook: a cell \
ending with `len(context)` shows the number. Other values are shown only if you print() them.
- Variables, functions and imports persist from cell to cell.
- What you see of the output is truncated: print summaries and slices (`context[:2000]`), not \
everything.

Defined in the kernel:
- `context`: the data, a str.
- `llm_query(prompt: str) -> str`: ask a language model. It can read far more text than you \
see here: give it pieces of the context with an instruction, and keep its answers in variables.
- `llm_query_batched(prompts: list[str]) -> list[str]`: many llm_query calls at once, run \
concurrently; answers come back in order; a failed one is a string starting with "Error: ". Much \
faster than a loop of llm_query.
- `rlm_query(prompt: str) -> str`, `rlm_query_batched(prompts)`: like llm_query, but answered \
by a sub-agent with its own kernel, for sub-tasks that need code.
- `SHOW_VARS()`: the variables you have defined.
- `FINAL(value)` ends the task with `value` as the final answer; `FINAL_VAR("name")` ends it \
with the value of the variable `name`. (Or set `answer["content"]` and `answer["ready"] = True`.)

A good approach: look at the context's structure (length, lines, a few slices); split it into \
chunks; ask about every chunk with llm_query_batched; combine the answers in code; check the \
result; then finish.

Finish with FINAL(...) or FINAL_VAR(...) in a code block once you have the answer, or write \
FINAL(your answer) on a line of its own outside code. Don't answer before you have looked at the \
context, and don't guess: compute."""

FINAL_REQUEST = (
    "You have no iterations left. Give your best final answer now, on one line, as "
    "FINAL(your answer) — or FINAL_VAR(name) to answer with a variable's value."
)
NO_CODE = (
    "Your reply had no code block and no final answer. Write code in a ```repl block, or "
    "finish with FINAL(your answer)."
)

# A fence opens at a line start (indented at most 3 spaces, as in Markdown) with ``` and an
# info string; it closes at a line of ``` alone. Unclosed blocks (a reply cut off) don't run.
_FENCE = re.compile(
    r"^ {0,3}```[ \t]*([\w+-]*)[^\n]*\n(.*?)^ {0,3}```[ \t]*$", re.MULTILINE | re.DOTALL
)
_CODE_LANGS = frozenset({"repl", "python", "py", "python3", "ipython"})
_FINAL_LINE = re.compile(r"^[ \t>*_`]*(FINAL|FINAL_VAR)\(", re.MULTILINE)


# -- pure helpers --------------------------------------------------------------------------


def extract_code_blocks(text: str) -> list[str]:
    """The code of every ```repl / ```python block in ``text``, in order."""
    return [
        match.group(2)
        for match in _FENCE.finditer(text)
        if match.group(1).lower() in _CODE_LANGS and match.group(2).strip()
    ]


def prose_before_blocks(text: str) -> list[str]:
    """For each code block :func:`extract_code_blocks` finds, the prose written before it
    (since the previous block), stripped; other fenced blocks count as prose."""
    notes, start = [], 0
    for match in _FENCE.finditer(text):
        if match.group(1).lower() in _CODE_LANGS and match.group(2).strip():
            notes.append(text[start : match.start()].strip())
            start = match.end()
    return notes


def strip_code_blocks(text: str) -> str:
    """``text`` without its fenced blocks (of any language)."""
    return _FENCE.sub("", text)


def text_final(text: str) -> tuple[Literal["value", "variable"], str] | None:
    """A final answer written as text: ``FINAL(...)`` or ``FINAL_VAR(name)`` starting a line
    outside code blocks (so prose that mentions FINAL in passing doesn't end the episode)."""
    prose = strip_code_blocks(text)
    for match in _FINAL_LINE.finditer(prose):
        rest = prose[match.start(1) :]
        if match.group(1) == "FINAL_VAR":
            if (name := find_final_var(rest)) is not None:
                return "variable", name
        elif (value := find_final(rest)) is not None and (value := _unquote(value)):
            return "value", value
    return None


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def first_messages(
    task: str,
    context: str,
    *,
    max_iterations: int,
    preview_chars: int = 500,
    system_prompt: str = SYSTEM_PROMPT,
) -> list[dict[str, str]]:
    """The system prompt and the first user message: the task and metadata about ``context``."""
    preview = context[:preview_chars]
    more = " (the whole context)" if len(preview) == len(context) else ""
    user = (
        f"Task: {task}\n\n"
        f"`context` is a str of {len(context):,} characters in "
        f"{context.count(chr(10)) + 1:,} lines. Its first {len(preview):,} characters{more}, "
        f"as a Python literal:\n{preview!r}\n\n"
        f"You have {max_iterations} replies. Start by looking at `context` with code."
    )
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]


def format_observation(result: CodeBlockResult, limit: int) -> str:
    """What the model sees of one cell: stdout, then stderr or the error, head+tail truncated."""
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.stderr.strip():
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    elif result.exception:
        parts.append(f"[error] {result.exception}")
    text = "\n".join(parts) or "(no output)"
    return truncate(text, limit)[0]


def turn_feedback(observations: list[str], iteration: int, max_iterations: int) -> str:
    """The user message after a turn: every block's output, and where the agent stands."""
    if not observations:
        return NO_CODE
    if len(observations) == 1:
        body = f"Output:\n{observations[0]}"
    else:
        body = "\n\n".join(f"Output of block {i}:\n{o}" for i, o in enumerate(observations, 1))
    return f"{body}\n\n[iteration {iteration} of {max_iterations} done]"


# -- the loop ------------------------------------------------------------------------------


class AgentEnv(Protocol):
    """What the loop needs of an env: ``AsyncKernelEnv`` (local or remote) has it."""

    async def reset(
        self,
        *,
        context: str = ...,
        task_prompt: str = ...,
        max_iterations: int = ...,
        expected_answer: str | None = ...,
        agent_max_turns: int | None = ...,
    ) -> StepResult[REPLObservation]: ...
    async def step(self, action: REPLAction) -> StepResult[REPLObservation]: ...
    async def execute(self, code: str) -> StepResult[REPLObservation]: ...
    async def submit_final_answer(self, answer: str) -> StepResult[REPLObservation]: ...


@dataclass
class Iteration:
    """One call of the root model and what came of it (one line of the trajectory log)."""

    index: int
    kind: Literal["turn", "final_request"]
    messages: list[dict[str, Any]]  # added to the conversation for this call
    response: str
    code_blocks: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    final_answer: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    elapsed: float = 0.0  # since the run started


@dataclass
class AgentResult:
    """How a run ended."""

    answer: str | None
    stop_reason: StopReason
    iterations: int
    reward: float | None
    usage: Usage
    elapsed: float
    trajectory: list[Iteration]


OnIteration = Callable[[Iteration], Any]


async def run_agent(
    env: AgentEnv,
    backend: LLMBackend,
    *,
    context: str,
    task: str,
    max_iterations: int = 20,
    time_limit: float | None = None,
    model: str | None = None,
    usage: Usage | None = None,
    budget: Budget | None = None,
    on_iteration: OnIteration | None = None,
    trajectory_path: str | Path | None = None,
    expected_answer: str | None = None,
    max_observation_chars: int = 20_000,
    preview_chars: int = 500,
    system_prompt: str = SYSTEM_PROMPT,
) -> AgentResult:
    """Reset ``env`` with ``context`` and ``task`` and let ``backend`` solve it with code.

    ``usage``/``budget`` meter the root model's calls; pass the same ones to ``as_query_fn`` for
    the kernel's ``llm_query`` to account for and limit the whole episode. ``time_limit`` (s,
    counted from the end of the reset) is checked before each model call and each cell.
    ``on_iteration`` (sync or async) gets every :class:`Iteration`; ``trajectory_path`` gets
    them as JSON lines. A root-model failure after its retries raises ``LLMError``; a spent
    budget ends the run (``stop_reason="budget"``).
    """
    if max_iterations < 1:
        raise ValueError("max_iterations must be at least 1")
    # The env counts cells, not replies: leave room for several blocks a reply, plus the answer.
    await env.reset(
        context=context,
        task_prompt=task,
        max_iterations=min(MAX_ITERATIONS, max_iterations * 10 + 2),
        agent_max_turns=max_iterations,
        **({"expected_answer": expected_answer} if expected_answer is not None else {}),
    )
    loop = _Loop(
        env,
        MeteredBackend(backend, usage, budget),
        model=model,
        deadline=None if time_limit is None else time.monotonic() + time_limit,
        on_iteration=on_iteration,
        log=_TrajectoryLog(Path(trajectory_path)) if trajectory_path is not None else None,
        observation_chars=max_observation_chars,
    )
    messages = first_messages(
        task,
        context,
        max_iterations=max_iterations,
        preview_chars=preview_chars,
        system_prompt=system_prompt,
    )
    return await loop.run(messages, max_iterations)


async def solve_child(
    environment: KernelEnvironment,
    backend: LLMBackend,
    prompt: str,
    model: str | None,
    link: ParentLink,
) -> str | None:
    """Solve an ``rlm_query`` child episode with the loop (the episode layer's ``ChildSolver``):
    ``prompt`` is the child's context, and its model calls count toward the root's budget."""
    result = await run_agent(
        _EpisodeDriver(environment),
        backend,
        context=prompt,
        task=CHILD_TASK,
        max_iterations=link.max_iterations,
        model=model,
        usage=link.usage,
        budget=link.budget,
    )
    return result.answer


class _EpisodeDriver:
    """An environment driven directly, as :class:`AgentEnv` (a child episode has no client)."""

    def __init__(self, environment: KernelEnvironment) -> None:
        self.environment = environment

    async def reset(self, **kwargs: Any) -> StepResult[REPLObservation]:
        return _result(await self.environment.reset(**kwargs))

    async def step(self, action: REPLAction) -> StepResult[REPLObservation]:
        return _result(await self.environment.step(action))

    async def execute(self, code: str) -> StepResult[REPLObservation]:
        return _result(await self.environment.step(REPLAction(code=code)))

    async def submit_final_answer(self, answer: str) -> StepResult[REPLObservation]:
        action = REPLAction(is_final=True, final_answer=answer)
        return _result(await self.environment.step(action))


def _result(observation: REPLObservation) -> StepResult[REPLObservation]:
    return StepResult(observation=observation, reward=observation.reward, done=observation.done)


class _Loop:
    """One run's state: the conversation, the env's status, the trajectory."""

    def __init__(
        self,
        env: AgentEnv,
        backend: MeteredBackend,
        *,
        model: str | None,
        deadline: float | None,
        on_iteration: OnIteration | None,
        log: _TrajectoryLog | None,
        observation_chars: int,
    ) -> None:
        self.env, self.backend, self.model = env, backend, model
        self.deadline, self.on_iteration, self.log = deadline, on_iteration, log
        self.observation_chars = observation_chars
        self.messages: list[dict[str, Any]] = []
        self.trajectory: list[Iteration] = []
        self.started = time.monotonic()
        self.done = False  # the env's episode has ended
        self.reward: float | None = None

    async def run(self, pending: list[dict[str, Any]], max_iterations: int) -> AgentResult:
        if self.log is not None:
            await self.log.start()
        for index in range(1, max_iterations + 1):
            if self._out_of_time():
                return self._result(None, "time_limit")
            try:
                response = await self._ask(pending)
            except BudgetExceeded:
                return self._result(None, "budget")
            turn = Iteration(index, "turn", pending, response)
            await self._play(turn)
            turn.usage, turn.elapsed = self.backend.usage.as_dict(), self._elapsed()
            await self._record(turn)
            if turn.final_answer is not None:
                return self._result(turn.final_answer, "final")
            if self.done:
                return self._result(None, "env_limit")
            feedback = turn_feedback(turn.observations, index, max_iterations)
            pending = [{"role": "user", "content": feedback}]
        return await self._last_chance(pending, max_iterations + 1)

    async def _ask(self, pending: list[dict[str, Any]]) -> str:
        self.messages.extend(pending)
        completion = await self.backend.complete(list(self.messages), model=self.model)
        self.messages.append({"role": "assistant", "content": completion.text})
        return completion.text

    async def _play(self, turn: Iteration) -> None:
        """Run the reply's code blocks in order, then look for a final answer written as text."""
        turn.code_blocks = extract_code_blocks(turn.response)
        notes = prose_before_blocks(turn.response)
        limit = self.observation_chars // max(1, len(turn.code_blocks))
        for code, note in zip(turn.code_blocks, notes, strict=True):
            if self._out_of_time():
                turn.observations.append("(not run: the time limit was reached)")
                break
            # The prose goes with the step, so the export reads as the model's story.
            action = REPLAction(code=code, metadata={"note": note} if note else {})
            step = await self.env.step(action)
            turn.observations.append(format_observation(step.observation.result, limit))
            if self._ended(step, turn):
                return
        if (found := text_final(turn.response)) is not None:
            await self._answer(found, turn, limit)

    async def _answer(self, found: tuple[str, str], turn: Iteration, limit: int) -> None:
        """Hand a final answer written as text to the env, which records and scores it."""
        kind, value = found
        if kind == "value":
            self._ended(await self.env.submit_final_answer(value), turn)
            return
        # FINAL_VAR(name) as text: the kernel holds the value; a missing name is fed back.
        step = await self.env.execute(f"FINAL_VAR({value!r})")
        turn.observations.append(format_observation(step.observation.result, limit))
        self._ended(step, turn)

    def _ended(self, step: StepResult[REPLObservation], turn: Iteration) -> bool:
        if not step.done:
            return False
        self.done, self.reward = True, step.reward
        answer = step.observation.metadata.get("final_answer")
        turn.final_answer = None if answer is None else str(answer)
        return True

    async def _last_chance(self, pending: list[dict[str, Any]], index: int) -> AgentResult:
        """Out of iterations: ask the model once for its answer, and submit that."""
        if self._out_of_time():
            return self._result(None, "time_limit")
        pending = [*pending, {"role": "user", "content": FINAL_REQUEST}]
        try:
            response = await self._ask(pending)
        except BudgetExceeded:
            return self._result(None, "budget")
        turn = Iteration(index, "final_request", pending, response)
        found = text_final(response) or _anywhere_final(response)
        if found is not None:
            await self._answer(found, turn, self.observation_chars)
        elif response.strip() and not self.done:
            self._ended(await self.env.submit_final_answer(response.strip()), turn)
        turn.usage, turn.elapsed = self.backend.usage.as_dict(), self._elapsed()
        await self._record(turn)
        return self._result(turn.final_answer, "max_iterations")

    async def _record(self, turn: Iteration) -> None:
        self.trajectory.append(turn)
        if self.log is not None:
            await self.log.write(turn)
        if self.on_iteration is not None:
            outcome = self.on_iteration(turn)
            if inspect.isawaitable(outcome):
                await outcome

    def _out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _elapsed(self) -> float:
        return time.monotonic() - self.started

    def _result(self, answer: str | None, reason: StopReason) -> AgentResult:
        return AgentResult(
            answer=answer,
            stop_reason=reason,
            iterations=len(self.trajectory),
            reward=self.reward,
            usage=self.backend.usage,
            elapsed=self._elapsed(),
            trajectory=self.trajectory,
        )


def _anywhere_final(text: str) -> tuple[Literal["value", "variable"], str] | None:
    """FINAL_VAR(name) / FINAL(value) anywhere, code included: the model was asked for it."""
    if (name := find_final_var(text)) is not None:
        return "variable", name
    if (value := find_final(text)) is not None and (value := _unquote(value)):
        return "value", value
    return None


class _TrajectoryLog:
    """Iterations as JSON lines; the file starts empty each run and is written as it goes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def start(self) -> None:
        await asyncio.to_thread(self._start)

    def _start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("", encoding="utf-8")

    async def write(self, turn: Iteration) -> None:
        line = json.dumps(asdict(turn), ensure_ascii=False) + "\n"
        # Off the event loop: a server runs other sessions on it (docs/architecture.md, #12).
        await asyncio.to_thread(self._append, line)

    def _append(self, line: str) -> None:
        with self.path.open("a", encoding="utf-8") as file:
            file.write(line)
