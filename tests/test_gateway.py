"""The gateway backend: the shared episode checks on local kernels and on kernels of a Kernel
Gateway and of an Enterprise Gateway, then what only a gateway can do wrong (token, kernel
specs, max_kernels, users, the gateway dying: F12).

A real ``jupyter kernelgateway`` and a real Enterprise Gateway (its own venv, default settings)
run on free loopback ports (see ``gateway.py``).
"""

from __future__ import annotations

import base64
import hashlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nbformat
import pytest
from conftest import STEP_TIMEOUT
from gateway import SECRET_VAR, EnterpriseGatewayProcess, GatewayProcess
from serverkit import LoopbackClient, serve_process, wait_until

from kernel_env import KernelEnv, KernelError, check_env
from kernel_env.errors import KernelStartError
from kernel_env.kernel import GatewayConfig, GatewayKernel
from kernel_env.kernel.factory import gateway_source, kernel_source_from, local_source
from kernel_env.kernel.gateway import decode_message, encode_message
from kernel_env.server import ServerSettings, create_app

pytestmark = pytest.mark.integration  # kernels, servers or other processes

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
)


def _config(gw: GatewayProcess, **options: object) -> GatewayConfig:
    return GatewayConfig(url=gw.url, token=gw.token, **options)  # type: ignore[arg-type]


