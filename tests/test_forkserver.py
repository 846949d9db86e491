"""The kernel forkserver: forked kernels are fresh, isolated from each other as cold ones are,
die and restart cleanly, and leave nothing behind; a forkserver that cannot run means cold
starts, said in its status."""

from __future__ import annotations

import asyncio
import logging
import os
import select
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from procs import alive, child_pids, comm, descendants, running

from kernel_env import AsyncKernelEnv
from kernel_env.kernel import Kernel, versions
from kernel_env.kernel.fork.server import ForkServer
from kernel_env.kernel.fork.spawner import SPAWNER_NAME
from kernel_env.kernel.fork.zygote import KERNEL_NAME
from kernel_env.kernel.isolation.cgroups import available_controllers
from kernel_env.kernel.isolation.sandbox import SandboxLimits, sandbox_problem
from kernel_env.kernel.local import LocalKernel
from kernel_env.kernel.sandboxed import SandboxedKernel

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox: {sandbox_problem()}"),
]


# With releases kernel_env was not tested with (make test-lowest) every kernel starts cold:
# the tests of forked kernels do not apply, and the fallback is what the other tests see.
UNTESTED = versions.untested()
FORKS_HERE = pytest.mark.skipif(UNTESTED is not None, reason=f"kernels start cold: {UNTESTED}")


@pytest.fixture
async def forkserver() -> AsyncIterator[ForkServer]:
    if UNTESTED is not None:
        pytest.skip(f"kernels start cold here: {UNTESTED}")
    async with ForkServer(preload=["numpy"]) as server:
        assert server.ready, server.status
        yield server


def _source(server: ForkServer, kind: type[LocalKernel] = SandboxedKernel, **options: object):
    async def start() -> Kernel:
        kernel = kind(forkserver=server, **options)
        await kernel.start()
        return kernel

    return start


async def _run(env: AsyncKernelEnv, code: str) -> str:
    result = (await env.execute(code)).observation.result
    assert result.success, result.stderr
    return result.stdout


async def test_forked_kernels_are_fresh_sandboxed_kernels(forkserver: ForkServer) -> None:
    """A forked kernel runs as the sandbox's unprivileged user with no capability and
    no-new-privileges, in its own PID namespace, and is what the status says."""
    async with AsyncKernelEnv(kernel_source=_source(forkserver)) as env:
        await env.reset()
        assert env.environment is not None and env.environment.kernel is not None
        assert getattr(env.environment.kernel, "forked", False)
        status = await _run(env, "print(open('/proc/self/status').read())")
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        assert fields["Uid"].split()[0] == "65534"
        assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0
        assert fields["NoNewPrivs"].strip() == "1"
        assert int(fields["FDSize"]) >= 1024  # grown before its threads: see grow_descriptor_table
        pids = await _run(
            env, "import os; print(sorted(p for p in os.listdir('/proc') if p.isdigit()))"
        )
        assert len(eval(pids)) <= 4  # the sandbox's init, the placeholder, the kernel, a child
        fds = await _run(
            env,
            "import os\ntargets = []\n"
            "for fd in os.listdir('/proc/self/fd'):\n"
            "    try:\n        targets.append(os.readlink(f'/proc/self/fd/{fd}'))\n"
            "    except OSError:\n        pass  # the listing's own descriptor, closed by now\n"
            "print(targets)",
        )
        # Nothing inherited from the zygote: no namespace, no host directory, no pidfd.
        leaked = [
            t
            for t in eval(fds)
            if t.startswith(
                (
                    "/proc/",
                    "/run",
                    "/sys",
                    "/root",
                    "/work",
                    "mnt:",
                    "user:",
                    "pid:",
                    "anon_inode:[pidfd]",
                )
            )
        ]
        assert leaked == []
    assert "forked from a preloaded forkserver" in forkserver.status
    assert forkserver.forks >= 1


async def test_a_forked_kernels_output_reaches_its_own_step(forkserver: ForkServer) -> None:
    """A forked kernel runs ipykernel's threads but the shell channel relay, the control
    thread (its iopub thread serves control) and the heartbeat, and a stream is flushed at a
    cell's end only when something was written to it: what a cell prints, writes to its
    descriptor 1 or has a subprocess write there still arrives with that cell's step, and
    nothing of it with the next, cell after cell."""
    async with AsyncKernelEnv(kernel_source=_source(forkserver)) as env:
        await env.reset()
        threads = await _run(
            env, "import threading; print(sorted(t.name for t in threading.enumerate()))"
        )
        names = eval(threads)
        assert not {"Shell channel", "Heartbeat", "Control"} & set(names), names
        assert {"MainThread", "IOPub"} <= set(names)
        for i in range(24):  # within the episode's 30 steps
            code, expected = [
                (f"print('p{i}')", f"p{i}\n"),
                (f"import os; _ = os.write(1, b'w{i}\\n')", f"w{i}\n"),
                (f"import os; _ = os.system('echo s{i}')", f"s{i}\n"),
                (f"x{i} = {i}", ""),
            ][i % 4]
            assert await _run(env, code) == expected, code


