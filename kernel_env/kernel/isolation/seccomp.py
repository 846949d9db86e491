"""The seccomp filter of sandboxed kernels: its policy, as data, and the loader of its programs.

The policy allows every system call except those below, which fail with ``EPERM`` (``clone3``
with ``ENOSYS``): what a Python kernel never needs and what widens the host kernel's attack
surface, at least everything Docker's default profile refuses a container without added
capabilities. Some are refused only for some arguments (``ARG_DENIALS``): ``clone`` with a
namespace flag, ``personality`` other than Docker's safe values, the ``AF_ALG`` and ``AF_VSOCK``
socket families, the terminal ioctls that inject input. A system call of another ABI than the
machine's own (i386's ``int 0x80`` and x32 numbers on x86_64, AArch32 on aarch64) fails with
``EPERM`` whatever it is: a process cannot step around the policy through another syscall table.

The programs (classic BPF, ``struct sock_filter`` arrays, one per machine) are built from this
data with libseccomp by ``scripts/seccomp_policy.py`` and checked in under
``kernel_env/kernel/isolation/seccomp/``; nothing here needs libseccomp at run time.
bubblewrap loads them (``bwrap --seccomp FD``); a process that is not started by bubblewrap
loads one with :func:`apply`. This module imports only the standard library and little of it:
a forked kernel calls it.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path
from typing import NamedTuple


class Denial(NamedTuple):
    """System calls refused outright, one group of them, and why."""

    group: str
    syscalls: tuple[str, ...]
    why: str


class ArgDenial(NamedTuple):
    """A system call refused for some arguments: when ``(args[arg] & mask) == value`` for any
    ``(mask, value)`` in ``when``."""

    group: str
    syscall: str
    arg: int
    when: tuple[tuple[int, int], ...]
    summary: str  # the rule in words, for POLICY
    why: str


# Refused with EPERM.
DENIED: tuple[Denial, ...] = (
    Denial(
        "kernel modules and kexec",
        (
            "init_module",
            "finit_module",
            "delete_module",
            "create_module",
            "get_kernel_syms",
            "query_module",
            "kexec_load",
            "kexec_file_load",
        ),
        "load, unload or replace kernel code",
    ),
    Denial(
        "mounts and the root directory",
        (
            "mount",
            "umount",
            "umount2",
            "pivot_root",
            "chroot",
            "open_tree",
            "open_tree_attr",
            "move_mount",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "mount_setattr",
        ),
        "change the filesystem view bubblewrap built (the new mount API included); the kernel "
        "holds no capability to do so, this removes the code paths too",
    ),
    Denial(
        "mount listing",
        ("listmount", "statmount"),
        "walk the mount tree by mount id (Linux 6.8): new code no program here needs; "
        "/proc/self/mountinfo already shows the sandbox its own mounts",
    ),
    Denial(
        "namespaces",
        ("setns", "unshare"),
        "leave or remake the sandbox's namespaces (clone's namespace flags: ARG_DENIALS)",
    ),
    Denial(
        "other processes' memory",
        (
            "ptrace",
            "process_vm_readv",
            "process_vm_writev",
            "process_madvise",
            "kcmp",
            "pidfd_getfd",
        ),
        "read, write or take from another process (its memory, its descriptors); ptrace has a "
        "long history of privilege escalations, and debuggers are not needed in an episode",
    ),
    Denial(
        "kernel keyrings",
        ("add_key", "keyctl", "request_key"),
        "not fully namespaced (Docker's reason), a history of privilege escalations, and "
        "nothing in a Python kernel uses them",
    ),
    Denial(
        "BPF, perf and userfaultfd",
        ("bpf", "perf_event_open", "userfaultfd"),
        "large attack surface; userfaultfd makes kernel races easy to win",
    ),
    Denial(
        "io_uring",
        ("io_uring_setup", "io_uring_enter", "io_uring_register"),
        "a second system call interface, with many privilege escalations to its name; "
        "Python does not use it",
    ),
    Denial(
        "file handles and fanotify",
        ("open_by_handle_at", "name_to_handle_at", "fanotify_init"),
        "open files by handle, around the mount namespace (the 'shocker' container escape), "
        "and learn the handles; watch whole filesystems",
    ),
    Denial(
        "clocks",
        ("settimeofday", "stime", "clock_settime", "clock_adjtime", "adjtimex"),
        "set the host's clock; reading the time does not need them (clock_gettime), only "
        "glibc's adjtimex() and ntp_gettime() read through them, and fail",
    ),
    Denial(
        "NUMA memory policy",
        (
            "get_mempolicy",
            "set_mempolicy",
            "set_mempolicy_home_node",
            "mbind",
            "migrate_pages",
            "move_pages",
        ),
        "as Docker without CAP_SYS_NICE; OpenBLAS's mbind hint (numpy) fails and changes "
        "nothing: the default policy already allocates on the local node",
    ),
    Denial(
        "memfd_secret",
        ("memfd_secret",),
        "memory taken out of the kernel's direct map, which fragments it for the whole host",
    ),
    Denial(
        "host administration",
        (
            "reboot",
            "swapon",
            "swapoff",
            "acct",
            "quotactl",
            "quotactl_fd",
            "sethostname",
            "setdomainname",
            "syslog",
            "vhangup",
        ),
        "each needs a capability the kernel never holds (Docker: CAP_SYS_BOOT, CAP_SYS_ADMIN, "
        "CAP_SYSLOG, CAP_SYS_TTY_CONFIG, ...); refused before any of their code runs",
    ),
    Denial(
        "security modules",
        ("lsm_get_self_attr", "lsm_set_self_attr", "lsm_list_modules"),
        "read or change the process's own AppArmor/SELinux attributes (Docker: CAP_SYS_ADMIN)",
    ),
    Denial(
        "x86 I/O ports and virtual 8086 mode",
        ("iopl", "ioperm", "vm86", "vm86old"),
        "raw hardware access (vm86 exists only for i386, whose calls are all refused anyway)",
    ),
    Denial(
        "x86 local descriptor table",
        ("modify_ldt",),
        "16-bit and custom segments (Wine, DOSEMU), nothing an episode runs; exploited in the "
        "past (CVE-2015-5157, CVE-2015-8830), unimplemented by gVisor",
    ),
    Denial(
        "obsolete",
        (
            "_sysctl",
            "lookup_dcookie",
            "uselib",
            "ustat",
            "sysfs",
            "nfsservctl",
            "afs_syscall",
            "getpmsg",
            "putpmsg",
            "security",
            "tuxcall",
            "vserver",
        ),
        "removed from Linux or never implemented: nothing calls them, Docker refuses them",
    ),
)

# Refused with ENOSYS: clone3 passes its flags in memory, which a filter cannot read, so it
# cannot be refused only with namespace flags as clone is. ENOSYS makes glibc fall back to
# clone (threads, posix_spawn), as under Docker.
NOT_IMPLEMENTED: tuple[str, ...] = ("clone3",)

# Docker's "safe" personalities: PER_LINUX (0), PER_LINUX32 (0x8), UNAME26 (0x20000), both, and
# 0xffffffff, which only asks for the current one.
PERSONALITY_FLAGS = 0x8 | 0x20000
PERSONALITY_QUERY = 0xFFFFFFFF
CLONE_NEW_FLAGS = 0x7E020000  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_LOW_32 = 0xFFFFFFFF  # the kernel reads these arguments as 32-bit: high bits must not matter


def _bits(mask: int) -> tuple[tuple[int, int], ...]:
    """``(bit, bit)`` for each bit of ``mask``: matches a value with any of them set."""
    return tuple((1 << b, 1 << b) for b in range(64) if mask >> b & 1)


def outside(flags: int, width: int = 32) -> tuple[tuple[int, int], ...]:
    """``(mask, value)`` pairs such that ``v & mask == value`` for at least one of them
    exactly when the low ``width`` bits of ``v`` are neither a combination of ``flags`` nor
    all ones (libseccomp compares an argument once per rule, so "not one of these values" is
    said as a union of masked comparisons):

    - some bit outside ``flags`` is set and the next bit outside ``flags`` (cyclically) is
      clear: some bit outside is set and some bit outside is clear;
    - the lowest bit outside ``flags`` is set and a bit of ``flags`` is clear: with every bit
      outside set, the value is still not all ones.
    """
    others = [b for b in range(width) if not flags >> b & 1]
    if len(others) < 2:
        raise ValueError("needs at least two bits outside flags")
    pairs = [
        ((1 << b) | (1 << others[(i + 1) % len(others)]), 1 << b) for i, b in enumerate(others)
    ]
    first = 1 << others[0]
    pairs += [(first | (1 << b), first) for b in range(width) if flags >> b & 1]
    return tuple(pairs)


# Refused with EPERM for some arguments only.
ARG_DENIALS: tuple[ArgDenial, ...] = (
    ArgDenial(
        "namespaces",
        "clone",
        0,
        _bits(CLONE_NEW_FLAGS),
        f"EPERM with a CLONE_NEW* flag ({CLONE_NEW_FLAGS:#x})",
        "new namespaces: a fork or a thread passes none",
    ),
    ArgDenial(
        "personality",
        "personality",
        0,
        outside(PERSONALITY_FLAGS),
        "EPERM unless 0x0, 0x8, 0x20000, 0x20008 or 0xffffffff (Docker's values)",
        "the other flags turn off address-space randomisation (ADDR_NO_RANDOMIZE), make "
        "readable memory executable (READ_IMPLIES_EXEC), map page zero (MMAP_PAGE_ZERO): "
        "exploit aids for the process and its children",
    ),
    ArgDenial(
        "sockets",
        "socket",
        0,
        ((_LOW_32, 38), (_LOW_32, 40)),
        "EPERM for AF_ALG (38) and AF_VSOCK (40)",
        "AF_VSOCK reaches the hypervisor's host, and the network namespace does not stop it; "
        "AF_ALG is the kernel's crypto API, a frequent source of bugs (both as Docker, whose "
        "rule compares 64 bits: the kernel reads 32)",
    ),
    ArgDenial(
        "terminals",
        "ioctl",
        1,
        ((_LOW_32, 0x5412), (_LOW_32, 0x541C)),
        "EPERM for TIOCSTI (0x5412) and TIOCLINUX (0x541c)",
        "push input into a terminal the host reads (CVE-2017-5226; TIOCLINUX pastes on a "
        "console); compared on 32 bits, as the kernel reads the request (CVE-2019-10063)",
    ),
)

# System calls that some libseccomp releases do not know, by number: the same on x86_64 and
# aarch64 (Linux numbers every system call from 424 on alike for both). The generator uses a
# number when its libseccomp does not know the name, and checks it when it does.
NUMBERS: dict[str, int] = {
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "memfd_secret": 447,
    "set_mempolicy_home_node": 450,
    "statmount": 457,
    "listmount": 458,
    "lsm_get_self_attr": 459,
    "lsm_set_self_attr": 460,
    "lsm_list_modules": 461,
    "open_tree_attr": 467,
}

# A system call of another ABI than the program's machine (i386, x32, AArch32).
FOREIGN_ABI_ERRNO = errno.EPERM


def _policy() -> dict[str, str]:
    policy = {name: "EPERM" for denial in DENIED for name in denial.syscalls}
    policy.update((name, "ENOSYS") for name in NOT_IMPLEMENTED)
    policy.update((rule.syscall, rule.summary) for rule in ARG_DENIALS)
    return dict(sorted(policy.items()))


# Every system call the policy names, and what it does to it; all others are allowed.
POLICY: dict[str, str] = _policy()


def policy_digest() -> str:
    """SHA-256 of the policy's data: the checked-in programs record the digest of the policy
    they were built from (``kernel_env/kernel/isolation/seccomp/programs.json``)."""
    import hashlib
    import json

    data = {
        "denied": [list(d.syscalls) for d in DENIED],
        "not_implemented": list(NOT_IMPLEMENTED),
        "arg_denials": [[r.syscall, r.arg, [list(w) for w in r.when]] for r in ARG_DENIALS],
        "numbers": NUMBERS,
        "foreign_abi_errno": FOREIGN_ABI_ERRNO,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# --- The loader ---------------------------------------------------------------------------

PROGRAMS = Path(__file__).with_name("seccomp")  # <machine>.bpf, made by the generator
MAX_INSTRUCTIONS = 4096  # BPF_MAXINSNS: the kernel refuses a longer program
_INSTRUCTION = 8  # sizeof(struct sock_filter)
_MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
_SECCOMP_SYSCALL = {"x86_64": 317, "aarch64": 277}  # __NR_seccomp
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def program_path(machine: str | None = None) -> Path | None:
    """The checked-in program for ``machine`` (this one's by default), None if there is none."""
    name = _MACHINES.get(machine or os.uname().machine)
    if name is None:
        return None
    path = PROGRAMS / f"{name}.bpf"
    return path if path.is_file() else None


def load(path: Path | str) -> bytes:
    """A program's bytes, checked for shape (:func:`instructions`)."""
    program = Path(path).read_bytes()
    instructions(program, str(path))
    return program


def instructions(program: bytes, name: str = "program") -> int:
    """How many instructions ``program`` holds; ValueError unless it is whole instructions,
    at least one and at most BPF_MAXINSNS."""
    count, rest = divmod(len(program), _INSTRUCTION)
    if rest or not 0 < count <= MAX_INSTRUCTIONS:
        raise ValueError(f"{name}: not a seccomp program ({len(program)} bytes)")
    return count


def apply(program: bytes) -> None:
    """Install ``program`` on the calling process: no-new-privileges, then the filter, on
    every thread (``SECCOMP_FILTER_FLAG_TSYNC``: a forked kernel calls this with one thread,
    where it changes nothing, but a thread that ran on unfiltered would be a way around it).
    It cannot be removed; children inherit it."""
    number = _SECCOMP_SYSCALL.get(_MACHINES.get(os.uname().machine, ""))
    if number is None:
        raise OSError(errno.ENOSYS, f"no seccomp support for {os.uname().machine}")
    count = instructions(program)
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, *_longs(1, 0, 0, 0)) != 0:  # variadic: whole longs
        _raise("prctl(PR_SET_NO_NEW_PRIVS)")
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(count, ctypes.addressof(buffer))
    flags = _longs(_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC)
    result = _libc.syscall(ctypes.c_long(number), *flags, ctypes.byref(fprog))
    if result > 0:  # TSYNC: a thread that could not take the filter
        raise OSError(errno.EBUSY, f"seccomp: thread {result} could not be synchronised")
    if result != 0:
        _raise("seccomp(SECCOMP_SET_MODE_FILTER)")


def _longs(*values: int) -> list[ctypes.c_ulong]:
    return [ctypes.c_ulong(v) for v in values]


def _raise(what: str) -> None:
    error = ctypes.get_errno()
    raise OSError(error, f"{what}: {os.strerror(error)}")


def main(argv: list[str]) -> None:
    """``python -I -S seccomp.py PROGRAM COMMAND...``: install ``PROGRAM`` on this process,
    then exec ``COMMAND`` under it (a command the host starts in a sandbox it entered
    itself, which bubblewrap's ``--seccomp`` does not reach: :mod:`kernel_env.kernel.commands`)."""
    if len(argv) < 3:
        raise SystemExit("usage: seccomp.py PROGRAM COMMAND...")
    apply(load(argv[1]))
    os.execv(argv[2], argv[2:])


if __name__ == "__main__":
    import sys

    main(sys.argv)