@pytest.fixture(params=["local", "gateway", "enterprise_gateway"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def env(request: pytest.FixtureRequest, backend: str) -> Iterator[KernelEnv]:
    """A client whose kernels come from the backend under test; echoing LLM, T = 5 s."""
    if backend == "local":
        # Unsandboxed, like the gateway's kernels: tests signal the pid the kernel reports.
        source = local_source(sandbox="none")
    else:  # no KERNEL_USERNAME given: Enterprise Gateway takes the default one
        source = gateway_source(_config(request.getfixturevalue(backend)))
    with KernelEnv(
        kernel_source=source, llm_query_fn=lambda p: f"echo:{p}", step_timeout=STEP_TIMEOUT
    ) as client:
        yield client


def _stdout(env: KernelEnv, code: str) -> str:
    return env.execute(code).observation.result.stdout


# -- the shared episode behaviour, on both backends ---------------------------------------


def test_conformance(env: KernelEnv) -> None:
    """The backend passes the reusable OpenEnv conformance check."""
    check_env(env, close=False)


def test_llm_query_travels_over_stdin(env: KernelEnv) -> None:
    """llm_query and llm_query_batched reach the host callable over the stdin channel."""
    env.reset()
    res = env.execute("print(llm_query('hi'))").observation.result
    assert res.stdout == "echo:hi\n", res
    assert _stdout(env, "print(llm_query_batched(['a', 'b']))") == "['echo:a', 'echo:b']\n"
    assert env.state().llm_calls == 3


def test_rich_outputs_and_notebook_export(env: KernelEnv, tmp_path: Path) -> None:
    """HTML and PNG displays arrive intact, and the episode exports as a valid notebook."""
    env.reset(context="c")
    result = env.execute(
        "from IPython.display import HTML, Image, display\n"
        "display(HTML('<b>bold</b>'))\n"
        f"display(Image(data=bytes.fromhex('{PNG.hex()}')))\n"
        "6 * 7"
    ).observation.result
    datas = [o["data"] for o in result.outputs]
    assert datas[0]["text/html"] == "<b>bold</b>"
    assert base64.b64decode(datas[1]["image/png"]) == PNG
    assert datas[2]["text/plain"] == "42"
    notebook = nbformat.read(env.export_notebook(tmp_path / "episode.ipynb"), as_version=4)
    nbformat.validate(notebook)
    assert any("display(HTML" in cell.source for cell in notebook.cells)


def test_large_context_is_staged_intact(env: KernelEnv) -> None:
    """A context above the inline limit (staged as a file) arrives byte for byte."""
    context = "".join(f"line {i} ✓\n" for i in range(60_000))  # ~0.7 MB, non-ASCII
    digest = hashlib.sha256(context.encode()).hexdigest()
    env.reset(context=context)
    code = "import hashlib; print(hashlib.sha256(context.encode()).hexdigest())"
    assert _stdout(env, code).strip() == digest


def test_f1_timeout_interrupts_and_keeps_state(env: KernelEnv) -> None:
    """F1: `while True: pass` ends in a timeout observation; same kernel, state kept."""
    env.reset()
    env.execute("kept = 7")
    res = env.execute("while True: pass").observation.result
    assert res.timed_out and not res.kernel_restarted and not res.state_lost
    assert _stdout(env, "kept").strip() == "7"


def test_f3_killed_kernel_is_reported_and_replaced(env: KernelEnv) -> None:
    """F3: a kernel SIGKILLed mid-step is reported as died (not a timeout); the next step works."""
    env.reset(context="ctx")
    pid = int(_stdout(env, "import os; print(os.getpid())"))
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    killer.start()
    res = env.execute("import time; time.sleep(30)").observation.result
    killer.join()
    assert (res.exception or "").startswith("KernelDied") and res.state_lost
    assert _stdout(env, "print(context.upper())") == "CTX\n"


def test_f3_kernel_killed_between_steps(env: KernelEnv) -> None:
    """F3: a kernel SIGKILLed while idle: the next step reports it died; the one after works."""
    env.reset(context="ctx")
    os.kill(int(_stdout(env, "import os; print(os.getpid())")), signal.SIGKILL)
    time.sleep(1.5)  # the gateway notices within its time_to_dead (1 s) and restarts it
    res = env.execute("kept = 1").observation.result
    assert (res.exception or "").startswith("KernelDied") and res.state_lost
    assert _stdout(env, "print(context, 'kept' in globals())") == "ctx False\n"


# -- gateway only ----------------------------------------------------------------------------


@pytest.fixture(params=["gateway", "enterprise_gateway"])
def any_gateway(request: pytest.FixtureRequest) -> GatewayProcess:
    """Kernel Gateway, then Enterprise Gateway."""
    gateway: GatewayProcess = request.getfixturevalue(request.param)
    return gateway


def test_f2_ignored_interrupt_restarts_over_rest(any_gateway: GatewayProcess) -> None:
    """F2: a cell ignoring SIGINT is restarted over REST; helpers and context come back."""
    with KernelEnv(
        kernel_source=gateway_source(_config(any_gateway)), step_timeout=STEP_TIMEOUT
    ) as env:
        env.reset(context="still here")
        env.execute("kept = 1")
        res = env.execute(
            "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass"
        ).observation.result
        assert res.timed_out and res.kernel_restarted and res.state_lost
        assert _stdout(env, "print(context, 'kept' in globals())") == "still here False\n"
        assert env.execute("FINAL('done')").done


@pytest.mark.parametrize("kernel_name", ["kernel_env", "python3-bare"])
def test_helpers_in_any_kernelspec(gateway: GatewayProcess, kernel_name: str) -> None:
    """The deploy kernelspec loads the helpers itself; a kernel lacking kernel_env is sent them."""
    source = gateway_source(_config(gateway, kernel_name=kernel_name))
    with KernelEnv(kernel_source=source, llm_query_fn=str.upper) as env:
        env.reset(context="abc")
        importable = _stdout(env, "import importlib.util as u; print(u.find_spec('kernel_env'))")
        assert (importable.strip() == "None") == (kernel_name == "python3-bare")
        assert _stdout(env, "print(llm_query(context))") == "ABC\n"
        assert "llm_query" not in env.execute("x = 1").observation.available_variables
        assert env.execute("FINAL(len(context))").observation.metadata["final_answer"] == "3"


async def test_kernel_sees_only_kernel_variables(any_gateway: GatewayProcess) -> None:
    """KERNEL_* values reach the kernel (KERNEL_USERNAME the default one, which Enterprise
    Gateway accepts from a root server); the gateway's own environment does not."""
    config = _config(any_gateway, env={"KERNEL_ENV_EPISODE": "e1"})
    async with GatewayKernel(config) as kernel:
        result = await kernel.execute(
            "import os; e = os.environ\n"
            f"print(e.get('KERNEL_ENV_EPISODE'), e.get('KERNEL_USERNAME'), '{SECRET_VAR}' in e)"
        )
    assert result.stdout == "e1 kernel-env False\n"


@pytest.mark.parametrize(
    ("options", "message"),
    [({"token": "wrong"}, "refused our token"), ({"kernel_name": "nope"}, "no kernel spec 'nope'")],
)
async def test_start_errors_are_clear(gateway: GatewayProcess, options: dict, message: str) -> None:
    """A wrong token or kernel name fails the start with a message that says so."""
    config = GatewayConfig(**{"url": gateway.url, "token": gateway.token, **options})
    with pytest.raises(KernelStartError, match=message):
        await GatewayKernel(config).start()


@pytest.mark.parametrize(
    ("gateway_class", "limit", "message"),
    [
        (GatewayProcess, "--KernelGatewayApp.max_kernels=1", "max_kernels"),
        (
            EnterpriseGatewayProcess,
            "--EnterpriseGatewayApp.max_kernels_per_user=1",
            "per-user kernel limit is reached",
        ),
    ],
    ids=["gateway", "enterprise_gateway"],
)
def test_refused_kernel_is_a_clear_error(
    tmp_path: Path, gateway_class: type[GatewayProcess], limit: str, message: str
) -> None:
    """A gateway at its kernel limit (Kernel Gateway's max_kernels, Enterprise Gateway's per
    user) refuses the next kernel: reset raises one clear line; the first episode goes on."""
    gw = gateway_class(tmp_path, limit)
    gw.start()
    try:
        source = gateway_source(_config(gw))
        with KernelEnv(kernel_source=source) as first, KernelEnv(kernel_source=source) as second:
            first.reset()
            with pytest.raises(KernelStartError, match=message):
                second.reset()
            assert _stdout(first, "print(1 + 1)") == "2\n"
    finally:
        gw.stop()


def test_f12_gateway_killed_mid_step_then_back(tmp_path: Path) -> None:
    """F12: the gateway SIGKILLed mid-step fails the step within 10 s; once back, reset works."""
    gw = GatewayProcess(tmp_path)
    gw.start()
    try:
        with KernelEnv(kernel_source=gateway_source(_config(gw)), step_timeout=30) as env:
            env.reset(context="x")
            killer = threading.Timer(0.5, gw.kill)
            killer.start()
            started = time.monotonic()
            try:
                res = env.execute("import time; time.sleep(20)").observation.result
            except KernelError as exc:
                assert "gateway" in str(exc) or "channels" in str(exc)
            else:
                assert not res.success
            killer.join()
            assert time.monotonic() - started <= 10
            gw.start()
            env.reset(context="back")
            assert _stdout(env, "print(context)") == "back\n"
    finally:
        gw.stop()


def test_server_episode_on_gateway_kernels(gateway: GatewayProcess) -> None:
    """Settings with a gateway URL: the server's pool and /ws run episodes on its kernels."""
    settings = ServerSettings(
        pool_size=1,
        max_sessions=2,
        step_timeout=10.0,
        gateway_url=gateway.url,
        gateway_token=gateway.token,
        gateway_kernel_name="kernel_env",
    )
    with LoopbackClient(create_app(settings)) as client, client.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {"context": "Hello World"}})
        assert ws.receive_json()["type"] == "observation"
        ws.send_json({"type": "step", "data": {"code": "print(len(context))"}})
        assert ws.receive_json()["data"]["observation"]["result"]["stdout"] == "11\n"
        ws.send_json({"type": "step", "data": {"code": PARENT}})
        assert ws.receive_json()["data"]["observation"]["result"]["stdout"] == _pid(gateway)


