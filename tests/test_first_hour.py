"""A newcomer's first hour: every wrong input gets a clear answer. The CLI is driven as a user
types it (the venv's ``kernel-env`` in a subprocess); the client in a second Python process."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbformat
import pytest
from fake_openai import FakeOpenAI
from gateway import free_port
from serverkit import make_client, small_settings, thread_server

from kernel_env import KernelEnv
from kernel_env.cli import _parser
from kernel_env.kernel.factory import local_source

pytestmark = pytest.mark.integration  # kernels, servers or other processes

KERNEL_ENV = str(Path(sys.executable).with_name("kernel-env"))
KEY = "sk-first-hour-77aa"
VERSION = importlib.metadata.version("kernel-env")


def cli(*args: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KERNEL_ENV, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a second Python process, the way a user's script runs."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


# -- versions and flags ------------------------------------------------------------------


def test_one_version_everywhere() -> None:
    shown = cli("--version")
    assert shown.returncode == 0 and shown.stdout.strip() == f"kernel-env {VERSION}"
    with make_client() as client:
        assert client.get("/openapi.json").json()["info"]["version"] == VERSION
        assert client.get("/metadata").json()["version"] == VERSION


def test_every_flag_names_its_default() -> None:
    commands = next(
        a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    for name, command in commands.items():
        for action in command._actions:
            if (
                not action.option_strings
                or action.required
                or isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction))
            ):
                continue
            assert "default" in (action.help or ""), f"{name} {action.option_strings}"


@pytest.mark.parametrize("command", ["run", "replay", "serve"])
def test_a_negative_step_timeout_is_refused_everywhere(command: str, tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("x")
    nb = tmp_path / "n.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), nb)
    args = {
        "run": ["--context", str(tmp_path / "c.txt"), "--task", "t", "--model", "m"],
        "replay": [str(nb)],
        "serve": ["--port", "0"],
    }[command]
    done = cli(command, *args, "--step-timeout", "-1", timeout=60)
    assert done.returncode == 2, done.stderr
    assert "greater than 0" in done.stderr or "step_timeout" in done.stderr, done.stderr


# -- kernel-env run ----------------------------------------------------------------------


def _run_args(tmp_path: Path, url: str, *more: str) -> list[str]:
    context = tmp_path / "c.txt"
    context.write_text("Hello World")
    return [
        "run",
        "--context",
        str(context),
        "--task",
        "How many characters?",
        "--model",
        "m",
        "--model-url",
        url,
        "--output",
        str(tmp_path),
        "--name",
        "r",
        "--sandbox",
        "none",
        *more,
    ]


def test_run_without_a_final_answer_exits_1(tmp_path: Path) -> None:
    """--max-iterations 1 with a model that never says FINAL: no "iteration 2/1", no reward
    line without an expected answer, the last reply shown as not final, exit status 1."""
    with FakeOpenAI(lambda body: "```repl\nprint(len(context))\n```") as fake:
        done = cli(
            *_run_args(tmp_path, fake.url, "--max-iterations", "1"), KERNEL_ENV_LLM_API_KEY=KEY
        )
    assert done.returncode == 1, done.stderr
    assert "iteration 2/1" not in done.stderr and "iteration 1/1" in done.stderr
    assert "out of iterations" in done.stderr and "reward" not in done.stderr
    assert "[no final answer given]" in done.stdout


def test_run_json_verbose_and_reward(tmp_path: Path) -> None:
    turns = ["```repl\nn = len(context)\nprint(n)\n```", "```repl\nFINAL_VAR('n')\n```"]

    def model(body: dict[str, Any]) -> str:
        return turns[sum(1 for m in body["messages"] if m["role"] == "assistant")]

    with FakeOpenAI(model) as fake:
        done = cli(
            *_run_args(tmp_path, fake.url, "--json", "--verbose", "--expected-answer", "11"),
            KERNEL_ENV_LLM_API_KEY=KEY,
        )
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)
    assert outcome["answer"] == "11" and outcome["final"] is True and outcome["reward"] == 1.0
    assert Path(outcome["notebook"]).is_file() and Path(outcome["trajectory"]).is_file()
    assert "n = len(context)" in done.stderr and "reward 1" in done.stderr  # echoed, scored


def _interrupted_run(
    tmp_path: Path, model: Callable[[dict[str, Any]], str], ready: Callable[[Any, str], bool]
) -> tuple[int, str, str]:
    """``kernel-env run`` against ``model``, sent SIGINT (as Ctrl-C in a terminal) once
    ``ready(fake, stderr so far)``; its exit code, stdout and stderr."""
    errors = tmp_path / "stderr.txt"
    with FakeOpenAI(model) as fake, errors.open("w") as sink:
        process = subprocess.Popen(
            [KERNEL_ENV, *_run_args(tmp_path, fake.url)],
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
            env={**os.environ, "KERNEL_ENV_LLM_API_KEY": KEY},
            # As in a terminal: a job started in the background (CI) inherits SIGINT ignored.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            deadline = time.monotonic() + 120
            while not ready(fake, errors.read_text()) and time.monotonic() < deadline:
                time.sleep(0.1)
            process.send_signal(signal.SIGINT)
            out, _ = process.communicate(timeout=60)
        finally:
            if process.poll() is None:  # never leave it (and its kernel) behind
                process.kill()
                process.communicate(timeout=30)
    return process.returncode, out, errors.read_text()


def test_ctrl_c_prints_what_was_written(tmp_path: Path) -> None:
    """Ctrl-C while the model thinks: the partial notebook is written and its path printed."""

    def model(body: dict[str, Any]) -> str:
        if any(m["role"] == "assistant" for m in body["messages"]):
            time.sleep(60)  # the second turn: the user gives up waiting
        return "```repl\nx = 1\nprint(x)\n```"

    code, out, said = _interrupted_run(tmp_path, model, lambda fake, said: "iteration 1/" in said)
    assert code == 130, said
    notebook = Path(out.split("notebook: ", 1)[1].splitlines()[0])
    assert notebook.is_file() and "x = 1" in notebook.read_text()


# -- kernel-env replay and export --------------------------------------------------------


def _exported(tmp_path: Path) -> Path:
    with KernelEnv(kernel_source=local_source("none")) as env:
        env.reset()
        env.execute("print(6 * 7)")
        return env.export_notebook(tmp_path / "episode.ipynb")


def test_replay_shows_a_diff_and_speaks_json(tmp_path: Path) -> None:
    path = _exported(tmp_path)
    nb = nbformat.read(path, as_version=4)
    step = next(c for c in nb.cells if c.cell_type == "code" and "6 * 7" in c.source)
    step.outputs[0]["text"] = "43\n"
    nbformat.write(nb, path)
    shown = cli("replay", str(path), "--sandbox", "none")
    assert shown.returncode == 1
    assert "-[stdout] 43" in shown.stdout and "+[stdout] 42" in shown.stdout
    as_json = json.loads(cli("replay", str(path), "--sandbox", "none", "--json").stdout)
    assert as_json["all_match"] is False and as_json["counts"] == {"mismatch": 1}
    assert "+[stdout] 42" in as_json["cells"][0]["diff"]


def test_replay_refuses_what_is_not_a_notebook_and_warns_on_foreign_ones(tmp_path: Path) -> None:
    not_a_notebook = tmp_path / "data.ipynb"
    not_a_notebook.write_text('{"rows": [1, 2]}')
    refused = cli("replay", str(not_a_notebook))
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0 and "not a Jupyter notebook" in refused.stderr
    foreign = tmp_path / "mine.ipynb"
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print('hi')")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n")]
    nb.cells.append(cell)
    nbformat.write(nb, foreign)
    warned = cli("replay", str(foreign), "--sandbox", "none")
    assert warned.returncode == 0, warned.stdout + warned.stderr
    assert "was not exported by kernel-env" in warned.stderr


def test_export_of_a_missing_notebook_says_so(tmp_path: Path) -> None:
    done = cli("export", str(tmp_path / "nothere.ipynb"))
    assert done.returncode == 2 and "no such notebook" in done.stderr


def test_recorded_cells_say_they_are_not_rerun() -> None:
    with KernelEnv(kernel_source=local_source("none")) as env:
        env.reset()
        out = env.run("%%kernel_env_recorded interrupted\nimport time\ntime.sleep(600)")
    assert "timed out when it was recorded; it is not run again" in out.stdout


# -- serve ----------------------------------------------------------------------------


def test_serve_names_a_busy_port() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = cli("serve", "--port", str(port), "--sandbox", "none", timeout=60)
    assert done.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr
    assert "--port N" in done.stderr and "make serve PORT=N" in done.stderr  # either way in


def test_an_unreachable_gateway_is_one_line_a_failure() -> None:
    process = subprocess.Popen(
        [KERNEL_ENV, "serve", "--port", "0", "--gateway-url", f"http://127.0.0.1:{free_port()}"],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    said: list[str] = []
    failures: list[str] = []
    deadline = time.monotonic() + 90  # the retries are seconds apart; a loaded machine is slow
    while len(failures) < 2 and time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        said.append(line)
        failures += [line] if "failed to start (" in line else []
    process.send_signal(signal.SIGTERM)
    said += process.communicate(timeout=60)[1].splitlines(keepends=True)
    assert len(failures) >= 2, "".join(said)
    assert "Traceback" not in "".join(said) and "next try in" in failures[-1]


# -- the remote client -------------------------------------------------------------------


def test_the_client_reads_the_token_variable_and_says_how_to_pass_one() -> None:
    token = "first-hour-token-31"
    code = """
        from kernel_env import KernelEnv
        with KernelEnv(base_url="{url}") as env:
            env.reset()
            print(env.run("1 + 1").stdout.strip())
    """
    with thread_server(small_settings(token=token, sandbox="none")) as url:
        ok = python(code.replace("{url}", url), KERNEL_ENV_TOKEN=token)
        env = {k: v for k, v in os.environ.items() if k != "KERNEL_ENV_TOKEN"}
        refused = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code.replace("{url}", url))],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    assert ok.returncode == 0 and ok.stdout.strip() == "2", ok.stderr
    assert refused.returncode == 1
    assert "pass token= or set KERNEL_ENV_TOKEN" in refused.stderr.splitlines()[-1]
    assert "The above exception" not in refused.stderr


def test_a_server_that_is_down_is_one_clear_connection_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    down = python(f"from kernel_env import KernelEnv\nKernelEnv(base_url={url!r}).reset()")
    last = down.stderr.strip().splitlines()[-1]
    assert last.startswith("ConnectionError: cannot reach the kernel-env server at " + url)
    assert len(down.stderr.splitlines()) < 15 and "The above exception" not in down.stderr


def test_llm_query_on_a_server_without_a_model_tells_the_operator_what_to_set() -> None:
    with thread_server(small_settings(sandbox="none")) as url, KernelEnv(base_url=url) as env:
        env.reset()
        result = env.run("x = llm_query('hi')")
    assert not result.success and "--llm-base-url" in (result.exception or "")
    assert "call_host" not in result.stderr  # kernel_env's own frames are not shown


# -- the first hour's issue: remote errors, export, messages --------------------------------


def _without(*names: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in names}


def _cli_in(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KERNEL_ENV, *args], capture_output=True, text=True, timeout=120, env=env)


def test_export_takes_an_episode_id_as_well_as_a_session_id(tmp_path: Path) -> None:
    """`kernel-env export` with the episode id that /web and state() show finds its session;
    `kernel-env ps` lists episode ids; an id that names nothing says where ids are listed."""
    env = _without("KERNEL_ENV_TOKEN", "KERNEL_ENV_URL")
    chosen, made = tmp_path / "chosen.ipynb", tmp_path / "made.ipynb"
    with thread_server(small_settings(sandbox="none")) as url, KernelEnv(base_url=url) as client:
        client.reset(episode_id="first-hour-episode")
        client.execute("print(6 * 7)")
        by_name = _cli_in(env, "export", "first-hour-episode", "--url", url, "-o", str(chosen))
        client.reset()  # an episode id the server makes
        client.execute("print(7 * 8)")
        episode = client.state().episode_id
        by_uuid = _cli_in(env, "export", episode, "--url", url, "-o", str(made))
        listed = _cli_in(env, "ps", "--url", url)
        nothing = _cli_in(env, "export", "no-such-episode", "--url", url)
    assert by_name.returncode == 0, by_name.stderr
    assert "6 * 7" in chosen.read_text()
    assert by_uuid.returncode == 0, by_uuid.stderr
    assert "7 * 8" in made.read_text()
    assert episode in listed.stdout, listed.stdout
    assert nothing.returncode == 2 and "kernel-env ps" in nothing.stderr, nothing.stderr


def test_a_client_tenant_resolves_only_its_own_episode_ids(tmp_path: Path) -> None:
    """An episode id is looked up among the asking tenant's own sessions: another tenant's
    episode id is answered as an id that names nothing, byte for byte."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice client alice-token-first-hour-1\nbob client bob-token-first-hour-22\n")
    tokens.chmod(0o600)
    alice = {"Authorization": "Bearer alice-token-first-hour-1"}
    bob = {"Authorization": "Bearer bob-token-first-hour-22"}
    with make_client(sandbox="none", tokens_file=str(tokens)) as client:
        reset = client.post("/reset", json={"episode_id": "alices-episode"}, headers=alice)
        assert reset.status_code == 200
        own = client.get("/sessions/alices-episode/export.zip", headers=alice)
        theirs = client.get("/sessions/alices-episode/export.zip", headers=bob)
        nothing = client.get("/sessions/nobodys-episode/export.zip", headers=bob)
    assert own.status_code == 200 and own.content.startswith(b"PK")
    assert theirs.status_code == 404
    assert (theirs.status_code, theirs.text) == (nothing.status_code, nothing.text)


