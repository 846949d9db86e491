"""DSPy's interpreter protocol on a kernel_env kernel: the real ``dspy`` package (pinned in the
``dspy`` extra), a scripted root model (``DummyLM``), a callable sub-model, no network."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

dspy = pytest.importorskip("dspy")

from dspy.primitives.code_interpreter import (  # noqa: E402
    CodeExecutionError,
    CodeInterpreter,
    CodeInterpreterError,
    FinalOutput,
)
from dspy.utils import DummyLM  # noqa: E402
from dspy.utils.callback import BaseCallback  # noqa: E402

from kernel_env.inkernel.contract import DSPY_MODULE  # noqa: E402
from kernel_env.integrations.dspy import KernelInterpreter  # noqa: E402
from kernel_env.kernel import GatewayConfig  # noqa: E402
from kernel_env.kernel.factory import gateway_source, local_source  # noqa: E402

pytestmark = pytest.mark.integration  # kernels, servers or other processes

LOCAL = local_source("none")


@pytest.fixture
def interp() -> Iterator[KernelInterpreter]:
    tools = {"add": lambda a, b: a + b, "fail": _fail}
    with KernelInterpreter(tools, kernel_source=LOCAL, execution_timeout=10) as it:
        yield it


def _fail(**kwargs: Any) -> None:
    raise ValueError("tool broke")


def test_rlm_runs_llm_query_in_the_kernel() -> None:
    """dspy.RLM's root model writes code that calls llm_query in the kernel (answered by the
    sub-model on the host over stdin), then SUBMITs: the prediction carries the answer."""
    prompts: list[str] = []

    def sub_lm(prompt: str, **kwargs: Any) -> list[str]:
        prompts.append(prompt)
        return [f"sub-answer to {prompt}"]

    root = DummyLM(
        [
            {"reasoning": "ask", "code": "```python\nr = llm_query('hello')\nprint(r)\n```"},
            {"reasoning": "done", "code": "SUBMIT(r.upper())"},
        ]
    )
    rlm = dspy.RLM(
        "context -> answer",
        max_iters=4,
        sub_lm=sub_lm,
        interpreter_factory=lambda: KernelInterpreter(kernel_source=LOCAL),
    )
    with dspy.context(lm=root):
        prediction = rlm(context="some text")
    assert prediction.answer == "SUB-ANSWER TO HELLO"
    assert prompts == ["hello"]
    assert prediction.trajectory[0]["output"] == "sub-answer to hello"


def test_protocol_shape(interp: KernelInterpreter) -> None:
    """It is a CodeInterpreter: tools dict, start/execute/shutdown."""
    assert isinstance(interp, CodeInterpreter)
    assert set(interp.tools) == {"add", "fail"}


def test_state_persists_and_variables_are_injected(interp: KernelInterpreter) -> None:
    """Variables given to execute are globals; state lasts across calls; output is returned."""
    assert interp.execute("x = n * 2", {"n": 21}) is None
    assert interp.execute("print(x)") == "42"
    assert interp.execute("x + 1") == 43  # a bare last expression: its value, as in DSPy


def test_tools_are_host_calls(interp: KernelInterpreter) -> None:
    """A tool runs on the host; its failure is a CodeExecutionError naming it."""
    assert interp.execute("print(add(2, b=3))") == "5"
    with pytest.raises(CodeExecutionError, match="tool broke"):
        interp.execute("fail()")


def test_submit_with_output_fields(interp: KernelInterpreter) -> None:
    """SUBMIT by position or name maps to the output fields; code after it does not run."""
    interp.output_fields = [{"name": "answer"}, {"name": "confidence"}]
    final = interp.execute("SUBMIT('yes', 0.9)\nprint('not reached')")
    assert final == FinalOutput({"answer": "yes", "confidence": 0.9})
    assert interp.execute("SUBMIT(confidence=1, answer='no')") == FinalOutput(
        {"answer": "no", "confidence": 1}
    )
    with pytest.raises(CodeExecutionError, match="SUBMIT fields"):
        interp.execute("SUBMIT('only one')")


def test_errors_map_to_dspy_exceptions(interp: KernelInterpreter) -> None:
    """Syntax errors raise SyntaxError, runtime errors CodeExecutionError; input() fails."""
    with pytest.raises(SyntaxError):
        interp.execute("def (")
    with pytest.raises(CodeExecutionError, match="ZeroDivisionError"):
        interp.execute("1 / 0")
    with pytest.raises(CodeExecutionError, match="EOFError"):
        interp.execute("input('name? ')")


def test_timeout_interrupts_and_keeps_state() -> None:
    """A cell past execution_timeout is interrupted (CodeExecutionError); state survives."""
    with KernelInterpreter(kernel_source=LOCAL, execution_timeout=1) as it:
        it.execute("kept = 7")
        with pytest.raises(CodeExecutionError, match="TimeoutError"):
            it.execute("while True: pass")
        assert it.execute("print(kept)") == "7"


def test_no_use_after_shutdown() -> None:
    """After shutdown the interpreter refuses to run code."""
    it = KernelInterpreter(kernel_source=LOCAL)
    it.execute("1")
    it.shutdown()
    with pytest.raises(CodeInterpreterError):
        it.execute("1")


def test_kernels_from_a_gateway(gateway: Any) -> None:
    """The same interpreter on a Kernel Gateway's kernel: tools still answered on the host."""
    config = GatewayConfig(url=gateway.url, token=gateway.token, kernel_name="kernel_env")
    with KernelInterpreter({"add": lambda a, b: a + b}, kernel_source=gateway_source(config)) as it:
        it.execute("x = add(1, 2)")
        assert it.execute("print(x)") == "3"