def test_serve_gateway_flags(any_gateway: GatewayProcess) -> None:
    """`kernel-env serve --gateway-url ... --gateway-kernel-name ... --gateway-env ...` with the
    token from KERNEL_ENV_GATEWAY_TOKEN: the status line names the gateway, episodes run there
    with the KERNEL_* values given, and the token is never logged."""
    gateway = any_gateway
    env = {**os.environ, "KERNEL_ENV_GATEWAY_TOKEN": gateway.token}
    with serve_process(
        "--gateway-url",
        gateway.url,
        "--gateway-kernel-name",
        "kernel_env",
        "--gateway-env",
        "KERNEL_USERNAME=alice",
        "--gateway-env",
        "KERNEL_ENV_NOTE=from-serve",
        "--pool-size",
        "1",
        env=env,
    ) as server:
        with KernelEnv(server.url) as client:
            client.reset(context="abc")
            assert client.execute("print(context[::-1])").observation.result.stdout == "cba\n"
            assert client.execute(PARENT).observation.result.stdout == _pid(gateway)
            said = client.execute(
                "import os; print(os.environ['KERNEL_USERNAME'], os.environ['KERNEL_ENV_NOTE'])"
            )
            assert said.observation.result.stdout == "alice from-serve\n"
        log = server.log.read_text(errors="replace")
    assert f"kernels on the gateway {gateway.url} (kernel spec 'kernel_env')" in log
    assert gateway.token not in log


