"""E2B's own SDK (``e2b``, ``e2b-code-interpreter``), unchanged, against a real ``kernel-env
serve`` on loopback: configured only through the SDK's settings (API URL, sandbox URL, key)."""

from __future__ import annotations

import asyncio
import base64
import gzip
import importlib.metadata
import os
import re
import secrets
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_openai import FakeOpenAI
from serverkit import ServeProcess, serve_process

from kernel_env.kernel.isolation.sandbox import sandbox_problem
from kernel_env.languages.catalog import installed_kernels

e2b = pytest.importorskip("e2b")
e2b_ci = pytest.importorskip("e2b_code_interpreter")

pytestmark = pytest.mark.integration  # a server and its kernels

SDK = importlib.metadata.version("e2b")  # tests/test_e2b_versions.py runs older releases too
TOKEN = "e2b_" + secrets.token_hex(20)  # the SDK checks a key's shape: e2b_ and hex
# The other languages' kernels (make kernels installs them) the module's server offers.
OTHERS = sorted({"ir", "bash", "deno"} & set(installed_kernels()))


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    """One server for the module, its llm_query answered by a fake model on loopback."""
    env = {**os.environ, "KERNEL_ENV_TOKEN": TOKEN}
    with (
        FakeOpenAI(lambda request: "the model says hi") as model,
        serve_process(
            "--pool-size",
            "2",
            "--llm-base-url",
            model.url,
            "--llm-model",
            "m",
            "--kernels",
            ",".join(["python3", *OTHERS]),
            env=env,
        ) as process,
    ):
        yield process


@pytest.fixture
def opts(server: ServeProcess) -> dict[str, Any]:
    """The SDK's own settings, as constructor arguments."""
    return {"api_url": server.url, "sandbox_url": server.url, "api_key": TOKEN}


def test_run_code_keeps_state_streams_in_order_and_dies_with_kill(opts: dict[str, Any]) -> None:
    """create -> run_code("x = 1") -> "x + 1" is "2"; callbacks in the order things happened;
    a matplotlib PNG; an error's name, value and traceback; after kill the sandbox is gone."""
    sandbox = e2b_ci.Sandbox.create(**opts)
    try:
        assert sandbox.run_code("x = 1").error is None
        assert sandbox.run_code("x + 1").text == "2"

        seen: list[tuple[str, str]] = []
        execution = sandbox.run_code(
            "import sys\nprint('a', flush=True)\nprint('b', file=sys.stderr, flush=True)\n"
            "print('c', flush=True)\n'done'",
            on_stdout=lambda m: seen.append(("stdout", m.line)),
            on_stderr=lambda m: seen.append(("stderr", m.line)),
            on_result=lambda r: seen.append(("result", r.text)),
        )
        assert seen == [("stdout", "a\n"), ("stderr", "b\n"), ("stdout", "c\n"), ("result", "done")]
        assert execution.logs.stdout == ["a\n", "c\n"] and execution.logs.stderr == ["b\n"]

        plot = sandbox.run_code(
            "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()"
        )
        assert plot.error is None, plot.error
        png = [r.png for r in plot.results if r.png]
        assert png and base64.b64decode(png[0]).startswith(b"\x89PNG\r\n\x1a\n")

        errors: list[Any] = []
        failed = sandbox.run_code(
            "print('before')\ndef f():\n    return 1 / 0\nf()", on_error=errors.append
        )
        assert failed.error is not None
        assert [(e.name, e.value) for e in errors] == [("ZeroDivisionError", "division by zero")]
        assert failed.logs.stdout == ["before\n"]
        assert (failed.error.name, failed.error.value) == ("ZeroDivisionError", "division by zero")
        assert "return 1 / 0" in re.sub(r"\x1b\[[0-9;]*m", "", failed.error.traceback)

        info = e2b_ci.Sandbox.get_info(sandbox.sandbox_id, **opts)
        assert info.sandbox_id == sandbox.sandbox_id and sandbox.is_running()
    finally:
        sandbox.kill()
    assert not sandbox.is_running()
    with pytest.raises(e2b.NotFoundException):
        e2b_ci.Sandbox.get_info(sandbox.sandbox_id, **opts)
    with pytest.raises(e2b.TimeoutException):
        sandbox.run_code("x")


def test_a_wrong_key_is_refused(opts: dict[str, Any]) -> None:
    """A key that is not the server's token creates nothing: the SDK's AuthenticationException."""
    with pytest.raises(e2b.AuthenticationException):
        e2b_ci.Sandbox.create(**{**opts, "api_key": "e2b_" + "0" * 40})


