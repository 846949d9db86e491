"""Kernels in Docker containers, started by a real Enterprise Gateway (its DockerProcessProxy),
behind `kernel-env serve --gateway-url`: one episode with llm_query, a timeout, a killed
kernel and an export; the container is the kernel's isolation boundary, and the server's pool
hides the container's start.

It needs a Docker daemon and the kernel image of deploy/gateway/kernel-image/: docker-smoke.sh
builds that image offline and runs this module against it (it names the image and Enterprise
Gateway's launchers in KERNEL_ENV_TEST_EG_KERNEL_IMAGE and KERNEL_ENV_TEST_EG_LAUNCHERS, and
the daemon in DOCKER_HOST). Without them the test skips; test_docker_image.py checks that the
smoke run ran it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nbformat
import pytest
from fake_openai import FakeOpenAI
from gateway import SECRET_VAR, DockerEnterpriseGateway, docker_bridge_gateway
from serverkit import metrics, serve_process, wait_until

from kernel_env import KernelEnv

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IMAGE = os.environ.get("KERNEL_ENV_TEST_EG_KERNEL_IMAGE", "")
LAUNCHERS = os.environ.get("KERNEL_ENV_TEST_EG_LAUNCHERS", "")
LLM_KEY = "sk-docker-kernels-test-key-4f1c"
ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 120.0  # a container start on a loaded 2-core machine with vfs storage

# Runs in the kernel: where it is, as whom, what of the host it sees, and whether it can reach
# the kernel-env server (on the host's loopback) at either of the host's addresses it knows.
PROBE = """\
import json as _j, os as _o, socket as _s
def _reach(host, port):
    try:
        _s.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False
print(_j.dumps({{
    "host": _s.gethostname(),
    "uid": _o.getuid(),
    "pid_1": open("/proc/1/cmdline", "rb").read().split(b"\\0")[0].decode(),
    "environ": dict(_o.environ),
    "sees_repo": _o.path.exists({repo!r}),
    "reaches_server": [h for h in ("127.0.0.1", {bridge!r}) if _reach(h, {port})],
}}))
"""


def _facts(client: KernelEnv, server_url: str) -> dict[str, Any]:
    code = PROBE.format(
        repo=str(ROOT), bridge=docker_bridge_gateway(), port=urlsplit(server_url).port
    )
    result = client.execute(code).observation.result
    assert result.success, result
    facts: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return facts


def _say(fact: str) -> None:
    """A fact for the smoke script's log (never an assertion on a time)."""
    print(f"[gateway-docker] {fact}", flush=True)


@pytest.fixture
def docker_gateway(tmp_path: Path) -> Iterator[DockerEnterpriseGateway]:
    if not (IMAGE and LAUNCHERS):
        pytest.skip("needs the Docker daemon and kernel image of scripts/docker-smoke.sh")
    gw = DockerEnterpriseGateway(tmp_path / "eg", IMAGE, Path(LAUNCHERS))
    gw.start()
    try:
        yield gw
    finally:
        gw.stop()


@pytest.mark.timeout(600)
def test_episode_in_docker_kernels_through_enterprise_gateway(
    docker_gateway: DockerEnterpriseGateway, tmp_path: Path
) -> None:
    """An episode on container kernels through `kernel-env serve --gateway-url`: a warm
    reset, llm_query, a timeout, a killed container, the export; no secret in the log."""
    gw = docker_gateway
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KERNEL_ENV_")},
        "KERNEL_ENV_GATEWAY_TOKEN": gw.token,
        "KERNEL_ENV_LLM_API_KEY": LLM_KEY,
    }
    with FakeOpenAI(lambda request: "forty-two") as llm:
        started = time.monotonic()
        with serve_process(
            "--gateway-url", gw.url, "--gateway-kernel-name", gw.KERNEL_NAME,
            "--pool-size", "1", "--step-timeout", "4",
            "--llm-base-url", llm.url, "--llm-model", "m",
            env=env,
        ) as server:  # fmt: skip
            assert wait_until(lambda: metrics(server.url)["pool_warm"] == 1, START_TIMEOUT)
            _say(f"pool warm (one kernel container) {time.monotonic() - started:.1f} s after start")
            _episode(server.url, gw, llm, tmp_path)
            log = server.log.read_text(errors="replace")
    assert LLM_KEY not in log and gw.token not in log