def test_export_onto_an_existing_file_names_the_cli_flag(tmp_path: Path) -> None:
    env = _without("KERNEL_ENV_TOKEN", "KERNEL_ENV_URL")
    target = str(tmp_path / "e.ipynb")
    with thread_server(small_settings(sandbox="none")) as url, KernelEnv(base_url=url) as client:
        client.reset()
        client.execute("1")
        session = client.state().episode_id
        first = _cli_in(env, "export", session, "--url", url, "-o", target)
        again = _cli_in(env, "export", session, "--url", url, "-o", target)
        forced = _cli_in(env, "export", session, "--url", url, "-o", target, "--overwrite")
    assert first.returncode == 0, first.stderr
    assert again.returncode == 2 and "--overwrite" in again.stderr, again.stderr
    assert "overwrite=True" not in again.stderr
    assert forced.returncode == 0, forced.stderr


def test_a_server_that_is_down_is_one_message_everywhere(tmp_path: Path) -> None:
    """ps, export and the Python client say the same sentence: the URL, and what to do."""
    url = f"http://127.0.0.1:{free_port()}"
    env = _without("KERNEL_ENV_TOKEN", "KERNEL_ENV_URL")
    ps = _cli_in(env, "ps", "--url", url)
    export = _cli_in(env, "export", "some-session", "--url", url, "-o", str(tmp_path / "x"))
    client = python(f"from kernel_env import KernelEnv\nKernelEnv(base_url={url!r}).reset()")
    assert ps.returncode == export.returncode == 2 and client.returncode == 1
    said = {
        ps.stderr.strip().removeprefix("kernel-env ps: "),
        export.stderr.strip().removeprefix("kernel-env export: "),
        client.stderr.strip().splitlines()[-1].removeprefix("ConnectionError: "),
    }
    assert len(said) == 1, said
    (sentence,) = said
    assert sentence.startswith(f"cannot reach the kernel-env server at {url} (")
    for words in ("is it running?", "kernel-env serve", "make serve", "KERNEL_ENV_URL", "--url"):
        assert words in sentence, sentence


