"""The sandboxed backend: limits, isolation between episodes, and teardown (F5, F6, S1, S2)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import alive, descendants
from serverkit import make_client, serve_process, wait_until
from uids import unsandboxed_kernels_get_own_uids

from kernel_env import KernelEnv
from kernel_env.errors import KernelStartError
from kernel_env.kernel import Kernel, LocalKernel
from kernel_env.kernel.isolation import cgroups, privilege
from kernel_env.kernel.isolation.sandbox import SandboxLimits, sandbox_problem
from kernel_env.kernel.launch import launch_guard
from kernel_env.kernel.sandboxed import SandboxedKernel

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        sandbox_problem() is not None, reason=f"sandbox unavailable: {sandbox_problem()}"
    ),
]

SECRETS = {"HF_TOKEN": "hf_sandbox_secret", "KERNEL_ENV_TOKEN": "server-secret-token"}


def sandboxed(**limits) -> KernelEnv:
    async def source() -> Kernel:
        kernel = SandboxedKernel(limits=SandboxLimits(**limits))
        await kernel.start()
        return kernel

    # 30 s: a first cell that reads every /proc file took past 5 s on a loaded machine.
    return KernelEnv(kernel_source=source, step_timeout=30, llm_query_fn=str.upper)


async def _local() -> Kernel:
    kernel = LocalKernel()
    await kernel.start()
    return kernel


@pytest.fixture
def senv() -> Iterator[KernelEnv]:
    with sandboxed(memory_bytes=1024**3, processes=64) as env:
        yield env


@pytest.mark.skipif(
    "memory" not in cgroups.available_controllers(), reason="no memory cgroup to write"
)
def test_a_kernel_killed_at_start_says_which_limit_it_hit() -> None:
    """A kernel whose cgroup's memory limit is too small for its interpreter is killed as it
    starts: the start fails saying so, not with a bare "exited while starting"."""
    tiny = SandboxLimits(memory_bytes=12 * 1024**2, address_space_bytes=8 * 1024**3)
    kernel = SandboxedKernel(limits=tiny)

    async def start() -> None:
        try:
            await kernel.start()
        finally:
            await kernel.shutdown()

    with pytest.raises(KernelStartError) as failed:
        asyncio.run(start())
    assert "exited while starting" in str(failed.value)
    assert "its memory limit" in str(failed.value), failed.value


def test_f5_memory_limit(senv: KernelEnv) -> None:
    """F5: an 8 GB allocation under a 1 GiB limit fails inside the kernel; the kernel lives."""
    senv.reset()
    res = senv.execute("x = bytearray(8 * 10**9)").observation.result
    assert "MemoryError" in (res.exception or "") or res.kernel_restarted
    assert senv.execute("1 + 1").observation.result.stdout.strip() == "2"


def test_f6_process_bomb_capped_and_setsid_children_reaped(senv: KernelEnv) -> None:
    """F6: forks stop at the processes cap (a pids cgroup, or RLIMIT_NPROC in the kernel's
    user namespace); after close, no process of the episode survives. Where neither holds
    (no pids cgroup to write, Linux before 5.14), nothing caps the forks: 40 of them, and
    the reaping is checked alone."""
    from kernel_env.kernel.isolation import cgroups
    from kernel_env.kernel.isolation.sandbox import nproc_per_namespace

    capped = "pids" in cgroups.available_controllers() or nproc_per_namespace()
    senv.reset()
    res = senv.execute(
        "import os, subprocess\n"
        "kids = []\n"
        "try:\n"
        f"    for _ in range({500 if capped else 40}):\n"
        "        kids.append(subprocess.Popen(['sleep', '300'], start_new_session=True))\n"
        "except OSError as e:\n"
        "    print('capped after', len(kids), type(e).__name__)"
    ).observation.result
    if capped:
        assert "capped after" in res.stdout, res
        assert int(res.stdout.split()[2]) < 64
    else:
        assert res.success and "capped after" not in res.stdout, res
    before = descendants(os.getpid())
    assert before  # the kernel and its children are ours
    senv.close()
    deadline = time.monotonic() + 10
    while descendants(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert descendants(os.getpid()) == set()


def test_s1_no_secrets_visible(monkeypatch, senv: KernelEnv) -> None:
    """S1: environment, /proc and the filesystem show no token from the host or the reset."""
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    senv.reset(hf_token="hf_reset_secret")
    res = senv.execute(
        "import os, glob\n"
        "blob = repr(dict(os.environ))\n"
        "for p in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
        "    try: blob += open(p, 'rb').read().decode(errors='replace')\n"
        "    except OSError: pass\n"
        "for p in glob.glob('/tmp/**', recursive=True):\n"
        "    blob += p\n"
        "print(len(blob), blob)"
    ).observation.result
    assert res.success and "PATH" in res.stdout
    for secret in [*SECRETS.values(), "hf_reset_secret"]:
        assert secret not in res.stdout


def test_s1_server_users_files_are_hidden(senv: KernelEnv) -> None:
    """The kernel's file access is checked against the server's uid (the user namespace maps
    to it), so the server user's home and the password hashes are hidden from it."""
    secret = Path.home() / f".kernel-env-test-secret-{os.getpid()}"
    secret.write_text("server-user-private")
    secret.chmod(0o600)
    try:
        senv.reset()
        res = senv.execute(
            "import os\n"
            "try: shadow = repr(open('/etc/shadow').read())\n"
            "except OSError: shadow = 'blocked'\n"
            f"print(os.path.exists({str(secret)!r}), shadow in ('blocked', repr('')))\n"
            "import kernel_env, sys; print('interpreter ok')"
        ).observation.result
    finally:
        secret.unlink()
    assert res.stdout == "False True\ninterpreter ok\n", res


