"""rlm's environments on kernel_env: the real ``rlms`` package (pinned in the ``rlm`` extra)
driving ``RLM(environment="kernel_env")``, its root model and sub-calls answered by a fake
OpenAI server on loopback through rlm's own OpenAI client and LM handler."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("rlm")

import nbformat
import rlm.core.rlm
import rlm.environments
from fake_openai import FakeOpenAI
from rlm import RLM
from rlm.logger import RLMLogger
from serverkit import small_settings, thread_server

from kernel_env.integrations.rlm import KernelREPL, register
from kernel_env.kernel import GatewayConfig
from kernel_env.kernel.factory import gateway_source
from kernel_env.kernel.isolation.sandbox import sandbox_problem

pytestmark = [
    pytest.mark.integration,  # kernels, servers or other processes
    # rlm's LMHandler.stop() shuts its server down without closing the listening socket
    # (rlms 0.1.3), which Python reports when the handler is collected.
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"
    ),
]

API_KEY = "sk-rlm-test-key-0f3a9c"


def scripted(*turns: str) -> Any:
    """Root-model turns in order (by how many assistant turns came before); a sub-call (a
    prompt starting "sub:") is answered "SUB(<prompt>)"."""

    def answer(body: dict[str, Any]) -> str:
        last = body["messages"][-1]["content"]
        if isinstance(last, str) and last.startswith("sub:"):
            return f"SUB({last})"
        done = sum(1 for m in body["messages"] if m["role"] == "assistant")
        return turns[min(done, len(turns) - 1)]

    return answer


def transcript(server: FakeOpenAI, index: int) -> str:
    """Everything the model was shown in request ``index`` (REPL outputs included)."""
    return "\n".join(str(m["content"]) for m in server.requests[index].body["messages"])


def repl(code: str) -> str:
    return f"Working.\n```repl\n{code}\n```"


def make_rlm(server: FakeOpenAI, **environment_kwargs: Any) -> RLM:
    environment_kwargs.setdefault("sandbox", "none")
    return RLM(
        backend="openai",
        backend_kwargs={"model_name": "m", "api_key": API_KEY, "base_url": server.url},
        environment="kernel_env",
        environment_kwargs=environment_kwargs,
        max_iterations=4,
    )


def test_an_rlm_completion_runs_in_a_kernel_env_episode(tmp_path: Path) -> None:
    """The root model's code calls llm_query in the kernel (answered by rlm's LM handler, so
    rlm counts it) and finishes with rlm's answer dict; the episode is exported."""
    turns = scripted(
        repl("r = llm_query('sub: ' + context[:5])\nprint(r)"),
        repl('answer["content"] = r.upper()\nanswer["ready"] = True'),
    )
    export = tmp_path / "episode.ipynb"
    with FakeOpenAI(turns) as server:
        out = make_rlm(server, export_path=str(export)).completion("Hello World")
        prompts = [r.body["messages"][-1]["content"] for r in server.requests]
    assert out.response == "SUB(SUB: HELLO)"
    assert "sub: Hello" in prompts
    usage = out.usage_summary.to_dict()["model_usage_summaries"]["m"]
    assert usage["total_calls"] == 3  # two root turns and the kernel's llm_query
    cells = [c.source for c in nbformat.read(export, as_version=4).cells if c.cell_type == "code"]
    assert any("llm_query('sub: '" in c for c in cells)
    assert any('answer["ready"] = True' in c for c in cells)


def test_json_context_and_data_tools() -> None:
    """A dict context is a dict in the kernel; data custom tools are variables; a host function
    is refused with a clear error (it cannot enter an isolated kernel)."""
    with KernelREPL(
        context_payload={"rows": [1, 2, 3]},
        custom_tools={"LIMIT": 7, "names": {"tool": ["a", "b"], "description": "names"}},
        sandbox="none",
    ) as env:
        result = env.execute_code(
            "print(type(context).__name__, sum(context['rows']), LIMIT, names)"
        )
    assert result.stdout.strip() == "dict 6 7 ['a', 'b']", result.stderr
    with pytest.raises(TypeError, match="host function"):
        KernelREPL(context_payload="x", custom_tools={"f": len}, sandbox="none")


def test_results_errors_and_the_end_of_an_episode() -> None:
    """REPLResult carries stdout, the error text, and the final answer once; a block after the
    final answer is not run."""
    with KernelREPL(context_payload="ctx", sandbox="none") as env:
        ok = env.execute_code("x = 41\nprint(x + 1)")
        failed = env.execute_code("1 / 0")
        final = env.execute_code("answer['content'] = x\nanswer['ready'] = True")
        after = env.execute_code("print('ran')")
    assert ok.stdout == "42\n" and ok.final_answer is None
    assert "ZeroDivisionError" in failed.stderr
    assert final.final_answer == "41"
    assert after.stdout == "" and "not run" in after.stderr


def test_a_code_block_that_hangs_is_interrupted() -> None:
    with KernelREPL(context_payload="", sandbox="none", step_timeout=2) as env:
        start = time.monotonic()
        result = env.execute_code("import time\ntime.sleep(60)")
        elapsed = time.monotonic() - start
        after = env.execute_code("print('alive')")
    assert elapsed < 30
    assert "timed out" in (result.stderr + result.stdout).lower() or "interrupt" in result.stderr
    assert after.stdout == "alive\n"


@pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox: {sandbox_problem()}")
def test_sandboxed_kernel_holds_no_host_secret() -> None:
    """In the sandbox, the model's code finds rlm's API key in no process's environment and
    cannot write to the host."""
    project = Path.cwd() / "rlm-was-here"
    turns = scripted(
        repl(
            "import glob\n"
            "key = 'sk-' + 'rlm-test'\n"
            "seen = [p for p in glob.glob('/proc/*/environ')\n"
            "        if key in open(p, 'rb').read().decode(errors='replace')]\n"
            "print('exposed' if seen else 'clean')\n"
            f"try:\n    open({str(project)!r}, 'w')\nexcept OSError as e:\n    print('refused')"
        ),
        repl("answer['content'] = 'done'\nanswer['ready'] = True"),
    )
    with FakeOpenAI(turns) as server:
        out = make_rlm(server, sandbox="bwrap").completion("secret-free context")
        shown = transcript(server, 1)
    assert out.response == "done"
    assert "clean\nrefused" in shown, shown
    assert not project.exists()


def test_episodes_on_a_kernel_env_server(tmp_path: Path) -> None:
    """With base_url the episode runs on a server (its pool, forkserver and sandbox), the token
    given as api_key, which rlm's logger leaves out of its log."""
    token = "server-token-for-rlm-4b1e"
    turns = scripted(repl("print(len(context))"), repl("answer.update(content='ok', ready=True)"))
    logs = tmp_path / "logs"
    settings = small_settings(token=token, sandbox="none")
    with thread_server(settings) as url, FakeOpenAI(turns) as llm:
        agent = RLM(
            backend="openai",
            backend_kwargs={"model_name": "m", "api_key": API_KEY, "base_url": llm.url},
            environment="kernel_env",
            environment_kwargs={"base_url": url, "api_key": token},
            max_iterations=3,
            logger=RLMLogger(log_dir=str(logs)),
        )
        out = agent.completion("twelve chars")
        seen = transcript(llm, 1)
    assert out.response == "ok"
    assert "\n12\n" in seen, seen
    logged = "".join(p.read_text() for p in logs.rglob("*") if p.is_file())
    assert logged and token not in logged


def test_kernels_from_a_gateway(gateway: Any) -> None:
    config = GatewayConfig(url=gateway.url, token=gateway.token, kernel_name="kernel_env")
    with KernelREPL(context_payload=[1, 2], kernel_source=gateway_source(config)) as env:
        result = env.execute_code("print(context + [3])")
    assert result.stdout == "[1, 2, 3]\n", result.stderr


def test_rlm_selects_it_by_name() -> None:
    """The name is rlm's to route; registering twice changes nothing."""
    env = rlm.environments.get_environment("kernel_env", {"sandbox": "none"})
    try:
        assert isinstance(env, KernelREPL)
        assert env.execute_code("print(1 + 1)").stdout == "2\n"
    finally:
        env.cleanup()
    before = rlm.environments.get_environment
    register()
    assert rlm.environments.get_environment is before is rlm.core.rlm.get_environment


def test_llm_query_names_a_model_that_rlms_handler_serves() -> None:
    """``llm_query(prompt, model=NAME)`` goes to rlm's LM handler, which picks the client: a
    model registered through ``other_backends`` answers, and rlm counts it under its name."""
    turns = scripted(
        repl("r = llm_query('sub: small one', model='small')\nprint(r)"),
        repl("answer.update(content=r, ready=True)"),
    )
    with FakeOpenAI(turns) as server:
        kwargs = {"api_key": API_KEY, "base_url": server.url}
        agent = RLM(
            backend="openai",
            backend_kwargs={"model_name": "m", **kwargs},
            other_backends=["openai"],
            other_backend_kwargs=[{"model_name": "small", **kwargs}],
            environment="kernel_env",
            environment_kwargs={"sandbox": "none"},
            max_iterations=3,
        )
        out = agent.completion("ctx")
        asked = [(r.body["model"], r.body["messages"][-1]["content"]) for r in server.requests]
    assert out.response == "SUB(sub: small one)"
    assert ("small", "sub: small one") in asked
    assert out.usage_summary.to_dict()["model_usage_summaries"]["small"]["total_calls"] == 1


def test_data_custom_tools_without_a_context() -> None:
    """Data custom tools are variables even when no context_payload is given."""
    with KernelREPL(custom_tools={"CONFIG": {"limit": 3}}, sandbox="none") as env:
        result = env.execute_code("print(CONFIG['limit'] * 2)")
    assert result.stdout == "6\n", result.stderr


def test_persistent_sessions_keep_the_kernel_across_completions(tmp_path: Path) -> None:
    """``persistent=True``: one kernel for every completion; contexts are context_0,
    context_1, ... (``context`` the first), histories history_0, ...; variables persist."""
    turns = [
        repl("kept = len(context)\nanswer.update(content=str(kept), ready=True)"),
        repl("answer.update(content=f'{kept} {context_1} {context} {len(history_0)}', ready=True)"),
    ]
    count = iter(range(len(turns)))
    with FakeOpenAI(lambda body: turns[next(count)]) as server:
        with RLM(
            backend="openai",
            backend_kwargs={"model_name": "m", "api_key": API_KEY, "base_url": server.url},
            environment="kernel_env",
            environment_kwargs={"sandbox": "none"},
            persistent=True,
            max_iterations=2,
        ) as agent:
            first = agent.completion("four")
            env = agent._persistent_env
            second = agent.completion("second")
            assert isinstance(env, KernelREPL) and agent._persistent_env is env
            assert env.get_context_count() == 2 and env.get_history_count() == 2
        assert env.env is None  # closed with the RLM
    assert first.response == "4"
    assert second.response.startswith("4 second four ")
