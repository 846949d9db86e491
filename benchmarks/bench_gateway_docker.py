"""Kernels in Docker containers through Enterprise Gateway: the container kernel's start, a
reset that takes a warm one from the pool, and the trivial step of P8 beside a local kernel's
and an Enterprise Gateway local-process kernel's.

    DOCKER_SMOKE_BENCH=1 make docker-smoke       # the only way to run it: it needs the
                                                 # daemon and the kernel image the smoke
                                                 # script builds (it runs this script then)

A real Enterprise Gateway 3.3.0 (tests/gateway.py: DockerEnterpriseGateway) starts each kernel
as a container of KERNEL_ENV_TEST_EG_KERNEL_IMAGE on the daemon DOCKER_HOST names.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gateway import DockerEnterpriseGateway, EnterpriseGatewayProcess  # tests/gateway.py

from kernel_env.environment import EnvConfig, KernelEnvironment
from kernel_env.kernel import GatewayConfig, KernelPool
from kernel_env.kernel.base import KernelSource
from kernel_env.kernel.factory import gateway_source, local_source
from kernel_env.models import REPLAction

STARTS = 5
ROUNDS, PER_ROUND = 5, 40


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f} ms"


async def starts(source: KernelSource, n: int) -> list[float]:
    """Seconds from asking for a kernel to its being ready (helpers loaded), ``n`` times."""
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        kernel = await source()
        samples.append(time.perf_counter() - t0)
        await kernel.shutdown()
    return samples


async def warm_resets(source: KernelSource, n: int) -> list[float]:
    """Resets that take a kernel from a warm pool of one (waiting for it to refill between)."""
    pool = KernelPool(source, size=1)
    await pool.start()
    samples = []
    try:
        for _ in range(n):
            while pool.warm < 1:
                await asyncio.sleep(0.05)
            env = KernelEnvironment(EnvConfig(step_timeout=30), kernel_source=pool.acquire)
            t0 = time.perf_counter()
            await env.reset(context="Hello World")
            samples.append(time.perf_counter() - t0)
            await env.close()
    finally:
        await pool.close()
    return samples


async def steps(sources: dict[str, KernelSource]) -> dict[str, list[float]]:
    envs = {}
    for name, source in sources.items():
        env = KernelEnvironment(EnvConfig(step_timeout=30), kernel_source=source)
        await env.reset(max_iterations=100_000)
        envs[name] = env
    samples: dict[str, list[float]] = {name: [] for name in envs}
    for _ in range(ROUNDS):  # interleaved: drift on a noisy machine hits all alike
        for name, env in envs.items():
            for _ in range(PER_ROUND):
                t0 = time.perf_counter()
                obs = await env.step(REPLAction(code="x = 1"))
                samples[name].append(time.perf_counter() - t0)
                if not obs.result.success:
                    raise RuntimeError(obs.result.stderr)
    for env in envs.values():
        await env.close()
    return samples


async def main() -> None:
    image = os.environ["KERNEL_ENV_TEST_EG_KERNEL_IMAGE"]
    launchers = Path(os.environ["KERNEL_ENV_TEST_EG_LAUNCHERS"])
    with tempfile.TemporaryDirectory(prefix="bench-gateway-docker-") as tmp:
        docker = DockerEnterpriseGateway(Path(tmp) / "docker", image, launchers)
        plain = EnterpriseGatewayProcess(Path(tmp) / "plain")
        try:
            docker.start()
            plain.start()
            in_docker = gateway_source(
                GatewayConfig(url=docker.url, token=docker.token, kernel_name=docker.KERNEL_NAME)
            )
            on_eg = gateway_source(
                GatewayConfig(url=plain.url, token=plain.token, kernel_name="kernel_env")
            )
            started = await starts(in_docker, STARTS)
            print(f"container kernel start, median of {STARTS}: "
                  f"{statistics.median(started):.2f} s (min {min(started):.2f}, "
                  f"max {max(started):.2f})")  # fmt: skip
            resets = await warm_resets(in_docker, STARTS)
            print(f"reset on a warm container kernel, median of {STARTS}: "
                  f"{ms(statistics.median(resets))}")  # fmt: skip
            timed = await steps(
                {"local": local_source(), "EG, local process": on_eg, "EG, Docker": in_docker}
            )
            local = statistics.median(timed["local"])
            print(f"trivial step `x = 1` ({ROUNDS} rounds x {PER_ROUND}, interleaved):")
            for name, samples in timed.items():
                p50 = statistics.median(samples)
                print(f"    {name:18} p50 {ms(p50)}  = {p50 / local:4.2f} x local")
        finally:
            docker.stop()
            plain.stop()


if __name__ == "__main__":
    asyncio.run(main())