async def test_a_forked_kernel_and_its_sandbox_hold_the_kernels_cgroups_and_rlimits(
    forkserver: ForkServer,
) -> None:
    """The spawner launches the sandbox in place of the cold launch guard: the launch, the
    sandbox's init and the kernel are all in the kernel's own cgroups (its memory, pids and CPU
    limits), and the kernel runs with its rlimits."""
    limits = SandboxLimits(open_files=321, address_space_bytes=3 * 1024**3)
    kernel = SandboxedKernel(forkserver=forkserver, limits=limits)
    await kernel.start()
    try:
        assert kernel.forked
        provisioner = kernel._km.provisioner  # type: ignore[union-attr]
        pids = [provisioner.pid, kernel._km.sandbox_init, _kernel_pid(kernel)]  # type: ignore[union-attr]
        assert kernel.pid == provisioner.pid  # the launch the host holds
        cgroup = f"kernel_env/{os.getpid()}/{kernel.kernel_id}"
        if available_controllers():
            for pid in pids:
                assert cgroup in Path(f"/proc/{pid}/cgroup").read_text(), pid
        seen = await kernel.execute(
            "import resource\n"
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0],"
            " resource.getrlimit(resource.RLIMIT_AS)[0])"
        )
        assert seen.stdout.split() == ["321", str(3 * 1024**3)]
    finally:
        await kernel.shutdown()


def _kernel_pid(kernel: LocalKernel) -> int:
    """The host pid of the process running a forked kernel's cells: the zygote's child."""
    pid = kernel.forked_pid
    assert pid is not None and comm(pid) == KERNEL_NAME
    return pid


async def test_two_forked_kernels_draw_different_random_numbers(forkserver: ForkServer) -> None:
    """random and a preloaded numpy are reseeded in every forked kernel."""
    code = "import random, numpy; print(random.random(), numpy.random.rand())"
    source = _source(forkserver)
    async with AsyncKernelEnv(kernel_source=source) as a, AsyncKernelEnv(kernel_source=source) as b:
        await a.reset()
        await b.reset()
        first, second = await _run(a, code), await _run(b, code)
    assert first.split()[0] != second.split()[0] and first.split()[1] != second.split()[1]


# (JPY_PARENT_PID: the server's pid, which jupyter_client's launch gives a cold kernel;
# PYDEVD_USE_FRAME_EVAL: set by importing debugpy, which a cold kernel's debugger does and a
# forked kernel, which has no debugger, does not.)
_WHAT_A_CELL_SEES = (
    "import os, sys\nip = get_ipython()\n"
    "env = sorted((k, v) for k, v in os.environ.items()\n"
    "             if k not in ('JPY_PARENT_PID', 'PYDEVD_USE_FRAME_EVAL'))\n"
    "print(repr((os.getcwd(), list(map(str, _dh)), str(ip.profile_dir.location),\n"
    "            ip.starting_dir, env, [p for p in sys.path if not p.startswith(sys.prefix)],\n"
    "            ip.execution_count, type(sys.stdout).__name__, callable(llm_query),\n"
    "            ip.kernel.shell is ip, sorted(ip.user_ns), len(In), len(Out),\n"
    "            sorted((os.path.relpath(d, ip.profile_dir.location), oct(os.stat(d).st_mode),\n"
    "                    sorted(f)) for d, _, f in os.walk(ip.profile_dir.location)),\n"
    "            [getattr(ip.profile_dir, n + '_dir') for n in ('security', 'log', 'startup',\n"
    "                                                           'pid', 'static')])))"
)


