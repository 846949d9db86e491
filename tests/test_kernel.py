"""The local kernel backend on its own: readiness, isolation, message routing."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest
import zmq
from procs import alive

from kernel_env.errors import KernelError, KernelStartError
from kernel_env.inkernel import tuning
from kernel_env.kernel import LocalKernel, versions

pytestmark = pytest.mark.integration  # kernels, servers or other processes


async def test_ipc_transport_in_private_dir() -> None:
    """The kernel listens on IPC sockets inside a 0700 directory (its own uid's, where it has
    one: tests/uids.py); no TCP port is opened."""
    async with LocalKernel() as kernel:
        runtime = kernel.runtime_dir
        assert runtime is not None
        lease = kernel._lease
        private = runtime if lease is None else runtime / "ipc"
        assert stat.S_IMODE(os.stat(private).st_mode) & 0o777 == 0o700
        assert os.stat(private).st_uid == (os.getuid() if lease is None else lease.uid)
        info = kernel._km.get_connection_info()
        assert info["transport"] == "ipc" and str(info["ip"]).startswith(str(private))
        result = await kernel.execute("import os; os.getcwd()")
        assert str(kernel.workdir) in result.stdout
    assert not runtime.exists()


async def test_minimal_environment(monkeypatch) -> None:
    """The kernel gets an explicit environment, not the host's os.environ."""
    monkeypatch.setenv("KERNEL_ENV_TOKEN", "server-token-value")
    async with LocalKernel() as kernel:
        result = await kernel.execute("import os; sorted(os.environ)")
    names = eval(result.stdout)  # a list literal of names
    assert "KERNEL_ENV_TOKEN" not in names and "PATH" in names


async def test_execute_waits_for_reply_and_idle() -> None:
    """All of a cell's output arrives with it, in order, even when printed right before idle."""
    async with LocalKernel() as kernel:
        for i in range(20):
            result = await kernel.execute(f"print({i}); {i} * 2")
            assert result.stdout == f"{i}\n{i * 2}\n"
            assert result.execution_count == i + 1


async def test_late_thread_output_not_put_in_next_cell() -> None:
    """Output printed by a thread after its cell ended is kept aside, not shown in a later cell."""
    async with LocalKernel() as kernel:
        await kernel.execute(
            "import threading, time\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('late'))).start()"
        )
        await asyncio.sleep(0.6)
        result = await kernel.execute("print('mine')")
        assert result.stdout == "mine\n"
        assert kernel.late_output_count == 1


async def test_restart_gives_fresh_namespace_and_ready_kernel() -> None:
    """After restart the namespace is empty and the very next cell's output is complete."""
    async with LocalKernel() as kernel:
        await kernel.execute("x = 1")
        for _ in range(3):
            await kernel.restart()
            result = await kernel.execute("print('x' in globals())")
            assert result.stdout == "False\n"
        assert kernel.restarts == 3


async def test_stdin_without_handler_answers_eof() -> None:
    """A kernel asking for input with no handler gets EOF instead of waiting forever."""
    async with LocalKernel() as kernel:
        result = await kernel.execute("get_ipython().kernel.raw_input('?')", timeout=5)
        assert result.status == "error" and result.error["ename"] == "EOFError"


async def test_shutdown_is_idempotent_and_kills_process() -> None:
    """shutdown() kills the process and may be called twice."""
    kernel = LocalKernel()
    await kernel.start()
    pid = kernel.pid
    await kernel.shutdown()
    await kernel.shutdown()
    assert pid is not None
    assert not alive(pid)  # a zombie until reaped is acceptable; a running process is not


async def test_runtime_root_too_long_for_sockets_is_a_clear_error(tmp_path: Path) -> None:
    """A runtime root whose socket paths would not fit a unix address is refused up front."""
    root = tmp_path / ("r" * 90)
    root.mkdir()
    kernel = LocalKernel(runtime_root=str(root))
    with pytest.raises(KernelStartError, match="too long for the kernel's IPC sockets"):
        await kernel.start()
    assert kernel.pid is None
    parents = list(root.iterdir())  # this process's runtime parent, and nothing in it
    assert len(parents) == 1 and os.listdir(parents[0]) == [".lock"]


