"""What a step gives back: the kernel's state read from its reply, the final answer found in
it, the observation the agent sees (outputs truncated head and tail, fault notes) and the
step's record. Plain functions over a cell's result; the episode holds the state."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from kernel_env import answers
from kernel_env.inkernel.contract import final_from_outputs, unsent_marker
from kernel_env.kernel import ExecutionResult
from kernel_env.languages.catalog import Language
from kernel_env.llm import Usage
from kernel_env.models import CodeBlockResult, REPLAction, REPLObservation, REPLState
from kernel_env.outputs import OutputBudget, truncate
from kernel_env.record import EpisodeRecord, StepRecord
from kernel_env.text import shorten

__all__ = [
    "code_block_result",
    "detect_final",
    "json_expression",
    "note",
    "observation",
    "ready_message",
    "state",
    "state_from",
    "step_record",
]

_MAX_NOTE_CHARS = 20_000


def ready_message(context: str, task_prompt: str, hint: str) -> str:
    """The reset observation's stdout, worded as upstream's (models are prompted with it);
    ``hint``: how the language's episode ends."""
    parts = ["REPL environment initialized."]
    if context:
        parts.append(f"Context loaded ({len(context)} chars). Use 'context' variable to access it.")
    if task_prompt:
        parts.append(f"Task: {task_prompt}")
    parts.append(hint)
    return "\n".join(parts)


def json_expression(value: Any) -> dict[str, Any] | None:
    """A user_expressions entry whose text/plain is JSON (see inkernel.extension._JSONState)."""
    if not isinstance(value, dict) or value.get("status") != "ok":
        return None
    try:
        parsed = json.loads(value.get("data", {}).get("text/plain", ""))
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def state_from(ex: ExecutionResult) -> dict[str, Any] | None:
    """The episode state a cell's reply reports (its ``state`` user expression)."""
    return json_expression(ex.user_expressions.get("state"))


def code_block_result(
    ex: ExecutionResult,
    state: dict[str, Any],
    *,
    limit: int,
    timeout: float,
    budget: OutputBudget,
) -> tuple[CodeBlockResult, dict[str, int]]:
    """What the agent sees of a cell (stdout and stderr each cut to ``limit`` chars, what
    the episode's ``budget`` keeps of its outputs), and the chars cut, by stream."""
    dropped = budget.dropped
    outputs = budget.keep([dict(o) for o in ex.outputs])
    notes = _fault_notes(ex, timeout)
    if budget.dropped > dropped:  # the episode's marker: the model sees it
        notes += str(outputs[-1]["text"])
    unsent = state.get("unsent")
    unsent = unsent if isinstance(unsent, dict) else {}
    stdout, cut_out = truncate(ex.stdout, limit, printed=_printed(ex.stdout, unsent, "stdout"))
    stderr, cut_err = truncate(
        ex.stderr + notes, limit, printed=_printed(ex.stderr, unsent, "stderr", len(notes))
    )
    result = CodeBlockResult(
        stdout=stdout,
        stderr=stderr,
        locals_snapshot=dict(state.get("snapshot") or {}),
        execution_time=ex.duration,
        success=ex.success,
        exception=_exception_text(ex),
        outputs=outputs,
        execution_count=ex.execution_count,
        timed_out=ex.status == "timeout",
        kernel_restarted=ex.restarted,
        state_lost=ex.restarted,
    )
    return result, {k: v for k, v in (("stdout", cut_out), ("stderr", cut_err)) if v}


def observation(
    record: EpisodeRecord,
    result: CodeBlockResult,
    *,
    names: list[str],
    cut: dict[str, int],
    total_time: float,
    preview: int,
    reward: float | None,
    done: bool,
) -> REPLObservation:
    """The observation of ``result`` in ``record``'s episode (``preview``: chars of context)."""
    if done:
        metadata: dict[str, Any] = {
            "final_answer": record.final_answer,
            "total_execution_time": total_time,
            "total_iterations": record.iterations,
        }
    else:
        metadata = {
            "task_prompt": record.task_prompt,
            "final_answer": record.final_answer,
            "execution_time": result.execution_time,
        }
    metadata["episode_id"] = record.episode_id
    if cut:
        metadata["truncated"] = dict(cut)  # chars cut, by stream
    return REPLObservation(
        result=result,
        context_preview=record.context[:preview] or None,
        context_length=len(record.context),
        available_variables=list(names),
        iteration=record.iterations,
        max_iterations=record.max_iterations,
        done=done,
        reward=reward,
        metadata=metadata,
    )


