"""The releases kernel_env was tested with (kernel_env/kernel/versions.py) and what it does
with others: the forkserver's fallback is in tests/test_forkserver.py, the tuning's in
tests/test_kernel.py."""

from __future__ import annotations

import pytest

from kernel_env.kernel import versions
from kernel_env.kernel.fork.template import missing_internals

TESTED = {"ipykernel": ((6, 29), (7, 4)), "jupyter_client": ((8, 6), (8, 10))}


@pytest.mark.parametrize(
    ("found", "why"),
    [
        ({"ipykernel": (7, 4, 0), "jupyter_client": (8, 10, 0)}, None),
        ({"ipykernel": (6, 29, 5), "jupyter_client": (8, 6, 0)}, None),
        (
            {"ipykernel": (7, 5, 0), "jupyter_client": (8, 10, 0)},
            "ipykernel 7.5.0 is not a release kernel_env was tested with (6.29 to 7.4)",
        ),
        (
            {"ipykernel": (7, 4), "jupyter_client": (9, 0)},
            "jupyter_client 9.0 is not a release kernel_env was tested with (8.6 to 8.10)",
        ),
        ({"ipykernel": (6, 28, 9), "jupyter_client": (8, 6)}, "ipykernel 6.28.9 is not"),
        ({"ipykernel": None, "jupyter_client": (8, 6)}, "ipykernel is not installed"),
    ],
)
def test_a_release_outside_the_tested_ones_is_named(
    found: dict[str, tuple[int, ...] | None], why: str | None
) -> None:
    """Each package's major.minor must lie in its tested span, both ends included."""
    problem = versions.untested(TESTED, found)
    assert problem == why if why is None else (problem or "").startswith(why)


IPYKERNEL_6 = (versions.installed("ipykernel") or ())[:1] < (7,)


@pytest.mark.skipif(IPYKERNEL_6, reason="make test-lowest: ipykernel 6, tested below")
def test_this_environment_is_one_kernel_env_was_tested_with() -> None:
    """The versions CI installs are tested ones, and this ipykernel has every internal the
    forkserver's template touches."""
    assert versions.untested() is None
    assert missing_internals() is None


@pytest.mark.skipif(not IPYKERNEL_6, reason="ipykernel 7: make test-lowest runs this")
def test_ipykernel_6_is_admitted_but_untested() -> None:
    """pyproject.toml admits ipykernel 6.29, whose kernels start cold and whose forks replay:
    the lowest releases CI installs are named as untested."""
    assert (versions.untested() or "").startswith("ipykernel 6.29")


def test_release_numbers_are_read_leniently() -> None:
    """Pre-releases and local versions keep their leading numbers."""
    assert versions._parse("7.4.0rc1") == (7, 4, 0)
    assert versions._parse("8.10.0+local") == (8, 10, 0)
    assert versions._parse("dev") == ()


def test_the_tuning_is_off_for_an_untested_ipykernel_or_when_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tuning tunes only a tested ipykernel, and KERNEL_ENV_TUNING=off turns it off."""
    from kernel_env.inkernel import tuning

    monkeypatch.delenv(tuning.SWITCH, raising=False)
    assert tuning.enabled() == (versions.untested() is None)
    monkeypatch.setitem(versions.TESTED, "ipykernel", ((0, 0), (99, 0)))  # 6.29 too
    assert tuning.enabled()
    monkeypatch.setenv(tuning.SWITCH, "off")
    assert not tuning.enabled()
    monkeypatch.delenv(tuning.SWITCH)
    monkeypatch.setitem(versions.TESTED, "ipykernel", ((99, 0), (99, 1)))
    assert not tuning.enabled()