def test_run_names_an_unreachable_model_endpoint_the_same_way(tmp_path: Path) -> None:
    """`kernel-env run` says it in the same words, for the model's endpoint and its flag."""
    url = f"http://127.0.0.1:{free_port()}/v1"
    done = cli(*_run_args(tmp_path, url), KERNEL_ENV_LLM_API_KEY=KEY)
    assert done.returncode == 1
    assert f"cannot reach the model endpoint at {url} (" in done.stderr, done.stderr
    assert "is it running?" in done.stderr
    assert "--model-url" in done.stderr and "KERNEL_ENV_LLM_BASE_URL" in done.stderr


def test_ps_and_export_say_a_wrong_token_was_refused() -> None:
    token = "first-hour-ps-token-5"
    with thread_server(small_settings(token=token, sandbox="none", pool_size=0)) as url:
        wrong = {**_without("KERNEL_ENV_URL"), "KERNEL_ENV_TOKEN": "not-the-token"}
        none = _without("KERNEL_ENV_TOKEN", "KERNEL_ENV_URL")
        ps_wrong, ps_none = _cli_in(wrong, "ps", "--url", url), _cli_in(none, "ps", "--url", url)
        export_wrong = _cli_in(wrong, "export", "s", "--url", url)
    for done in (ps_wrong, export_wrong):
        assert done.returncode == 2 and "refused the token in KERNEL_ENV_TOKEN" in done.stderr
        assert "set KERNEL_ENV_TOKEN" not in done.stderr
    assert ps_none.returncode == 2 and "set KERNEL_ENV_TOKEN" in ps_none.stderr