async def test_shutdown_kills_the_process_when_jupyter_client_cannot() -> None:
    """A kernel whose manager fails to shut it down (as after a half-failed start) is still
    killed and reaped: no process left running, no Popen left for the garbage collector."""
    kernel = LocalKernel()
    await kernel.start()
    pid = kernel.pid
    assert pid is not None

    async def failing_shutdown(**kwargs: object) -> None:
        raise RuntimeError("injected: no control socket")

    kernel._km.shutdown_kernel = failing_shutdown
    await kernel.shutdown()
    with pytest.raises(ProcessLookupError):  # reaped, not even a zombie
        os.kill(pid, 0)
    assert kernel.runtime_dir is None


async def test_the_hosts_channels_retry_every_few_ms_and_have_room_for_many_kernels() -> None:
    """A host channel that connects before its kernel binds (a forked kernel binds tens of
    ms after its launch) tries again within 5 ms, not zmq's 100 ms, and without backing off;
    and the host's zmq context holds more than zmq's default of 1023 sockets (3 a kernel)."""
    async with LocalKernel() as kernel:
        assert kernel._client is not None
        for name, sock in kernel._client._sockets.items():
            retry = (sock.getsockopt(zmq.RECONNECT_IVL), sock.getsockopt(zmq.RECONNECT_IVL_MAX))
            assert retry == (5, 0), name
        context = kernel._km.context
        assert context.get(zmq.MAX_SOCKETS) == context.get(zmq.SOCKET_LIMIT) > 1023


async def test_each_kernel_signs_with_a_key_of_its_own() -> None:
    """A kernel's connection file holds a fresh signing key (one kernel's key opens no
    other's), and the host checks its messages with that key."""
    async with LocalKernel() as a, LocalKernel() as b:
        keys = [json.loads(Path(k._km.connection_file).read_text())["key"] for k in (a, b)]
        assert all(len(key) >= 32 for key in keys) and keys[0] != keys[1]
        assert [k._client.session.key.decode() for k in (a, b) if k._client] == keys
        assert all(k._client and k._client.session.auth is not None for k in (a, b))
        assert (await a.execute("1 + 1")).stdout == "2\n"


async def test_a_forged_message_fails_the_step_instead_of_hanging() -> None:
    """A cell that sends the host a message it cannot verify (a forged signature, on its own
    iopub socket) loses the kernel's channels: that step and the next fail at once with a
    KernelError, none waits out a timeout."""
    forge = (
        "get_ipython().kernel.iopub_socket.send_multipart("
        "[b'x', b'<IDS|MSG>', b'forged', b'{}', b'{}', b'{}', b'{}'])\n"
        "import time; time.sleep(1)"
    )
    async with LocalKernel() as kernel:
        with pytest.raises(KernelError, match="channel"):
            await asyncio.wait_for(kernel.execute(forge, timeout=30), 10)
        with pytest.raises(KernelError, match="channel"):
            await asyncio.wait_for(kernel.execute("1", timeout=30), 10)


async def test_a_well_formed_message_with_a_wrong_signature_is_refused() -> None:
    """What reaches the host without this kernel's key (here a cell plays the keyless sender:
    a stream output for its own request, well formed, signed with another key) is refused:
    the channel fails and the output is never taken for the cell's."""
    forge = (
        "import hashlib, hmac, json, uuid\n"
        "k = get_ipython().kernel\n"
        "parent = k.get_parent()['header']\n"
        "header = {'msg_id': uuid.uuid4().hex, 'msg_type': 'stream', 'username': 'x',\n"
        "          'session': k.session.session, 'date': '2026-01-01T00:00:00Z',\n"
        "          'version': '5.3'}\n"
        "parts = [json.dumps(p, default=str).encode() for p in\n"
        "         (header, parent, {}, {'name': 'stdout', 'text': 'FORGED'})]\n"
        "mac = hmac.new(b'not the key', digestmod=hashlib.sha256)\n"
        "for p in parts: mac.update(p)\n"
        "sig = mac.hexdigest().encode()\n"
        "k.iopub_socket.send_multipart([b'stream', b'<IDS|MSG>', sig, *parts])\n"
        "import time; time.sleep(1)"
    )
    async with LocalKernel() as kernel:
        with pytest.raises(KernelError, match="channel"):
            result = await asyncio.wait_for(kernel.execute(forge, timeout=30), 10)
            assert "FORGED" not in result.stdout  # reached only when the forgery was taken