# -- DSPy's interpreter contract: large variables, callbacks, re-entrancy, values -----------


def test_large_variables_are_staged_not_pasted() -> None:
    """150 MiB of variables reach the kernel through a staged file in seconds (pasted into a
    cell, they took longer than any preparation may), and the session goes on."""
    big = "x" * (150 * 2**20)
    with KernelInterpreter(kernel_source=LOCAL, execution_timeout=60) as it:
        it.execute("kept = 1")
        start = time.monotonic()
        assert it.execute("print(len(big), kept)", {"big": big}) == f"{len(big)} 1"
        elapsed = time.monotonic() - start
        assert it.execute("print(kept + 1)") == "2"
    assert elapsed < 20, elapsed


def test_variables_past_the_bound_are_refused_and_the_session_goes_on() -> None:
    """Variables larger than ``max_variables_bytes`` are refused before anything is sent:
    the session keeps its state and its tools (never half-prepared)."""
    with KernelInterpreter(
        {"add": lambda a, b: a + b}, kernel_source=LOCAL, max_variables_bytes=2**20
    ) as it:
        it.execute("kept = add(1, 2)")
        with pytest.raises(CodeInterpreterError, match="max_variables_bytes"):
            it.execute("print(len(big))", {"big": "y" * 2**21})
        assert it.execute("print(kept, add(kept, 1))") == "3 4"


def test_the_session_is_never_left_half_prepared() -> None:
    """Preparing a run does not depend on kernel state the code can break; a kernel lost
    meanwhile ends the session with CodeInterpreterError, and every later call says so
    (never an internal KeyError)."""
    with KernelInterpreter(kernel_source=LOCAL, execution_timeout=10) as it:
        it.execute("import sys, os\nkept = 5")
        it.execute(f"del sys.modules[{DSPY_MODULE!r}]")
        assert it.execute("print(kept + v)", {"v": 1}) == "6"
        with pytest.raises(CodeInterpreterError, match="restarted"):
            it.execute("os._exit(1)")
        for _ in range(2):
            with pytest.raises(CodeInterpreterError, match="session"):
                it.execute("print(1)", {"v": 1})


def _local_interpreter() -> KernelInterpreter:
    return KernelInterpreter(kernel_source=LOCAL)