def test_a_step_after_the_end_names_the_http_route_or_the_ws_frame() -> None:
    with make_client(sandbox="none") as client:
        reset = client.post("/reset", json={})
        headers = {"X-Session-Id": reset.headers["X-Session-Id"]}
        final = {"action": {"is_final": True, "final_answer": "1"}}
        assert client.post("/step", json=final, headers=headers).status_code == 200
        http = client.post("/step", json={"action": {"code": "1"}}, headers=headers)
        with client.websocket_connect("/ws") as ws:
            ws.send_json({"type": "reset"})
            ws.receive_json()
            ws.send_json({"type": "step", "data": {"is_final": True, "final_answer": "1"}})
            ws.receive_json()
            ws.send_json({"type": "step", "data": {"code": "1"}})
            frame = ws.receive_json()
    assert http.status_code == 409 and "POST /reset" in http.json()["detail"]
    assert "reset()" not in http.json()["detail"]
    assert frame["type"] == "error" and '{"type": "reset"}' in frame["data"]["message"]
    assert frame["data"]["exception"] == "EpisodeFinished"


def test_kernel_env_takes_the_async_clients_keywords() -> None:
    """KernelEnv.__init__ and reset() spell out AsyncKernelEnv's keywords (names, defaults),
    so help() and IDEs show them; a mistyped one is reported against the method called."""
    import inspect

    from kernel_env import AsyncKernelEnv

    for method in ("__init__", "reset"):
        sync = inspect.signature(getattr(KernelEnv, method)).parameters
        both = inspect.signature(getattr(AsyncKernelEnv, method)).parameters
        assert [(p.name, p.kind, p.default) for p in sync.values()] == [
            (p.name, p.kind, p.default) for p in both.values()
        ], method
    assert "connect_timeout_s" in (KernelEnv.__init__.__doc__ or "")
    assert KernelEnv.__init__.__doc__ == AsyncKernelEnv.__init__.__doc__
    with pytest.raises(TypeError, match=r"KernelEnv\.__init__\(\) got an unexpected"):
        KernelEnv(step_timout=3)  # type: ignore[call-arg]
    with KernelEnv() as env, pytest.raises(TypeError, match=r"^KernelEnv\.reset\(\) got an"):
        env.reset(contxt="x")  # type: ignore[call-arg]