# A message whose frames are each under the host's limit but add up to more (shell), and one
# over it sent by a thread after its cell ended (iopub).
SPLIT_MESSAGE = (
    "k = get_ipython().kernel\n"
    "k.session.send(k.shell_stream, 'stream', {}, parent=k.get_parent('shell'),\n"
    "               ident=k._parent_ident['shell'],\n"
    "               buffers=[bytearray(40 * 2**20), bytearray(40 * 2**20)])\n"
    "import time; time.sleep(1)"
)
LATE_MESSAGE = (
    "import threading, time\n"
    "k = get_ipython().kernel\n"
    "def late():\n"
    "    time.sleep(0.5)\n"
    "    k.session.send(k.iopub_socket, 'stream', {'name': 'stdout', 'text': 'late'},\n"
    "                   buffers=[bytearray(100 * 2**20)])\n"
    "threading.Thread(target=late).start()\n"
    "x = 1"
)


async def test_a_message_over_the_hosts_limit_restarts_the_kernel() -> None:
    """Frames adding up to more than the host's limit are dropped before they are read, and a
    message over it from a thread after its cell is noticed before the next cell (which is
    then not run): each restarts the kernel, says why, and is counted."""
    from kernel_env.kernel.channels import MAX_KERNEL_MESSAGE_BYTES

    async with LocalKernel() as kernel:
        split = await asyncio.wait_for(kernel.execute(SPLIT_MESSAGE, timeout=30), 20)
        assert (split.status, split.restarted) == ("died", True), split
        assert f"over the host's limit of {MAX_KERNEL_MESSAGE_BYTES} bytes on shell" in (
            split.fault or ""
        )
        assert (await kernel.execute(LATE_MESSAGE, timeout=30)).status == "ok"
        await asyncio.sleep(2)
        after = await asyncio.wait_for(kernel.execute("print('x' in dir())", timeout=30), 20)
        assert (after.status, after.restarted, after.stdout) == ("died", True, ""), after
        assert "on iopub" in (after.fault or "")  # restarted before the cell, which did not run
        assert (kernel.oversize_messages, kernel.restarts) == (2, 2)
        fresh = await asyncio.wait_for(kernel.execute("print('x' in dir())", timeout=30), 20)
        assert (fresh.status, fresh.restarted, fresh.stdout) == ("ok", False, "False\n"), fresh


async def test_a_cell_flooding_its_channels_does_not_stall_the_host() -> None:
    """A cell that sends the host signed messages as fast as it can (on its iopub socket, for
    4 s): the host reads them in turns with everything else on its event loop, so a tick
    that other sessions would need still comes every few ms, not after the flood."""
    flood = (
        "import time\n"
        "k = get_ipython().kernel\n"
        "sock, s = k.iopub_thread.socket, k.session\n"
        "time.sleep(0.3)  # the iopub thread has sent the cell's busy status: the socket is ours\n"
        "end = time.monotonic() + 4\n"
        "while time.monotonic() < end:\n"
        "    msg = s.msg('stream', {'name': 'stdout', 'text': 'x'})\n"
        "    sock.send_multipart(s.serialize(msg, ident=b'stream'))\n"
    )
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while not done.is_set():
            await asyncio.sleep(0.01)
            gaps.append(loop.time() - last)
            last = loop.time()

    async with LocalKernel() as kernel:
        ticker = asyncio.create_task(tick())
        try:
            await asyncio.wait_for(kernel.execute(flood, timeout=20), 60)
        finally:
            done.set()
            await ticker
    # The ticks spanned the whole flood (4 s), and none waited for it to end; how many came
    # depends on the machine's load, not on the host.
    assert sum(gaps) > 4, gaps
    assert max(gaps) < 1.0, f"the event loop stalled {max(gaps):.2f} s"


