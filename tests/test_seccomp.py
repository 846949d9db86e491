"""The sandboxed kernels' seccomp filter: its policy, the checked-in programs, and what a program
does to a process that loads it (kernel_env/kernel/isolation/seccomp.py, scripts/seccomp_policy.py).

The integration tests run this file as a script in a fresh interpreter (``--child``), which
tries the refused system calls before and after ``apply()``, each in a fork of its own (a call
that the filter should have refused changes only that fork), then runs what a kernel runs
(numpy, subprocesses, threads, multiprocessing, asyncio, ssl) under the filter, and prints
what it saw as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import mmap
import multiprocessing
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kernel_env.kernel.isolation import seccomp

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "scripts" / "seccomp_policy.py"
SYSTEM_PYTHON = "/usr/bin/python3"  # where Debian's python3-seccomp is
MACHINE = os.uname().machine
PROGRAM = seccomp.program_path()
MANIFEST = json.loads((seccomp.PROGRAMS / "programs.json").read_text())

# System call numbers (x86_64, aarch64), written out here rather than taken from libseccomp.
NR = {
    "io_uring_setup": (425, 425),
    "add_key": (248, 217),
    "keyctl": (250, 219),
    "request_key": (249, 218),
    "userfaultfd": (323, 282),
    "perf_event_open": (298, 241),
    "memfd_secret": (447, 447),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "pidfd_open": (434, 434),
    "pidfd_getfd": (438, 438),
    "bpf": (321, 280),
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "clone": (56, 220),
    "clone3": (435, 435),
    "personality": (135, 92),
    "socket": (41, 198),
    "ioctl": (16, 29),
    "statmount": (457, 457),
    "listmount": (458, 458),
}
MODIFY_LDT = 154  # x86_64 only
X32 = 0x40000000  # the x32 ABI's system call numbers on x86_64
HIGH = 1 << 32  # arguments the kernel reads as 32-bit, with a high bit set

# The names of the policy that the machine has no system call for (a foreign ABI's), and so
# are in no program of it.
ABSENT = {
    "x86_64": {"stime", "umount", "vm86", "vm86old"},
    "aarch64": {
        *("_sysctl", "afs_syscall", "create_module", "get_kernel_syms", "getpmsg", "ioperm"),
        "modify_ldt",
        *("iopl", "putpmsg", "query_module", "security", "stime", "sysfs", "tuxcall"),
        *("umount", "uselib", "ustat", "vm86", "vm86old", "vserver"),
    },
}

# What Docker's default profile refuses a container without added capabilities
# (moby/profiles seccomp/default.json), for x86_64 and aarch64, and the brief's additions.
DOCKER_REFUSES = {
    *("_sysctl", "acct", "add_key", "afs_syscall", "bpf", "chroot", "clock_settime"),
    *("create_module", "delete_module", "fanotify_init", "finit_module", "fsconfig"),
    *("fsmount", "fsopen", "fspick", "get_kernel_syms", "get_mempolicy", "getpmsg"),
    *("init_module", "io_uring_enter", "io_uring_register", "io_uring_setup", "ioperm"),
    *("iopl", "kcmp", "kexec_file_load", "kexec_load", "keyctl", "lookup_dcookie", "mbind"),
    *("migrate_pages", "mount", "mount_setattr", "move_mount", "move_pages", "nfsservctl"),
    *("open_by_handle_at", "open_tree", "perf_event_open", "pidfd_getfd", "pivot_root"),
    *("process_madvise", "putpmsg", "query_module", "quotactl", "quotactl_fd", "reboot"),
    *("request_key", "security", "set_mempolicy", "set_mempolicy_home_node"),
    *("setdomainname", "sethostname", "setns", "settimeofday", "swapoff", "swapon", "sysfs"),
    *("syslog", "tuxcall", "umount2", "unshare", "uselib", "userfaultfd", "ustat"),
    *("vhangup", "vserver", "lsm_get_self_attr", "lsm_set_self_attr", "lsm_list_modules"),
    *("ptrace", "process_vm_readv", "process_vm_writev", "umount", "stime"),
}
ALSO_REFUSED = {
    *("clock_adjtime", "name_to_handle_at", "memfd_secret", "vm86", "vm86old"),
    *("open_tree_attr", "adjtimex", "modify_ldt", "listmount", "statmount"),
}
ARG_REFUSED = {"clone", "personality", "socket", "ioctl"}


def nr(name: str) -> int:
    return NR[name][0 if MACHINE == "x86_64" else 1]


# --- The policy and the programs, no process -----------------------------------------------


def test_policy_refuses_at_least_what_docker_does() -> None:
    assert {n for n, a in seccomp.POLICY.items() if a == "EPERM"} >= DOCKER_REFUSES | ALSO_REFUSED
    assert seccomp.POLICY["clone3"] == "ENOSYS"
    assert set(seccomp.POLICY) - DOCKER_REFUSES - ALSO_REFUSED - {"clone3"} == ARG_REFUSED
    for name in ("landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self"):
        assert name not in seccomp.POLICY  # the sandbox's own code may use Landlock


def _refused_by(pairs: tuple[tuple[int, int], ...], value: int) -> bool:
    return any(value & mask == expected for mask, expected in pairs)


def _samples() -> Iterator[int]:
    """32-bit values with at most two bits set or clear, and 20,000 random ones."""
    ones = 0xFFFFFFFF
    for a in range(33):
        for b in range(a, 33):
            value = (1 << a | 1 << b) & ones
            yield value
            yield ones ^ value
    rng = random.Random(0)
    yield from (rng.getrandbits(32) for _ in range(20_000))


def test_personality_rules_refuse_exactly_what_docker_does() -> None:
    """Docker allows personality() with 0x0, 0x8, 0x20000, 0x20008 and 0xffffffff only; the
    masked comparisons refuse every other value (the kernel reads 32 bits)."""
    rule = next(r for r in seccomp.ARG_DENIALS if r.syscall == "personality")
    allowed = {0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF}
    for value in [*allowed, *_samples()]:
        assert _refused_by(rule.when, value) == (value not in allowed), hex(value)
        assert _refused_by(rule.when, value | HIGH) == (value not in allowed)


def test_clone_rules_refuse_every_namespace_flag() -> None:
    rule = next(r for r in seccomp.ARG_DENIALS if r.syscall == "clone")
    for bit in range(64):
        flag = 1 << bit
        assert _refused_by(rule.when, flag | 0x11) == bool(flag & 0x7E020000), hex(flag)


def test_programs_were_built_from_this_policy() -> None:
    """Edit the policy, then run the generator: the programs record the policy's digest."""
    assert MANIFEST["policy_sha256"] == seccomp.policy_digest(), (
        "the policy changed: run /usr/bin/python3 scripts/seccomp_policy.py"
    )


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_each_program_has_a_rule_for_each_refused_call(machine: str) -> None:
    """Read from libseccomp's listing of the program (<machine>.pfc), which names each rule.
    The aarch64 program lacks the calls too new for the libseccomp that built it (it adds a
    number only for its own machine's table): programs.json says which."""
    placed = _listed(machine)
    not_refused = set(MANIFEST["programs"][machine]["not_refused"])
    missing = set(seccomp.POLICY) - set(placed) - ABSENT[machine] - not_refused
    assert not missing
    assert not_refused <= {"lsm_get_self_attr", "lsm_set_self_attr", "lsm_list_modules"} | {
        *("open_tree_attr", "listmount", "statmount")
    }
    if machine == MANIFEST["built_on"]:
        assert not not_refused