def test_call_reset_first_has_one_wording() -> None:
    """A step, a fork, a state and an export before any reset say the same thing."""
    from kernel_env.errors import ResetNeeded

    said = []
    with KernelEnv() as env:
        for call in (
            lambda: env.execute("1"),
            lambda: env.fork(),
            lambda: env.state(),
            lambda: env.export_notebook("/tmp/never-written.ipynb"),
        ):
            with pytest.raises(ResetNeeded) as raised:
                call()
            said.append(str(raised.value))
    assert set(said) == {"Environment not initialized. Call reset() first."}


def test_run_without_a_key_for_a_public_endpoint_is_refused(tmp_path: Path) -> None:
    """No --model-url (nor a variable naming one) and no key: OpenAI's endpoint would be called
    with no key; the run is refused, naming what to set, before anything starts."""
    (tmp_path / "c.txt").write_text("x")
    keys = ("KERNEL_ENV_LLM_API_KEY", "OPENAI_API_KEY", "HF_TOKEN")
    env = _without(*keys, "KERNEL_ENV_LLM_BASE_URL", "OPENAI_BASE_URL")
    args = ["run", "--context", str(tmp_path / "c.txt"), "--task", "t", "--model", "m"]
    done = _cli_in(env, *args, "--output", str(tmp_path))
    assert done.returncode == 2, done.stderr
    for name in (*keys, "--model-url"):
        assert name in done.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "c.txt"]


