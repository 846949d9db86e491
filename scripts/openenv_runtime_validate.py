"""``openenv validate``'s runtime graders (the ``openenv`` package, 0.10) against a running
``kernel-env serve``, for where its Docker provider cannot build the image.

    VENV/bin/python scripts/openenv_runtime_validate.py PACKAGE_ROOT SERVER_URL

Run by a Python with ``openenv`` 0.10 installed (tests/test_openenv_validate.py makes one).
openenv's own runner (``run_validation``) reads the manifest and the runtime plan and runs
every grader up to the semantic level; only its provider differs: instead of building the
package's Dockerfile and starting the image, it hands the runner the server at SERVER_URL. It
declares no network-policy capability, so the grader that measures the network from outside
a container is skipped, not claimed. Prints the report as JSON; exits 1 when a check FAILs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from openenv.validation.report import write_report
from openenv.validation.runner import run_validation
from openenv.validation.types import ProviderCapability, Verdict

IMAGE = "sha256:" + "0" * 64  # no image: the server is already running


class RunningServer:
    """The running subject openenv's runner talks to: the server, which the caller owns."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def inspect(self) -> dict[str, str]:
        return {"base_url": self.base_url}

    def logs(self, max_bytes: int = 0) -> str:
        return ""

    def stop(self) -> None:
        return None


class ServerProvider:
    """openenv's validation provider protocol over a server that is already running.

    ``build`` builds nothing (the runner requires the ``image_build`` capability before it
    starts a subject); ``no-network`` is accepted as the manifest's declaration, which the
    image's sandbox enforces and this provider does not measure (no ``network_policy``)."""

    name = "kernel-env-serve"
    capabilities = frozenset({ProviderCapability.IMAGE_BUILD})
    supported_network_modes = frozenset({"public", "no-network"})

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def build(self, root: Path, execution: object) -> str:
        return IMAGE

    def start(self, spec: object) -> RunningServer:
        return RunningServer(self.base_url)


def main(root: str, base_url: str) -> int:
    report = run_validation(Path(root), provider=ServerProvider(base_url))
    print(write_report(report))
    return 1 if report.verdict is Verdict.FAIL else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