async def test_a_forked_kernel_looks_like_a_cold_one(forkserver: ForkServer) -> None:
    """The zygote builds each kernel's shell before the fork (and runs a silent cell in it):
    what a cell sees of its working directory, profile (its directories, made as IPython makes
    them), environment, path, stdout, helpers, namespace and history is still what a kernel
    started cold sees (its own directories, not the zygote's), and each forked kernel has its
    own session id (the msg ids it sends are its own)."""
    snapshots = []
    for source in (_source(forkserver), _source(ForkServerStub())):
        async with AsyncKernelEnv(kernel_source=source) as env:
            await env.reset()
            kernel = env.environment.kernel  # type: ignore[union-attr]
            seen = eval(await _run(env, _WHAT_A_CELL_SEES))
            workdir = kernel.kernel_cwd  # a sandboxed kernel's is /home/user, inside it
            assert seen[0] == workdir and seen[1] == [workdir]
            assert seen[2] == f"{workdir}/.ipython/profile_default"
            snapshots.append((kernel.forked, [s.replace(workdir, "W") for s in map(str, seen)]))
    (forked, as_forked), (cold, as_cold) = snapshots
    assert forked and not cold
    for a, b in zip(as_forked, as_cold, strict=True):
        assert a == b
    source = _source(forkserver)
    async with AsyncKernelEnv(kernel_source=source) as a, AsyncKernelEnv(kernel_source=source) as b:
        await a.reset()
        await b.reset()
        code = "print(get_ipython().kernel.session.session, get_ipython().kernel.ident)"
        assert set((await _run(a, code)).split()).isdisjoint((await _run(b, code)).split())


async def test_a_forked_kernel_runs_a_cell_with_top_level_await(forkserver: ForkServer) -> None:
    """A forked kernel serves shell on its main thread (no shell channel thread): a cell with
    top-level ``await``, which ipykernel runs as a task of that thread, replies as in a cold
    kernel (it used to get no reply), and the kernel offers no subshells."""
    kernel = SandboxedKernel(forkserver=forkserver)
    async with kernel:
        assert kernel.forked
        code = "import asyncio\nawait asyncio.sleep(0.01)\nprint('awaited')"
        result = await kernel.execute(code, timeout=20)
        assert (result.status, result.stdout) == ("ok", "awaited\n"), result.stderr
        subshells = "print(get_ipython().kernel._supports_kernel_subshells)"
        assert (await kernel.execute(subshells)).stdout == "False\n"


async def test_a_forked_kernel_has_no_debugger_and_answers_a_debug_request(
    forkserver: ForkServer,
) -> None:
    """Forked kernels make no debugger (nothing but the host reaches their control channel,
    and it sends no debug requests): their ``kernel_info`` offers none, as an ipykernel
    without debugpy does, a debug request on the control channel still gets its reply, and
    a cell can import debugpy. (Unsandboxed: a client of this process reaches the kernel's
    sockets by their paths.)"""
    from jupyter_client.asynchronous import AsyncKernelClient

    kernel = LocalKernel(forkserver=forkserver)
    async with kernel:
        assert kernel.forked
        client = AsyncKernelClient(connection_file=kernel._km.connection_file)
        client.load_connection_file()
        client.start_channels()
        try:
            info = await client.kernel_info(reply=True, timeout=10)
            assert "debugger" not in info["content"]["supported_features"], info["content"]
            request = {"seq": 1, "type": "request", "command": "initialize", "arguments": {}}
            client.control_channel.send(client.session.msg("debug_request", request))
            reply = await client.control_channel.get_msg(timeout=10)
            assert reply["msg_type"] == "debug_reply"
        finally:
            client.stop_channels()
        # The zygote imported ipykernel without debugpy; a cell may still import it.
        imported = await kernel.execute("import debugpy\nprint('imported')")
        assert imported.stdout == "imported\n", imported.stderr


def _cpus_of_threads(pid: int) -> list[str]:
    tasks = Path(f"/proc/{pid}/task")
    return [
        next(line.split()[1] for line in (task / "status").read_text().splitlines()
             if line.startswith("Cpus_allowed_list:"))
        for task in tasks.iterdir()
    ]  # fmt: skip


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to keep to")
async def test_a_forked_kernel_starts_on_one_cpu_and_runs_cells_on_all(
    forkserver: ForkServer,
) -> None:
    """A forked kernel starts on one CPU (its threads hand work to each other there), and
    every one of its threads may use every CPU the server may from its first cell on, a
    silent one included."""
    kernel = SandboxedKernel(forkserver=forkserver)
    async with kernel:
        pid = _kernel_pid(kernel)
        started = _cpus_of_threads(pid)
        assert len(started) > 1 and len(set(started)) == 1, started
        assert "," not in started[0] and "-" not in started[0]  # one CPU
        assert (await kernel.execute("pass", silent=True)).status == "ok"
        server = Path("/proc/self/status").read_text().split("Cpus_allowed_list:")[1].split()[0]
        assert set(_cpus_of_threads(pid)) == {server}
        code = "import os\nprint(sorted(os.sched_getaffinity(0)))"
        assert (await kernel.execute(code)).stdout == f"{sorted(os.sched_getaffinity(0))}\n"