def test_a_failed_run_prints_the_trajectory_it_wrote(tmp_path: Path) -> None:
    """The model fails on its second turn: what ran is kept, and both paths are printed."""
    from fake_openai import Reply

    def model(body: dict[str, Any]) -> Any:
        if any(m["role"] == "assistant" for m in body["messages"]):
            return Reply(400, '{"error": "context too long"}')
        return "```repl\nx = 1\nprint(x)\n```"

    with FakeOpenAI(model) as fake:
        done = cli(*_run_args(tmp_path, fake.url), KERNEL_ENV_LLM_API_KEY=KEY)
    assert done.returncode == 1, done.stderr
    trajectory = tmp_path / "r.trajectory.jsonl"
    assert trajectory.is_file() and "the run failed" in done.stderr
    assert f"trajectory: {trajectory}" in done.stdout, done.stdout + done.stderr
    assert f"notebook: {tmp_path / 'r.ipynb'}" in done.stdout


def test_ctrl_c_before_the_first_cell_says_nothing_ran(tmp_path: Path) -> None:
    """Interrupted while the model thinks about its first turn: nothing ran, so nothing is
    written, and it says so (not "writing what ran so far")."""

    def model(body: dict[str, Any]) -> str:
        time.sleep(60)
        return "FINAL(1)"

    code, out, said = _interrupted_run(tmp_path, model, lambda fake, said: bool(fake.requests))
    assert code == 130, said
    assert "writing what ran so far" not in said and "nothing ran" in said, said
    assert "notebook:" not in out and "trajectory:" not in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "stderr.txt"]


def test_the_concepts_page_lists_every_field_of_a_cells_result() -> None:
    """docs/concepts.md's `CodeBlockResult` table, what `observation.result` holds, names each
    of its fields, and no field it does not have."""
    import re

    from kernel_env.models import CodeBlockResult

    concepts = (Path(__file__).resolve().parent.parent / "docs" / "concepts.md").read_text()
    table = concepts.split("\n`CodeBlockResult`:\n", 1)[1].lstrip("\n").split("\n\n", 1)[0]
    rows = [row.split("|")[1] for row in table.splitlines()[2:]]  # the field column
    listed = {name for row in rows for name in re.findall(r"`([a-z_]+)`", row)}
    assert listed == set(CodeBlockResult.model_fields), listed


# -- polish ------------------------------------------------------------------------------


def test_a_mistyped_flag_shows_the_commands_usage_and_the_nearest_flag() -> None:
    done = cli("serve", "--prot", "9000")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: kernel-env serve"), done.stderr
    assert "unrecognized arguments: --prot 9000 (did you mean --port?)" in done.stderr


