"""Run DSPy's and rlm's own test suites with kernel_env substituted, and say which tests fail
only because of the substitution.

    python scripts/upstream_suites.py dspy DSPY_CHECKOUT [--local-tests FILE]
    python scripts/upstream_suites.py rlm RLM_CHECKOUT
    python scripts/upstream_suites.py dspy-interpreters DSPY_INTERPRETERS_CHECKOUT
    python scripts/upstream_suites.py e2b CODE_INTERPRETER_CHECKOUT E2B_CHECKOUT [--sdk-python PY]

``dspy``: the interpreter tests of a DSPy checkout (its ``tests/``: ``test_python_interpreter``,
``test_code_interpreter``, the interpreter callbacks, RLM, CodeAct, ProgramOfThought and Flex
interpreter tests, and ``--local-tests``, ``LocalInterpreter``'s tests, where the checkout
lacks them) run twice against the installed ``dspy``: every name ``PythonInterpreter`` and
``LocalInterpreter`` the tests use is bound to DSPy's own ``LocalInterpreter`` (the reference:
real CPython, no Deno needed), then to kernel_env's ``KernelInterpreter``. Deno-marked tests
are included (``--deno``): with either substitute they need no Deno.

``rlm``: rlm's tests of its RLM loop (those that run ``RLM(...)`` with ``environment="local"``,
patched clients, no network) run twice: as written, then with ``environment="kernel_env"``.

``dspy-interpreters``: the black-box conformance suites of the ``dspy-interpreters`` project
(``check_interpreter``, ``check_execution_instructions``, ``check_rlm``,
``check_rlm_execution_instructions``, ``check_flex_facade``; imported from the checkout's
``src/``), for DSPy's ``LocalInterpreter`` and for ``KernelInterpreter``.

``e2b``: E2B's own suites against ``kernel-env serve`` (scripts/upstream_e2b.py).

``dspy`` and ``rlm`` print each run's counts and the tests that pass in the reference run and
fail in kernel_env's. Not part of ``make test`` (minutes, and the checkouts are not in this repo);
the counts are in docs/dspy.md, docs/rlm.md and docs/e2b.md.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

DSPY_TESTS = [
    "primitives/test_python_interpreter.py",
    "primitives/test_code_interpreter.py",
    "primitives/test_local_interpreter.py",
    "callback/test_interpreter_callback.py",
    "predict/test_rlm.py",
    "predict/test_code_act.py",
    "predict/test_program_of_thought.py",
    "flex/test_flex_interpreter.py",
]
# The tests that run rlm's RLM loop (RLM(...) with its default environment, "local").
RLM_TESTS = [
    "test_multi_turn_integration.py",
    "test_subcall.py",
    "test_depth_metadata.py",
    "test_e2e_depth.py",
]

# Bound in each collected test module and in ``dspy``: the interpreter under test.
DSPY_PLUGIN = """
import sys

import dspy
import pytest

if "{mode}" == "kernel":
    from kernel_env.integrations.dspy import KernelInterpreter as Substitute
else:
    from dspy.primitives.local_interpreter import LocalInterpreter as Substitute

NAMES = ("PythonInterpreter", "LocalInterpreter")


def pytest_configure(config):
    for name in NAMES:
        setattr(dspy, name, Substitute)


def pytest_collection_modifyitems(config, items):
    for module in {{item.module for item in items if getattr(item, "module", None)}}:
        for name in NAMES:
            if name in vars(module):
                setattr(module, name, Substitute)
"""

# rlm's environments by name: "local" (what the tests ask for) becomes "kernel_env".
RLM_PLUGIN = """
import kernel_env.integrations.rlm as adapter
import rlm.core.rlm
import rlm.environments

_known = rlm.environments.get_environment


def get_environment(environment, environment_kwargs):
    if environment == "local":
        environment_kwargs = {{**environment_kwargs, "sandbox": "none"}}
        return adapter.KernelREPL(**environment_kwargs)
    return _known(environment, environment_kwargs)


if "{mode}" == "kernel":
    rlm.environments.get_environment = get_environment
    rlm.core.rlm.get_environment = get_environment