def test_program_path_and_load(tmp_path: Path) -> None:
    assert seccomp.program_path("riscv64") is None
    assert seccomp.program_path("amd64") == seccomp.program_path("x86_64")
    for machine in ("x86_64", "aarch64"):
        path = seccomp.program_path(machine)
        assert path is not None
        count = MANIFEST["programs"][machine]["instructions"]
        assert len(seccomp.load(path)) == 8 * count
    for size in (0, 7, 8 * 4097):
        (tmp_path / "bad.bpf").write_bytes(b"\0" * size)
        with pytest.raises(ValueError):
            seccomp.load(tmp_path / "bad.bpf")
    with pytest.raises(ValueError):  # checked before anything is installed
        seccomp.apply(b"\0" * 12)


def _listed(machine: str) -> dict[str, tuple[int, str]]:
    """Each system call of the program's listing: its number and its first action line."""
    text = (seccomp.PROGRAMS / f"{machine}.pfc").read_text()
    by_number = {number: name for name, number in seccomp.NUMBERS.items()}
    pattern = r'# filter for syscall "([^"]*)" \((\d+)\).*\n.*\n\s*(.*)'
    listed = {}
    for name, number, first in re.findall(pattern, text):
        listed[name if name != "UNKNOWN" else by_number[int(number)]] = (int(number), first)
    return listed