def _episode(url: str, gw: DockerEnterpriseGateway, llm: FakeOpenAI, tmp_path: Path) -> None:
    with KernelEnv(url) as client:
        t0 = time.perf_counter()
        client.reset(context="Hello World", task_prompt="How long?", expected_answer="11")
        _say(f"reset on a warm container kernel: {time.perf_counter() - t0:.3f} s")
        # The pool hid the container's start: the reset took the warm kernel.
        assert metrics(url)["pool_warm_hits"] == 1

        # The container is the boundary: its own host name (the container's, named by EG
        # after the user and the kernel), its own pid 1, EG's kernel uid, none of the host's
        # files, no secret of the server's or the gateway's, and no way to the server.
        facts = _facts(client, url)
        first = facts["host"]
        assert first.startswith("kernel-env-") and first in gw.containers(), facts["host"]
        assert facts["pid_1"] == "tini" and facts["uid"] == 1000, facts
        assert not facts["sees_repo"] and facts["reaches_server"] == [], facts
        values = "\n".join(facts["environ"].values())
        assert SECRET_VAR not in facts["environ"] and "KERNEL_ENV_TOKEN" not in facts["environ"]
        assert LLM_KEY not in values and gw.token not in values
        assert facts["environ"]["KERNEL_USERNAME"] == "kernel-env"

        # llm_query travels over the stdin channel, through EG, to the server's model.
        said = client.execute("print(llm_query('what is six times seven?'))").observation.result
        assert said.stdout == "forty-two\n", said
        assert "six times seven" in llm.requests[-1].raw

        # A timeout: EG relays the interrupt into the container; the state is kept.
        client.execute("kept = len(context)")
        spun = client.execute("while True: pass").observation.result
        assert spun.timed_out and not spun.kernel_restarted and not spun.state_lost, spun
        assert client.execute("print(kept)").observation.result.stdout == "11\n"

        # The kernel's container killed: the next step says the state was lost, and the
        # episode goes on in a new container with its context and helpers.
        subprocess.run(["docker", "kill", first], check=True, capture_output=True, timeout=60)
        t0 = time.perf_counter()
        lost = client.execute("print('after the kill')").observation.result
        _say(f"killed container noticed and replaced in {time.perf_counter() - t0:.1f} s")
        assert not lost.success and lost.state_lost, lost
        again = _facts(client, url)
        assert again["host"] != first and again["host"].startswith("kernel-env-"), again
        final = client.execute("FINAL(len(context))")
        assert final.done and final.reward == 1.0, final

        # The export: the episode's notebook, every step in it.
        notebook = nbformat.read(client.export_notebook(tmp_path / "episode.ipynb"), 4)
        nbformat.validate(notebook)
        sources = "\n".join(cell.source for cell in notebook.cells)
        for step in ("llm_query(", "while True: pass", "after the kill", "FINAL("):
            assert step in sources, step
    assert wait_until(lambda: first not in gw.containers(), 60), "the killed kernel's container"


def test_the_kernel_image_runs_enterprise_gateways_launcher() -> None:
    """The image's command is EG's bootstrap, which refuses to start without what EG sends
    (a kernel id, a response address, a public key): proof it is the launcher that runs."""
    if not IMAGE:
        pytest.skip("needs the Docker daemon and kernel image of scripts/docker-smoke.sh")
    run = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", IMAGE],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert "KERNEL_ID, RESPONSE_ADDRESS, and PUBLIC_KEY are required" in run.stdout + run.stderr
    probe = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python", IMAGE, "-c",
         "import Cryptodome, kernel_env.inkernel.extension, ipykernel; print('ok')"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert probe.stdout.strip() == "ok", probe.stderr