async def test_an_aggressive_reset_drops_only_what_cells_imported(forkserver: ForkServer) -> None:
    """``%reset -f --aggressive`` drops the modules imported since the kernel started, as in a
    kernel started cold: a cell's import goes; the preloads, IPython and kernel_env stay."""
    code = (
        "import sys, wave\nget_ipython().run_line_magic('reset', '-f --aggressive')\n"
        "import sys\nprint(sorted(m for m in ('wave', 'numpy', 'IPython', "
        "'kernel_env.inkernel.extension') if m in sys.modules))"
    )
    kept = {"forked": "['IPython', 'kernel_env.inkernel.extension', 'numpy']"}
    for kind, source in (("forked", _source(forkserver)), ("cold", _source(ForkServerStub()))):
        async with AsyncKernelEnv(kernel_source=source) as env:
            await env.reset()
            after = (await _run(env, code)).strip().splitlines()[-1]
            assert after == kept.get(kind, "['IPython', 'kernel_env.inkernel.extension']"), after


class ForkServerStub(ForkServer):
    """A forkserver that never started: kernels start cold (the same code path as a server
    whose forkserver failed)."""

    async def start(self) -> ForkServer:
        self._problem = "not used here"
        return self


async def test_forked_kernels_cannot_reach_each_other(forkserver: ForkServer) -> None:
    """S2 between forked kernels: from A, B's processes, files, sockets and connection file
    are out of reach, and the two run as different host uids."""
    source = _source(forkserver)
    async with AsyncKernelEnv(kernel_source=source) as a, AsyncKernelEnv(kernel_source=source) as b:
        await a.reset()
        await b.reset()
        await _run(
            b, "open('/tmp/b-was-here', 'w').write('secret'); open('b-work', 'w').write('x')"
        )
        kernel_b = b.environment.kernel  # type: ignore[union-attr]
        b_dir = kernel_b.runtime_dir
        found = await _run(a, _LOOK_FOR_B.format(b_connection=str(b_dir / "kernel.json")))
        hits, read = found.strip().splitlines()[-1].split(" | ")
        # A finds the files it wrote itself (the walk reaches them), none of B's.
        assert hits == "['/tmp/a-was-here', 'a-work']" and read == "blocked", found
        uids = [_host_uid(env.environment.kernel) for env in (a, b)]  # type: ignore[union-attr]
    if os.geteuid() == 0:
        assert uids[0] != uids[1] and 0 not in uids


# From kernel A: the files named like B's (and A's own) on every filesystem A can write or
# that is a tmpfs (a file B wrote is on one of B's; the host's read-only root cannot hold
# it), and whether B's connection file opens.
_LOOK_FOR_B = """\
import os, json
open('/tmp/a-was-here', 'w').write('mine'); open('a-work', 'w').write('x')
def tops():
    for line in open('/proc/self/mountinfo'):
        left, right = line.split(' - ')
        point, options = left.split()[4:6]
        kind = right.split()[0]
        if point.startswith(('/proc', '/sys')) or kind in ('devtmpfs', 'devpts'):
            continue
        if 'rw' in options.split(',') or kind == 'tmpfs':
            yield point
def walk(top, writable):
    # Each writable or tmpfs mount alone, not down into the host's read-only binds under it
    # (a tmpfs root holds /usr's, and /proc): B cannot write those, so they hold none of its
    # files, and walking them took past the step timeout on a loaded machine.
    for d, subdirs, fs in os.walk(top):
        subdirs[:] = [s for s in subdirs if os.path.join(d, s) in writable
                      or not os.path.ismount(os.path.join(d, s))]
        yield d, fs
names = ('b-was-here', 'b-work', 'a-was-here', 'a-work')
here = os.getcwd()
writable = set(tops())
hits = sorted({{os.path.relpath(os.path.join(d, f), here) if d == here else os.path.join(d, f)
               for top in writable for d, fs in walk(top, writable) for f in fs if f in names}})
try:
    json.load(open({b_connection!r}))
    read = 'READ'
except OSError:
    read = 'blocked'
print(hits, '|', read)
"""


def _host_uid(kernel: SandboxedKernel) -> int:
    """The host uid of the process running a kernel's cells."""
    return _uid_of(_kernel_pid(kernel))


def _uid_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("Uid:\t")[1].split()[0])