async def test_an_episode_kernel_sends_only_what_the_host_reads() -> None:
    """Once an episode's setup runs, a cell's iopub messages are its outputs and its idle
    status: no busy status, no execute_input broadcast (read by no one). Seen from a second
    iopub subscriber, which sees both from the same kernel before the setup."""

    import zmq
    from jupyter_client.session import Session

    from kernel_env import AsyncKernelEnv

    kernel = LocalKernel()
    await kernel.start()

    async def source() -> LocalKernel:
        return kernel

    info = json.loads(Path(kernel._km.connection_file).read_text())
    session = Session(key=info["key"].encode(), signature_scheme=info["signature_scheme"])
    observer = zmq.Context.instance().socket(zmq.SUB)
    observer.linger = 0
    observer.setsockopt(zmq.SUBSCRIBE, b"")
    observer.connect(f"ipc://{info['ip']}-{info['iopub_port']}")

    def types(idle: bool = True) -> list[str]:
        """What a cell sends until its idle status (or whatever arrives until 0.5 s of
        silence, for ``idle=False``)."""
        seen: list[str] = []
        while observer.poll(10_000 if idle else 500):
            msg = session.deserialize(session.feed_identities(observer.recv_multipart())[1])
            if idle and msg["parent_header"].get("msg_type") != "execute_request":
                continue  # the start's own (a kernel_info request's status, say)
            kind = msg["msg_type"]
            if kind == "status":
                kind += ":" + msg["content"]["execution_state"]
            seen.append(kind)
            if idle and kind == "status:idle":
                return seen
        assert not idle, f"no idle status after {seen}"
        return seen

    try:
        await asyncio.to_thread(types, False)  # subscribed, and past the start's messages
        await kernel.execute("print(1)")
        assert await asyncio.to_thread(types) == [
            "status:busy", "execute_input", "stream", "status:idle"
        ]  # fmt: skip
        async with AsyncKernelEnv(kernel_source=source) as env:
            await env.reset()
            await env.execute("print(2)")  # carries the setup: its busy and input went first
            assert await asyncio.to_thread(types) == [
                "status:busy", "execute_input", "stream", "status:idle"
            ]  # fmt: skip
            assert (await env.execute("print(3)")).observation.result.stdout == "3\n"
            assert await asyncio.to_thread(types) == ["stream", "status:idle"]
    finally:
        observer.close()
        await kernel.shutdown()


class _CountingKernel(LocalKernel):
    """A cold-started LocalKernel (its start takes hundreds of ms) that notes what it sends."""

    def __init__(self, *, welcomes: bool) -> None:
        super().__init__(forkserver=None)
        self.sent: list[str] = []
        if not welcomes:
            self._welcomes_subscribers = False

    def _send(
        self,
        channel: str,
        msg_type: str,
        content: dict,
        parent: dict | None = None,
        metadata: dict | None = None,
    ) -> str:
        self.sent.append(msg_type)
        return super()._send(channel, msg_type, content, parent, metadata)


@pytest.mark.skipif(
    not versions.welcomes_subscribers(), reason="ipykernel 6 welcomes no subscriber"
)
async def test_a_kernel_that_welcomes_its_subscribers_is_not_asked_for_kernel_info(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ipykernel 7 welcomes each iopub subscriber: the host waits for that, and does not ask
    a starting kernel for kernel_info every 50 ms (each request costs the kernel CPU once it
    serves its shell). A kernel not known to welcome is still asked, and is ready."""
    from kernel_env.kernel import base

    monkeypatch.setattr(base, "_WELCOME_OVERDUE", 60.0)  # a loaded machine's slow start too
    welcoming = _CountingKernel(welcomes=True)
    assert welcoming._welcomes_subscribers  # this environment's ipykernel is 7 or later
    async with welcoming:
        assert (await welcoming.execute("1 + 1")).stdout == "2\n"
    assert "kernel_info_request" not in welcoming.sent, welcoming.sent

    asking = _CountingKernel(welcomes=False)
    async with asking:
        assert (await asking.execute("1 + 1")).stdout == "2\n"
    assert "kernel_info_request" in asking.sent  # a cold start outlasts the first 50 ms


@pytest.mark.parametrize("switch", [None, "off"])
async def test_the_per_cell_tuning_switches_off_and_cells_behave_the_same(
    switch: str | None,
) -> None:
    """An episode kernel is tuned (kernel_env.inkernel.tuning) unless KERNEL_ENV_TUNING=off is
    in its environment; either way a cell's result, a top-level await and an error are the
    same."""
    extra = {"KERNEL_ENV_TUNING": switch} if switch is not None else {}
    tuned = switch is None and tuning.enabled()  # not on an untested ipykernel
    async with LocalKernel(extra_env=extra) as kernel:
        name = await kernel.execute("get_ipython().transform_cell.__name__")
        assert name.stdout == ("'remembered'\n" if tuned else "'transform_cell'\n")
        awaited = await kernel.execute("import asyncio\nawait asyncio.sleep(0)\nx = 5\nx * 2")
        assert (awaited.status, awaited.stdout) == ("ok", "10\n")
        failed = await kernel.execute("1/0")
        assert failed.error is not None and failed.error["ename"] == "ZeroDivisionError"
        assert (await kernel.execute("x")).stdout == "5\n"