# --- A process under the filter ------------------------------------------------------------

needs_program = pytest.mark.skipif(PROGRAM is None, reason=f"no program for {MACHINE}")


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    assert PROGRAM is not None
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(PROGRAM)],
        capture_output=True,
        text=True,
        timeout=100,
        start_new_session=True,  # no controlling terminal: vhangup() has none to hang up
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


REFUSED_PROBES = [
    "io_uring_setup",
    "add_key",
    "keyctl",
    "request_key",
    "userfaultfd",
    "perf_event_open",
    "memfd_secret",
    "ptrace(PTRACE_ATTACH)",
    "process_vm_readv",
    "pidfd_getfd",
    "bpf",
    "unshare(CLONE_NEWUSER)",
    "setns",
    "mount",
    "clone(CLONE_NEWNS)",
    "personality(ADDR_NO_RANDOMIZE)",
    "personality(ADDR_NO_RANDOMIZE | 1 << 32)",
    "socket(AF_VSOCK)",
    "socket(AF_VSOCK | 1 << 32)",
    "socket(AF_ALG)",
    "ioctl(TIOCSTI)",
    "ioctl(TIOCSTI | 1 << 32)",
    "clone3",
    "listmount",
    "statmount",
    "modify_ldt",
    "keyctl (x32 ABI)",
    "keyctl (i386 int 0x80)",
]
ALLOWED_PROBES = [
    "personality(query)",
    "personality(PER_LINUX32)",
    "personality(UNAME26)",
    "personality(PER_LINUX32 | UNAME26)",
    "personality(PER_LINUX)",
    "socket(AF_UNIX)",
    "ioctl(FIONREAD)",
    "clone(SIGCHLD)",
    "getpid",
]
# Refused with the filter, and not so without it, as any user: the test can fail.
CONTROLS = ["keyctl", "add_key", "process_vm_readv", "personality(ADDR_NO_RANDOMIZE)"]
CONTROLS += ["clone3", "ioctl(TIOCSTI)", "ioctl(TIOCSTI | 1 << 32)"]


@pytest.mark.integration
@needs_program
@pytest.mark.parametrize("probe", REFUSED_PROBES)
def test_refused_under_the_filter(report: dict[str, Any], probe: str) -> None:
    if probe not in report["filtered"]:
        pytest.skip(f"{probe}: not on {MACHINE}")
    if probe.endswith("int 0x80)") and report["control"][probe] == "signal 11":
        pytest.skip("this kernel runs no i386 code (no IA32 emulation)")
    expected = "ENOSYS" if probe == "clone3" else "EPERM"
    assert report["filtered"][probe] == expected, report["control"].get(probe)


@pytest.mark.integration
@needs_program
def test_the_controls_differ_without_the_filter(report: dict[str, Any]) -> None:
    for probe in CONTROLS:
        assert report["control"][probe] != report["filtered"][probe], probe
    succeeded = [p for p in REFUSED_PROBES if report["control"].get(p) == "ok"]
    assert len(succeeded) >= 5, report["control"]


@pytest.mark.integration
@needs_program
@pytest.mark.parametrize("probe", ALLOWED_PROBES)
def test_allowed_under_the_filter(report: dict[str, Any], probe: str) -> None:
    assert report["filtered"][probe] == "ok"


@pytest.mark.integration
@needs_program
def test_every_refused_call_of_the_program(report: dict[str, Any]) -> None:
    """Every system call the program refuses whatever its arguments, called with -1 for each
    argument (in forks, under the filter only)."""
    sweep = report["sweep"]
    listed = _listed(MACHINE)
    assert set(sweep) == {n for n, a in seccomp.POLICY.items() if a == "EPERM"} & set(listed)
    wrong = {name: seen for name, seen in sweep.items() if seen != "EPERM"}
    assert not wrong


@pytest.mark.integration
@needs_program
def test_the_filter_is_installed(report: dict[str, Any]) -> None:
    assert report["status"] == {"NoNewPrivs": "1", "Seccomp": "2", "Seccomp_filters": "1"}


WORKLOADS = ["numpy", "subprocess", "pipeline", "thread", "asyncio subprocess", "os.fork"]
WORKLOADS += ["pool fork", "pool forkserver", "pool spawn", "ssl socketpair", "ipykernel"]


@pytest.mark.integration
@needs_program
@pytest.mark.parametrize("workload", WORKLOADS)
def test_a_kernel_runs_under_the_filter(report: dict[str, Any], workload: str) -> None:
    assert report["works"][workload] == "ok"


