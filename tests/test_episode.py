"""An episode end to end on a real kernel: steps, rich outputs, errors, final answers, rewards."""

from __future__ import annotations

import base64

import pytest

from kernel_env import EpisodeFinished, KernelEnv, REPLAction, ResetNeeded, check_env
from kernel_env.errors import KernelError
from kernel_env.inkernel import tuning

pytestmark = pytest.mark.integration  # kernels, servers or other processes

# A 1x1 transparent PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
)


def test_episode_story(env: KernelEnv) -> None:
    """Context, shared variables, a shown expression, rich output, a traceback, FINAL → 1.0."""
    obs = env.reset(context="Hello World", task_prompt="Count chars", expected_answer="11")
    assert obs.observation.context_length == 11
    assert obs.observation.context_preview == "Hello World"

    r1 = env.execute("n = len(context)")
    r2 = env.execute("m = n * 2\nprint('m is', m)")
    r3 = env.execute("n + m")
    assert r1.observation.result.success and r2.observation.result.success
    assert r2.observation.result.stdout == "m is 22\n"
    assert r3.observation.result.stdout.strip() == "33"
    assert r3.observation.result.outputs[0]["output_type"] == "execute_result"
    assert {"n", "m", "context"} <= set(r3.observation.available_variables)
    assert r3.observation.result.locals_snapshot["m"] == "22"

    png = PNG.hex()
    rich = env.execute(
        "from IPython.display import HTML, Image, display\n"
        "display(HTML('<b>bold</b>'))\n"
        f"display(Image(data=bytes.fromhex('{png}')))"
    )
    datas = [o["data"] for o in rich.observation.result.outputs]
    assert datas[0]["text/html"] == "<b>bold</b>"
    assert base64.b64decode(datas[1]["image/png"]) == PNG
    assert "<IPython.core.display.HTML object>" in rich.observation.result.stdout

    err = env.execute("def f():\n    return 1/0\nf()")
    res = err.observation.result
    assert not res.success
    assert res.exception == "ZeroDivisionError: division by zero"
    assert "return 1/0" in res.stderr and "\x1b[" not in res.stderr
    assert err.reward == pytest.approx(-0.05)
    assert not err.done

    final = env.execute("FINAL(n)")
    assert final.done
    assert final.reward == 1.0
    assert final.observation.metadata["final_answer"] == "11"
    assert final.observation.metadata["total_iterations"] == 6
    state = env.state()
    assert state.final_answer == "11" and state.step_count == 6 and state.done


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("FINAL('a (b) c')", "a (b) c"),
        ("print('FINAL(f(x) + (1))')", "f(x) + (1)"),
        ("answer_value = 'v'\nFINAL_VAR('answer_value')", "v"),
        ("answer_value = 'w'\nprint('FINAL_VAR(answer_value)')", "w"),
        ("answer['content'] = 42\nanswer['ready'] = True", "42"),
    ],
)
def test_final_answer_dialects(env: KernelEnv, code: str, expected: str) -> None:
    """FINAL called or printed (nested parens), FINAL_VAR called or printed, answer["ready"]."""
    env.reset(context="c", expected_answer=expected)
    result = env.execute(code)
    assert result.done
    assert result.observation.metadata["final_answer"] == expected
    assert result.reward == 1.0


def test_submit_final_answer_runs_no_code(env: KernelEnv) -> None:
    """An is_final action ends the episode without running its code, scored by the rubric."""
    env.reset(expected_answer="Paris")
    result = env.step(REPLAction(code="raise SystemExit", is_final=True, final_answer=" paris "))
    assert result.done and result.reward == 1.0
    assert result.observation.result.stdout == "Final answer submitted."
    wrong = KernelEnv()
    try:
        wrong.reset(expected_answer="Paris")
        assert wrong.submit_final_answer("Lyon").reward == 0.0
    finally:
        wrong.close()


def test_budget_exhausted(env: KernelEnv) -> None:
    """Reaching max_iterations without an answer ends the episode with reward -0.1."""
    env.reset(max_iterations=2)
    assert not env.execute("x = 1").done
    last = env.execute("x += 1")
    assert last.done and last.reward == pytest.approx(-0.1)
    with pytest.raises(EpisodeFinished):
        env.execute("x")


