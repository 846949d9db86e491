"""Forking an episode: copies that hold the parent's state and record, then step on their own.
Unsandboxed local kernels are copied live (a fork of the kernel's process); sandboxed and
gateway kernels, and kernels running a thread of their own, replay (llm_query answered from
the record, never asked again)."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverkit import small_settings, thread_server
from uids import OWN_UIDS_REASON, unsandboxed_fork_method, unsandboxed_kernels_get_own_uids
from websockets.asyncio.client import connect

from kernel_env import AsyncKernelEnv, KernelEnv
from kernel_env.errors import ForkRefused, InvalidInput, LiveForkUnavailable
from kernel_env.kernel import GatewayConfig, versions
from kernel_env.kernel.factory import gateway_source, local_source
from kernel_env.kernel.isolation.cgroups import available_controllers
from kernel_env.kernel.isolation.sandbox import sandbox_problem
from kernel_env.remote import ws_url

pytestmark = pytest.mark.integration  # kernels, servers or other processes
# A live fork relies on ipykernel's internals: with a release kernel_env was not tested with
# (make test-lowest) every fork replays, and the tests of what a live copy is do not apply.
LIVE = pytest.mark.skipif(
    versions.untested() is not None, reason=f"forks replay here: {versions.untested()}"
)

# A live copy needs a kernel that runs as the server's uid (tests/uids.py).
COPIED = pytest.mark.skipif(unsandboxed_kernels_get_own_uids(), reason=OWN_UIDS_REASON)

LOCAL = local_source("none")
SETUP = (
    "import json, random\n"
    "xs = [1]\n"
    "open('shared.txt', 'w').write('parent')\n"
    "json.MARK = 'parent'\n"
    "answer_1 = llm_query('setup question')\n"
)


class Model:
    """Counts the prompts it really gets."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        return f"answer to {prompt}"


def _out(env: KernelEnv, code: str) -> str:
    result = env.run(code)
    assert result.success, result.stderr
    return result.stdout.strip()


@LIVE
def test_a_fork_before_the_first_step_copies_the_set_up_episode() -> None:
    """The setup a reset leaves for the first request is carried in before the kernel is
    copied: a copy made right after the reset (live, where the kernel can be copied) has the
    context and the seed's draws."""
    with KernelEnv(kernel_source=LOCAL) as parent:
        parent.reset(context="ctx", seed=3)
        (child,) = parent.fork(1)
        with child:
            forked = child._async.environment.record.forked_from  # type: ignore[union-attr]
            assert forked["method"] == unsandboxed_fork_method()
            probe = "import random\nprint(context, random.random() == random.Random(3).random())"
            assert _out(child, probe) == "ctx True"
            assert _out(parent, probe) == "ctx True"