@FORKS_HERE  # else the untested release is the reason given
async def test_a_preload_that_fails_means_cold_starts() -> None:
    """A preload that cannot be imported: the forkserver says why, and kernels start cold."""
    async with ForkServer(preload=["no_such_module_for_kernel_env"]) as server:
        assert not server.ready
        assert "no_such_module_for_kernel_env" in server.status and "cold" in server.status
        async with AsyncKernelEnv(kernel_source=_source(server)) as env:
            await env.reset()
            assert "2" in await _run(env, "print(1 + 1)")
            assert not env.environment.kernel.forked  # type: ignore[union-attr]


@pytest.mark.parametrize("package", ["ipykernel", pytest.param("jupyter_client", marks=FORKS_HERE)])
async def test_an_untested_release_means_cold_starts_said_once(
    package: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With an ipykernel or jupyter_client release outside the tested ones (faked: the
    tested range is moved past the installed release), the zygote builds nothing, the log
    says why in one line, and kernels start cold and work."""
    monkeypatch.setitem(versions.TESTED, package, ((99, 0), (99, 1)))
    caplog.set_level(logging.WARNING, logger="kernel_env.kernel.fork.server")
    async with ForkServer() as server:
        assert not server.ready
        assert f"{package} " in server.status and "tested with (99.0 to 99.1)" in server.status
        async with AsyncKernelEnv(kernel_source=_source(server, LocalKernel)) as env:
            await env.reset()
            assert "2" in await _run(env, "print(1 + 1)")
            assert not env.environment.kernel.forked  # type: ignore[union-attr]
    said = [r.getMessage() for r in caplog.records if "cold" in r.getMessage()]
    assert len(said) == 1 and package in said[0], said


class _UnlaunchableKernel(LocalKernel):
    """A kernel whose forked launch cannot run (its placeholder does not exist)."""

    def _launch_spec(self) -> dict[str, object]:
        return {**super()._launch_spec(), "launch": ["/nonexistent/kernel-env-placeholder"]}


async def test_a_launch_that_fails_starts_that_kernel_cold(forkserver: ForkServer) -> None:
    """A forked launch that fails: that kernel starts cold, and the forkserver still forks
    the next one."""
    assert await _forked_two_in_turn(forkserver, _UnlaunchableKernel) == (False, True)
    assert forkserver.ready


class _NoPlaceholderKernel(SandboxedKernel):
    """A kernel whose forked launch fails at its end: bubblewrap makes the whole sandbox,
    then has no placeholder program to run."""

    def _launch_spec(self) -> dict[str, object]:
        spec = super()._launch_spec()
        launch = list(spec["launch"])  # type: ignore[call-overload]
        return {**spec, "launch": [*launch[: launch.index("--") + 1], "/nonexistent/kernel-env"]}


async def test_a_sandbox_that_fails_leaves_the_zygote_as_it_was(
    forkserver: ForkServer,
) -> None:
    """The zygote forks a sandboxed kernel as soon as its sandbox's PID namespace exists, and
    tells it once the sandbox runs its placeholder. When the sandbox fails before that, the
    kernel ends and the zygote keeps nothing of it (no descriptor, no child); each such kernel
    starts cold, and the next one is forked."""
    zygote = forkserver._pid()
    opened = lambda: len(os.listdir(f"/proc/{zygote}/fd"))  # noqa: E731
    only_the_spawner = lambda: [comm(p) for p in child_pids(zygote)] == [SPAWNER_NAME]  # noqa: E731

    async def settled() -> int:
        """The zygote's descriptors once it watches no kernel (each ended one collected)."""
        for _ in range(50):
            if only_the_spawner():
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.6)  # past its next collection round (every 0.5 s)
        return opened()

    assert await _forked_two_in_turn(forkserver, LocalKernel) == (True, True)  # warm
    before = await settled()
    for _ in range(4):
        assert await _forked_two_in_turn(forkserver, _NoPlaceholderKernel) == (False, True)
    assert await settled() == before
    assert only_the_spawner()
    assert forkserver.ready


