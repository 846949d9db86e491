"""The package's public surface stays curated and importable."""

from __future__ import annotations

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