@pytest.mark.integration
def test_generator_check_passes() -> None:
    """The checked-in files are what the generator makes of the policy."""
    found = subprocess.run([SYSTEM_PYTHON, "-c", "import seccomp"], capture_output=True)
    if found.returncode != 0:
        pytest.skip(f"{SYSTEM_PYTHON} has no libseccomp bindings: apt-get install python3-seccomp")
    done = subprocess.run(
        [SYSTEM_PYTHON, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=60
    )
    if done.returncode == 77:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.integration
@needs_program
def test_bubblewrap_loads_the_program() -> None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        pytest.skip("no bwrap")
    assert PROGRAM is not None
    code = (
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
        f"r = libc.syscall({nr('keyctl')}, 0, -3, 0); print(ctypes.get_errno() if r == -1 else 0)"
    )

    def run(*seccomp_args: str, fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
        command = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        command += ["--unshare-all", *seccomp_args, sys.executable, "-c", code]
        return subprocess.run(command, capture_output=True, text=True, pass_fds=fds, timeout=30)

    control = run()
    if control.returncode != 0:
        pytest.skip(f"bwrap cannot run here: {control.stderr.strip()}")
    assert control.stdout.strip() != str(errno.EPERM)
    with PROGRAM.open("rb") as program:
        fd = program.fileno()
        filtered = run("--seccomp", str(fd), fds=(fd,))
    assert filtered.returncode == 0, filtered.stderr
    assert filtered.stdout.strip() == str(errno.EPERM)


# --- The child: run as ``python tests/test_seccomp.py --child PROGRAM`` --------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def syscall(number: int, *args: Any) -> int:
    """The raw system call: its result, or -errno."""
    passed = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    result = _libc.syscall(ctypes.c_long(number), *passed)
    return -ctypes.get_errno() if result == -1 else int(result)


def _clone(flags: int) -> int:
    result = syscall(nr("clone"), flags | 17, 0, 0, 0, 0)  # 17: SIGCHLD when the child ends
    if result == 0:
        os._exit(0)
    if result > 0:
        os.waitpid(result, 0)
    return result


def _i386_keyctl() -> Callable[[], int]:
    """keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING) through ``int 0x80``: i386's
    system call table, from this 64-bit process."""
    code = bytes.fromhex(
        "53"  # push rbx (callee-saved)
        "b820010000"  # mov eax, 288: keyctl in i386's table
        "31db"  # xor ebx, ebx: KEYCTL_GET_KEYRING_ID
        "b9fdffffff"  # mov ecx, -3: KEY_SPEC_SESSION_KEYRING
        "31d2"  # xor edx, edx
        "cd80"  # int 0x80
        "5b"  # pop rbx
        "c3"  # ret
    )
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))

    def call() -> int:
        assert not page.closed  # and holds the page while the function may run
        return int(function())

    return call