async def test_a_kernel_forked_early_joins_only_its_own_sandbox(forkserver: ForkServer) -> None:
    """A kernel forked into its sandbox's PID namespace before the sandbox is whole is told
    its placeholder's pid, and joins the namespaces it opens through that pid only once it
    has checked that they are its own sandbox's: handed another sandbox's placeholder (a pid
    reused meanwhile), it refuses. Run here as the zygote runs it: a process forked into one
    sandbox's PID namespace looks at that sandbox's placeholder and at a sibling's."""
    if os.geteuid() != 0:
        pytest.skip("pointing a fork into another PID namespace needs root")
    from kernel_env.kernel.fork.zygote import _CLONE_NEWPID, _Sandbox, _set_namespace

    kernels = [SandboxedKernel(forkserver=forkserver) for _ in range(2)]
    try:
        await asyncio.gather(*(k.start() for k in kernels))
        inits = [k._km.sandbox_init for k in kernels]  # type: ignore[union-attr]
        own, sibling = (next(c for c in child_pids(i) if comm(c) == "sleep") for i in inits)
        ours = os.open("/proc/self/ns/pid", os.O_RDONLY)
        into = os.open(f"/proc/{inits[0]}/ns/pid", os.O_RDONLY)
        told, tell = os.pipe()
        _set_namespace(into, _CLONE_NEWPID)
        try:
            child = os.fork()
            if child == 0:
                seen = [_Sandbox(pid).holds_this_process() for pid in (own, sibling)]
                os.write(tell, repr(seen).encode())
                os._exit(0)
        finally:
            _set_namespace(ours, _CLONE_NEWPID)
            for fd in (ours, into, tell):
                os.close(fd)
        os.waitpid(child, 0)
        with os.fdopen(told, "rb") as pipe:
            assert pipe.read() == b"[True, False]"
    finally:
        await asyncio.gather(*(k.shutdown() for k in kernels))


async def _forked_two_in_turn(forkserver: ForkServer, kind: type[LocalKernel]) -> tuple[bool, bool]:
    """Whether the next kernel (of ``kind``, which must work) and the one after were forked."""
    forked = []
    for source in (_source(forkserver, kind), _source(forkserver, LocalKernel)):
        async with AsyncKernelEnv(kernel_source=source) as env:
            await env.reset()
            assert "2" in await _run(env, "print(1 + 1)")
            forked.append(bool(env.environment.kernel.forked))  # type: ignore[union-attr]
    return forked[0], forked[1]


async def test_a_spawner_that_died_means_cold_starts(forkserver: ForkServer) -> None:
    """The zygote's spawner is killed: the kernels it launched end with it, the next kernel
    starts cold, and the forkserver says why."""
    running = SandboxedKernel(forkserver=forkserver)
    await running.start()
    try:
        zygote = forkserver._pid()
        assert zygote is not None
        (spawner,) = [p for p in child_pids(zygote) if comm(p) == SPAWNER_NAME]
        kernel = _kernel_pid(running)
        os.kill(spawner, signal.SIGKILL)
        for _ in range(100):
            if not Path(f"/proc/{kernel}").exists():
                break
            await asyncio.sleep(0.05)
        assert not Path(f"/proc/{kernel}").exists()
    finally:
        await running.shutdown()
    async with AsyncKernelEnv(kernel_source=_source(forkserver)) as env:
        await env.reset()
        assert "2" in await _run(env, "print(1 + 1)")
        assert not env.environment.kernel.forked  # type: ignore[union-attr]
    assert not forkserver.ready and "spawner" in forkserver.status


async def test_kernels_started_together_each_land_in_their_own_sandbox(
    forkserver: ForkServer,
) -> None:
    """Launches overlap and are answered by id: four sandboxed kernels started at once each
    run in the PID, mount, network and IPC namespaces of their own sandbox (the one the host
    holds and tears down), not a sibling's, and as uids of their own on a root server."""
    kernels = [SandboxedKernel(forkserver=forkserver) for _ in range(4)]
    try:
        await asyncio.gather(*(k.start() for k in kernels))
        for kernel in kernels:
            pid, init = _kernel_pid(kernel), kernel._km.sandbox_init  # type: ignore[union-attr]
            assert kernel.forked and init is not None
            for ns in ("pid", "mnt", "net", "ipc"):
                theirs = os.stat(f"/proc/{init}/ns/{ns}").st_ino
                assert os.stat(f"/proc/{pid}/ns/{ns}").st_ino == theirs, (ns, pid, init)
            # The sandbox was launched for this kernel: as its uid, in its cgroups.
            assert _uid_of(init) == _uid_of(pid)
            cgroups = [Path(f"/proc/{p}/cgroup").read_text() for p in (init, pid)]
            assert cgroups[0] == cgroups[1]
        if os.geteuid() == 0:
            assert len({_host_uid(k) for k in kernels}) == len(kernels)
    finally:
        await asyncio.gather(*(k.shutdown() for k in kernels))


async def test_kernels_ending_together_leave_the_forkserver_serving(
    forkserver: ForkServer,
) -> None:
    """Eight forked kernels, sandboxed and not, shut down at once (their kernels and
    placeholders end in the same instants): every one ends, and the next kernel is forked."""
    kernels = [
        kind(forkserver=forkserver) for kind in (SandboxedKernel, LocalKernel) for _ in range(4)
    ]
    await asyncio.gather(*(k.start() for k in kernels))
    pids = [_kernel_pid(k) for k in kernels]
    await asyncio.gather(*(k.shutdown() for k in kernels))
    for _ in range(100):
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            break
        await asyncio.sleep(0.05)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert await _forked_two_in_turn(forkserver, LocalKernel) == (True, True)
    assert forkserver.ready