def test_s2_episodes_cannot_reach_each_other() -> None:
    """S2: from episode A, B's processes, connection file and sockets are out of reach."""
    with sandboxed() as a, sandboxed() as b:
        a.reset()
        b.reset()
        b.execute("secret_of_b = 'b-private'")
        b_dir = b.environment.kernel.runtime_dir
        res = a.execute(
            "import os, glob, json\n"
            "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            f"visible = os.path.exists({str(b_dir)!r})\n"
            "print('pids', len(pids), 'b_dir_visible', visible)\n"
            f"try:\n    json.load(open({str(b_dir / 'kernel.json')!r}))\n    print('READ')\n"
            "except OSError as e:\n    print('blocked', type(e).__name__)"
        ).observation.result
        assert "b_dir_visible False" in res.stdout and "blocked" in res.stdout
        assert int(res.stdout.split()[1]) <= 3  # the reaper, the kernel, maybe a child
        assert "READ" not in res.stdout


def test_the_workspace_is_home_user() -> None:
    """Inside the sandbox the workspace is /home/user, as on E2B: the kernel's working
    directory, its $HOME and its commands' too; each episode's is its own."""
    with sandboxed() as a, sandboxed() as b:
        a.reset()
        b.reset()
        b.execute("open('/home/user/mine.txt', 'w').write('b')")
        res = a.execute(
            "import os, subprocess\n"
            "print(os.getcwd(), os.environ['HOME'], os.path.expanduser('~'))\n"
            "print(subprocess.run(['pwd'], capture_output=True, text=True).stdout.strip())\n"
            "open('here.txt', 'w').write('a')\n"
            "print(sorted(n for n in os.listdir('/home/user') if not n.startswith('.')))"
        ).observation.result
        assert res.stdout.splitlines() == [
            "/home/user /home/user /home/user",
            "/home/user",
            "['here.txt']",
        ], res


def test_s1_unsandboxed_kernel_has_no_secrets_either(monkeypatch) -> None:
    """S1 on the plain local backend: its explicit environment holds no host secret."""
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    with KernelEnv(kernel_source=_local) as env:
        env.reset(hf_token="hf_reset_secret")
        out = env.execute("import os; print(dict(os.environ))").observation.result.stdout
    assert "PATH" in out
    for secret in [*SECRETS.values(), "hf_reset_secret"]:
        assert secret not in out


def test_network_off_by_default(senv: KernelEnv) -> None:
    """No network by default: even the host's loopback services are unreachable."""
    senv.reset()
    res = senv.execute(
        "import socket\n"
        "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n    print('reached')\n"
        "except OSError as e:\n    print('no network', type(e).__name__)"
    ).observation.result
    assert "no network" in res.stdout


def test_llm_query_works_without_network(senv: KernelEnv) -> None:
    """The stdin-channel llm_query needs no network, so it works in the sandbox."""
    senv.reset()
    assert senv.execute("llm_query('hi')").observation.result.stdout.strip() == "'HI'"


def test_workspace_quota(tmp_path: Path) -> None:
    """Writing past the workspace size fails with an OSError instead of filling the host disk."""
    with sandboxed(workspace_bytes=32 * 1024**2) as env:
        env.reset()
        res = env.execute(
            "try:\n    open('big', 'wb').write(b'x' * 64 * 1024**2)\n"
            "except OSError as e:\n    print('quota', e.errno)"
        ).observation.result
    assert "quota" in res.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~40 s alone; a loaded 2-core machine takes longer