def test_step_before_reset_is_a_clear_error() -> None:
    """step() before reset() raises ResetNeeded instead of running anything."""
    with KernelEnv() as env, pytest.raises(ResetNeeded, match="reset"):
        env.execute("1")


def test_reset_gives_fresh_namespace_and_kernel(env: KernelEnv) -> None:
    """Each reset runs in a new kernel: earlier variables are gone."""
    env.reset()
    env.execute("secret = 1")
    first = env.environment.kernel
    env.reset()
    assert env.environment.kernel is not first
    assert "NameError" in (env.execute("secret").observation.result.exception or "")


def test_large_context_is_loaded_without_pasting(env: KernelEnv) -> None:
    """A multi-MB context arrives intact (it travels as a file, not as code)."""
    context = "line with needle\n" * 300_000 + "tail-marker"
    obs = env.reset(context=context)
    assert obs.observation.context_length == len(context)
    result = env.execute("(len(context), context.count('needle'), context[-11:])")
    assert result.observation.result.stdout.strip() == f"({len(context)}, 300000, 'tail-marker')"


def test_the_setup_rides_on_the_first_request_and_is_applied_once(env: KernelEnv) -> None:
    """A reset sends the kernel nothing: the episode's setup (context, seed) rides on its
    first request, applied before that request's code, and once: after a first cell that
    fails, the host asks for the state carrying the same setup, which must not set the
    episode up again over what the cell did."""
    env.reset(context="abc", seed=7)
    first = env.execute("import random\ndrawn = random.random()\ncontext = context * 2\n1/0")
    assert first.observation.result.exception == "ZeroDivisionError: division by zero"
    after = env.execute("print(context, drawn == random.Random(7).random())")
    assert after.observation.result.stdout == "abcabc True\n"


def test_an_empty_first_step_carries_the_setup(env: KernelEnv) -> None:
    """IPython runs no cell hook for an empty cell; the request carries the setup all the
    same (not the setup cell a kernel that ignores the request's metadata gets instead)."""
    env.reset(context="xyz")
    assert env.execute("").observation.result.success
    carried = (
        "import kernel_env.inkernel.extension as k\nprint(context, k._episode.setup_token != None)"
    )
    assert env.execute(carried).observation.result.stdout == "xyz True\n"


def test_a_kernel_that_ignores_the_carried_setup_gets_it_as_a_cell(env: KernelEnv) -> None:
    """A kernel whose extension does not read a request's metadata (an older kernel_env in a
    gateway's kernel image): the setup follows as a cell of its own, after the first step."""
    env.reset(context="late")
    kernel = env.environment.kernel
    assert kernel is not None
    unwrap = "k = get_ipython().kernel\nk.do_execute = k.do_execute.__wrapped__"
    assert env._run(kernel.execute(unwrap, silent=True)).success
    assert env.execute("print(context)").observation.result.stdout == "\n"
    assert env.execute("print(context)").observation.result.stdout == "late\n"


def test_a_setup_that_fails_in_the_kernel_fails_the_first_step(env: KernelEnv) -> None:
    """The staged context is gone when the first step carries the setup (taken away on the
    host: a cell cannot reach it): that step fails, saying why, and runs no code."""
    env.reset(context="c" * 100_000)  # long enough to travel as a file
    kernel = env.environment.kernel
    assert kernel is not None and kernel.runtime_dir is not None
    (kernel.runtime_dir / ".kernel_env_context.txt").unlink()
    with pytest.raises(KernelError, match="episode setup failed in the kernel: FileNotFoundError"):
        env.execute("print('ran')")


def test_fuzzy_and_custom_rubrics() -> None:
    """The rubric is configurable: fuzzy matching, or a user callable."""
    from kernel_env import EnvConfig

    with KernelEnv(config=EnvConfig(rubric="fuzzy")) as env:
        env.reset(expected_answer="the answer is 42")
        assert env.submit_final_answer("the answer is 42.").reward > 0.9
    with KernelEnv(config=EnvConfig(rubric=lambda a, e: a.startswith(e))) as env:
        env.reset(expected_answer="4")
        assert env.submit_final_answer("42").reward == 1.0


