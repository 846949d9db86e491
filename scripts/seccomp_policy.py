#!/usr/bin/python3
"""Build the sandboxed kernels' seccomp programs from the policy in
kernel_env/kernel/isolation/seccomp.py.

    /usr/bin/python3 scripts/seccomp_policy.py          # write kernel_env/kernel/isolation/seccomp/
    /usr/bin/python3 scripts/seccomp_policy.py --check  # exit 1 if the checked-in files differ

It runs under the system's python3 with libseccomp's own bindings (Debian: python3-seccomp; they
are not on PyPI), and imports nothing else beyond the standard library; the policy module is
loaded by path. For each machine (x86_64, aarch64) it writes:

- ``<machine>.bpf``: the program, a ``struct sock_filter`` array, as ``bwrap --seccomp FD`` and
  ``kernel_env.kernel.isolation.seccomp.apply`` take it;
- ``<machine>.pfc``: the same filter in libseccomp's pseudo filter code, to read and review;
- ``programs.json``: the libseccomp version and machine that built them, the policy's digest
  (a quick test compares it with the policy's), and per program what it could not refuse.

A filter for another machine than this one is built by giving libseccomp only that
architecture. libseccomp adds a system call by number only if it knows the number on the
machine it runs on (it translates numbers through names), so a system call too new for it is
refused by number on this machine, and left out of the others' programs: ``programs.json``
lists those (``not_refused``), and this script says so. The output is deterministic for one
libseccomp version and machine; ``--check`` exits 77 (skip) if the files were built by another.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import importlib.util
import json
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import IO, NamedTuple

import seccomp

ROOT = Path(__file__).resolve().parent.parent
POLICY_MODULE = ROOT / "kernel_env" / "kernel" / "isolation" / "seccomp.py"
OUT = ROOT / "kernel_env" / "kernel" / "isolation" / "seccomp"
ARCHES = {"x86_64": seccomp.Arch.X86_64, "aarch64": seccomp.Arch.AARCH64}
# The machine libseccomp runs on (its architecture tokens: as signed or unsigned 32-bit ints).
NATIVE = {a & 0xFFFFFFFF: m for m, a in ARCHES.items()}.get(seccomp.system_arch() & 0xFFFFFFFF, "")
SKIP = 77  # --check: built by another libseccomp or machine, cannot compare
# libseccomp resolves a name it does not know to -1, one that an architecture has no call for
# (iopl on aarch64) to a "pseudo" number below -1.
_UNKNOWN = -1


class Program(NamedTuple):
    bpf: bytes
    pfc: str
    not_refused: list[str]


def load_policy() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kernel_env_seccomp_policy", POLICY_MODULE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def libseccomp_version() -> str:
    class Version(ctypes.Structure):
        _fields_ = (("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint))

    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_version.restype = ctypes.POINTER(Version)
    v = lib.seccomp_version().contents
    return f"{v.major}.{v.minor}.{v.micro}"


def rules(policy: ModuleType) -> list[tuple[int, str, tuple[seccomp.Arg, ...]]]:
    """(action, system call, argument comparisons) for every rule, in the policy's order."""
    eperm = seccomp.ERRNO(errno.EPERM)
    out: list[tuple[int, str, tuple[seccomp.Arg, ...]]]
    out = [(eperm, name, ()) for denial in policy.DENIED for name in denial.syscalls]
    out += [(seccomp.ERRNO(errno.ENOSYS), name, ()) for name in policy.NOT_IMPLEMENTED]
    for rule in policy.ARG_DENIALS:
        for mask, value in rule.when:
            compare = seccomp.Arg(rule.arg, seccomp.MASKED_EQ, mask, value)
            out.append((eperm, rule.syscall, (compare,)))
    return out


def number_of(machine: str, name: str) -> int:
    return int(seccomp.resolve_syscall(ARCHES[machine], name))


class CannotAdd(Exception):
    """A system call this libseccomp does not know, for another machine than its own."""


