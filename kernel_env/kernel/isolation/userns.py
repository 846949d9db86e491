"""Enter the user namespace a sandbox's own hangs below, then run a command: how a server that
is not root reaches into one of its sandboxes (``python -I -S userns.py PID -- COMMAND...``).

bubblewrap's ``--disable-userns`` nests a second user namespace inside the one it makes, and
the sandbox's processes live in the inner one. ``setns(2)`` into a user namespace needs
``CAP_SYS_ADMIN`` there, which a process has in a namespace its own uid made only from the
namespace's parent: a root server enters the inner one at once; any other must first enter
the outer one (which its uid made, from the host's), where its uid owns the inner one, and
only then can ``nsenter`` go the rest of the way. Run by path, as its own process, before
``nsenter``: the standard library alone.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import sys

_NS_GET_PARENT = 0xB702  # ioctl(2) on a namespace file: its parent's, as a new descriptor
_CLONE_NEWUSER = 0x10000000


def enter_parent(pid: int) -> None:
    """Join the parent of ``pid``'s user namespace."""
    own = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    try:
        parent = fcntl.ioctl(own, _NS_GET_PARENT)
    finally:
        os.close(own)
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if libc.setns(parent, _CLONE_NEWUSER) != 0:
            raise OSError(ctypes.get_errno(), "setns into the sandbox's outer user namespace")
    finally:
        os.close(parent)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: userns.py PID -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    try:
        enter_parent(int(argv[0]))
    except OSError as exc:
        print(f"userns.py: {exc}", file=sys.stderr)
        return 126
    os.execvp(argv[2], argv[2:])
    return 127  # not reached: execvp raises or replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