def test_two_sandboxes_cannot_see_each_other(opts: dict[str, Any], server: ServeProcess) -> None:
    """Each sandbox is its own kernel; one sandbox's token does not open another."""
    one = e2b_ci.Sandbox.create(**opts)
    two = e2b_ci.Sandbox.create(**opts)
    try:
        one.run_code("secret = 42")
        seen = two.run_code("secret")
        assert seen.error is not None and seen.error.name == "NameError"
        borrowed = httpx.post(
            f"{server.url}/execute",
            json={"code": "secret"},
            headers={
                "E2b-Sandbox-Id": two.sandbox_id,
                "E2b-Sandbox-Port": "49999",
                "X-Access-Token": one._envd_access_token,
            },
            timeout=10,
        )
        assert borrowed.status_code == 502  # as an id that never existed
        listed = {s.sandbox_id for s in e2b_ci.Sandbox.list(**opts).next_items()}
        assert {one.sandbox_id, two.sandbox_id} <= listed
    finally:
        one.kill()
        two.kill()


def _listed(opts: dict[str, Any], query: Any, **kwargs: Any) -> list[str]:
    listed = e2b_ci.Sandbox.list(**{"query": query, **kwargs}, **opts).next_items()
    return [s.sandbox_id for s in listed]


def test_list_pages_and_filters_by_state(opts: dict[str, Any]) -> None:
    """Sandbox.list as E2B's: limit pages with a next token (has_next), newest first; the
    state filter; a forged next token is refused."""
    mark = {"run": secrets.token_hex(4)}
    query = e2b.SandboxQuery(metadata=mark)
    first = e2b_ci.Sandbox.create(metadata=mark, **opts)
    second = e2b_ci.Sandbox.create(metadata=mark, **opts)
    try:
        pages = e2b_ci.Sandbox.list(query=query, limit=1, **opts)
        assert [s.sandbox_id for s in pages.next_items()] == [second.sandbox_id]
        assert pages.has_next and pages.next_token is not None
        assert [s.sandbox_id for s in pages.next_items()] == [first.sandbox_id]
        assert not pages.has_next and pages.next_token is None
        first.pause()
        paused = e2b.SandboxQuery(metadata=mark, state=[e2b.SandboxState.PAUSED])
        assert _listed(opts, paused) == [first.sandbox_id]
        with pytest.raises(e2b.SandboxException):
            e2b_ci.Sandbox.list(query=query, next_token="forged", **opts).next_items()
    finally:
        first.kill()
        second.kill()


def test_list_orders_and_filters_by_start_and_template(opts: dict[str, Any]) -> None:
    """Sandbox.list's order (newest first unless "asc"), startedAfter (at or after) and the
    template filter (a template's id or alias)."""
    if not hasattr(e2b.SandboxQuery(), "started_after"):
        pytest.skip(f"e2b {SDK} has no list order, started_after or template filter (2.51 on)")
    mark = {"run": secrets.token_hex(4)}
    query = e2b.SandboxQuery(metadata=mark)
    first = e2b_ci.Sandbox.create(metadata=mark, **opts)
    second = e2b_ci.Sandbox.create(template="python3", metadata=mark, **opts)
    try:
        assert _listed(opts, query, order="asc") == [first.sandbox_id, second.sandbox_id]
        assert _listed(opts, query, order="desc") == [second.sandbox_id, first.sandbox_id]
        started = first.get_info().started_at
        after = e2b.SandboxQuery(metadata=mark, started_after=started)
        assert first.sandbox_id in _listed(opts, after)
        later = e2b.SandboxQuery(metadata=mark, started_after=started + timedelta(seconds=3600))
        assert _listed(opts, later) == []
        # A template's id, or its alias (the kernel's name: python3 is both sandboxes' own).
        by_id = e2b.SandboxQuery(metadata=mark, template="code-interpreter-v1")
        assert _listed(opts, by_id) == [first.sandbox_id]
        by_alias = e2b.SandboxQuery(metadata=mark, template="python3")
        assert _listed(opts, by_alias) == [second.sandbox_id, first.sandbox_id]
        unknown = e2b.SandboxQuery(metadata=mark, template="unknown-template")
        assert _listed(opts, unknown) == []
    finally:
        first.kill()
        second.kill()