def test_clobbered_helpers_are_restored(env: KernelEnv) -> None:
    """Rebinding or deleting llm_query or FINAL lasts only until the next step (S3); `answer`
    is the user's variable and keeps its value, as upstream."""
    env.reset()
    env.execute("llm_query = None\ndel FINAL\nanswer = 5")
    result = env.execute("print(callable(llm_query), callable(FINAL), answer)")
    assert result.observation.result.stdout == "True True 5\n"


def test_helpers_hidden_from_namespace_listing(env: KernelEnv) -> None:
    """Helpers are not listed as user variables; context and answer are."""
    env.reset(context="abc")
    names = env.execute("z = 1").observation.available_variables
    assert names == ["answer", "context", "z"]


def test_conformance_local() -> None:
    """The local client passes the reusable conformance check."""
    check_env(KernelEnv(step_timeout=10))


def test_a_cell_is_transformed_once_and_a_new_transformer_applies_to_the_next(
    env: KernelEnv,
) -> None:
    """ipykernel transforms each cell, then IPython's run_cell transforms it again: a tuned
    episode kernel (kernel_env.inkernel.tuning; not on an untested ipykernel) does it once.
    What a cell changes still changes the next cell: a transformer it adds applies there, and
    top-level ``await`` still runs."""
    env.reset()
    counted = env.execute(
        "_ip = get_ipython()\n"
        "_transforms = []\n"
        "_manager = _ip.input_transformer_manager\n"
        "_plain = _manager.transform_cell\n"
        "_manager.transform_cell = lambda cell: (_transforms.append(cell), _plain(cell))[1]"
    )
    assert counted.observation.result.success, counted.observation.result.stderr
    env.execute("x = 1")
    seen = env.execute("print(_transforms)").observation.result.stdout
    once = ["x = 1", "print(_transforms)"]
    expected = once if tuning.enabled() else [c for c in once for _ in (1, 2)]
    assert seen == f"{expected}\n"  # once each when tuned, not twice

    env.execute(
        "_ip.input_transformers_post.append("
        "lambda lines: [line.replace('MAGIC_WORD', '42') for line in lines])"
    )
    assert env.execute("print(MAGIC_WORD)").observation.result.stdout == "42\n"
    waited = env.execute("import asyncio\nawait asyncio.sleep(0)\nprint('awaited')")
    assert waited.observation.result.stdout == "awaited\n"
    broken = env.execute("x = (")
    assert not broken.observation.result.success
    assert "SyntaxError" in broken.observation.result.exception


def test_output_from_threads_and_a_forked_child_arrives_whole_and_in_order(
    env: KernelEnv,
) -> None:
    """Everything a cell prints reaches its output through ipykernel's iopub thread: lines
    from several threads each in their order, and a forked child's line (the child has no
    iopub thread: its output goes to the parent's through ipykernel's pipe)."""
    env.reset()
    threads = env.execute(
        "import sys, threading\n"
        "def _lines(n):\n"
        "    for i in range(200):\n"
        "        sys.stdout.write(f'{n}:{i}\\n')  # one write (print makes two)\n"
        "_ts = [threading.Thread(target=_lines, args=(n,)) for n in range(4)]\n"
        "[t.start() for t in _ts]\n"
        "_lines(4)\n"
        "[t.join() for t in _ts]"
    ).observation.result
    lines = threads.stdout.split()
    for n in range(5):
        assert [line for line in lines if line.startswith(f"{n}:")] == [
            f"{n}:{i}" for i in range(200)
        ]
    forked = env.execute(
        "import os, sys, time\n"
        "_pid = os.fork()\n"
        "if _pid == 0:\n"
        "    print('from the child'); sys.stdout.flush(); os._exit(0)\n"
        "os.waitpid(_pid, 0)\n"
        "time.sleep(0.5)\n"
        "print('from the parent')"
    ).observation.result
    assert forked.success, forked.stderr
    assert sorted(forked.stdout.splitlines()) == ["from the child", "from the parent"]