async def test_a_forked_kernel_killed_mid_step_is_replaced(forkserver: ForkServer) -> None:
    """kill -9 of a forked kernel inside a cell: an error observation, then a new forked
    kernel that answers the next step."""
    async with AsyncKernelEnv(kernel_source=_source(forkserver), step_timeout=20) as env:
        await env.reset()
        died = await env.execute("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
        assert not died.observation.result.success
        assert "restart" in died.observation.result.stderr.lower()
        assert "ok" in await _run(env, "print('ok')")
        assert env.environment.kernel.forked  # type: ignore[union-attr]


async def test_forked_kernels_without_the_sandbox(forkserver: ForkServer) -> None:
    """The unsandboxed local backend forks too; an interrupt reaches the cell, not the
    placeholder, and closing the kernel ends it."""
    async with AsyncKernelEnv(
        kernel_source=_source(forkserver, LocalKernel), step_timeout=2
    ) as env:
        await env.reset()
        timed_out = (await env.execute("import time\nwhile True: time.sleep(0.01)")).observation
        assert timed_out.result.timed_out and not timed_out.result.kernel_restarted
        assert "still" in await _run(env, "print('still here')")


async def test_a_sandboxed_fork_leaves_the_next_kernel_outside_its_sandbox(
    forkserver: ForkServer,
) -> None:
    """The zygote points its forks into a sandbox's PID namespace for one fork only: the
    unsandboxed kernel forked next runs in the host's, its pid the one the host sees (it would
    be a small pid of that sandbox otherwise, and inside that kernel's processes)."""
    sandboxed = SandboxedKernel(forkserver=forkserver)
    await sandboxed.start()
    plain = LocalKernel(forkserver=forkserver)
    try:
        await plain.start()
        assert sandboxed.forked and plain.forked
        seen = await plain.execute("import os; print(os.getpid())")
        assert seen.stdout.strip() == str(_kernel_pid(plain))
    finally:
        await plain.shutdown()
        await sandboxed.shutdown()


class _LaunchWithAStray(LocalKernel):
    """A kernel whose forked launch starts a process that does not end with the launch, as
    bubblewrap's init does not when the launch is killed just after it cloned the init (before
    the init asked to die with its parent: bubblewrap's issue 633): a shell starts a ``sleep``
    in the background, then execs the launch's placeholder. Without a cgroup or a uid of its
    own, as a kernel of an unprivileged server has (either would find the stray at the end)."""

    STRAY = ["sleep", f"{os.getpid()}.5"]  # a command line no other process has

    def _make_cgroup(self) -> None:  # type: ignore[override]
        return None

    def _lease_uid(self) -> None:
        return None

    def _launch_spec(self) -> dict[str, object]:
        spec = super()._launch_spec()
        stray = " ".join(self.STRAY)
        return {**spec, "launch": ["/bin/sh", "-c", f'{stray} & exec "$@"', "sh", *spec["launch"]]}  # type: ignore[misc]


async def test_what_a_forked_launch_started_ends_with_its_kernel(forkserver: ForkServer) -> None:
    """A forked kernel's launch leads a process group of its own, which the kernel's end kills
    whole: a process of the launch that outlives it (here a stray ``sleep``; in the race, a
    sandbox's init) is gone too. bubblewrap's init is in that group."""
    sandboxed = SandboxedKernel(forkserver=forkserver)
    await sandboxed.start()
    try:
        launcher = sandboxed._km.provisioner.pid  # type: ignore[union-attr]
        init = sandboxed._km.sandbox_init  # type: ignore[union-attr]
        assert sandboxed.forked and init is not None
        assert os.getpgid(launcher) == launcher and os.getpgid(init) == launcher
    finally:
        await sandboxed.shutdown()
    stray = "\0".join(_LaunchWithAStray.STRAY).encode() + b"\0"
    kernel = _LaunchWithAStray(forkserver=forkserver)
    await kernel.start()
    try:
        assert kernel.forked
        strays = running(stray)
        assert len(strays) == 1
    finally:
        await kernel.shutdown()
    for _ in range(100):
        if not any(alive(pid) for pid in strays):
            break
        await asyncio.sleep(0.05)
    left = [pid for pid in strays if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "the launch's stray outlived its kernel"


async def test_a_stuck_launch_does_not_hold_up_the_next_kernel(
    forkserver: ForkServer, tmp_path: Path
) -> None:
    """Launches overlap: a kernel whose launch is stuck (writing its cgroup join file, a FIFO
    here, until something reads it) does not keep the next kernel from being forked; it
    starts itself once unblocked."""
    fifo = tmp_path / "join"
    os.mkfifo(fifo)

    class Stuck(LocalKernel):
        def _cgroup_joins(self) -> list[Path]:
            return [*super()._cgroup_joins(), fifo]

    stuck, other = Stuck(forkserver=forkserver), LocalKernel(forkserver=forkserver)
    starting = asyncio.ensure_future(stuck.start())
    try:
        await asyncio.sleep(0.5)
        assert not starting.done()
        await asyncio.wait_for(other.start(), 20)
        assert other.forked and not starting.done()
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the stuck launch goes on
        try:
            await asyncio.wait_for(asyncio.shield(starting), 20)
        finally:
            os.close(reader)
        assert stuck.forked
        assert "2" in (await stuck.execute("print(1 + 1)")).stdout
    finally:
        await other.shutdown()
        if not starting.done():
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        await asyncio.gather(starting, return_exceptions=True)
        await stuck.shutdown()


async def test_kernels_share_the_hosts_zmq_threads(forkserver: ForkServer) -> None:
    """Every local kernel's host sockets are on one zmq context: once one kernel runs (and
    has made that context's two threads, I/O and reaper), three more add no zmq thread to the
    host (they added two each; one thread of asyncio's executor may come and go)."""
    threads = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    kernels = [LocalKernel(forkserver=forkserver) for _ in range(4)]
    try:
        await kernels[0].start()
        before = threads()
        for kernel in kernels[1:]:
            await kernel.start()
        assert "1" in (await kernels[-1].execute("print(1)")).stdout
        assert threads() - before <= 1, threads() - before
    finally:
        for kernel in kernels:
            await kernel.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_forked_churn_leaves_nothing_behind(tmp_path: Path) -> None:
    """200 forked reset/close cycles: no kernel, launch or placeholder process, runtime
    file or cgroup is left over, and the forkserver is gone once closed."""
    if UNTESTED is not None:
        pytest.skip(f"kernels start cold here: {UNTESTED}")
    server = await ForkServer().start()
    source = _source(server, runtime_root=str(tmp_path))

    async def cycle() -> None:
        env = AsyncKernelEnv(kernel_source=source, step_timeout=10)
        await env.reset(context="churn")
        await env.execute("import subprocess; p = subprocess.Popen(['sleep', '60'])")
        await env.close()

    try:
        await cycle()
        parent = next(tmp_path.iterdir())
        zygote = server._pid()
        cgroups = Path(f"/sys/fs/cgroup/pids/kernel_env/{os.getpid()}")
        before = set(cgroups.iterdir()) if cgroups.exists() else set()
        for _ in range(200):
            await cycle()
        # The zygote and its spawner, and nothing else, once the last kernel has ended.
        for _ in range(50):
            left = descendants(os.getpid()) - {zygote}
            if len(left) == 1:
                break
            await asyncio.sleep(0.1)
        assert [comm(p) for p in left] == [SPAWNER_NAME]
        assert sorted(os.listdir(parent)) == [".lock"]
        assert not cgroups.exists() or set(cgroups.iterdir()) - before == set()
        assert server.forks >= 200 and server.ready
    finally:
        await server.close()
    assert descendants(os.getpid()) == set()


def test_the_spawner_wakes_when_the_placeholder_program_runs(tmp_path: Path) -> None:
    """The spawner waits for a sandbox's placeholder on inotify, not by polling /proc: an exec
    of the watched program wakes it, nothing else does; a program it cannot watch has no
    descriptor (the spawner then looks at /proc every millisecond)."""
    from kernel_env.kernel.fork.spawner import _ExecWatch

    program = tmp_path / "placeholder"  # a file of its own: nothing else on the host runs it
    program.write_bytes(Path(shutil.which("true") or "/bin/true").read_bytes())
    program.chmod(0o755)
    watch = _ExecWatch(str(program))
    assert watch.fd >= 0
    assert select.select([watch.fd], [], [], 0.05)[0] == [] and not watch.taken()
    subprocess.run([str(program)], check=True)
    assert select.select([watch.fd], [], [], 5.0)[0] == [watch.fd]
    assert watch.taken()
    assert not watch.taken()  # the event was taken
    unwatched = _ExecWatch(str(tmp_path / "missing"))
    assert unwatched.fd < 0 and not unwatched.taken()