def test_a_tenant_sees_and_kills_only_its_own_sandboxes(tmp_path: Path) -> None:
    """On a server with a tokens file, each client tenant's key lists, reaches and kills only
    the sandboxes it created; another tenant's sandbox is "not found" to it."""
    keys = {name: "e2b_" + secrets.token_hex(20) for name in ("alice", "bob")}
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{name} client {key}\n" for name, key in keys.items()))
    tokens.chmod(0o600)
    with serve_process("--pool-size", "1", "--tokens-file", str(tokens)) as server:
        alice, bob = ({"api_url": server.url, "sandbox_url": server.url, "api_key": keys[name]}
                      for name in ("alice", "bob"))  # fmt: skip
        mine = e2b_ci.Sandbox.create(**alice)
        theirs = e2b_ci.Sandbox.create(**bob)
        try:
            mine.run_code("secret = 42")
            assert {s.sandbox_id for s in e2b_ci.Sandbox.list(**bob).next_items()} == {
                theirs.sandbox_id
            }
            with pytest.raises(e2b.NotFoundException):
                e2b_ci.Sandbox.get_info(mine.sandbox_id, **bob)
            with pytest.raises(e2b.NotFoundException):
                e2b_ci.Sandbox.connect(mine.sandbox_id, **bob)
            assert e2b_ci.Sandbox.kill(mine.sandbox_id, **bob) is False
            assert mine.is_running() and mine.run_code("secret").text == "42"
        finally:
            mine.kill()
            theirs.kill()


def test_a_sandbox_past_its_timeout_is_gone(opts: dict[str, Any]) -> None:
    """A sandbox created with timeout=1 is killed a second later, as E2B's are."""
    sandbox = e2b_ci.Sandbox.create(timeout=1, **opts)
    assert sandbox.run_code("1 + 1").text == "2"
    deadline = time.monotonic() + 10
    while sandbox.is_running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not sandbox.is_running()
    with pytest.raises(e2b.NotFoundException):
        e2b_ci.Sandbox.get_info(sandbox.sandbox_id, **opts)


async def test_async_sdk_runs_code_with_callbacks(opts: dict[str, Any]) -> None:
    """AsyncSandbox: create, state across run_code calls, an async on_stdout, kill."""
    sandbox = await e2b_ci.AsyncSandbox.create(**opts)
    try:
        await sandbox.run_code("x = 20")
        lines: list[str] = []

        async def on_stdout(message: Any) -> None:
            lines.append(message.line)

        execution = await sandbox.run_code("print(x)\nx + 22", on_stdout=on_stdout)
        assert execution.text == "42" and lines == ["20\n"]
    finally:
        await sandbox.kill()
    assert not await sandbox.is_running()


async def test_an_async_commands_timeout_is_its_lifetime(opts: dict[str, Any]) -> None:
    """AsyncSandbox.commands.run(timeout=2): the server keeps the Connect deadline, so a
    longer command raises the SDK's TimeoutException in about 2 s, and is killed."""
    sandbox = await e2b_ci.AsyncSandbox.create(**opts)
    try:
        since = time.monotonic()
        with pytest.raises(e2b.TimeoutException):
            await sandbox.commands.run("sleep 30", timeout=2)
        assert 1.5 <= time.monotonic() - since < 15
        deadline = time.monotonic() + 15
        while _running("sleep 30", await sandbox.commands.list()):
            assert time.monotonic() < deadline, "the command outlived its timeout"
            await asyncio.sleep(0.1)
        assert (await sandbox.commands.run("echo on", timeout=5)).stdout == "on\n"
    finally:
        await sandbox.kill()


def test_a_commands_timeout_kills_it_after_its_client_left(opts: dict[str, Any]) -> None:
    """The sync SDK gives up on a command at its timeout and closes the stream; the server
    still kills the command at the deadline, as envd does."""
    with e2b_ci.Sandbox.create(**opts) as sandbox:
        with pytest.raises(e2b.TimeoutException):
            sandbox.commands.run("sleep 31", timeout=2)
        deadline = time.monotonic() + 15
        while _running("sleep 31", sandbox.commands.list()):
            assert time.monotonic() < deadline, "the command outlived its timeout"
            time.sleep(0.1)


def _running(command: str, processes: list[Any]) -> bool:
    return any(command in process.args for process in processes)


def test_a_sandbox_killed_during_run_code_raises_timeout(opts: dict[str, Any]) -> None:
    """Killing a sandbox while its cell runs cuts the cell's answer short, as E2B's does: the
    SDK raises its TimeoutException (the sandbox was killed), not an ExecutionError."""
    sandbox = e2b_ci.Sandbox.create(**opts)
    try:

        def kill(message: Any) -> None:
            assert e2b_ci.Sandbox.kill(sandbox.sandbox_id, **opts) is True

        with pytest.raises(e2b.TimeoutException, match="killed"):
            sandbox.run_code(
                "import time\nprint('running', flush=True)\ntime.sleep(60)", on_stdout=kill
            )
        assert not sandbox.is_running()
    finally:
        sandbox.kill()