def _probes(target: int) -> dict[str, Callable[[], int]]:
    """Each call, with arguments that harm nothing if it is let through."""
    io_uring_params = ctypes.create_string_buffer(120)
    reader, _ = os.pipe()
    char = ctypes.c_char(b"x")
    count = ctypes.create_string_buffer(8)
    pidfd = syscall(nr("pidfd_open"), os.getpid(), 0)
    probes: dict[str, Callable[[], int]] = {
        "io_uring_setup": lambda: syscall(nr("io_uring_setup"), 1, io_uring_params),
        "add_key": lambda: syscall(nr("add_key"), b"user", b"kernel-env-test", b"v", 1, -2),
        "keyctl": lambda: syscall(nr("keyctl"), 0, -3, 0),
        "request_key": lambda: syscall(nr("request_key"), b"user", b"kernel-env-none", 0, 0),
        "userfaultfd": lambda: syscall(nr("userfaultfd"), os.O_CLOEXEC),
        "perf_event_open": lambda: syscall(nr("perf_event_open"), 0, 0, -1, -1, 0),
        "memfd_secret": lambda: syscall(nr("memfd_secret"), 0),
        "ptrace(PTRACE_ATTACH)": lambda: syscall(nr("ptrace"), 16, target, 0, 0),
        "process_vm_readv": lambda: syscall(nr("process_vm_readv"), os.getpid(), 0, 0, 0, 0, 0),
        "pidfd_getfd": lambda: syscall(nr("pidfd_getfd"), pidfd, 0, 0),
        "bpf": lambda: syscall(nr("bpf"), 0, 0, 0),
        "unshare(CLONE_NEWUSER)": lambda: syscall(nr("unshare"), 0x10000000),
        "setns": lambda: syscall(nr("setns"), -1, 0),
        "mount": lambda: syscall(nr("mount"), 0, 0, 0, 0, 0),
        "clone(CLONE_NEWNS)": lambda: _clone(0x20000),
        "personality(ADDR_NO_RANDOMIZE)": lambda: syscall(nr("personality"), 0x40000),
        "personality(ADDR_NO_RANDOMIZE | 1 << 32)": lambda: syscall(
            nr("personality"), 0x40000 | HIGH
        ),
        "socket(AF_VSOCK)": lambda: syscall(nr("socket"), 40, socket.SOCK_STREAM, 0),
        "socket(AF_VSOCK | 1 << 32)": lambda: syscall(nr("socket"), 40 | HIGH, 1, 0),
        "socket(AF_ALG)": lambda: syscall(nr("socket"), 38, socket.SOCK_SEQPACKET, 0),
        "ioctl(TIOCSTI)": lambda: syscall(nr("ioctl"), reader, 0x5412, ctypes.byref(char)),
        "ioctl(TIOCSTI | 1 << 32)": lambda: syscall(
            nr("ioctl"), reader, 0x5412 | HIGH, ctypes.byref(char)
        ),
        "clone3": lambda: syscall(nr("clone3"), 0, 0),
        "listmount": lambda: syscall(nr("listmount"), 0, 0, 0, 0),  # no request: EFAULT
        "statmount": lambda: syscall(nr("statmount"), 0, 0, 0, 0),
        # Allowed.
        "personality(query)": lambda: syscall(nr("personality"), 0xFFFFFFFF),
        "personality(PER_LINUX32)": lambda: syscall(nr("personality"), 0x8),
        "personality(UNAME26)": lambda: syscall(nr("personality"), 0x20000),
        "personality(PER_LINUX32 | UNAME26)": lambda: syscall(nr("personality"), 0x20008),
        "personality(PER_LINUX)": lambda: syscall(nr("personality"), 0),
        "socket(AF_UNIX)": lambda: syscall(nr("socket"), socket.AF_UNIX, socket.SOCK_STREAM, 0),
        "ioctl(FIONREAD)": lambda: syscall(nr("ioctl"), reader, 0x541B, count),
        "clone(SIGCHLD)": lambda: _clone(0),
        "getpid": lambda: syscall(39 if MACHINE == "x86_64" else 172),
    }
    if MACHINE == "x86_64":
        ldt = ctypes.create_string_buffer(16)
        probes["modify_ldt"] = lambda: syscall(MODIFY_LDT, 0, ldt, 16)  # read: harmless
        probes["keyctl (x32 ABI)"] = lambda: syscall(nr("keyctl") | X32, 0, -3, 0)
        probes["keyctl (i386 int 0x80)"] = _i386_keyctl()
    return probes


def _in_fork(call: Callable[[], int]) -> str:
    """What ``call`` gives in a fork of this process: "ok", an errno name, or "signal N"."""
    pid = os.fork()
    if pid == 0:
        code = 255
        try:
            result = call()
            code = 0 if result >= 0 else min(-result, 255)
        finally:
            os._exit(code)
    status = os.waitpid(pid, 0)[1]
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    code = os.WEXITSTATUS(status)
    return "ok" if code == 0 else errno.errorcode.get(code, str(code))


def _sweep() -> dict[str, str]:
    """Every call the program refuses whatever the arguments, with -1 for each argument."""
    numbers = {
        name: number
        for name, (number, first) in _listed(MACHINE).items()
        if first == "action ERRNO(1);" and seccomp.POLICY.get(name) == "EPERM"
    }
    return {name: _in_fork(_with_minus_ones(number)) for name, number in numbers.items()}


def _with_minus_ones(number: int) -> Callable[[], int]:
    return lambda: syscall(number, *[-1] * 6)


async def _echo() -> bytes:
    process = await asyncio.create_subprocess_exec("echo", "hi", stdout=subprocess.PIPE)
    out, _ = await process.communicate()
    return out


def _pipeline() -> bytes:
    command = "printf 'b\\na\\n' | sort | head -n 1"
    return subprocess.run(command, shell=True, capture_output=True).stdout


def _fork_exit_code() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _thread_result() -> list[int]:
    box: list[int] = []
    thread = threading.Thread(target=lambda: box.append(sum(range(10))))
    thread.start()
    thread.join()
    return box