def state(
    record: EpisodeRecord, *, names: list[str], total_time: float, restarts: int, usage: Usage
) -> REPLState:
    """The state of ``record``'s episode, as ``GET /state`` reports it."""
    return REPLState(
        episode_id=record.episode_id,
        step_count=record.iterations,
        context=record.context,
        task_prompt=record.task_prompt,
        iteration=record.iterations,
        max_iterations=record.max_iterations,
        namespace_keys=list(names),
        final_answer=record.final_answer,
        total_execution_time=total_time,
        done=record.done,
        reward=record.reward,
        kernel_restarts=restarts,
        llm_calls=usage.calls,
        llm_usage=usage.as_dict(),
    )


async def detect_final(
    ex: ExecutionResult,
    state: dict[str, Any],
    language: Language,
    lookup: Callable[[str], Awaitable[str | None]],
) -> str | None:
    """The four dialects, in OpenEnv's order: FINAL(...) called or printed, FINAL_VAR, then
    ``answer["ready"]``; before them, a ``FINAL`` display (the languages with a shim).
    ``lookup(expression)``: the value a user expression reads in the kernel, or None."""
    if (shown := final_from_outputs(ex.outputs)) is not None:
        return shown
    if state.get("final") is not None:
        return str(state["final"])
    printed = "".join(
        o.get("text", "")
        for o in ex.outputs
        if o.get("output_type") == "stream" and o.get("name") == "stdout"
    )
    if (value := answers.find_final(printed)) is not None:
        return value
    name = answers.find_final_var(printed)
    expression = language.lookup_expression(name) if name is not None else None
    if expression is not None and (found := await lookup(expression)) is not None:
        return found
    answer = state.get("answer") or {}
    return str(answer.get("content", "")) if answer.get("ready") else None


def step_record(
    index: int,
    action: REPLAction,
    ex: ExecutionResult | None,
    result: CodeBlockResult,
    calls: list[Any],
    reward: float,
    final: str | None,
) -> StepRecord:
    """The record of one step (``ex`` None: a final answer submitted directly, nothing ran)."""
    if ex is None:
        now = datetime.now(UTC)
        step = StepRecord(
            index, action.code, [], None, now, now, 0.0, "final", reward=reward, final_answer=final
        )
    else:
        step = StepRecord(
            index=index,
            code=action.code,
            outputs=result.outputs,
            execution_count=ex.execution_count,
            started=ex.started,
            finished=ex.finished,
            duration=ex.duration,
            status=ex.status,
            interrupted=ex.interrupted,
            restarted=ex.restarted,
            llm_calls=calls,
            reward=reward,
            final_answer=final,
        )
    step.note = note(action)
    return step


def note(action: REPLAction) -> str | None:
    """The prose an agent sent with a step (``metadata["note"]``), kept for the export."""
    text = action.metadata.get("note")
    return shorten(text, _MAX_NOTE_CHARS) if isinstance(text, str) and text.strip() else None


def _printed(text: str, unsent: dict[str, Any], name: str, extra: int = 0) -> int | None:
    """How many chars a stream printed when the kernel sent only part (its state says how
    many it kept back, and ``text`` holds its marker line for them), else None."""
    count = unsent.get(name)
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return None
    return len(text) - len(unsent_marker(count)) + count + extra


def _exception_text(ex: ExecutionResult) -> str | None:
    if ex.status == "timeout":
        return "TimeoutError: the cell exceeded the step timeout"
    if ex.status == "died" and ex.fault is not None:
        return f"MessageTooLarge: {ex.fault}"
    if ex.status == "died":
        return "KernelDied: the kernel process exited while running the cell"
    if ex.error:
        return f"{ex.error.get('ename', 'Error')}: {ex.error.get('evalue', '')}"
    return None


def _fault_notes(ex: ExecutionResult, timeout: float) -> str:
    if ex.fault is not None:
        return (
            f"\n[kernel_env] {ex.fault[:1].upper()}{ex.fault[1:]}, so the host restarted the "
            "kernel. All variables were lost; `context` and the helpers were loaded again.\n"
        )
    if ex.status == "timeout" and not ex.restarted:
        return (
            f"\n[kernel_env] The cell ran longer than {timeout:g} s and was interrupted. "
            "The kernel kept its state: variables from earlier steps are still defined.\n"
        )
    if ex.status == "timeout":
        return (
            f"\n[kernel_env] The cell ran longer than {timeout:g} s and did not stop when "
            "interrupted, so the kernel was restarted. All variables were lost; `context` and "
            "the helpers were loaded again.\n"
        )
    if ex.status == "died":
        return (
            "\n[kernel_env] The kernel process died while running this cell (os._exit, a "
            "signal, or a crash) and was restarted. All variables were lost; `context` and the "
            "helpers were loaded again.\n"
        )
    return ""