def test_serve_says_gateway_kernels_are_not_sandboxed(gateway: GatewayProcess) -> None:
    """`kernel-env serve --gateway-url`: the status line and ``/health`` say that kernel_env
    does not sandbox the gateway's kernels and that the gateway's own isolation is unknown,
    and a cell shows why it matters: it runs as the gateway's uid (root here), in the
    gateway's PID namespace."""
    env = {**os.environ, "KERNEL_ENV_GATEWAY_TOKEN": gateway.token}
    args = ("--gateway-url", gateway.url, "--gateway-kernel-name", "kernel_env")
    with serve_process(*args, "--pool-size", "0", env=env) as server:
        kernels = httpx.get(f"{server.url}/health").json()["kernels"]
        with KernelEnv(server.url) as client:
            client.reset()
            said = client.execute("import os; print(os.getuid(), os.getppid())")
        log = server.log.read_text(errors="replace")
    assert gateway.process is not None
    uid = os.stat(f"/proc/{gateway.process.pid}").st_uid
    assert said.observation.result.stdout == f"{uid} {gateway.process.pid}\n"
    assert kernels["sandbox"].startswith("none from kernel_env"), kernels
    assert kernels["gateway_isolation"].startswith("unknown"), kernels
    assert "NOT sandboxed by kernel_env" in kernels["backend"], kernels
    assert f"sandbox: {kernels['sandbox']}" in log
    assert f"gateway_isolation: {kernels['gateway_isolation']}" in log
    assert "NOT sandboxed by kernel_env" in log


async def test_a_kernel_that_dies_at_start_is_named(any_gateway: GatewayProcess) -> None:
    """A kernel spec whose command fails: the start fails saying the kernel died, not that a
    WebSocket handshake timed out."""
    with pytest.raises(KernelStartError, match="'broken' kernel died as it started"):
        await GatewayKernel(_config(any_gateway, kernel_name="broken")).start()


# -- Enterprise Gateway only -----------------------------------------------------------------


async def test_eg_refuses_root_and_the_error_says_how_to_name_a_user(
    enterprise_gateway: GatewayProcess,
) -> None:
    """Enterprise Gateway refuses a kernel for root (its default unauthorized_users): one
    line with its words and the flag that names another user."""
    config = _config(enterprise_gateway, env={"KERNEL_USERNAME": "root"})
    with pytest.raises(KernelStartError) as refused:
        await GatewayKernel(config).start()
    said = str(refused.value)
    assert "User 'root' is not authorized" in said and "for user 'root'" in said
    assert "--gateway-env KERNEL_USERNAME=NAME" in said and "\n" not in said


def test_eg_culls_an_idle_kernel_and_the_next_step_says_so(tmp_path: Path) -> None:
    """Enterprise Gateway culls a kernel idle past its timeout: the next step reports the
    kernel gone (not a hang), and the episode goes on in a fresh kernel."""
    gw = EnterpriseGatewayProcess(
        tmp_path,
        # Idle 5 s: the kernel that replaces the culled one must be ready before that, or it
        # is culled too (a kernel starting on a loaded machine sends nothing for seconds).
        "--MappingKernelManager.cull_idle_timeout=5",
        "--MappingKernelManager.cull_interval=1",
        "--MappingKernelManager.cull_connected=True",  # kernel_env keeps its channels open
    )
    gw.start()
    try:
        with KernelEnv(kernel_source=gateway_source(_config(gw)), step_timeout=10) as env:
            env.reset(context="ctx")
            env.execute("kept = 1")
            time.sleep(8)  # culled meanwhile
            started = time.monotonic()
            res = env.execute("print('after')").observation.result
            assert time.monotonic() - started < 30
            assert not res.success and res.state_lost, res
            assert _stdout(env, "print(context, 'kept' in globals())") == "ctx False\n"
    finally:
        gw.stop()


