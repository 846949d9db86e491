"""``openenv validate`` of the newest ``openenv`` release (0.10) against this package and a
real ``kernel-env serve`` process, and that release's generic client.

``openenv`` 0.10 and ``openenv-core`` 0.3 (the dev venv's, tested by test_openenv_compat.py)
install the same ``openenv`` package, so 0.10 lives in a venv of its own, made on first use
and kept in the user's cache for later runs (tests/venvs.py).

Its Docker provider builds the package's Dockerfile as it is, which needs the base image from
a registry (scripts/docker-smoke.sh builds offline by importing a debootstrapped base and
fetching the wheels outside the build, which the provider cannot do), and measures the
network with a helper image pinned by digest, also from a registry. So ``openenv validate .``
runs with ``--skip-build``, and its runtime and semantic graders run through openenv's own
runner against a live server instead (scripts/openenv_runtime_validate.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from serverkit import ServeProcess, serve_process
from venvs import cached_venv

pytestmark = [
    pytest.mark.integration,  # kernels, servers or other processes
    pytest.mark.slow,
    pytest.mark.timeout(900),  # the first run makes the venv (~2 min)
]

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.10.0"


@pytest.fixture(scope="module")
def openenv_python() -> Path:
    return cached_venv("openenv", [f"openenv=={VERSION}"])


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with serve_process("--pool-size", "2") as process:
        yield process


def _openenv(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(python), "-m", "openenv.cli", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _statuses(report: dict) -> dict[str, str]:
    return {r["check_id"]: r["status"] for r in report["results"]}


def test_validate_package_static_level(openenv_python: Path) -> None:
    """`openenv validate . --skip-build`: the manifest's validation block is schema-valid; no
    check FAILs (the runtime ones SKIP, saying why)."""
    done = _openenv(openenv_python, "validate", ".", "--skip-build", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    statuses = _statuses(report)
    assert statuses["static.manifest"] == "pass"
    assert "fail" not in statuses.values() and "error" not in statuses.values()
    assert report["manifest"]["network"]["mode"] == "no-network"


def test_runtime_graders_against_a_live_server(openenv_python: Path, server: ServeProcess) -> None:
    """openenv's runner, its runtime plan (validation/runtime.json) and graders against the
    server: startup, observation schema, reward and state contracts pass; nothing FAILs."""
    script = ROOT / "scripts" / "openenv_runtime_validate.py"
    done = subprocess.run(
        [str(openenv_python), str(script), str(ROOT), server.url],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    statuses = _statuses(report)
    for check in (
        "static.manifest",
        "runtime.startup",
        "runtime.observation_schema",
        "runtime.reward_well_formed",
        "runtime.state_contract",
    ):
        assert statuses[check] == "pass", (check, report)
    assert "fail" not in statuses.values() and "error" not in statuses.values()
    assert report["levels_run"] == [1, 2]


def test_validate_url_with_the_newest_release(openenv_python: Path, server: ServeProcess) -> None:
    """`openenv validate --url` of 0.10 reports 6/6 criteria passed."""
    done = _openenv(openenv_python, "validate", "--url", server.url, "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 0, report
    assert report["passed"] is True
    assert report["summary"]["passed_count"] == report["summary"]["total_count"] == 6


_GENERIC_EPISODE = """
import json, sys
from openenv.core.generic_client import GenericEnvClient

with GenericEnvClient(base_url=sys.argv[1]).sync() as env:
    reset = env.reset(context="Hello World", task_prompt="Count", expected_answer="11")
    step = env.step({"code": "count = len(context)\\nprint(count)"})
    final = env.step({"code": "print(f'FINAL({count})')"})
    print(json.dumps({
        "reset_done": reset.done,
        "context_length": reset.observation["context_length"],
        "stdout": step.observation["result"]["stdout"],
        "final": [final.done, final.reward, final.observation["metadata"]["final_answer"]],
        "state_final": env.state()["final_answer"],
    }))
"""


def test_the_newest_releases_generic_client_runs_an_episode(
    openenv_python: Path, server: ServeProcess
) -> None:
    """OpenEnv 0.10's GenericEnvClient (its sync wrapper) runs reset -> step -> final answer
    against the server, as openenv-core 0.3's does (tests/test_openenv_compat.py)."""
    done = subprocess.run(
        [str(openenv_python), "-c", _GENERIC_EPISODE, server.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "reset_done": False,
        "context_length": 11,
        "stdout": "11\n",
        "final": [True, 1.0, "11"],
        "state_final": "11",
    }


def test_the_oracle_scores_the_top_reward(server: ServeProcess) -> None:
    """The manifest's oracle (validation/oracle.py) submits the expected answer and gets the
    top of the declared reward range."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "validation" / "oracle.py"), server.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.strip()) == 1.0