# Run in a sandboxed kernel by the test below: two processes that confine themselves with
# Landlock into sibling domains, as a live copy and its parent would have to. A binds a
# pathname and an abstract UNIX socket and makes a System V segment, then confines itself; B
# confines itself (everything on the filesystem refused but reading /proc) and tries each.
LANDLOCK_PROBE = r"""
import ctypes, errno, json, os, socket, time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.shmat.restype = ctypes.c_void_p
CREATE_RULESET, ADD_RULE, RESTRICT_SELF = 444, 445, 446  # alike on x86_64 and aarch64
abi = libc.syscall(CREATE_RULESET, None, ctypes.c_long(0), ctypes.c_long(1))  # the version
if abi < 6:  # no scopes (or no Landlock: EPERM would be the seccomp filter's refusal)
    print(json.dumps({"abi": abi, "errno": errno.errorcode.get(ctypes.get_errno())}))
    raise SystemExit


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


def confine():
    fs = (1 << 13) - 1 | (abi >= 2) << 13 | (abi >= 3) << 14 | (abi >= 5) << 15
    fs |= (abi >= 9) << 16  # LANDLOCK_ACCESS_FS_RESOLVE_UNIX: pathname UNIX sockets
    attr = (ctypes.c_uint64 * 3)(fs, 0, 0b11)  # scoped: abstract UNIX sockets, signals
    ruleset = libc.syscall(CREATE_RULESET, attr, ctypes.c_long(24), ctypes.c_long(0))
    proc = os.open("/proc", os.O_PATH)
    rule = PathBeneath(1 << 2 | 1 << 3, proc)  # READ_FILE, READ_DIR
    assert libc.syscall(ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) == 0
    assert libc.prctl(38, ctypes.c_ulong(1), 0, 0, 0) == 0  # no_new_privs
    assert libc.syscall(RESTRICT_SELF, ruleset, 0) == 0, ctypes.get_errno()


def attempt(action):
    try:
        action()
    except OSError as exc:
        return errno.errorcode[exc.errno]
    return "ok"


def connect(address):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(address)


path = os.path.join(os.environ["TMPDIR"], "probe.sock")
ready_r, ready_w = os.pipe()
a = os.fork()
if a == 0:
    listening = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)]
    for s, address in zip(listening, (path, "\0kernel-env-probe")):
        s.bind(address)
        s.listen()
    segment = libc.shmget(0, 4096, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
    with open(path + ".txt", "w") as f:
        f.write("A's")
    confine()
    os.write(ready_w, str(segment).encode())
    time.sleep(60)
    os._exit(0)
os.close(ready_w)
segment = int(os.read(ready_r, 32))
answer_r, answer_w = os.pipe()
b = os.fork()
if b == 0:
    confine()
    channels = [line.split()[-1] for line in open("/proc/net/unix") if "kernel-ipc" in line]
    seen = {
        "signal": attempt(lambda: os.kill(a, 0)),
        "environ": attempt(lambda: open(f"/proc/{a}/environ", "rb").read()),
        "abstract socket": attempt(lambda: connect("\0kernel-env-probe")),
        "pathname socket": attempt(lambda: connect(path)),
        "kernel channel": attempt(lambda: connect(channels[0] if channels else "")),
        "file": attempt(lambda: open(path + ".txt").read()),
        "sysv shm": "ok" if libc.shmat(segment, None, 0) not in (None, 2**64 - 1) else "EPERM",
    }
    os.write(answer_w, json.dumps(seen).encode())
    os._exit(0)
os.close(answer_w)
seen = json.loads(os.read(answer_r, 4096))
seen["signal from the unconfined ancestor"] = attempt(lambda: os.kill(a, 0))
seen["abi"] = abi
os.kill(a, 9)
os.waitpid(a, 0)
os.waitpid(b, 0)
print(json.dumps(seen))
"""


def test_why_a_sandboxed_episode_forks_by_replay() -> None:
    """The facts docs/security.md gives for it, checked in a sandbox: Landlock passes the
    seccomp filter, and a process confined in a sibling domain cannot signal another, read
    its /proc/<pid>/environ, connect to its abstract socket or open its files; but before
    Landlock ABI 9 it connects to its pathname sockets (the kernel's channels included),
    and nothing keeps it from the System V segments of the IPC namespace both share."""
    if sandbox_problem() is not None:
        pytest.skip(f"no sandbox: {sandbox_problem()}")
    with KernelEnv(kernel_source=local_source("bwrap")) as env:
        env.reset()
        code = (
            "import subprocess, sys\n"
            f"print(subprocess.run([sys.executable, '-c', {LANDLOCK_PROBE!r}],"
            " capture_output=True, text=True, check=True).stdout)"
        )
        seen = json.loads(_out(env, code))
    assert seen.get("errno") != "EPERM"  # the seccomp filter lets landlock_* through
    if seen["abi"] < 6:
        pytest.skip(f"Landlock ABI {seen['abi']} here: no signal or abstract socket scoping")
    assert seen["signal"] == "EPERM"
    assert seen["environ"] == "EACCES"
    assert seen["abstract socket"] == "EPERM"
    assert seen["file"] == "EACCES"
    assert seen["signal from the unconfined ancestor"] == "ok"  # so the parent must confine too
    assert seen["sysv shm"] == "ok"  # the IPC namespace is theirs alike: Landlock has no say
    pathname = "ok" if seen["abi"] < 9 else "EACCES"  # LANDLOCK_ACCESS_FS_RESOLVE_UNIX
    assert seen["pathname socket"] == seen["kernel channel"] == pathname


