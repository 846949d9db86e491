"""Gateway benchmarks P8 and P9 of docs/acceptance.md, local and gateway side by side in one run.

    python benchmarks/bench_gateway.py            # ~1-2 minutes on 2 cores
    python benchmarks/bench_gateway.py --quick    # fewer samples, for a smoke run

P8  trivial step (`x = 1`) through KernelEnvironment: local backend, gateway backend with our
    client-side TCP_QUICKACK fix, without it (the 40 ms delayed-ACK stall), and without it
    against a second gateway running deploy/gateway/kg_nodelay.py (the gateway-side fix); and
    an Enterprise Gateway (3.3.0, its own venv) with and without the client fix;
    interleaved in rounds so that drift on a noisy machine hits all alike; also an llm_query
    round trip (the kernel asks the host over the stdin channel).
P9  reset with a 100 MB context (staged as a file; via the gateway, sent in 8 MiB binary
    chunks), next to a reset with an empty context (kernel start + setup) on the same backend.

Real `jupyter kernelgateway` and Enterprise Gateway processes run on free loopback ports
(tests/gateway.py starts them).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from gateway import EnterpriseGatewayProcess, GatewayProcess  # tests/gateway.py

from kernel_env.environment import EnvConfig, KernelEnvironment
from kernel_env.kernel import GatewayConfig
from kernel_env.kernel.factory import gateway_source, local_source
from kernel_env.models import REPLAction

ROOT = Path(__file__).resolve().parent.parent
MB = 1_000_000


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f} ms"


async def timed_steps(env: KernelEnvironment, code: str, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        obs = await env.step(REPLAction(code=code))
        samples.append(time.perf_counter() - t0)
        if not obs.result.success:
            raise RuntimeError(f"{code!r} failed: {obs.result.stderr}")
    return samples


async def p8(sources: dict[str, Callable], rounds: int, per_round: int) -> None:
    envs = {}
    for name, source in sources.items():
        env = KernelEnvironment(
            EnvConfig(step_timeout=30), kernel_source=source, llm_query_fn=lambda p: p
        )
        await env.reset(max_iterations=100_000)
        await timed_steps(env, "x = 1", 20)  # warm up
        envs[name] = env
    steps: dict[str, list[float]] = {name: [] for name in envs}
    llm: dict[str, list[float]] = {name: [] for name in envs}
    for _ in range(rounds):
        for name, env in envs.items():
            steps[name] += await timed_steps(env, "x = 1", per_round)
            llm[name] += await timed_steps(env, "llm_query('q')", max(per_round // 5, 2))
    print(f"P8  trivial step `x = 1` ({rounds} rounds x {per_round}, interleaved):")
    local = statistics.median(steps["local"])
    for name, samples in steps.items():
        p50, llm_p50 = statistics.median(samples), statistics.median(llm[name])
        print(
            f"    {name:22} p10 {ms(pct(samples, 0.1))}  p50 {ms(p50)}  p90 {ms(pct(samples, 0.9))}"
            f"  = {p50 / local:4.2f} x local   (llm_query step p50 {ms(llm_p50)})"
        )
    print("    target: gateway p50 <= 2 x local")
    for env in envs.values():
        await env.close()


async def p9(sources: dict[str, Callable], size: int, repeat: int) -> None:
    context = ("0123456789abcdef" * (size // 16 + 1))[:size]
    print(f"P9  reset with a {size / MB:.0f} MB context vs an empty one (median of {repeat}):")
    for name, source in sources.items():
        env = KernelEnvironment(EnvConfig(step_timeout=30), kernel_source=source)
        empty, full = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            await env.reset()
            empty.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await env.reset(context=context)
            full.append(time.perf_counter() - t0)
            obs = await env.step(REPLAction(code="len(context)"))
            if obs.result.stdout.strip() != str(size):
                raise RuntimeError(f"context arrived with length {obs.result.stdout!r}")
        await env.close()
        e, f = statistics.median(empty), statistics.median(full)
        print(
            f"    {name:22} reset, empty context {ms(e)}   with {size / MB:.0f} MB {ms(f)}"
            f"   (context costs {ms(f - e)})"
        )
    print("    target: <= 2 s local, <= 5 s via the gateway")


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        gw = GatewayProcess(Path(tmp) / "plain")
        nodelay = GatewayProcess(
            Path(tmp) / "nodelay",
            "--KernelGatewayApp.kernel_websocket_connection_class="
            "kg_nodelay.NoDelayWebsocketConnection",
        )
        nodelay.env["PYTHONPATH"] = str(ROOT / "deploy" / "gateway")
        enterprise = EnterpriseGatewayProcess(Path(tmp) / "enterprise")
        try:
            gw.start()
            sources = {
                "local": local_source(),
                "gateway, client fix": gateway_source(GatewayConfig(url=gw.url, token=gw.token)),
                "gateway, no fix": gateway_source(
                    GatewayConfig(url=gw.url, token=gw.token, quickack=False)
                ),
            }
            if not args.skip_p8:
                nodelay.start()
                enterprise.start()
                eg = GatewayConfig(url=enterprise.url, token=enterprise.token)
                p8_sources = sources | {
                    "gateway, gateway fix": gateway_source(
                        GatewayConfig(url=nodelay.url, token=nodelay.token, quickack=False)
                    ),
                    "EG, client fix": gateway_source(eg),
                    "EG, no fix": gateway_source(dataclasses.replace(eg, quickack=False)),
                }
                rounds, per_round = (3, 20) if args.quick else (10, 40)
                await p8(p8_sources, rounds, per_round)
                nodelay.stop()
                enterprise.stop()
            if not args.skip_p9:
                await p9(sources, args.context_mb * MB, 1 if args.quick else 3)
        finally:
            gw.stop()
            nodelay.stop()
            enterprise.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--context-mb", type=int, default=100)
    parser.add_argument("--skip-p8", action="store_true")
    parser.add_argument("--skip-p9", action="store_true")
    asyncio.run(main(parser.parse_args()))