class Recording(BaseCallback):
    """DSPy's interpreter events, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def on_interpreter_startup_start(self, call_id: str, instance: Any, inputs: Any) -> None:
        self.events.append(("startup_start", None))

    def on_interpreter_execute_start(self, call_id: str, instance: Any, inputs: Any) -> None:
        self.events.append(("execute_start", inputs["code"]))

    def on_interpreter_execute_end(self, call_id: str, outputs: Any, exception: Any = None) -> None:
        self.events.append(("execute_end", outputs if exception is None else repr(exception)))

    def on_interpreter_tool_call_start(self, call_id: str, instance: Any, inputs: Any) -> None:
        self.events.append(("tool_start", (inputs["tool_name"], inputs["args"], inputs["kwargs"])))

    def on_interpreter_tool_call_end(
        self, call_id: str, outputs: Any, exception: Any = None
    ) -> None:
        self.events.append(("tool_end", outputs))

    def on_interpreter_shutdown_start(self, call_id: str, instance: Any, inputs: Any) -> None:
        self.events.append(("shutdown_start", None))


def test_interpreter_callbacks_see_kernel_executions() -> None:
    """Instance callbacks (``callbacks=``) and DSPy's configured ones see startup, each
    execute and each tool call, in order."""
    mine, configured = Recording(), Recording()
    with dspy.context(callbacks=[configured]):
        it = KernelInterpreter({"add": lambda a, b: a + b}, kernel_source=LOCAL, callbacks=[mine])
        with it:
            assert it.execute("add(2, b=3)") == 5
        assert it.callbacks == [mine]
    expected = [
        ("startup_start", None),
        ("execute_start", "add(2, b=3)"),
        ("tool_start", ("add", [2], {"b": 3})),
        ("tool_end", 5),
        ("execute_end", 5),
        ("shutdown_start", None),
    ]
    assert mine.events == expected
    assert configured.events == expected


def test_a_reentrant_execute_fails_at_once() -> None:
    """A tool that calls execute() on its own interpreter gets DSPy's "cannot execute
    recursively" at once, instead of waiting out the timeout; the session goes on."""
    holder: dict[str, KernelInterpreter] = {}

    def nested() -> Any:
        return holder["it"].execute("1 + 1")

    with KernelInterpreter({"nested": nested}, kernel_source=LOCAL, execution_timeout=20) as it:
        holder["it"] = it
        start = time.monotonic()
        with pytest.raises(CodeExecutionError, match="cannot execute recursively"):
            it.execute("nested()")
        assert time.monotonic() - start < 5
        assert it.execute("print('alive')") == "alive"


def test_bare_expressions_return_their_json_values(interp: KernelInterpreter) -> None:
    """As DSPy's own interpreters: a bare last expression's value when it is JSON (a string
    as is), its repr otherwise; printed text when there is none."""
    assert interp.execute("41 + 1") == 42
    assert interp.execute("import json\njson.dumps({'a': [1, 2]})") == '{"a": [1, 2]}'
    assert interp.execute("{'a': None, 'b': [1.5, True]}") == {"a": None, "b": [1.5, True]}
    assert interp.execute("print('shown')\nNone") == "shown"
    assert interp.execute("object").startswith("<class")
    assert interp.execute("x = 1;") is None
    assert interp.execute("1;") is None


# DummyLM is called with messages=, which DSPy 3.4 deprecates (the warning is raised in the
# Flex predictor's host-side call).
@pytest.mark.filterwarnings("ignore:Passing OpenAI-style message:DeprecationWarning")
def test_flex_runs_on_the_kernel() -> None:
    """dspy.Flex runs its module in the kernel and json.loads what the kernel returns."""

    class Signature(dspy.Signature):
        value: int = dspy.InputField()
        result: int = dspy.OutputField()

    source = (
        "class AddModule(dspy.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.solve = dspy.Predict('value: int -> result: int')\n"
        "\n"
        "    def forward(self, **inputs):\n"
        "        predicted = self.solve(value=inputs['value'])\n"
        "        return dspy.Prediction(result=predicted.result + 1)\n"
    )
    program = dspy.Flex(
        Signature, interpreter_factory=lambda: KernelInterpreter(kernel_source=LOCAL)
    )
    program._bind_code(source)
    with dspy.context(lm=DummyLM([{"result": 41}])):
        assert program(value=20).result == 42