@pytest.mark.parametrize("sandbox", [pytest.param("none", marks=LIVE), "bwrap"])
def test_children_hold_the_state_then_change_only_their_own(sandbox: str) -> None:
    """Also in the sandbox (each copy its own kernel, uid, /tmp and workspace), as root."""
    if sandbox == "bwrap" and sandbox_problem() is not None:
        pytest.skip(f"no sandbox: {sandbox_problem()}")
    model = Model()
    with KernelEnv(llm_query_fn=model, kernel_source=local_source(sandbox)) as parent:
        parent.reset(context="ctx", task_prompt="fork me")
        parent.execute(SETUP)
        first, second = parent.fork(2)
        with first, second:
            assert model.prompts == ["setup question"]  # the replay asked no model
            assert first.state().step_count == second.state().step_count == 1  # continues
            for child in (first, second):
                assert _out(child, "print(xs, open('shared.txt').read(), json.MARK, answer_1)") == (
                    "[1] parent parent answer to setup question"
                )
            first.execute(
                "xs.append(2)\nopen('shared.txt', 'w').write('first')\njson.MARK = 'first'"
            )
            probe = "print(xs, open('shared.txt').read(), json.MARK)"
            assert _out(parent, probe) == "[1] parent parent"
            assert _out(second, probe) == "[1] parent parent"
            assert _out(first, probe) == "[1, 2] first first"
            forked = first._async.environment.record.forked_from  # type: ignore[union-attr]
            if sandbox == "none":
                assert forked["method"] == unsandboxed_fork_method()
            else:
                assert forked["method"] == "replay" and forked["outputs_matched"] is True
                assert "sandbox" in forked["live_fork"]
            assert forked["steps"] == 1
        assert len(parent._async.environment.record.forks) == 2  # type: ignore[union-attr]


def test_children_draw_different_random_numbers() -> None:
    with KernelEnv(kernel_source=LOCAL) as parent:
        parent.reset()
        parent.execute("import random")
        children = parent.fork(3)
        try:
            draws = {_out(child, "print(random.random())") for child in children}
        finally:
            for child in children:
                child.close()
    assert len(draws) == 3


def test_live_copies_of_a_seeded_episode_keep_its_random_state() -> None:
    """A reset's seed makes the episode deterministic: its live copies draw what it draws."""
    with KernelEnv(kernel_source=LOCAL) as parent:
        parent.reset(seed=7)
        parent.execute("import random; random.random()")
        children = parent.fork(2)
        try:
            draws = {_out(env, "print(random.random())") for env in (parent, *children)}
        finally:
            for child in children:
                child.close()
    assert len(draws) == 1


@LIVE
@COPIED
def test_a_live_copy_has_channels_of_its_own() -> None:
    """What a copy prints, from Python or from a subprocess writing to its descriptors, is
    its own output; the parent's next step shows none of it. A copy's files are copies."""
    with KernelEnv(kernel_source=LOCAL) as parent:
        parent.reset()
        parent.execute("import os, subprocess; open('data.txt', 'w').write('parent')")
        parent.execute("log = open('log.txt', 'a'); log.write('shared line\\n'); log.flush()")
        (child,) = parent.fork()
        with child:
            assert child._async.environment.kernel.copied  # type: ignore[union-attr]
            shown = _out(child, "os.system('echo from-a-subprocess'); print(os.getpid())")
            # Both lines, in either order: the subprocess's output reaches the step through
            # the descriptor capture's thread, which may deliver it after the print.
            (pid,) = set(shown.splitlines()) - {"from-a-subprocess"}
            assert "from-a-subprocess" in shown.splitlines()
            time.sleep(0.3)  # what the parent's output threads would publish, they have by now
            assert _out(parent, "print('parent', os.getpid())") == f"parent {_pid_of(parent)}"
            late = parent._async.environment.kernel.late_outputs  # type: ignore[union-attr]
            assert "from-a-subprocess" not in repr(list(late))
            assert pid != str(_pid_of(parent))
            child.execute("open('data.txt', 'w').write('child')")
            assert _out(parent, "print(open('data.txt').read())") == "parent"
            # A file held open at the fork: the copy writes to its own copy of it.
            child.execute("log.write('child line\\n'); log.flush()")
            assert _out(parent, "print(open('log.txt').read().split())") == "['shared', 'line']"
            seen = _out(child, "print(open('log.txt').read().split())")
            assert seen == "['shared', 'line', 'child', 'line']"
            workdirs = {_workdir(env) for env in (parent, child)}
            assert len(workdirs) == 2


