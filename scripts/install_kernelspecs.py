"""Register the kernelspecs of kernel_env's other languages in this virtualenv (make kernels).

Each one goes to ``<sys.prefix>/share/jupyter/kernels/<name>``, where this environment's
jupyter_client finds it: ``bash`` (bash_kernel from PyPI, run through kernel_env's subclass,
which has the helpers), ``deno`` (the binary of the ``deno`` package on PyPI) and ``ir``
(IRkernel: Debian's r-base-core and r-cran-irkernel). A kernel whose program is missing is
skipped, with what to install. Idempotent.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

KERNELS = Path(sys.prefix) / "share" / "jupyter" / "kernels"
BASH_KERNEL = [sys.executable, "-m", "kernel_env.inkernel.bash_kernel"]


def _write(name: str, spec: dict[str, object]) -> None:
    target = KERNELS / name / "kernel.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(spec, indent=1) + "\n"
    if not target.exists() or target.read_text() != text:
        target.write_text(text)
    print(f"kernelspec {name!r}: {target}")


def bash() -> str | None:
    if importlib.util.find_spec("bash_kernel") is None:
        return "pip install bash_kernel"
    _write(
        "bash",
        {
            # kernel_env's bash_kernel: the helpers, so that exported episodes re-run here.
            "argv": [*BASH_KERNEL, "-f", "{connection_file}"],
            "display_name": "Bash",
            "language": "bash",
        },
    )
    return None


def deno() -> str | None:
    program = shutil.which("deno", path=str(Path(sys.executable).parent))
    if program is None:
        return "pip install deno"
    _write(
        "deno",
        {
            "argv": [program, "jupyter", "--kernel", "--conn", "{connection_file}"],
            "display_name": "Deno",
            "language": "typescript",
        },
    )
    return None


def ir() -> str | None:
    program = shutil.which("R")
    if program is None:
        return "apt-get install r-base-core r-cran-irkernel"
    check = [program, "--slave", "-e", "invisible(packageVersion('IRkernel'))"]
    if subprocess.run(check, capture_output=True, check=False).returncode != 0:
        return "apt-get install r-cran-irkernel"
    _write(
        "ir",
        {
            "argv": [program, "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"],
            "display_name": "R",
            "language": "R",
        },
    )
    return None


def main() -> int:
    missing = {name: install() for name, install in (("bash", bash), ("deno", deno), ("ir", ir))}
    for name, how in missing.items():
        if how is not None:
            print(f"kernelspec {name!r} not registered: {how}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