def syscall(policy: ModuleType, machine: str, name: str) -> str | int | None:
    """How to name ``name`` to libseccomp for ``machine``'s filter: by name, by number, or
    None if that machine has no such call (CannotAdd if there is no way)."""
    number = policy.NUMBERS.get(name)
    known = number_of(machine, name)
    if known >= 0:
        if number is not None and known != number:
            sys.exit(f"{name}: libseccomp numbers it {known} on {machine}, the policy {number}")
        return name
    if known < _UNKNOWN:
        return None
    if number is None:
        sys.exit(f"{name}: unknown to libseccomp {libseccomp_version()}, and no number given")
    if machine != NATIVE:
        raise CannotAdd(name)
    return number


def build(policy: ModuleType, machine: str) -> Program:
    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    if machine != NATIVE:
        f.add_arch(ARCHES[machine])
        f.remove_arch(ARCHES[NATIVE])
    f.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.ERRNO(policy.FOREIGN_ABI_ERRNO))
    f.set_attr(seccomp.Attr.CTL_OPTIMIZE, 2)  # a binary tree of system call numbers
    not_refused = []
    for action, name, args in rules(policy):
        try:
            target = syscall(policy, machine, name)
        except CannotAdd:
            not_refused.append(name)
            continue
        if target is not None:
            f.add_rule(action, target, *args)
    return Program(_export(f.export_bpf), _export(f.export_pfc).decode(), sorted(set(not_refused)))


def _export(method: Callable[[IO[bytes]], None]) -> bytes:
    with tempfile.TemporaryFile() as out:
        method(out)
        out.seek(0)
        return out.read()


def check_placed(policy: ModuleType, machine: str, program: Program) -> None:
    """Every system call the policy refuses on ``machine`` has a rule in its program (read
    back from the pseudo filter code), but those it could not add."""
    placed = {int(n) for n in re.findall(r'# filter for syscall "[^"]*" \((\d+)\)', program.pfc)}
    for _, name, _ in rules(policy):
        if name in program.not_refused:
            continue
        target = syscall(policy, machine, name)
        if target is None:
            continue
        number = target if isinstance(target, int) else number_of(machine, name)
        if number not in placed:
            sys.exit(f"{machine}: no rule for {name} ({number}) in the generated filter")


def outputs(policy: ModuleType) -> dict[str, bytes]:
    """Every file the generator writes, by name."""
    files: dict[str, bytes] = {}
    programs = {}
    for machine in ARCHES:
        program = build(policy, machine)
        check_placed(policy, machine, program)
        files[f"{machine}.bpf"] = program.bpf
        files[f"{machine}.pfc"] = program.pfc.encode()
        programs[machine] = {
            "instructions": policy.instructions(program.bpf, machine),
            "not_refused": program.not_refused,
        }
    manifest = {
        "generator": "scripts/seccomp_policy.py",
        "libseccomp": libseccomp_version(),
        "built_on": NATIVE,
        "policy_sha256": policy.policy_digest(),
        "programs": programs,
    }
    files["programs.json"] = (json.dumps(manifest, indent=2) + "\n").encode()
    return files


def check(files: dict[str, bytes]) -> int:
    try:
        recorded = json.loads((OUT / "programs.json").read_text())
    except (OSError, ValueError) as exc:
        print(f"no readable {OUT / 'programs.json'}: {exc}")
        return 1
    ours = json.loads(files["programs.json"])
    for key in ("libseccomp", "built_on"):
        if recorded.get(key) != ours[key]:
            print(f"SKIP: built with {key} {recorded.get(key)}, here {ours[key]}: cannot compare")
            return SKIP
    stale = [name for name, data in files.items() if _read(OUT / name) != data]
    for name in stale:
        print(f"{OUT / name} differs from what the policy gives")
    if stale:
        print(f"run: /usr/bin/python3 {Path(__file__).relative_to(ROOT)}")
    return 1 if stale else 0


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    options = parser.parse_args()
    if not NATIVE:
        print(f"libseccomp runs on architecture {seccomp.system_arch()}, not one of {list(ARCHES)}")
        return 1
    files = outputs(load_policy())
    if options.check:
        return check(files)
    OUT.mkdir(exist_ok=True)
    for name, data in files.items():
        (OUT / name).write_bytes(data)
    manifest = json.loads(files["programs.json"])
    for machine, info in manifest["programs"].items():
        left = ", ".join(info["not_refused"]) or "nothing"
        print(f"{OUT / machine}.bpf: {info['instructions']} instructions; not refused: {left}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