@LIVE
@COPIED
def test_a_live_copy_runs_a_cell_with_top_level_await() -> None:
    """A copy serves shell on its main thread: a cell with top-level ``await`` replies."""
    with KernelEnv(kernel_source=LOCAL) as parent:
        parent.reset()
        (child,) = parent.fork(method="live")
        with child:
            code = "import asyncio\nawait asyncio.sleep(0.01)\nprint('awaited')"
            assert _out(child, code) == "awaited"
            assert _out(parent, code) == "awaited"


@LIVE
@COPIED
def test_a_live_copy_grows_its_descriptor_table_before_it_has_threads() -> None:
    """A copy inherits a table its parent's ~60 descriptors fill; grown on the copy's first
    new descriptor, with its threads running, the growth would wait ~8 ms for RCU."""
    fd_size = "print(open('/proc/self/status').read().split('FDSize:')[1].split()[0])"
    with KernelEnv(kernel_source=LOCAL) as parent:
        parent.reset()
        (child,) = parent.fork(method="live")
        with child:
            assert int(_out(child, fd_size)) >= 1024


@LIVE
@COPIED
def test_a_live_copy_runs_in_a_cgroup_of_its_own() -> None:
    """Closing a copy kills what is in its cgroup: the copy must be there, not in its
    parent's (where closing it would leave the copy's children running)."""
    if "pids" not in available_controllers():
        pytest.skip("no writable pids cgroup here")
    pids_cgroup = "print([l for l in open('/proc/self/cgroup').read().split() if ':pids:' in l])"
    with KernelEnv(kernel_source=LOCAL) as parent:
        parent.reset()
        (child,) = parent.fork(method="live")
        with child:
            ids = [env._async.environment.kernel.kernel_id for env in (parent, child)]  # type: ignore[union-attr]
            mine = _out(child, pids_cgroup)
            assert ids[1] in mine and ids[0] not in mine
            assert ids[0] in _out(parent, pids_cgroup)


def _pid_of(env: KernelEnv) -> int:
    return int(_out(env, "import os; print(os.getpid())"))


def _workdir(env: KernelEnv) -> str:
    return _out(env, "import os; print(os.getcwd())")


@LIVE
@COPIED
def test_a_kernel_running_a_thread_of_its_own_is_forked_by_replay() -> None:
    """A thread would be cut in half by a fork: the copy replays instead, and says why."""
    with KernelEnv(kernel_source=LOCAL) as parent:
        parent.reset()
        parent.execute(
            "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start()"
        )
        (child,) = parent.fork()
        with child:
            forked = child._async.environment.record.forked_from  # type: ignore[union-attr]
            assert forked["method"] == "replay" and "threads" in forked["live_fork"]
            assert _out(child, "print(threading.active_count() > 1)") == "True"


@LIVE
@COPIED
def test_a_kernel_on_an_untested_release_is_forked_by_replay() -> None:
    """A live copy relies on ipykernel's internals: a kernel whose releases are not the
    tested ones (faked here inside it) replays, and says why."""
    with KernelEnv(kernel_source=LOCAL) as parent:
        parent.reset()
        parent.execute(
            "from kernel_env.kernel import versions\n"
            "versions.TESTED['ipykernel'] = ((99, 0), (99, 1))"
        )
        (child,) = parent.fork()
        with child:
            forked = child._async.environment.record.forked_from  # type: ignore[union-attr]
            assert forked["method"] == "replay"
            assert "not a release kernel_env was tested with" in forked["live_fork"]
            assert "UntestedRelease" in forked["live_fork"]


@LIVE
@COPIED
def test_the_method_can_be_chosen() -> None:
    """``method="replay"`` replays an episode that could be copied live; ``"live"`` refuses
    where it cannot be; anything else is refused."""
    with KernelEnv(kernel_source=LOCAL) as parent:
        parent.reset()
        parent.execute("x = 1")
        (child,) = parent.fork(method="replay")
        with child:
            forked = child._async.environment.record.forked_from  # type: ignore[union-attr]
            assert forked["method"] == "replay" and forked["live_fork"] == "asked for a replay"
        with pytest.raises(InvalidInput):
            parent.fork(method="teleport")  # type: ignore[arg-type]
        parent.execute("import threading, time; t = threading.Thread(target=time.sleep, args=(9,))")
        parent.execute("t.start()")
        with pytest.raises(LiveForkUnavailable, match="threads"):
            parent.fork(method="live")
        assert _out(parent, "print(x)") == "1"


