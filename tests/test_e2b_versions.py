"""tests/test_e2b.py under each older E2B SDK release of tests/e2b_sdks.txt, in that release's
own venv (``.venv/e2b-sdk-<version>``, made by ``make e2b-sdks``); this venv's pins are run by
tests/test_e2b.py itself. The tests' server runs from this venv
(``KERNEL_ENV_TEST_SERVER_PYTHON``): the older SDKs pin connectrpc and protobuf-py below the
versions E2B's door is built on, so the two cannot share a venv, as a client and a server
need not. What an older SDK cannot do is skipped by the test, with a reason naming its
version; anything else skipped or failed fails here."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
SDKS = [
    tuple(line.split())
    for line in (ROOT / "tests" / "e2b_sdks.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]
# Skipped in every older release's venv, which holds the SDK and not these frameworks: they
# are tested with the dev venv's pins (tests/test_e2b.py).
NOT_INSTALLED = ("could not import 'rlm'", "could not import 'smolagents'")


def _venv(sdk: str) -> Path:
    return Path(sys.prefix) / f"e2b-sdk-{sdk}"  # inside the dev venv (make e2b-sdks)


def _venv_python(sdk: str) -> Path:
    python = _venv(sdk) / "bin" / "python"
    if not (_venv(sdk) / ".installed").exists():
        message = f"no venv for e2b {sdk}: run `make e2b-sdks`"
        if os.environ.get("CI"):
            pytest.fail(message)  # make test makes them: a missing one is a failure there
        pytest.skip(message)
    return python


def _installed(python: Path) -> list[str]:
    code = (
        "import importlib.metadata as m; print(m.version('e2b'), m.version('e2b_code_interpreter'))"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.split()


@dataclass
class Run:
    process: subprocess.Popen[bytes]
    log: Path
    junit: Path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """tests/test_e2b.py started in every release's venv at once: each run mostly waits on
    its sandboxes' timeouts, so together they take about as long as one."""
    work = tmp_path_factory.mktemp("e2b-sdks")
    # The kernelspecs `make kernels` registered in this venv (R, Bash, Deno contexts).
    specs = [str(Path(sys.prefix) / "share" / "jupyter"), os.environ.get("JUPYTER_PATH", "")]
    env = {
        **os.environ,
        "KERNEL_ENV_TEST_SERVER_PYTHON": sys.executable,
        "JUPYTER_PATH": os.pathsep.join(filter(None, specs)),
    }
    started = {}
    for sdk, _ in SDKS:
        python = _venv(sdk) / "bin" / "python"
        if not (_venv(sdk) / ".installed").exists():
            continue
        log, junit = work / f"{sdk}.log", work / f"{sdk}.xml"
        command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += ["--junitxml", str(junit), "tests/test_e2b.py"]
        with open(log, "wb") as sink:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=sink)
        started[sdk] = Run(process, log, junit)
    yield started
    for run in started.values():
        if run.process.poll() is None:
            run.process.kill()
        run.process.wait()


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("sdk", "interpreter"), SDKS, ids=[f"e2b-{s}" for s, _ in SDKS])
def test_e2b_tests_pass_under_an_older_sdk(
    sdk: str, interpreter: str, runs: dict[str, Run]
) -> None:
    """Every test of tests/test_e2b.py passes with this SDK release, or is skipped for what
    the release lacks (its reason names the version)."""
    python = _venv_python(sdk)
    assert _installed(python) == [sdk, interpreter]
    run = runs[sdk]
    returncode = run.process.wait(timeout=850)
    said = run.log.read_text(errors="replace")
    assert returncode == 0, said[-8000:]
    cases = list(ET.parse(run.junit).getroot().iter("testcase"))
    skipped = {
        case.get("name"): (case.find("skipped").get("message") or "")  # type: ignore[union-attr]
        for case in cases
        if case.find("skipped") is not None
    }
    unexplained = {
        name: reason
        for name, reason in skipped.items()
        if f"e2b {sdk}" not in reason and not reason.startswith(NOT_INSTALLED)
    }
    assert cases and not unexplained, unexplained
