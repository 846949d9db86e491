"""The package's public surface stays curated and importable."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import kernel_env


def test_all_is_sorted_and_resolvable() -> None:
    """Every name in __all__ resolves, and __all__ is sorted."""
    assert kernel_env.__all__ == sorted(kernel_env.__all__)
    for name in kernel_env.__all__:
        assert getattr(kernel_env, name) is not None


@pytest.mark.integration
def test_import_is_light() -> None:
    """Importing kernel_env loads neither pydantic nor jupyter_client (kernels start faster)."""
    code = (
        "import sys, kernel_env\n"
        "print(sorted(m for m in ('pydantic', 'jupyter_client') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.integration
def test_local_episodes_do_not_load_the_gateway_backend() -> None:
    """The environment, the client and the kernel factory load neither httpx nor websockets
    (the gateway backend's and the model client's): they load when first used."""
    code = (
        "import sys, kernel_env.environment, kernel_env.client, kernel_env.kernel.factory\n"
        "print(sorted(m for m in ('httpx', 'websockets', 'kernel_env.kernel.gateway')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.integration
def test_the_cli_help_loads_neither_the_server_nor_jupyter_client() -> None:
    """``kernel-env --help`` (and the parsing every command starts with) loads neither
    FastAPI nor jupyter_client."""
    code = (
        "import contextlib, io, sys\n"
        "from kernel_env import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    cli.main(['--help'])\n"
        "print(sorted(m for m in ('fastapi', 'jupyter_client') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_clients_reset_keywords_are_the_reset_options() -> None:
    """reset()'s keywords on the client are exactly ResetOptions' fields: one vocabulary."""
    from kernel_env.models import ResetOptions

    parameters = inspect.signature(kernel_env.AsyncKernelEnv.reset).parameters
    keywords = [n for n, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keywords == list(ResetOptions.model_fields)