def test_live_fork_churn_leaves_no_process_or_directory() -> None:
    """30 cycles of fork, step and close: no copy's process or runtime dir is left."""
    tmp_path = Path(tempfile.mkdtemp(prefix="ke-"))  # short: the IPC socket paths live here
    source = local_source("none", runtime_root=str(tmp_path))
    with KernelEnv(kernel_source=source) as parent:
        parent.reset()
        parent.execute("x = list(range(1000))")
        pids = []
        for _ in range(30):
            (child,) = parent.fork()
            with child:
                pids.append(_pid_of(child))
        time.sleep(0.5)
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and _not_zombie(pid)]
        assert alive == []
        (runtime,) = tmp_path.iterdir()
        assert len([d for d in runtime.iterdir() if d.is_dir()]) == 1  # the parent's own
        assert _out(parent, "print(len(x))") == "1000"
    shutil.rmtree(tmp_path, ignore_errors=True)


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_budgets_shared_by_default_or_each_its_own() -> None:
    model = Model()
    with KernelEnv(llm_query_fn=model, kernel_source=LOCAL) as parent:
        parent.reset()
        parent.execute("a = llm_query('one')")
        (shared,) = parent.fork()
        (own,) = parent.fork(own_budget=True)
        with shared, own:
            shared.execute("b = llm_query('two')")
            own.execute("c = llm_query('three')")
            assert parent.state().llm_calls == 2  # its own call and the shared child's
            assert own.state().llm_calls == 1
    assert model.prompts == ["one", "two", "three"]


async def test_a_fork_during_a_running_step_is_refused() -> None:
    async with AsyncKernelEnv(kernel_source=LOCAL) as parent:
        await parent.reset()
        running = asyncio.create_task(parent.execute("import time; time.sleep(2)"))
        await asyncio.sleep(0.5)
        with pytest.raises(ForkRefused, match="a step is running"):
            await parent.fork()
        await running
        (child,) = await parent.fork()
        await child.close()


def test_a_finished_episode_is_not_forked() -> None:
    with KernelEnv(kernel_source=LOCAL) as parent:
        parent.reset()
        parent.execute("FINAL(1)")
        with pytest.raises(ForkRefused, match="over"):
            parent.fork()


def test_a_killed_child_leaves_the_parent_fine() -> None:
    with KernelEnv(kernel_source=LOCAL) as parent:
        parent.reset()
        parent.execute("x = 41")
        (child,) = parent.fork()
        with child:
            copy = child.environment.kernel  # type: ignore[union-attr]
            assert copy.pid == int(_out(child, "import os; print(os.getpid())"))
            died = child.run("import os; os._exit(1)")
            assert not died.success
        assert _out(parent, "print(x + 1)") == "42"


def test_forks_on_gateway_kernels(gateway: Any) -> None:
    config = GatewayConfig(url=gateway.url, token=gateway.token, kernel_name="kernel_env")
    with KernelEnv(kernel_source=gateway_source(config)) as parent:
        parent.reset()
        parent.execute("xs = [1, 2]")
        (child,) = parent.fork()
        with child:
            child.execute("xs.append(3)")
            assert _out(child, "print(xs)") == "[1, 2, 3]"
        assert _out(parent, "print(xs)") == "[1, 2]"


def test_exports_mark_the_shared_prefix_and_list_the_forks(tmp_path: Any) -> None:
    import nbformat

    from kernel_env.notebook import recorded_steps

    with KernelEnv(kernel_source=LOCAL) as parent:
        parent.reset(task_prompt="branch")
        parent.execute("x = 1")
        (child,) = parent.fork()
        with child:
            child.execute("x += 1")
            child_nb = nbformat.read(child.export_notebook(tmp_path / "child"), as_version=4)
        parent_nb = nbformat.read(parent.export_notebook(tmp_path / "parent"), as_version=4)
    code = recorded_steps(child_nb)
    assert [c.metadata.get("kernel_env", {}).get("shared_prefix") for c in code] == [True, None]
    notes = [c.source for c in child_nb.cells if c.cell_type == "markdown"]
    assert any(n.startswith("**Shared prefix.**") for n in notes)
    fork_id = child_nb.metadata["kernel_env"]["episode_id"]
    assert parent_nb.metadata["kernel_env"]["forks"] == [fork_id]
    assert fork_id in parent_nb.cells[-1].source