def _first_lines(args: list[str], until: str, timeout: float = 60) -> str:
    """What ``kernel-env serve`` prints up to the line holding ``until``; then it is stopped."""
    said = []
    with subprocess.Popen(
        [KERNEL_ENV, "serve", *args], stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as serve:
        assert serve.stderr is not None
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                line = serve.stderr.readline()
                said.append(line)
                if until in line or not line:
                    break
        finally:
            os.killpg(serve.pid, signal.SIGINT)
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()
                pytest.fail(f"kernel-env serve outlived its SIGINT by 60 s:\n{''.join(said)}")
    return "".join(said)


def test_serving_every_interface_without_a_token_says_what_that_means() -> None:
    """No token on 0.0.0.0: anyone who reaches the port runs code; how to set a token."""
    port = str(free_port())
    env_args = ["--port", port, "--pool-size", "0", "--sandbox", "none", "--forkserver", "false"]
    said = _first_lines(["--host", "0.0.0.0", *env_args], until="--tokens-file")
    assert f"no token is set and 0.0.0.0:{port} is reachable from other hosts" in said
    assert "anyone who can connect to that port runs code on this machine" in said
    assert "KERNEL_ENV_TOKEN" in said and "Authorization: Bearer" in said


def test_a_huge_print_reports_the_size_that_was_printed() -> None:
    """100 MB printed: the kernel sends 1 MB, and the observation names the 100 MB."""
    with KernelEnv() as env:
        env.reset()
        out = env.run("print('x' * 100_000_000)").stdout
        err = env.run("import sys; sys.stderr.write('y' * 3_000_000)").stderr
        small = env.run("print('z' * 50_000)").stdout
    assert "of 100000001 chars cut" in out
    assert "of 3000000 chars cut" in err
    assert "of 50001 chars cut" in small


def test_a_plain_script_gets_no_library_log_lines() -> None:
    """A kernel that ignores the interrupt is restarted: the observation says so, and a script
    that configured no logging sees nothing of kernel_env's log on its stderr."""
    done = python(
        """
        from kernel_env import KernelEnv
        with KernelEnv(step_timeout=1.5) as env:
            env.reset()
            result = env.run(
                "import signal, time\\n"
                "signal.signal(signal.SIGINT, signal.SIG_IGN)\\n"
                "while True: time.sleep(0.01)"
            )
            print(result.timed_out, result.kernel_restarted)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
    assert done.stderr == ""


def test_a_failed_llm_query_traceback_ends_at_the_models_line() -> None:
    """The model sees its own cell's line, not kernel_env's frames or where it is installed."""

    def down(prompt: str) -> str:
        raise RuntimeError("model down")

    with KernelEnv(llm_query_fn=down) as env:
        env.reset()
        result = env.run("def ask():\n    return llm_query('hi')\n\nanswer_ = ask()")
    (error,) = [o for o in result.outputs if o["output_type"] == "error"]
    shown = "\n".join(error["traceback"])
    assert "answer_ = ask()" in shown and "return llm_query('hi')" in shown  # the model's frames
    assert "inkernel" not in shown and "site-packages" not in shown
    assert str(Path(__file__).resolve().parent.parent) not in shown
    assert error["evalue"] == "RuntimeError: model down"


def test_snippets_that_need_an_extra_say_how_to_install_it() -> None:
    """A docs or README snippet importing a package of an extra names that extra just before
    (a package installed on its own: its `pip install`)."""
    import re

    extras = {
        "nbclient": ("notebooks", "dev"),
        "matplotlib": ("notebooks", "bench", "dev"),
        "nbconvert": ("html", "dev"),
        "dspy": ("dspy",),
        "rlm": ("rlm",),
        "openenv": ("notebooks",),
        "smolagents": ("bench",),
    }
    root = Path(__file__).resolve().parent.parent
    silent = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        lines = page.read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("```python")]
        for start in starts:
            end = next(j for j in range(start + 1, len(lines)) if lines[j].startswith("```"))
            block = "\n".join(lines[start + 1 : end])
            before = "\n".join(lines[max(0, start - 15) : start])
            for module, names in extras.items():
                imports = re.search(rf"^\s*(from|import) {module}\b", block, re.MULTILINE)
                said = any(f"[{name}]" in before for name in names) or (
                    f"pip install {module}" in before  # a package of its own, in its own venv
                )
                if imports and not said:
                    silent.append(f"{page.name}:{start + 1} imports {module}")
    assert not silent, silent


def test_snippets_import_the_kernel_env_names_they_use() -> None:
    """A docs or README snippet that uses a public kernel_env name imports it (in that snippet
    or an earlier one on the page), so it runs as pasted."""
    import ast
    import importlib
    import re

    modules = ("kernel_env", "kernel_env.kernel", "kernel_env.kernel.factory", "kernel_env.llm")
    public = {name for m in modules for name in importlib.import_module(m).__all__}
    root = Path(__file__).resolve().parent.parent
    missing = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        imported: set[str] = set()
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S):
            code = "\n".join(line for line in block.splitlines() if not line.startswith("%"))
            tree = ast.parse(code)  # a snippet that is not Python fails here too
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
            used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            missing += [f"{page.name}: {name}" for name in sorted((used & public) - imported)]
    assert not missing, missing
