"""DSPy's interpreter protocol on a kernel_env kernel: the real ``dspy`` package (pinned in the
``dspy`` extra), a scripted root model (``DummyLM``), a callable sub-model, no network."""

from __future__ import annotations

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
    assert interp.execute("x + 1") == "43"  # a bare last expression, as Jupyter shows it


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