ALICE, BOB = "alice-token-Xq81mTz0", "bob-token-Lp27vNc5"
KERNEL_USER = "import os; print(os.environ['KERNEL_USERNAME'])"


def test_eg_tenants_kernels_start_as_their_own_users(tmp_path: Path) -> None:
    """With tenants (a tokens file), each tenant's kernels start on Enterprise Gateway as that
    tenant's KERNEL_USERNAME, warm ones included, so EG's per-user limit stops the tenant who
    reached it and not the others; no shared pool keeps kernels nobody can take."""
    gw = EnterpriseGatewayProcess(
        tmp_path,
        "--EnterpriseGatewayApp.max_kernels_per_user=2",
        "--EnterpriseGatewayApp.list_kernels=True",  # off by default; the test counts them
    )
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice client {ALICE}\nbob client {BOB}\n")
    tokens.chmod(0o600)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KERNEL_ENV_")},
        "KERNEL_ENV_GATEWAY_TOKEN": gw.token,
        "KERNEL_ENV_TOKENS_FILE": str(tokens),
    }
    flags = ["--gateway-url", gw.url, "--gateway-kernel-name", "kernel_env", "--pool-size", "1"]
    gw.start()
    try:
        with (
            serve_process(*flags, env=env) as server,
            KernelEnv(server.url, token=ALICE) as first,
            KernelEnv(server.url, token=ALICE) as second,
            KernelEnv(server.url, token=ALICE) as third,
            KernelEnv(server.url, token=BOB) as bob,
        ):
            first.reset()
            assert _stdout(first, KERNEL_USER) == "alice\n"
            # Alice's pool, made at her first session: her episode's kernel and a warm one.
            assert wait_until(lambda: len(_eg_kernels(gw)) == 2, 60), _eg_kernels(gw)
            second.reset()  # the warm kernel: hers from its start
            assert _stdout(second, KERNEL_USER) == "alice\n"
            with pytest.raises(KernelStartError, match="per-user kernel limit is reached"):
                third.reset()
            bob.reset()  # his own user, his own limit
            assert _stdout(bob, KERNEL_USER) == "bob\n"
            assert _stdout(first, "print(1 + 1)") == "2\n"
    finally:
        gw.stop()


def _eg_kernels(gw: GatewayProcess) -> list[dict]:
    response = httpx.get(f"{gw.url}/api/kernels", headers={"Authorization": f"token {gw.token}"})
    kernels: list[dict] = response.raise_for_status().json()
    return kernels


PARENT = "import os; print(os.getppid())"  # a gateway kernel is the gateway's child


def _pid(gw: GatewayProcess) -> str:
    assert gw.process is not None
    return f"{gw.process.pid}\n"


# -- pure ------------------------------------------------------------------------------------


def test_binary_frames_round_trip() -> None:
    """Messages with buffers use Jupyter's binary WebSocket framing, and decode back."""
    msg = {"header": {"msg_type": "execute_request"}, "content": {"code": "é"}, "channel": "shell"}
    assert decode_message(encode_message(msg)) == msg
    frame = encode_message(msg, [b"abc", b"", b"\x00" * 5])
    back = decode_message(frame)
    assert [bytes(b) for b in back.pop("buffers")] == [b"abc", b"", b"\x00" * 5]
    assert back == msg


def test_config_validation() -> None:
    """Only KERNEL_* variables, http(s) URLs and non-empty tokens are accepted."""
    with pytest.raises(ValueError, match="KERNEL_"):
        GatewayConfig(url="http://h:1", env={"HF_TOKEN": "x"})
    with pytest.raises(ValueError, match="http"):
        GatewayConfig(url="ftp://h")
    with pytest.raises(ValueError, match="token"):
        GatewayConfig(url="http://h", token="")
    config = GatewayConfig(url="https://h:9/base/", token="s3cret")
    assert config.ws_url == "wss://h:9/base" and "s3cret" not in repr(config)


def test_source_selection() -> None:
    """No gateway URL: local kernels; a URL (and gateway_* fields): gateway kernels."""

    class Settings:
        gateway_url = "http://127.0.0.1:1"
        gateway_token = ""
        gateway_kernel_name = "kernel_env"

    assert kernel_source_from(None).__name__ == "start_local_kernel"
    assert kernel_source_from(Settings()).__name__ == "start_gateway_kernel"