def _pool(method: str) -> list[int]:
    # A built-in as the task: a kernel's cell (tests/test_defense.py) has no module to import.
    with multiprocessing.get_context(method).Pool(2) as pool:
        return pool.starmap(pow, [(x, 2) for x in range(5)])


def _in_a_thread(work: Callable[[], object]) -> object:
    """``work()`` on a thread of its own (asyncio.run needs one where no loop runs, which a
    kernel's main thread is not)."""
    box: list[object] = []
    thread = threading.Thread(target=lambda: box.append(work()))
    thread.start()
    thread.join()
    return box[0] if box else None


def _ssl_socketpair() -> bytes:
    import ssl

    ssl.create_default_context()
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"ping")
        return right.recv(4)


def _numpy() -> float:
    import numpy

    a = numpy.arange(400.0 * 400).reshape(400, 400) / 1e5
    return float((a @ a.T).trace())


def _ipykernel() -> list[str]:
    """A Jupyter kernel started from this process (so under its filter) runs a cell."""
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3", startup_timeout=60)
    try:
        seen: list[str] = []

        def output(message: dict[str, Any]) -> None:
            if message["msg_type"] == "stream":
                seen.append(message["content"]["text"])

        code = "import numpy, subprocess; print(numpy.ones(3).sum(), subprocess.run(['true']))"
        client.execute_interactive(code, timeout=60, output_hook=output)
        return seen
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _workloads() -> dict[str, tuple[Callable[[], object], object]]:
    return {
        "numpy": (_numpy, None),
        "subprocess": (lambda: subprocess.run(["true"]).returncode, 0),
        "pipeline": (_pipeline, b"a\n"),
        "thread": (_thread_result, [45]),
        "asyncio subprocess": (lambda: _in_a_thread(lambda: asyncio.run(_echo())), b"hi\n"),
        "os.fork": (_fork_exit_code, 7),
        "pool fork": (lambda: _pool("fork"), [0, 1, 4, 9, 16]),
        "pool forkserver": (lambda: _pool("forkserver"), [0, 1, 4, 9, 16]),
        "pool spawn": (lambda: _pool("spawn"), [0, 1, 4, 9, 16]),
        "ssl socketpair": (_ssl_socketpair, b"ping"),
        "ipykernel": (_ipykernel, ["3.0 CompletedProcess(args=['true'], returncode=0)\n"]),
    }


def _run_workloads() -> dict[str, str]:
    seen = {}
    for name, (work, expected) in _workloads().items():
        try:
            result = work()
            ok = expected is None or result == expected
            seen[name] = "ok" if ok else f"got {result!r}"
        except Exception as exc:
            seen[name] = f"{type(exc).__name__}: {exc}"
    return seen


def _status() -> dict[str, str]:
    fields = dict(
        line.split(":\t", 1) for line in Path("/proc/self/status").read_text().splitlines()
    )
    return {key: fields[key].strip() for key in ("NoNewPrivs", "Seccomp", "Seccomp_filters")}


def under_the_filter() -> dict[str, Any]:
    """What a process already under the filter sees: the probes, the sweep, its status and
    the workloads (a sandboxed kernel's cell runs this: tests/test_defense.py)."""
    target = subprocess.Popen(["sleep", "60"])  # for ptrace to attach to
    try:
        probes = _probes(target.pid)
        filtered = {name: _in_fork(call) for name, call in probes.items()}
        return {
            "filtered": filtered,
            "status": _status(),
            "sweep": _sweep() if filtered["keyctl"] == "EPERM" else {},
            "works": _run_workloads(),
        }
    finally:
        target.kill()
        target.wait()


def _child(program: Path) -> None:
    target = subprocess.Popen(["sleep", "60"])  # for ptrace to attach to
    try:
        probes = _probes(target.pid)
        control = {name: _in_fork(call) for name, call in probes.items()}
        seccomp.apply(seccomp.load(program))
        filtered = {name: _in_fork(call) for name, call in probes.items()}
        active = filtered["keyctl"] == "EPERM"  # never sweep without the filter
        report = {
            "control": control,
            "filtered": filtered,
            "status": _status(),
            "sweep": _sweep() if active else {},
            "works": _run_workloads(),
        }
    finally:
        target.kill()
        target.wait()
    print(json.dumps(report))


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    with contextlib.suppress(BrokenPipeError):
        _child(Path(sys.argv[2]))