async def test_an_async_sandbox_killed_during_run_code_raises_timeout(
    opts: dict[str, Any],
) -> None:
    """The same with AsyncSandbox."""
    sandbox = await e2b_ci.AsyncSandbox.create(**opts)
    try:

        async def kill(message: Any) -> None:
            assert await e2b_ci.AsyncSandbox.kill(sandbox.sandbox_id, **opts) is True

        with pytest.raises(e2b.TimeoutException, match="killed"):
            await sandbox.run_code(
                "import time\nprint('running', flush=True)\ntime.sleep(60)", on_stdout=kill
            )
        assert not await sandbox.is_running()
    finally:
        await sandbox.kill()


def test_the_sdk_reads_its_environment_variables(server: ServeProcess) -> None:
    """E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY alone configure the SDK."""
    import subprocess

    code = (
        "from e2b_code_interpreter import Sandbox\n"
        "with Sandbox.create() as sandbox:\n"
        "    print(sandbox.run_code('6 * 7').text)\n"
    )
    env = {
        **os.environ,
        "E2B_API_URL": server.url,
        "E2B_SANDBOX_URL": server.url,
        "E2B_API_KEY": TOKEN,
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "42"


def test_pause_contexts_and_a_cell_past_its_timeout(opts: dict[str, Any]) -> None:
    """A paused sandbox is not running and keeps its state through connect(); a context is
    a namespace of its own; a cell past run_code's timeout raises the SDK's TimeoutException
    and is interrupted, so the next cell runs."""
    with e2b_ci.Sandbox.create(**opts) as sandbox:
        sandbox.run_code("kept = 'yes'")
        assert sandbox.pause() is True
        assert not sandbox.is_running()
        sandbox.connect()
        assert sandbox.is_running() and sandbox.run_code("kept").text == "yes"

        context = sandbox.create_code_context()
        sandbox.run_code("mine = 1", context=context)
        assert sandbox.run_code("mine + 1", context=context).text == "2"
        assert sandbox.run_code("mine").error.name == "NameError"
        assert context.id in {c.id for c in sandbox.list_code_contexts()}
        sandbox.remove_code_context(context)
        assert context.id not in {c.id for c in sandbox.list_code_contexts()}

        with pytest.raises(e2b.TimeoutException):
            sandbox.run_code("import time\ntime.sleep(60)", timeout=1)
        assert sandbox.run_code("'next'").text == "next"


def test_restart_code_context(opts: dict[str, Any]) -> None:
    """restart_code_context starts a context's kernel afresh (its variables gone, the context
    still there); the sandbox's own context is refused in E2B's shape, as is an unknown one."""
    with e2b_ci.Sandbox.create(**opts) as sandbox:
        context = sandbox.create_code_context()
        sandbox.run_code("x = 1", context=context)
        sandbox.restart_code_context(context.id)
        gone = sandbox.run_code("x", context=context)
        assert gone.error is not None
        assert (gone.error.name, gone.error.value) == ("NameError", "name 'x' is not defined")
        assert sandbox.run_code("2 + 2", context=context).text == "4"
        assert context.id in {c.id for c in sandbox.list_code_contexts()}
        with pytest.raises(e2b.SandboxException, match="default context"):
            sandbox.restart_code_context(sandbox.sandbox_id)
        with pytest.raises(e2b.NotFoundException):
            sandbox.restart_code_context("no-such-context")


def test_a_sandbox_paused_at_its_timeout_keeps_its_state(opts: dict[str, Any]) -> None:
    """lifecycle={"on_timeout": "pause"}: at its timeout the sandbox is paused, not killed,
    and connect() resumes it with its state; with auto_resume, a request to it resumes it."""

    def paused(sandbox: Any) -> Any:
        deadline = time.monotonic() + 20
        while (info := e2b_ci.Sandbox.get_info(sandbox.sandbox_id, **opts)).state != (
            e2b.SandboxState.PAUSED
        ):
            assert time.monotonic() < deadline, "the sandbox was not paused at its timeout"
            time.sleep(0.1)
        return info

    sandbox = e2b_ci.Sandbox.create(timeout=2, lifecycle={"on_timeout": "pause"}, **opts)
    try:
        sandbox.run_code("kept = 'still here'")
        info = paused(sandbox)
        assert info.lifecycle == {"on_timeout": "pause", "auto_resume": False}
        assert not sandbox.is_running()
        sandbox.connect(timeout=60)
        assert sandbox.run_code("kept").text == "still here"
    finally:
        sandbox.kill()
    lifecycle: Any = {"on_timeout": "pause", "auto_resume": True}
    auto = e2b_ci.Sandbox.create(timeout=2, lifecycle=lifecycle, **opts)
    try:
        auto.run_code("kept = 'resumed'")
        paused(auto)
        assert auto.run_code("kept").text == "resumed"
        assert auto.get_info().state == e2b.SandboxState.RUNNING
    finally:
        auto.kill()


def test_r_bash_and_typescript_contexts_and_templates(opts: dict[str, Any]) -> None:
    """run_code(language=...) runs in that language's default context (its state kept from
    cell to cell), create_code_context makes a context in a language, and a template names
    a kernel; a language the server does not run is refused."""
    if OTHERS != ["bash", "deno", "ir"]:
        pytest.skip(f"make kernels installs R, Bash and Deno; here only {OTHERS}")
    with e2b_ci.Sandbox.create(**opts) as sandbox:
        # IRkernel shows a value as display data, not as the cell's result: E2B's results list
        # has it, its main-result shortcut (.text) does not.
        assert _texts(sandbox.run_code("x <- 1:10; sum(x)", language="r")) == ["[1] 55"]
        assert _texts(sandbox.run_code("sum(x) * 2", language="r")) == ["[1] 110"]
        said = sandbox.run_code("echo $((6*7))", language="bash")
        assert "".join(said.logs.stdout).strip() == "42", said
        context = sandbox.create_code_context(language="typescript")
        assert sandbox.run_code("const a: number = 6*7; a", context=context).text == "42"
        assert sandbox.run_code("1 + 1").text == "2"  # the default context is still Python
        with pytest.raises(Exception, match="not served here"):
            sandbox.run_code("System.out.println(1);", language="java")
    with e2b_ci.Sandbox.create(template="ir", **opts) as sandbox:
        assert _texts(sandbox.run_code("sum(1:10)")) == ["[1] 55"]


def test_the_sandboxs_envs_reach_every_languages_context(opts: dict[str, Any]) -> None:
    """create(envs=...) sets the variables of every context's kernel, in every language, and
    again after a restart (E2B's env_vars tests of Bash, R and JavaScript)."""
    if OTHERS != ["bash", "deno", "ir"]:
        pytest.skip(f"make kernels installs R, Bash and Deno; here only {OTHERS}")
    value = 'it\'s "quoted" $HOME'
    with e2b_ci.Sandbox.create(envs={"TEST_ENV_VAR": value}, **opts) as sandbox:
        said = sandbox.run_code('echo "$TEST_ENV_VAR"', language="bash")
        assert said.logs.stdout == [value + "\n"], said
        assert _texts(sandbox.run_code("Sys.getenv('TEST_ENV_VAR')", language="r")) == [
            '[1] "it\'s \\"quoted\\" $HOME"'
        ]
        js = sandbox.run_code("console.log(process.env.TEST_ENV_VAR)", language="javascript")
        assert js.logs.stdout == [value + "\n"], js
        context = sandbox.create_code_context(language="bash")
        sandbox.restart_code_context(context)
        again = sandbox.run_code('echo "$TEST_ENV_VAR"', context=context)
        assert again.logs.stdout == [value + "\n"], again


def _texts(execution: Any) -> list[str]:
    return [result.text for result in execution.results]


def test_files_in_the_sandbox_workspace(opts: dict[str, Any]) -> None:
    """write / read / list / exists / make_dir / rename / remove, through envd's protocol;
    the kernel sees the same files (they are its workspace)."""
    with e2b_ci.Sandbox.create(**opts) as sandbox:
        info = sandbox.files.write("/home/user/notes/a.txt", "hello")
        assert info.path == "/home/user/notes/a.txt"
        assert sandbox.files.read("/home/user/notes/a.txt") == "hello"
        assert sandbox.files.read("notes/a.txt", format="bytes") == bytearray(b"hello")
        assert sandbox.run_code("open('notes/a.txt').read()").text == "hello"
        sandbox.run_code("open('made.txt', 'w').write('by the kernel')")
        assert sandbox.files.read("/home/user/made.txt") == "by the kernel"

        assert sandbox.files.make_dir("/home/user/d") is True
        assert sandbox.files.make_dir("/home/user/d") is False  # it exists
        names = {e.name for e in sandbox.files.list("/home/user")}
        assert {"notes", "made.txt", "d"} <= names
        assert sandbox.files.exists("/home/user/made.txt")
        moved = sandbox.files.rename("/home/user/made.txt", "/home/user/d/moved.txt")
        assert moved.path == "/home/user/d/moved.txt"
        assert not sandbox.files.exists("/home/user/made.txt")
        sandbox.files.remove("/home/user/d")
        assert not sandbox.files.exists("/home/user/d/moved.txt")
        with pytest.raises(e2b.NotFoundException):
            sandbox.files.read("/home/user/none.txt")


def test_home_user_is_the_sandboxs_workspace(opts: dict[str, Any]) -> None:
    """In a bubblewrap sandbox, /home/user is the kernel's workspace, as on E2B: a file the
    files API writes there is the one the code opens, and the code's, its commands' and every
    language's working directory and $HOME is /home/user."""
    if sandbox_problem() is not None:
        pytest.skip(f"the server's kernels are not sandboxed here: {sandbox_problem()}")
    with e2b_ci.Sandbox.create(**opts) as sandbox:
        sandbox.files.write("/home/user/x.txt", "from the files API")
        assert sandbox.run_code("open('/home/user/x.txt').read()").text == "from the files API"
        where = sandbox.run_code("import os; print(os.getcwd(), os.environ['HOME'])\n!pwd")
        # (IPython runs a shell escape in a pty: its line ends in \r\n. A loaded kernel may
        # send both lines in one stream message.)
        lines = "".join(where.logs.stdout).replace("\r\n", "\n").splitlines()
        assert lines == ["/home/user /home/user", "/home/user"], where
        assert sandbox.commands.run("pwd; echo $HOME").stdout == "/home/user\n/home/user\n"
        assert "x.txt" in sandbox.commands.run("ls /home/user").stdout.split()
        if "bash" in OTHERS:
            said = sandbox.run_code("pwd; echo $HOME", language="bash")
            assert "".join(said.logs.stdout) == "/home/user\n/home/user\n", said


def test_remove_symlink_info_and_connect_as_e2bs(opts: dict[str, Any]) -> None:
    """files.remove of a path that is not there does nothing; get_info of a symlink describes
    its target (a FILE, its size) and names it; commands.connect to a pid that no command has
    raises NotFoundException at once, not at wait()."""
    with e2b_ci.Sandbox.create(**opts) as sandbox:
        sandbox.files.remove("/home/user/never-was.txt")
        sandbox.files.write("/home/user/d/t.txt", "hi")
        sandbox.commands.run("ln -s t.txt link.txt", cwd="/home/user/d")
        info = sandbox.files.get_info("/home/user/d/link.txt")
        assert (info.type, info.size) == (e2b.FileType.FILE, 2)
        assert info.symlink_target == "/home/user/d/t.txt"
        assert sandbox.files.get_info("/home/user/d").type == e2b.FileType.DIR
        with pytest.raises(e2b.NotFoundException):
            sandbox.commands.connect(999999)
        running = sandbox.commands.run("sleep 60", background=True)
        assert sandbox.commands.connect(running.pid).pid == running.pid
        assert running.kill() is True


def test_signed_file_links(opts: dict[str, Any], server: ServeProcess) -> None:
    """download_url() and upload_url() links work with no headers, as E2B's: the server finds
    the sandbox whose token signed them. A link unsigned, forged, for another path or
    operation, with its expiration moved, or expired is refused (401, E2B's shape)."""
    with e2b_ci.Sandbox.create(**opts) as sandbox, e2b_ci.Sandbox.create(**opts) as other:
        sandbox.files.write("/home/user/s.txt", "signed")
        link = sandbox.download_url("s.txt")
        assert "signature=v1_" in link
        assert httpx.get(link, timeout=30).text == "signed"
        assert httpx.get(sandbox.download_url("s.txt", use_signature_expiration=120)).text == (
            "signed"
        )
        upload = sandbox.upload_url("up.txt")
        sent = httpx.post(upload, files={"file": ("up.txt", b"uploaded")}, timeout=30)
        assert sent.status_code == 200, sent.text
        assert sandbox.files.read("/home/user/up.txt") == "uploaded"
        # Another sandbox's link reaches that sandbox, which has no s.txt.
        assert httpx.get(other.download_url("s.txt"), timeout=30).status_code == 404

        expired = httpx.get(sandbox.download_url("s.txt", use_signature_expiration=-120))
        assert (expired.status_code, expired.json()) == (
            401,
            {"code": 401, "message": "signature is already expired"},
        )
        timed = httpx.URL(sandbox.download_url("s.txt", use_signature_expiration=120))
        later = int(timed.params["signature_expiration"]) + 3600
        refused = [
            httpx.URL(link).copy_remove_param("signature"),  # unsigned: kernel_env's own route
            httpx.URL(link).copy_set_param("signature", "v1_" + "A" * 43),
            httpx.URL(link).copy_set_param("path", "up.txt"),
            httpx.URL(link).copy_set_param("username", "root"),
            timed.copy_set_param("signature_expiration", str(later)),
        ]
        for url in refused:
            assert httpx.get(url, timeout=30).status_code == 401, url
        as_upload = httpx.post(link, files={"file": ("s.txt", b"overwritten")}, timeout=30)
        assert as_upload.status_code == 401
        assert sandbox.files.read("/home/user/s.txt") == "signed"


def test_gzip_uploads_and_the_owner_user(opts: dict[str, Any], server: ServeProcess) -> None:
    """files.write(gzip=True) sends the file gzipped (Content-Encoding), written inflated; a
    body that is not gzip is refused (400); a file of the sandbox's is owned by 'user'."""
    with e2b_ci.Sandbox.create(**opts) as sandbox:
        info = sandbox.files.write("/home/user/z.txt", "zipped " * 1000, gzip=True)
        assert info.path == "/home/user/z.txt"
        assert sandbox.files.read("/home/user/z.txt") == "zipped " * 1000
        assert sandbox.files.read("/home/user/z.txt", gzip=True) == "zipped " * 1000
        entry = sandbox.files.get_info("/home/user/z.txt")
        assert (entry.owner, entry.group) == ("user", "user")
        headers = {
            "E2b-Sandbox-Id": sandbox.sandbox_id,
            "E2b-Sandbox-Port": "49983",
            "X-Access-Token": sandbox._envd_access_token,
            "Content-Type": "application/octet-stream",
            "Content-Encoding": "gzip",
        }
        for body in (b"not gzip at all", gzip.compress(b"cut short")[:-6]):
            sent = httpx.post(
                f"{server.url}/files", params={"path": "bad.txt"}, content=body,
                headers=headers, timeout=30,
            )  # fmt: skip
            assert sent.status_code == 400, sent.text


def test_commands_run_in_the_kernels_sandbox(opts: dict[str, Any]) -> None:
    """commands.run in the foreground with on_stdout, in the background with wait() and
    kill(); a non-zero exit raises the SDK's CommandExitException; the command sees the
    sandbox's files and envs; a command still running when its sandbox is killed ends with
    it."""
    with e2b_ci.Sandbox.create(envs={"GREETING": "hi"}, **opts) as sandbox:
        lines: list[str] = []
        done = sandbox.commands.run("echo hi; echo $GREETING >&2", on_stdout=lines.append)
        assert (done.exit_code, done.stdout, done.stderr) == (0, "hi\n", "hi\n")
        assert lines == ["hi\n"]

        sandbox.files.write("/home/user/data.txt", "a\nb\n")
        assert sandbox.commands.run("wc -l < data.txt").stdout.strip() == "2"
        assert sandbox.run_code("import os; os.environ['GREETING']").text == "hi"

        background = sandbox.commands.run("sleep 0.2; echo late", background=True)
        assert background.wait().stdout == "late\n"

        forever = sandbox.commands.run("sleep 60", background=True)
        assert forever.kill() is True
        with pytest.raises(e2b.CommandExitException):
            forever.wait()
        with pytest.raises(e2b.CommandExitException) as failed:
            sandbox.commands.run("exit 3")
        assert failed.value.exit_code == 3

        orphan = sandbox.commands.run("sleep 60", background=True)
        sandbox.kill()  # the command goes with its sandbox
        # e2b 2.63 raises SandboxNotRunningException; 2.35 and 2.51 its base class
        gone = getattr(e2b, "SandboxNotRunningException", e2b.TimeoutException)
        with pytest.raises(gone):
            orphan.wait()


def test_llm_query_notebook_and_fork(opts: dict[str, Any], server: ServeProcess) -> None:
    """What E2B lacks, on its protocol: llm_query answered by the server's model (no key in
    the sandbox), the episode as a notebook, and fork() copying a live sandbox."""
    with e2b_ci.Sandbox.create(**opts) as sandbox:
        assert sandbox.run_code("llm_query('hello?')").text == "the model says hi"
        sandbox.run_code("counter = 41")

        notebook = httpx.get(
            f"{server.url}/sessions/{sandbox.sandbox_id}/notebook",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10,
        )
        assert notebook.status_code == 200
        cells = notebook.json()["cells"]
        sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        assert "counter = 41" in sources

        (copy,) = sandbox.fork()
        assert not isinstance(copy, Exception)
        try:
            assert copy.run_code("counter + 1").text == "42"
            copy.run_code("counter = 0")
            assert sandbox.run_code("counter").text == "41"
        finally:
            copy.kill()


def test_a_forks_count_is_checked_before_its_sandbox(
    opts: dict[str, Any], server: ServeProcess
) -> None:
    """fork(count=0) is refused whatever the sandbox: E2B's API answers 400 before it looks
    the sandbox up (e2b 2.63 checks the count itself; 2.35 and 2.51 send it)."""
    for count in (0, 65, "2"):
        refused = httpx.post(
            f"{server.url}/sandboxes/no-such-sandbox/fork",
            json={"count": count},
            headers={"X-API-KEY": TOKEN},
            timeout=10,
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["code"] == 400
    with pytest.raises(e2b.SandboxException, match="count must be"):
        e2b_ci.Sandbox.fork("no-such-sandbox", count=0, **opts)


def test_out_of_scope_calls_are_refused_in_e2b_shape(
    opts: dict[str, Any], server: ServeProcess
) -> None:
    """An unknown template, templates built from Dockerfiles and volumes: E2B's error shape."""
    with pytest.raises(e2b.SandboxException, match="not served here"):
        e2b_ci.Sandbox.create(template="my-dockerfile-template", **opts)
    refused = httpx.get(f"{server.url}/templates", headers={"X-API-KEY": TOKEN}, timeout=10)
    assert refused.status_code == 501
    assert refused.json()["code"] == 501 and "Dockerfile" in refused.json()["message"]
    volumes = httpx.post(f"{server.url}/volumes", headers={"X-API-KEY": TOKEN}, timeout=10)
    assert volumes.status_code == 501 and "volumes" in volumes.json()["message"]


# rlm's LMHandler.stop() leaves its listening socket open (rlms 0.1.3), reported when collected.
@pytest.mark.slow  # rlm runs pip and starts a Flask broker in the sandbox first
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"
)
def test_rlms_e2b_environment_completes_a_run(
    server: ServeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rlm's own ``e2b`` environment, unchanged, on kernel_env: it installs its broker's
    packages with ``pip`` (present already: no network in a sandbox), starts the broker in the
    background, waits for it with commands, and runs each code block as a script; the root
    model's answer comes from a block run in the sandbox. (Its llm_query goes through a
    broker URL on E2B's domain, which a loopback test cannot reach: a proxy on a closed
    loopback port makes those polls fail at once.)"""
    rlm = pytest.importorskip("rlm")
    monkeypatch.setenv("E2B_API_URL", server.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", server.url)
    monkeypatch.setenv("E2B_API_KEY", TOKEN)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # the broker polls: refused
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")

    def turns(body: dict[str, Any]) -> str:
        done = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if done == 0:
            return "```repl\nanswer['content'] = str(6 * 7)\nanswer['ready'] = True\n```"
        return "FINAL(not from the sandbox)"

    with FakeOpenAI(turns) as model:
        runner = rlm.RLM(
            backend="openai",
            backend_kwargs={"model_name": "m", "api_key": "sk-test", "base_url": model.url},
            environment="e2b",
            environment_kwargs={"timeout": 120},
            max_iterations=3,
        )
        out = runner.completion("What is six times seven?")
    assert out.response == "42"


@pytest.mark.slow  # smolagents runs pip in the sandbox for its tools' requirements first
def test_smolagents_e2b_executor_runs_an_agent(opts: dict[str, Any]) -> None:
    """An agent framework's E2B tool, unchanged: smolagents' CodeAgent with
    ``executor_type="e2b"`` runs the model's code in a kernel_env sandbox; the final answer
    is computed there and comes back through E2B's error channel (smolagents'
    FinalAnswerException), as on E2B."""
    smolagents = pytest.importorskip("smolagents")

    def answer(body: dict[str, Any]) -> str:
        return "Thought: compute it.\n<code>\nresult = 6 * 7\nfinal_answer(result)\n</code>"

    with FakeOpenAI(answer) as model:
        agent = smolagents.CodeAgent(
            tools=[],
            model=smolagents.OpenAIServerModel(model_id="m", api_base=model.url, api_key="x"),
            executor_type="e2b",
            executor_kwargs=opts,
            max_steps=2,
            verbosity_level=0,
        )
        try:
            assert agent.run("What is six times seven?") == 42
        finally:
            agent.cleanup()
