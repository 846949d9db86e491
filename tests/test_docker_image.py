"""The Docker image: scripts/docker-smoke.sh end to end, and the wheel its build stage makes.

The smoke script builds the image with no network, serves it, runs episodes in it through the
remote client, builds the kernel image for Enterprise Gateway on top of it and runs
tests/test_gateway_docker.py against that, and removes everything it made; it exits 77 with a
"SKIP:" line where Docker itself cannot run, and the test then skips with that reason. As root
on a machine without Docker it installs docker.io and debootstrap and starts a dockerd of its
own, so it is the slowest test (5-10 minutes); KERNEL_ENV_TEST_DOCKER=0 skips it. The
wheel test does what the image's first stage does (wheel, fresh virtualenv, install) without
Docker, and then runs an episode from the installed package with the source tree out of sight.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # kernels, servers or other processes

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "scripts" / "docker-smoke.sh"
SKIP_STATUS = 77
SMOKE_TIMEOUT = 1800  # debootstrap, docker.io, wheels and the build on a busy 2-core machine
DOCKER_OFF = os.environ.get("KERNEL_ENV_TEST_DOCKER") == "0"

EPISODE = """\
import kernel_env
from kernel_env import KernelEnv
print(kernel_env.__file__)
with KernelEnv() as env:
    env.reset(context="Hello World")
    print(env.execute("len(context)").observation.result.stdout.strip())
"""


def run_bounded(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run ``command`` in its own process group; past ``timeout`` the group gets SIGTERM (the
    smoke script's trap then removes what it made) and, a minute later, SIGKILL."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, **kwargs,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"{command[-1]} ran past {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def skip_reason(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("SKIP: ")]
    assert lines, f"exit status {SKIP_STATUS} without a SKIP: line:\n{stderr[-2000:]}"
    return lines[-1].removeprefix("SKIP: ")


@pytest.mark.slow
@pytest.mark.timeout(SMOKE_TIMEOUT + 120)
@pytest.mark.skipif(DOCKER_OFF, reason="the Docker smoke is switched off: KERNEL_ENV_TEST_DOCKER=0")
def test_image_builds_offline_and_serves_episodes() -> None:
    # The smoke script's client needs this Python (kernel_env installed), not any PYTHON of
    # the environment (make's own setting of the interpreter that makes the venv).
    env = {**os.environ, "PYTHON": sys.executable}
    result = run_bounded(["bash", str(SMOKE)], SMOKE_TIMEOUT, env=env)
    if result.returncode == SKIP_STATUS:
        pytest.skip(f"Docker cannot run here: {skip_reason(result.stderr)}")
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"docker-smoke.sh exited {result.returncode}:\n{log[-4000:]}"
    # Each part announces itself; a script that skipped one would not print its line.
    assert "built offline" in log
    assert "episode ok:" in log and "kernel uid 65534" in log  # the sandboxed container
    assert "from_docker_image ok:" in log
    assert "e2b ok:" in log  # E2B's SDK against the default container (the e2b extra)
    assert "languages ok: bash, deno:" in log  # the KERNELS build argument's kernels
    assert "image facts:" in log
    # Kernels in containers through Enterprise Gateway: tests/test_gateway_docker.py ran,
    # against the kernel image built offline on top of this one, and none of it skipped.
    assert "kernel image" in log and "built offline" in log
    ran = re.search(r"Enterprise Gateway, kernels in containers: (\d+) passed", log)
    assert ran and int(ran.group(1)) >= 2, log[-3000:]
    # The default container: the server as root, the kernel as a uid of its own.
    uids = [int(u) for u in re.findall(r"episode ok: .*?kernel uid (\d+)", log)]
    assert any(uid not in (0, 65534) for uid in uids), uids


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_installs_into_a_fresh_venv_and_runs(tmp_path: Path) -> None:
    """The image's build stage, without Docker: a wheel of this tree, installed with its
    dependencies into a new virtualenv, runs `kernel-env` and an episode away from the tree."""
    dist, venv = tmp_path / "dist", tmp_path / "venv"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    built = run_bounded([*pip, "wheel", "--no-deps", "--wheel-dir", str(dist), str(ROOT)], 120)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = dist.glob("kernel_env-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"kernel_env/inkernel/extension.py", "kernel_env/inkernel/shims/bash.sh"} <= set(names)
    assert not [name for name in names if name.startswith(("tests/", "scripts/", "deploy/"))]

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    installed = run_bounded(
        [*pip, "--python", str(python), "install", "--no-compile", str(wheel)], 240
    )
    assert installed.returncode == 0, installed.stderr[-2000:]

    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    cli = subprocess.run(
        [str(venv / "bin" / "kernel-env"), "--help"],
        capture_output=True, text=True, cwd=tmp_path, env=clean_env, timeout=60,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert "serve" in cli.stdout
    episode = subprocess.run(
        [str(python), "-c", EPISODE],
        capture_output=True, text=True, cwd=tmp_path, env=clean_env, timeout=120,
    )  # fmt: skip
    assert episode.returncode == 0, episode.stderr[-2000:]
    module_file, answer = episode.stdout.split()[-2:]
    assert Path(module_file).is_relative_to(venv), module_file
    assert answer == "11"
