"""tests/test_e2b.py under each older E2B SDK release of tests/e2b_sdks.txt, in that release's
own venv (``.venv-e2b-<version>``, made by ``make e2b-sdks``); this venv's pins are run by
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


def _venv_python(sdk: str) -> Path:
    python = ROOT / f".venv-e2b-{sdk}" / "bin" / "python"
    if not (python.parent.parent / ".installed").exists():
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


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("sdk", "interpreter"), SDKS, ids=[f"e2b-{s}" for s, _ in SDKS])
def test_e2b_tests_pass_under_an_older_sdk(sdk: str, interpreter: str, tmp_path: Path) -> None:
    """Every test of tests/test_e2b.py passes with this SDK release, or is skipped for what
    the release lacks (its reason names the version)."""
    python = _venv_python(sdk)
    assert _installed(python) == [sdk, interpreter]
    junit = tmp_path / "junit.xml"
    # The kernelspecs `make kernels` registered in this venv (R, Bash, Deno contexts).
    specs = [str(Path(sys.prefix) / "share" / "jupyter"), os.environ.get("JUPYTER_PATH", "")]
    env = {
        **os.environ,
        "KERNEL_ENV_TEST_SERVER_PYTHON": sys.executable,
        "JUPYTER_PATH": os.pathsep.join(filter(None, specs)),
    }
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["--junitxml", str(junit), "tests/test_e2b.py"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    cases = list(ET.parse(junit).getroot().iter("testcase"))
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