async def test_churn_leaves_nothing_behind(tmp_path: Path) -> None:
    """60 reset/close cycles of cold sandboxed kernels: no kernel process, runtime file,
    cgroup or fd is left over (test_forkserver's churn runs forked ones)."""
    from kernel_env import AsyncKernelEnv

    async def source() -> Kernel:
        kernel = SandboxedKernel(runtime_root=str(tmp_path))
        await kernel.start()
        return kernel

    async def cycle() -> None:
        env = AsyncKernelEnv(kernel_source=source, step_timeout=10)
        await env.reset(context="churn")
        await env.execute("import subprocess; p = subprocess.Popen(['sleep', '60'])")
        await env.close()

    await cycle()  # warm imports and caches before the baseline
    parent = next(tmp_path.iterdir())  # this process's runtime parent, locked while it lives
    baseline = len(os.listdir("/proc/self/fd"))
    mine = Path(f"/sys/fs/cgroup/pids/kernel_env/{os.getpid()}")
    before = set(mine.iterdir()) if mine.exists() else set()
    for _ in range(60):
        await cycle()
    assert sorted(os.listdir(parent)) == [".lock"]
    assert descendants(os.getpid()) == set()
    assert len(os.listdir("/proc/self/fd")) <= baseline
    # Compared with before: other tests' servers, killed on purpose, may have left some.
    assert not mine.exists() or set(mine.iterdir()) - before == set()


def test_a_dead_servers_cgroups_are_swept() -> None:
    """The cgroups of a server killed with SIGKILL (its parent is named by its pid) are
    removed by the next server's sweep, and whatever still ran in them is killed; a live
    server's cgroups are left alone."""
    if "pids" not in cgroups.available_controllers():
        pytest.skip("no writable pids cgroup here")
    tree = Path("/sys/fs/cgroup/pids/kernel_env")
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    stale, live = tree / str(dead.pid) / "k1", tree / str(os.getpid()) / "k-live"
    for cgroup in (stale, live):
        cgroup.mkdir(parents=True, exist_ok=True)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        (stale / "cgroup.procs").write_text(str(sleeper.pid))
        assert cgroups.sweep_dead_servers() >= 1
        assert not stale.parent.exists() and live.exists()
        assert sleeper.wait(timeout=10) == -9  # killed by the sweep
    finally:
        sleeper.kill()
        sleeper.wait()
        live.rmdir()


def test_a_server_in_another_pid_namespace_leaves_this_ones_cgroups_alone() -> None:
    """A server whose PID namespace cannot see this process (a container's, a Ray node's)
    shares the cgroup tree: its sweep must not take this live server for dead and remove the
    cgroup a kernel of this one is about to join (its start would fail)."""
    from kernel_env.kernel.isolation import cgroups

    if "pids" not in cgroups.available_controllers() or shutil.which("unshare") is None:
        pytest.skip("no writable pids cgroup or no unshare here")
    cgroup = cgroups.KernelCgroup("k-other-ns", memory_bytes=None, processes=64, cpus=None)
    try:
        sweep = (
            "from kernel_env.kernel.isolation import cgroups; print(cgroups.sweep_dead_servers())"
        )
        other = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", sweep],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert other.returncode == 0, other.stderr
        assert all(path.exists() for path in cgroup.paths), other.stdout
        for path in cgroup.join_files:  # a kernel can still join it
            assert path.exists()
    finally:
        cgroup.remove()


def test_launch_guard_ties_the_kernel_to_its_parent() -> None:
    """A parent killed right after starting a kernel's command takes that command with it
    (bwrap's own --die-with-parent comes too late for a kill in its first milliseconds), and
    a command whose parent is not the expected one does not start."""
    script = (
        "import os, signal, subprocess, sys\n"
        "from kernel_env.kernel.launch import launch_guard\n"
        "child = subprocess.Popen([*launch_guard(), 'sleep', '60'])\n"
        "print(child.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    parent = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    child = int(parent.stdout)
    gone = wait_until(lambda: not alive(child), timeout=10)
    assert gone, f"pid {child} outlived its parent"
    wrong = subprocess.run(
        [*launch_guard(parent=1), "echo", "started"], capture_output=True, text=True, timeout=10
    )
    assert wrong.returncode != 0 and "started" not in wrong.stdout


UID = "import os; print(os.getuid())"


def _served_uid(**settings: object) -> str:
    with make_client(**settings) as client, client.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {"context": "x"}})
        assert ws.receive_json()["type"] == "observation"
        ws.send_json({"type": "step", "data": {"code": UID}})
        return str(ws.receive_json()["data"]["observation"]["result"]["stdout"])


def test_served_kernels_are_sandboxed_by_default() -> None:
    """The server's kernels run in the sandbox (as nobody) unless sandbox="none" is asked:
    then as the server's uid, or a uid of their own (tests/uids.py)."""
    assert _served_uid() == "65534\n"
    unsandboxed = int(_served_uid(sandbox="none"))
    if unsandboxed_kernels_get_own_uids():
        first, last = privilege.KERNEL_UIDS
        assert first <= unsandboxed <= last
    else:
        assert unsandboxed == os.getuid()


def test_serve_says_whether_kernels_are_sandboxed() -> None:
    for args, status in [
        ((), "local kernels, sandboxed (bubblewrap)"),
        (("--sandbox", "none"), "local kernels, NOT sandboxed (sandbox=none)"),
    ]:
        with serve_process(*args, "--pool-size", "0") as server:
            assert status in server.log.read_text(), server.log.read_text()