# -- on a server --------------------------------------------------------------------------


def _server_step(url: str, session: str, code: str) -> dict[str, Any]:
    reply = httpx.post(
        f"{url}/step",
        json={"action": {"code": code}},
        headers={"X-Session-Id": session},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


@LIVE
def test_fork_over_http_and_attach_a_websocket_to_a_copy() -> None:
    with thread_server(small_settings(sandbox="none", max_sessions=4)) as url:
        parent = httpx.post(f"{url}/reset", json={}, timeout=60).headers["X-Session-Id"]
        _server_step(url, parent, "xs = [1]")
        reply = httpx.post(f"{url}/sessions/{parent}/fork", json={"n": 2}, timeout=120)
        assert reply.status_code == 200, reply.text
        first, second = (c["session_id"] for c in reply.json()["sessions"])
        assert {c["method"] for c in reply.json()["sessions"]} == {unsandboxed_fork_method()}
        _server_step(url, first, "xs.append(2)")

        async def over_ws() -> str:
            async with connect(ws_url(url) + f"?session={second}") as ws:
                await ws.send(json.dumps({"type": "step", "data": {"code": "print(xs)"}}))
                frame = json.loads(await ws.recv())
                return str(frame["data"]["observation"]["result"]["stdout"])

        assert asyncio.run(over_ws()) == "[1]\n"
        shown = _server_step(url, first, "print(xs)")["observation"]["result"]["stdout"]
        assert shown == "[1, 2]\n"
        shown = _server_step(url, parent, "print(xs)")["observation"]["result"]["stdout"]
        assert shown == "[1]\n"


def test_a_fork_frame_on_ws_and_the_copies_count_toward_capacity() -> None:
    async def main(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
        async with connect(ws_url(url)) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            await ws.recv()
            await ws.send(json.dumps({"type": "fork", "data": {"n": 1}}))
            ok = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "fork", "data": {"n": 1}}))
            full = json.loads(await ws.recv())
            return ok, full

    with thread_server(small_settings(sandbox="none", max_sessions=2)) as url:
        ok, full = asyncio.run(main(url))
    assert ok["type"] == "fork" and len(ok["data"]["sessions"]) == 1
    assert full["type"] == "error" and full["data"]["code"] == "CAPACITY_REACHED"


def test_a_fork_while_a_step_runs_is_refused_over_http() -> None:
    with thread_server(small_settings(sandbox="none")) as url:
        parent = httpx.post(f"{url}/reset", json={}, timeout=60).headers["X-Session-Id"]
        running = threading.Thread(
            target=_server_step, args=(url, parent, "import time; time.sleep(3)")
        )
        running.start()
        time.sleep(1)
        refused = httpx.post(f"{url}/sessions/{parent}/fork", json={}, timeout=60)
        running.join()
    assert refused.status_code == 409 and "a step is running" in refused.text


def test_attaching_needs_a_session_no_other_socket_holds() -> None:
    async def main(url: str, session: str) -> tuple[str, str]:
        async with connect(ws_url(url) + "?session=" + "0" * 32) as ws:
            unknown = json.loads(await ws.recv())["data"]["code"]
        async with connect(ws_url(url) + f"?session={session}") as first:
            await first.send(json.dumps({"type": "state"}))
            await first.recv()
            async with connect(ws_url(url) + f"?session={session}") as second:
                taken = json.loads(await second.recv())["data"]["message"]
        return unknown, taken

    with thread_server(small_settings(sandbox="none")) as url:
        session = httpx.post(f"{url}/reset", json={}, timeout=60).headers["X-Session-Id"]
        unknown, taken = asyncio.run(main(url, session))
    assert unknown == "SESSION_ERROR" and "another WebSocket" in taken