"""


def main() -> int:
    if sys.argv[1:2] == ["e2b"]:
        import upstream_e2b  # scripts/, beside this file

        return upstream_e2b.main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=["dspy", "rlm", "dspy-interpreters", "e2b"])
    parser.add_argument("checkout", type=Path, help="the project's checkout (its tests/)")
    parser.add_argument("--local-tests", type=Path, help="DSPy's test_local_interpreter.py")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    if args.suite == "dspy-interpreters":
        return _conformance(args.checkout)
    work = Path(tempfile.mkdtemp(prefix=f"upstream-{args.suite}-"))
    try:
        tests = _copy_tests(args, work)
        results = {}
        for mode in ("reference", "kernel"):
            results[mode] = _run(args.suite, mode, work, tests)
        _report(results)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


CONFORMANCE = """
from dspy.primitives.local_interpreter import LocalInterpreter
from dspy_interpreters import (
    check_execution_instructions,
    check_flex_facade,
    check_interpreter,
    check_rlm,
    check_rlm_execution_instructions,
)

from kernel_env.integrations.dspy import KernelInterpreter

suites = (
    check_interpreter,
    check_execution_instructions,
    check_rlm,
    check_rlm_execution_instructions,
    check_flex_facade,
)
for factory in (LocalInterpreter, KernelInterpreter):
    for suite in suites:
        results = suite(factory).to_dict().get("results", [])
        failed = [r.get("check_id") for r in results if not r.get("passed")]
        passed = len(results) - len(failed)
        print(f"{factory.__name__} {suite.__name__}: {passed}/{len(results)} passed {failed or ''}")
"""


def _conformance(checkout: Path) -> int:
    import os

    env = dict(os.environ, PYTHONPATH=str(checkout / "src"))
    with tempfile.TemporaryDirectory() as cwd:  # nothing in the cwd shadows a module
        return subprocess.run([sys.executable, "-c", CONFORMANCE], cwd=cwd, env=env).returncode


def _copy_tests(args: argparse.Namespace, work: Path) -> list[str]:
    source = args.checkout / "tests"
    shutil.copytree(source, work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    if args.local_tests is not None:
        shutil.copy(args.local_tests, work / "tests/primitives/test_local_interpreter.py")
    wanted = DSPY_TESTS if args.suite == "dspy" else RLM_TESTS
    return [f"tests/{name}" for name in wanted if (work / "tests" / name).exists()]


def _run(suite: str, mode: str, work: Path, tests: list[str]) -> dict[str, str]:
    plugin = DSPY_PLUGIN if suite == "dspy" else RLM_PLUGIN
    (work / f"substitute_{mode}.py").write_text(textwrap.dedent(plugin.format(mode=mode)))
    junit = work / f"{mode}.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        f"substitute_{mode}",
        "-p",
        "no:cacheprovider",
    ]
    command += ["--junitxml", str(junit), "-o", "addopts=", "--timeout", "120", *tests]
    if suite == "dspy":
        command.append("--deno")
    print(f"== {suite}, {mode}: {' '.join(command[1:])}", flush=True)
    done = subprocess.run(command, cwd=work, capture_output=True, text=True, env=_env(work))
    print(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:])
    return _outcomes(junit)


def _env(work: Path) -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(work), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _outcomes(junit: Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            outcomes[name] = "failed"
        elif "skipped" in kinds:
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "passed"
    return outcomes


def _report(results: dict[str, dict[str, str]]) -> None:
    for mode, outcomes in results.items():
        counts = {
            kind: list(outcomes.values()).count(kind) for kind in ("passed", "failed", "skipped")
        }
        passed, failed, skipped = counts["passed"], counts["failed"], counts["skipped"]
        print(f"{mode}: {passed} passed, {failed} failed, {skipped} skipped")
    reference, kernel = results["reference"], results["kernel"]
    only = sorted(
        name
        for name, outcome in kernel.items()
        if outcome == "failed" and reference.get(name) == "passed"
    )
    print(f"fail only with kernel_env: {len(only)}")
    for name in only:
        print(f"  {name}")


if __name__ == "__main__":
    sys.exit(main())
