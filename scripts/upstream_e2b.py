"""E2B's own test suites against ``kernel-env serve``: ``scripts/upstream_suites.py e2b``.

    python scripts/upstream_suites.py e2b CODE_INTERPRETER_CHECKOUT E2B_CHECKOUT \\
        [--sdk-python PYTHON ...]

Starts one ``kernel-env serve`` (this Python's, on loopback, with every kernel ``make kernels``
installed) and runs, under each ``--sdk-python`` (a venv with an ``e2b`` and
``e2b-code-interpreter`` release and pytest; this Python by default), the suites that need a
sandbox: e2b-dev/code-interpreter's ``python/tests`` and e2b-dev/E2B's
``packages/python-sdk/tests/sync`` and ``tests/async``, configured only by the SDK's settings
(``E2B_API_URL``, ``E2B_SANDBOX_URL``, ``E2B_API_KEY``). The installed SDK is tested, not the
checkout's copy of it (``python -P``: the working directory is not on the path).

Each failed test is put in a category by ``KNOWN`` below: a difference docs/e2b.md documents,
or a test that needs what a local server cannot have (E2B's cloud, template builds, a VM).
A failure no entry explains is printed as ``unexplained``. The output is the table of
docs/e2b.md: per SDK version, per test file, what passed, failed for a documented
difference, needs E2B's cloud, failed unexplained, or was skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

# (suite, the directory pytest runs in, the test paths in it).
SUITES = [
    ("code-interpreter", "python", ["tests"]),
    ("sdk sync", "packages/python-sdk", ["tests/sync"]),
    ("sdk async", "packages/python-sdk", ["tests/async"]),
]
DIFF, CLOUD = "documented difference", "needs E2B's cloud"
# A test of the checkout that this SDK release does not pass against E2B either: it checks the
# SDK's own code, of another release.
STALE = "test of another SDK release"
# Why a failed test fails: (a regex on "file::test", category, reason). The first match wins.
# A DIFF reason names the entry of docs/e2b.md ("The differences", "The supported subset",
# "Refused") that says so.
KNOWN: list[tuple[str, str, str]] = [
    # code-interpreter's python/tests
    (r"env_vars/test_\w+\.py::test_env_vars_(per_execution|overwrite)", DIFF,
     "per-execution envs of run_code are refused"),
    (r"java(?!script)", DIFF, "no Java kernel"),
    (r"contexts\.py::test_list_contexts", DIFF,
     "a language's default context is listed once made (E2B's template starts JavaScript's)"),
    (r"test_(async_)?data\.py::test_data", DIFF, "no DataFrame data result"),
    (r"^charts/", DIFF, "no charts of E2B's own"),
    (r"^images/test_images\.py", DIFF, "no PIL hook"),
    (r"systemd\.py::", CLOUD, "E2B's VM: its systemd restarts the Jupyter server"),
    # E2B's packages/python-sdk tests
    (r"^(sync|async)/template_(sync|async)/", CLOUD, "template builds from Dockerfiles"),
    (r"test_network\.py::test_firewall_transform", CLOUD, "the httpbin template (a build)"),
    (r"test_network\.py::test_allow_public_traffic", CLOUD,
     "E2B's hosts: a sandbox's port at <port>-<id>.e2b.app"),
    (r"test_network\.py::|test_internet_access\.py::", DIFF, "no network in a sandbox"),
    (r"test_host\.py::|test_create\.py::test_auto_resume_wakes_on_http_request", CLOUD,
     "E2B's hosts: a sandbox's port at <port>-<id>.e2b.app"),
    (r"test_config_propagation\.py::test_connect_sets_stable_host_routing_headers", CLOUD,
     "E2B's hosts: the SDK's sandbox URL is https://sandbox.e2b.app"),
    (r"files/test_metadata\.py::", DIFF, "no file metadata"),
    (r"files/test_watch\.py::", DIFF, "directory watches are refused"),
    (r"/pty/", DIFF, "PTYs are refused"),
    (r"test_metrics\.py::", DIFF, "per-sandbox metrics are refused"),
    (r"test_snapshot_api\.py::", DIFF, "snapshots to remote storage are refused"),
    (r"test_snapshot_filesystem_only\.py::|test_create\.py::test_auto_pause_filesystem_only",
     DIFF, "pause keeps the kernel (a filesystem-only pause keeps the memory too)"),
    (r"test_fork\.py::test_fork$", DIFF, "a fork by replay re-runs the cells, not file writes"),
    (r"test_env_vars\.py::test_bash_command_scoped_env_vars", DIFF,
     "commands run as the kernel's uid, never root (no sudo)"),
    (r"test_sandbox_killed_during_run\.py::", DIFF,
     "a sandbox killed under a command ends its stream with `unavailable` (2.35 and 2.51"
     " word it as a likely timeout)"),
    (r"test_connect\.py::test_connect_normalizes_unset_tokens", STALE,
     "mocks the v1 connect call this SDK no longer makes, so its placeholder key is sent"),
    (r"^test_execute_timeout\.py::", STALE, "checks the httpx.Timeout a newer SDK builds"),
    (r"test_fork\.py::test_fork_invalid_count", STALE,
     "checks the count a newer SDK checks itself (2.51 sends it; the API's 400 is a"
     " SandboxException)"),
]  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="upstream_suites.py e2b", description=__doc__)
    parser.add_argument(
        "code_interpreter", type=Path, nargs="?", help="e2b-dev/code-interpreter's checkout"
    )
    parser.add_argument("e2b", type=Path, nargs="?", help="e2b-dev/E2B's checkout")
    parser.add_argument("--sdk-python", action="append", help="a venv's python with the SDK")
    parser.add_argument("--keep", type=Path, help="write each run's JUnit XML in this directory")
    parser.add_argument(
        "--report", type=Path, action="append", help="only report the runs --keep wrote there"
    )
    args = parser.parse_args(argv)
    if args.report:
        _report({k: v for kept in args.report for k, v in _load(kept).items()})
        return 0
    if args.code_interpreter is None or args.e2b is None:
        parser.error("the two checkouts are needed, but with --report")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the server stops with the run
    pythons = args.sdk_python or [sys.executable]
    with tempfile.TemporaryDirectory(prefix="upstream-e2b-") as work:
        return run(args.code_interpreter, args.e2b, pythons, args.keep or Path(work))


def run(ci_checkout: Path, sdk_checkout: Path, pythons: list[str], work: Path) -> int:
    checkouts = {"code-interpreter": ci_checkout, "sdk sync": sdk_checkout}
    checkouts["sdk async"] = sdk_checkout
    token = "e2b_" + secrets.token_hex(20)
    results: dict[str, dict[str, dict[str, str]]] = {}
    runs: list[list[str]] = []
    work.mkdir(parents=True, exist_ok=True)
    with _server(token) as url:
        for python in pythons:
            version = _sdk_version(python)
            for suite, cwd, paths in SUITES:
                junit = work / (re.sub(r"\W+", "-", f"{version} {suite}") + ".xml")
                _pytest(python, checkouts[suite] / cwd, paths, junit, url, token, suite)
                results.setdefault(version, {})[suite] = _outcomes(junit)
                runs.append([version, suite, junit.name])
                (work / "runs.json").write_text(json.dumps(runs, indent=1))
    _report(results)
    return 0


def _load(work: Path) -> dict[str, dict[str, dict[str, str]]]:
    results: dict[str, dict[str, dict[str, str]]] = {}
    for version, suite, name in json.loads((work / "runs.json").read_text()):
        results.setdefault(version, {})[suite] = _outcomes(work / name)
    return results


def _sdk_version(python: str) -> str:
    code = (
        "import importlib.metadata as m; print(m.version('e2b'), m.version('e2b_code_interpreter'))"
    )
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    sdk, interpreter = done.stdout.split()
    return f"e2b {sdk} / e2b-code-interpreter {interpreter}"


@contextlib.contextmanager
def _server(token: str) -> Iterator[str]:
    """``kernel-env serve`` of this Python on a free loopback port, with every kernel
    installed here; its log goes to stderr's file, ``upstream-e2b-serve.log`` in the cwd."""
    from kernel_env.languages.catalog import installed_kernels

    kernels = ["python3", *sorted({"ir", "bash", "deno"} & set(installed_kernels()))]
    log = Path("upstream-e2b-serve.log").resolve()
    command = [sys.executable, "-m", "kernel_env", "serve", "--host", "127.0.0.1", "--port",
               "0", "--pool-size", "2", "--max-sessions", "64", "--kernels",
               ",".join(kernels)]  # fmt: skip
    env = {**os.environ, "KERNEL_ENV_TOKEN": token, "KERNEL_ENV_EPISODES": "none"}
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=sink, env=env)
    try:
        url = _wait_for_url(process, log)
        print(f"== kernel-env serve at {url} (kernels {', '.join(kernels)}; log {log})")
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_for_url(process: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        found = re.search(r"serving (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
        if found:
            return found.group(1)
        time.sleep(0.1)
    raise RuntimeError(f"kernel-env serve did not start:\n{log.read_text(errors='replace')}")


def _pytest(
    python: str, cwd: Path, paths: list[str], junit: Path, url: str, token: str, suite: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=token)
    # The suites' own settings but one: no xdist workers (code-interpreter's addopts).
    command = [python, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
               "addopts=--import-mode=importlib", "-o", "junit_family=xunit1", "--junitxml",
               str(junit), *paths]  # fmt: skip
    print(f"== {suite} under {_sdk_version(python)}: {' '.join(command[1:])}", flush=True)
    started = time.monotonic()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    tail = done.stdout.strip().splitlines()[-1:] or [done.stderr[-2000:]]
    print(f"   {tail[0]} ({time.monotonic() - started:.0f} s)", flush=True)


def _outcomes(junit: Path) -> dict[str, str]:
    """Each test's outcome by ``file::name``: passed, skipped or failed."""
    outcomes = {}
    if not junit.exists():
        return outcomes
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        name = f"{path.removeprefix('tests/')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            outcomes[name] = "failed"
        else:
            outcomes[name] = "skipped" if "skipped" in kinds else "passed"
    return outcomes


def classify(name: str) -> tuple[str, str]:
    """The category and reason of a failed test, ``("unexplained", "")`` if none is known."""
    for pattern, category, reason in KNOWN:
        if re.search(pattern, name):
            return category, reason
    return "unexplained", ""


def _report(results: dict[str, dict[str, dict[str, str]]]) -> None:
    columns = ["passed", DIFF, CLOUD, STALE, "unexplained", "skipped"]
    print("\n| SDK | suite | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 2) + "|")
    for version, suites in results.items():
        for suite, outcomes in suites.items():
            counts = Counter(_kind(name, outcome) for name, outcome in outcomes.items())
            print(f"| {version} | {suite} | " + " | ".join(str(counts[c]) for c in columns) + " |")
    print("\n| test file | " + " | ".join(results) + " |")
    print("|---" * (len(results) + 1) + "|")
    files: dict[str, dict[str, Counter[str]]] = defaultdict(lambda: defaultdict(Counter))
    for version, suites in results.items():
        for suite, outcomes in suites.items():
            project = "code-interpreter" if suite == "code-interpreter" else "E2B"
            for name, outcome in outcomes.items():
                path = f"{project} {name.split('::')[0]}"
                files[path][version][_kind(name, outcome)] += 1
    short = {
        "passed": "pass",
        DIFF: "diff",
        CLOUD: "cloud",
        STALE: "stale",
        "unexplained": "FAIL",
        "skipped": "skip",
    }
    for path in sorted(files):
        cells = [
            ", ".join(f"{n} {short[k]}" for k, n in sorted(files[path][v].items())) or "-"
            for v in results
        ]
        print(f"| {path} | " + " | ".join(cells) + " |")
    print("\nfailures by reason:")
    reasons: dict[tuple[str, str], list[str]] = defaultdict(list)
    for version, suites in results.items():
        for outcomes in suites.values():
            for name, outcome in outcomes.items():
                if outcome == "failed":
                    reasons[classify(name)].append(f"{version}: {name}")
    for (category, reason), names in sorted(reasons.items()):
        print(f"- {category}: {reason or '(no entry)'} ({len(names)})")
        for name in names if category == "unexplained" else []:
            print(f"    {name}")


def _kind(name: str, outcome: str) -> str:
    return classify(name)[0] if outcome == "failed" else outcome
