"""kernel_env's kernels in a plain Jupyter: the provisioner and ``kernel-env kernelspec install``.

Real jupyter_client managers, a real ``jupyter execute`` (nbclient), real sandboxed kernels, and
an OpenAI-compatible server on loopback that answers ``llm_query`` for the host: the kernel
reaches it only through the host's call socket, with the key only the host holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from fake_openai import FakeOpenAI
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from procs import alive, descendants, peak_growth

from kernel_env.integrations.callsocket import MAX_CONNECTIONS
from kernel_env.kernel.isolation import privilege
from kernel_env.kernel.isolation.sandbox import sandbox_problem

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox: {sandbox_problem()}"),
]

BIN = Path(sys.executable).parent
KEY = "sk-provisioner-test-key-7f3a"
NOBODY = 65534  # the uid the sandbox maps the kernel's own to


@pytest.fixture
def model() -> Iterator[FakeOpenAI]:
    def answer(body: dict[str, Any]) -> str:
        return "pong: " + body["messages"][-1]["content"]

    with FakeOpenAI(answer) as server:
        yield server


@pytest.fixture
def specs(tmp_path: Path) -> Path:
    """The kernelspec, installed by the command a user runs, under a prefix of the test's."""
    prefix = tmp_path / "prefix"
    done = subprocess.run(
        [str(BIN / "kernel-env"), "kernelspec", "install", "--prefix", str(prefix)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "installed kernelspec kernel-env" in done.stdout
    return prefix / "share" / "jupyter"


@pytest.fixture
def jupyter(specs: Path, model: FakeOpenAI, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Jupyter's environment: where the kernelspec is, the model, and its key."""
    env = {
        "JUPYTER_PATH": str(specs),
        "KERNEL_ENV_LLM_BASE_URL": model.url,
        "KERNEL_ENV_LLM_MODEL": "m",
        "KERNEL_ENV_LLM_API_KEY": KEY,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return {**os.environ, **env}


# 32 threads of the kernel each send a 17 MiB request at once, three times over.
OVERSIZED_FLOOD = """
import os, socket, threading
def one():
    s = socket.socket(socket.AF_UNIX)
    s.connect(os.environ['KERNEL_ENV_CALL_SOCKET'])
    try:
        s.sendall(b'\\x00kernel_env/1:' + b'x' * (17 << 20))
        s.recv(100)
    except OSError:
        pass
    s.close()
for _ in range(3):
    threads = [threading.Thread(target=one) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
print('flooded')
"""


def _port(model: FakeOpenAI) -> int:
    return int(model.url.rsplit(":", 1)[1].split("/")[0])


def test_the_kernelspec_names_the_provisioner_and_holds_no_key(specs: Path) -> None:
    spec = KernelSpecManager(kernel_dirs=[str(specs / "kernels")]).get_kernel_spec("kernel-env")
    assert spec.metadata["kernel_provisioner"]["provisioner_name"] == "kernel-env"
    assert spec.interrupt_mode == "message"
    assert Path(spec.argv[0]).exists()
    assert KEY not in (specs / "kernels" / "kernel-env" / "kernel.json").read_text()


def test_a_bad_kernelspec_install_says_why(tmp_path: Path) -> None:
    both = subprocess.run(
        [str(BIN / "kernel-env"), "kernelspec", "install", "--user", "--prefix", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_jupyter_execute_runs_a_notebook_sandboxed_with_llm_query(
    tmp_path: Path, jupyter: dict[str, str], model: FakeOpenAI
) -> None:
    """``jupyter execute`` (nbclient, which answers no input request) of a notebook in the
    installed kernelspec: the kernel runs as the sandbox's uid, with no network, none of
    Jupyter's environment, and ``llm_query`` answered by the host with the host's key."""
    cells = [
        "import os, socket\nprint('uid', os.getuid())",
        "print('names', sorted(os.environ))\nprint('key' , open('/proc/self/environ').read())",
        "s = socket.socket()\ns.settimeout(3)\ntry:\n"
        f"    s.connect(('127.0.0.1', {_port(model)}))\n"
        "    print('NET REACHED')\nexcept OSError as exc:\n    print('no network:', exc)",
        "print(llm_query('hi'))",
        "print(llm_query_batched(['a', 'b']))",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "kernel-env", "display_name": "kernel_env"}
    path = tmp_path / "agent.ipynb"
    nbformat.write(nb, path)
    done = subprocess.run(
        [str(BIN / "jupyter"), "execute", "--output", "done", str(path)],
        env=jupyter, capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ran = nbformat.read(tmp_path / "done.ipynb", as_version=4)
    out = ["".join(o.get("text", "") for o in cell.outputs) for cell in ran.cells]
    assert out[0].strip() == f"uid {NOBODY}", out
    assert "KERNEL_ENV_LLM" not in out[1] and KEY not in out[1] and "JUPYTER_PATH" not in out[1]
    assert "no network" in out[2], out[2]
    assert out[3].strip() == "pong: hi", out
    assert out[4].strip() == "['pong: a', 'pong: b']", out
    assert len(model.requests) == 3
    assert {r.headers["authorization"] for r in model.requests} == {f"Bearer {KEY}"}
    assert KEY not in (tmp_path / "done.ipynb").read_text()


# -- through jupyter_client's own manager ---------------------------------------------------


async def _run(kc: Any, code: str, timeout: float = 60.0) -> tuple[str, str | None]:
    """A cell's stream text and the name of its error, if any."""
    msg_id = kc.execute(code)
    text, error = [], None
    deadline = time.monotonic() + timeout
    while True:
        msg = await kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            text.append(content["text"])
        elif kind == "error":
            error = content["ename"]
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(text), error


async def _started() -> tuple[AsyncKernelManager, Any]:
    km = AsyncKernelManager(kernel_name="kernel-env")
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=60)
    return km, kc


def _processes(km: AsyncKernelManager) -> set[int]:
    """The host pids of the kernel: its launch and every process under it."""
    kernel = km.provisioner.kernel  # type: ignore[union-attr]
    assert kernel is not None and kernel.pid is not None
    return {kernel.pid, *descendants(kernel.pid)}


async def test_interrupt_and_restart_through_jupyter_client(jupyter: dict[str, str]) -> None:
    """The manager a frontend uses interrupts ``time.sleep(60)`` (the kernel lives on, its
    variables kept) and restarts the kernel: the same client reaches the new one, whose
    namespace is fresh and whose ``llm_query`` still works. Shutting down leaves nothing."""
    km, kc = await _started()
    try:
        await _run(kc, "x = 6 * 7")
        # stop_on_error=False: the kernel runs the cells queued after this one, interrupted.
        msg_id = kc.execute("import time; time.sleep(60)", stop_on_error=False)
        await asyncio.sleep(0.5)
        asked = time.monotonic()
        await km.interrupt_kernel()
        while True:
            msg = await kc.get_iopub_msg(timeout=10)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "error":
                break
        print(f"interrupt: the cell stopped {time.monotonic() - asked:.2f} s after it was asked")
        assert msg["content"]["ename"] == "KeyboardInterrupt"
        assert await _run(kc, "print(x)") == ("42\n", None)

        launch = _processes(km)
        await km.restart_kernel()
        await kc.wait_for_ready(timeout=60)
        assert await _run(kc, "print('x' in globals(), llm_query('again'))") == (
            "False pong: again\n",
            None,
        )
        assert not [pid for pid in launch if alive(pid)], "the first process outlived its restart"
        kept = _processes(km)
    finally:
        kc.stop_channels()
        await km.shutdown_kernel()
    assert not [pid for pid in kept if alive(pid)], "the kernel outlived its shutdown"
    assert not km.has_kernel


async def test_the_call_socket_is_bounded_and_answers_only_requests(
    jupyter: dict[str, str],
) -> None:
    """The host's call socket is a door the kernel's code can knock on at will: garbage, an
    oversized request and a flood of silent connections get refusals and closed connections,
    the host's memory does not follow, and ``llm_query`` works once the flood stops."""
    km, kc = await _started()
    try:
        ask = (
            "import os, socket\n"
            "def ask(data):\n"
            "    s = socket.socket(socket.AF_UNIX)\n"
            "    s.connect(os.environ['KERNEL_ENV_CALL_SOCKET'])\n"
            "    try:\n"
            "        s.sendall(data)\n"
            "        s.shutdown(socket.SHUT_WR)\n"
            "    except BrokenPipeError:\n"
            "        pass  # refused before the end: the reply waits\n"
            "    got = b''\n"
            "    while chunk := s.recv(65536):\n"
            "        got += chunk\n"
            "    return got.decode()\n"
        )
        await _run(kc, ask)
        out, _ = await _run(kc, "print(ask(b'not json\\n'))")
        assert json.loads(out) == {"ok": False, "error": "bad request: not a helper's request"}
        out, _ = await _run(kc, 'print(ask(b\'\\x00kernel_env/1:{"op": "rm -rf"}\\n\'))')
        assert json.loads(out)["ok"] is False and "bad request" in json.loads(out)["error"]
        out, _ = await _run(kc, "print(ask(b'x' * (17 << 20)))")
        assert "at most" in json.loads(out)["error"], out
        # 32 oversized requests at once, three times over: this process (the host) holds
        # one request's read at a time, not 32.
        with peak_growth(os.getpid()) as grown:
            out, _ = await _run(kc, OVERSIZED_FLOOD, timeout=120)
        growth = grown[0]
        print(f"call socket: 96 oversized requests grew the host's peak by {growth:.0f} MiB")
        assert out.strip() == "flooded" and growth < 128, (out, growth)
        flood = (
            "held = []\n"
            f"for _ in range({MAX_CONNECTIONS * 2}):\n"
            "    s = socket.socket(socket.AF_UNIX)\n"
            "    s.connect(os.environ['KERNEL_ENV_CALL_SOCKET'])\n"
            "    held.append(s)\n"
            "s.settimeout(5)\n"
            "print('closed unanswered:', s.recv(10) == b'')"
        )
        out, _ = await _run(kc, flood)
        assert "closed unanswered: True" in out, out
        assert km.provisioner.call_socket.refused >= MAX_CONNECTIONS  # type: ignore[union-attr]
        # A call made while the kernel still holds every connection the host serves waits
        # for room (the host sees closes late on a busy machine), and is answered once the
        # kernel closes them.
        free_later = (
            "import threading\nthreading.Timer(0.5, lambda: [s.close() for s in held]).start()\n"
        )
        said = await _run(kc, free_later + "print(llm_query('still'))")
        assert said == ("pong: still\n", None), said
        await _run(kc, "del held")
        assert await _run(kc, "print(llm_query('again'))") == ("pong: again\n", None)
    finally:
        kc.stop_channels()
        await km.shutdown_kernel()


@pytest.mark.skipif(not privilege.privileged(), reason="another uid to attack from needs root")
async def test_another_local_user_cannot_reach_the_call_socket(jupyter: dict[str, str]) -> None:
    """The socket spends the host's key: only the kernel may connect, not another uid of
    this machine (a process of the nobody user here)."""
    km, kc = await _started()
    try:
        path = km.provisioner.call_socket.path  # type: ignore[union-attr]
        probe = (
            "import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect(sys.argv[1])\n    print('CONNECTED')\n"
            "except OSError as exc:\n    print(type(exc).__name__)"
        )
        done = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             sys.executable, "-I", "-c", probe, path],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.stdout.strip() == "PermissionError", done
    finally:
        kc.stop_channels()
        await km.shutdown_kernel()
