"""Large files through E2B's envd ``/files``, with E2B's SDK: wall time and the server's peak RSS.

    python benchmarks/bench_e2b_transfer.py             # 150 MiB each way, ~1 minute on 2 cores
    python benchmarks/bench_e2b_transfer.py --mib 20    # a smaller file

One ``kernel-env serve`` subprocess (pool of 2, sandboxed kernels) on loopback. In one sandbox
the SDK uploads a file of ``--mib`` MiB as a file object (``application/octet-stream``,
streamed) and as bytes (``multipart/form-data``), then downloads a file of that size a cell
wrote (``files.read(format="stream")``). For each: the wall time, the throughput, and how much
the server's peak RSS grew (VmHWM reset before each, as root; else RSS sampled every 5 ms).
Each file is checked byte for byte (SHA-256) in the kernel or on arrival; an upload's wall
time includes that check (a cell hashing the file), a download's the client's hashing.
Needs the SDK: ``pip install e2b==2.63.0 e2b-code-interpreter==2.11.5``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import re
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from e2b_code_interpreter import Sandbox

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from serverkit import serving

TOKEN = "e2b_" + secrets.token_hex(20)
MiB = 1 << 20
HASH = (
    "import hashlib, os\n"
    "d = hashlib.sha256()\n"
    "with open(os.path.expanduser({path!r}), 'rb') as f:\n"
    "    while b := f.read(1 << 20):\n"
    "        d.update(b)\n"
    "d.hexdigest()\n"
)
MAKE = (
    "import os\n"
    "with open(os.path.expanduser({path!r}), 'wb') as f:\n"
    "    for n in range({mib}):\n"
    "        f.write(n.to_bytes(8, 'big') * (1 << 17))\n"
)


def payload(mib: int) -> bytes:
    return b"".join(n.to_bytes(8, "big") * (1 << 17) for n in range(mib))


def _status(pid: int, field: str) -> int:
    match = re.search(rf"{field}:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    assert match is not None
    return int(match.group(1))


@contextlib.contextmanager
def peak_growth(pid: int) -> Iterator[list[float]]:
    """The server's peak RSS growth in MiB over the block, appended to the list yielded."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        hwm = True
    except PermissionError:
        hwm = False
    before = _status(pid, "VmHWM" if hwm else "VmRSS")
    samples = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            samples.append(_status(pid, "VmRSS"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    grown: list[float] = []
    try:
        yield grown
    finally:
        done.set()
        sampler.join(timeout=5)
        peak = _status(pid, "VmHWM") if hwm else max(samples)
        grown.append((peak - before) / 1024)


def measure(name: str, pid: int, mib: int, run: Callable[[], None]) -> None:
    t0 = time.perf_counter()
    with peak_growth(pid) as grown:
        try:
            run()
            outcome = "ok"
        except Exception as exc:  # the figure to show is that it fails
            outcome = f"FAILED: {type(exc).__name__}: {str(exc)[:80]}"
    wall = time.perf_counter() - t0
    print(f"{name:<26} {wall:7.2f} s {mib / wall:8.1f} MiB/s {grown[0]:8.0f} MiB   {outcome}")


def run(mib: int) -> None:
    env = {**os.environ, "KERNEL_ENV_TOKEN": TOKEN}
    args = ["-m", "kernel_env", "serve", "--host", "127.0.0.1", "--port", "0", "--pool-size", "2"]
    log = Path(tempfile.mkstemp(prefix="bench-e2b-transfer-", suffix=".log")[1])
    data = payload(mib)
    digest = hashlib.sha256(data).hexdigest()
    try:
        with serving([sys.executable, *args], log, env=env) as server:
            sandbox = Sandbox.create(api_url=server.url, sandbox_url=server.url, api_key=TOKEN)
            try:
                load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
                print(f"{mib} MiB, server pid {server.pid}, load average {load}")
                print(f"{'transfer':<26} {'wall':>9} {'throughput':>14} {'peak RSS +':>12}")

                def upload(name: str, body: object) -> Callable[[], None]:
                    def go() -> None:
                        sandbox.files.write(f"/home/user/{name}", body, request_timeout=600)  # type: ignore[arg-type]
                        # /home/user is the kernel's home: its own path for the file is ~/name.
                        got = sandbox.run_code(HASH.format(path=f"~/{name}"), timeout=600).text
                        assert got is not None and got.strip("'") == digest, "the file differs"

                    return go

                measure("upload, octet-stream", server.pid, mib, upload("a.bin", io.BytesIO(data)))
                measure("upload, multipart", server.pid, mib, upload("b.bin", data))
                sandbox.run_code(MAKE.format(path="~/c.bin", mib=mib), timeout=600)

                def download() -> None:
                    got = hashlib.sha256()
                    stream = sandbox.files.read(
                        "/home/user/c.bin", format="stream", request_timeout=600
                    )
                    for piece in stream:
                        got.update(piece)
                    assert got.hexdigest() == digest, "the file that came down differs"

                measure("download, stream", server.pid, mib, download)
            finally:
                sandbox.kill()
    finally:
        log.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=150, help="the file's size (MiB)")
    run(parser.parse_args().mib)


if __name__ == "__main__":
    main()
