"""P4: the same cells on kernel_env and on smolagents' LocalPythonExecutor, side by side.

OpenEnv's repl_env runs agent code in smolagents' ``LocalPythonExecutor``, an interpreter that
walks the code's AST in Python; kernel_env runs it in a real IPython kernel. This script runs
the same cells on both, as steps of one episode each, and prints the medians and the ratios:

    .venv/bin/python benchmarks/bench_compare.py                  # print the table
    .venv/bin/python benchmarks/bench_compare.py --write-readme   # also rewrite the P4 section
                                                                  # of benchmarks/README.md and
                                                                  # benchmarks/compare.png

kernel_env runs through its public client, ``KernelEnv()`` with a local kernel: once with the
default backend (the bubblewrap sandbox where it works) and once with
``local_source(sandbox="none")``. smolagents runs as repl_env sets it up (its ``PythonExecutor``:
the same authorized imports, helpers sent with ``send_tools``, ``answer`` and ``context`` sent
with ``send_variables``, smolagents' default time limit, and the step's bookkeeping), in a child
process that is killed when one run exceeds ``--cap`` seconds. For reference, the same code also
runs by plain ``exec`` in this process: CPython's own time, with no kernel and no protocol.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import math
import multiprocessing
import os
import platform
import random
import re
import statistics
import tempfile
import textwrap
import time
import traceback
from contextlib import ExitStack
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
CHART = HERE / "compare.png"
TIMES = "\N{MULTIPLICATION SIGN}"
HEADING = "## P4 — kernel_env vs smolagents' LocalPythonExecutor"

# repl_env's PythonExecutor: the imports it authorizes by default (numpy is not among them)
REPL_ENV_IMPORTS = [
    "re",
    "json",
    "math",
    "random",
    "collections",
    "itertools",
    "functools",
    "operator",
    "string",
    "textwrap",
    "difflib",
    "statistics",
    "decimal",
    "fractions",
    "datetime",
    "copy",
    "pprint",
    "typing",
    "dataclasses",
    "enum",
    "bisect",
    "heapq",
    "array",
    "struct",
    "base64",
    "hashlib",
    "hmac",
    "uuid",
]
REPL_ENV_MAX_OUTPUT = 8192
WORKER_SETUP_TIMEOUT = 180.0


# --- the cells ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One cell, run as is on both systems."""

    label: str
    code: str
    short: str  # the chart's x label
    smol_imports: tuple[str, ...] = ()  # authorized on top of repl_env's for this row
    target: bool = False  # one of P4's two cells: kernel_env must be >= 50x faster


_MATRIX = "import numpy as np\na = np.arange(10**6, dtype=np.float64).reshape(1000, 1000) / 10**6\n"
TARGET_RATIO = 50.0


def make_cells(context_mb: float) -> list[Cell]:
    """The cells, labelled with the context's size."""
    mb = f"{context_mb:g} MB context"
    return [
        Cell("trivial: `1 + 1`", "1 + 1", "1 + 1"),
        Cell(
            "10⁶-iteration loop",
            "total = 0\nfor i in range(10**6):\n    total += i\ntotal",
            "10⁶ loop",
            target=True,
        ),
        Cell(
            f'count lines with "needle", {mb}',
            'sum(1 for line in context.splitlines() if "needle" in line)',
            "line count",
            target=True,
        ),
        Cell(
            f"`len(re.findall(...))`, {mb}",
            'import re\nlen(re.findall(r"needle\\d+", context))',
            "re.findall",
        ),
        Cell(
            "numpy `np.dot` 1000x1000 + sum, repl_env's imports",
            _MATRIX + "float(np.dot(a, a).sum())",
            "np.dot\n(stock)",
        ),
        Cell(
            "numpy `np.dot` 1000x1000 + sum, numpy authorized",
            _MATRIX + "float(np.dot(a, a).sum())",
            "np.dot\n(+numpy)",
            ("numpy",),
        ),
        Cell(
            "numpy `a @ a` 1000x1000 + sum, numpy authorized",
            _MATRIX + "float((a @ a).sum())",
            "a @ a\n(+numpy)",
            ("numpy",),
        ),
    ]


def make_context(megabytes: float, every: int = 997) -> str:
    """Deterministic text of ~``megabytes`` MB: numbered lines, one in ``every`` has a needle."""
    words = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit"]
    rng = random.Random(0)
    filler = [" ".join(rng.choices(words, k=11)) for _ in range(1000)]
    lines, size, i = [], 0, 0
    while size < megabytes * 1_000_000:
        line = f"{i:07d} {filler[i % 1000]}" + (f" needle{i}" if i % every == 0 else "")
        lines.append(line)
        size += len(line) + 1
        i += 1
    return "\n".join(lines)


# --- one measured cell -------------------------------------------------------------------------


@dataclass
class Measurement:
    """Wall-clock times of the runs of one cell on one system, and how it ended."""

    times: list[float] = field(default_factory=list)
    answer: str | None = None
    error: str | None = None  # the cell fails there (e.g. an import not allowed)
    over: float | None = None  # a run went past this many seconds and was stopped

    @property
    def done(self) -> bool:
        """No more runs: the cell failed or was stopped."""
        return self.error is not None or self.over is not None

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times and not self.over else None

    def text(self) -> str:
        if self.over:
            return f"> {self.over:g} s"
        if self.error:
            return "not supported"
        return _seconds(self.median) if self.median is not None else "n/a"


def _seconds(value: float) -> str:
    if value < 1:
        return f"{value * 1000:.3g} ms"
    return f"{value:.3g} s"


def short_error(text: str | None) -> str:
    """The gist of an error: its last line, past smolagents' "due to: ", first sentence."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    gist = lines[-1].rsplit("due to: ", 1)[-1] if lines else "error"
    return re.split(r"(?<=\.) ", gist, maxsplit=1)[0][:200]


# --- kernel_env --------------------------------------------------------------------------------


def open_episode(stack: ExitStack, source: Any, context: str, cap: float) -> Any:
    """A local episode on ``source`` with ``context`` loaded, its first (slower) step done."""
    from kernel_env import KernelEnv

    env = stack.enter_context(KernelEnv(kernel_source=source, step_timeout=cap))
    env.reset(context=context, task_prompt="P4 benchmark", max_iterations=10_000)
    env.execute("pass")
    return env


def kernel_step(env: Any, code: str, m: Measurement, cap: float) -> None:
    """Run ``code`` once as a step of ``env``'s episode; record it in ``m``."""
    t0 = time.perf_counter()
    result = env.execute(code).observation.result
    elapsed = time.perf_counter() - t0
    if result.timed_out:
        m.over = cap
    elif not result.success:
        m.error = short_error(result.exception or result.stderr)
    else:
        m.times.append(elapsed)
        m.answer = result.stdout.strip()


# --- the reference: CPython itself ------------------------------------------------------------


class PlainExec:
    """The cells run by ``exec`` in this process, a last bare expression evaluated: what CPython
    itself takes with no kernel and no protocol, the floor for any backend running real Python."""

    def __init__(self, context: str) -> None:
        self.namespace: dict[str, Any] = {"__name__": "__main__", "context": context}

    def step(self, code: str, m: Measurement) -> None:
        """Run ``code`` once; record it in ``m``."""
        t0 = time.perf_counter()
        try:
            tree = ast.parse(code)
            last = tree.body[-1]
            if isinstance(last, ast.Expr):
                tree.body.pop()
            exec(compile(tree, "<cell>", "exec"), self.namespace)
            if isinstance(last, ast.Expr):
                value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), self.namespace)
                m.answer = repr(value)
        except Exception as exc:
            m.error = short_error(f"{type(exc).__name__}: {exc}")
            return
        m.times.append(time.perf_counter() - t0)


# --- smolagents, as repl_env runs it -----------------------------------------------------------


class ReplEnvExecutor:
    """smolagents' LocalPythonExecutor set up and stepped the way repl_env's PythonExecutor and
    REPLEnvironment do it, so that its per-step bookkeeping is timed too."""

    def __init__(self, context: str, extra_imports: tuple[str, ...], timeout: float | None):
        from smolagents import LocalPythonExecutor
        from smolagents.local_python_executor import MAX_EXECUTION_TIME_SECONDS

        options = {} if timeout is None else {"timeout_seconds": timeout or None}
        self.timeout = MAX_EXECUTION_TIME_SECONDS if timeout is None else timeout
        self.executor = LocalPythonExecutor(
            additional_authorized_imports=REPL_ENV_IMPORTS + list(extra_imports), **options
        )
        self.executor.send_tools(
            {
                "format_exc": traceback.format_exc,
                "safe_json_dumps": lambda obj: json.dumps(obj, default=repr),
                "FINAL": lambda value: f"FINAL({value})",
                "FINAL_VAR": lambda name: f"FINAL_VAR({name})",
            }
        )
        self.executor.send_variables({"answer": {"content": "", "ready": False}})
        self.executor.send_variables({"context": context})

    def step(self, code: str) -> tuple[str, BaseException | None]:
        """Run ``code``; return the step's stdout and the exception it raised, if any."""
        before = set(self.executor.state)
        parts, error = [], None
        try:
            out = self.executor(code)
            parts.append(out.logs)
            if out.output is not None:
                try:
                    parts.append(json.dumps(out.output))
                except (TypeError, ValueError):
                    parts.append(repr(out.output))
        except Exception as exc:  # repl_env: any failure -> stderr
            error = exc
        state = self.executor.state
        self.snapshot = {  # repl_env reports the new variables' reprs with each step
            key: repr(state[key])[:500] for key in set(state) - before if not key.startswith("_")
        }
        stdout = "\n".join(p for p in parts if p)[:REPL_ENV_MAX_OUTPUT]
        self.final = re.search(r"FINAL\((.*?)\)", stdout, re.DOTALL)  # its final-answer check
        return stdout, error


def _smolagents_worker(
    conn: Any, context_path: str, imports: tuple[str, ...], timeout: float | None
) -> None:
    """Child process: one repl_env-style executor; runs each code it receives, reports it."""
    from smolagents.local_python_executor import ExecutionTimeoutError

    executor = ReplEnvExecutor(Path(context_path).read_text(), imports, timeout)
    executor.step("pass")
    conn.send(("ready",))
    while True:
        code = conn.recv()
        t0 = time.perf_counter()
        stdout, error = executor.step(code)
        elapsed = time.perf_counter() - t0
        if isinstance(error, ExecutionTimeoutError):
            conn.send(("timeout", executor.timeout))
            return
        conn.send(("run", elapsed, stdout, None if error is None else short_error(str(error))))


class SmolagentsRunner:
    """An executor in a child process (a fresh one per cell), killed when a run exceeds ``cap``
    seconds: smolagents' own time limit leaves its thread running, and CPU is shared here."""

    def __init__(
        self, context_path: str, imports: tuple[str, ...], cap: float, timeout: float | None
    ) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.cap = cap
        self.conn, theirs = spawn.Pipe()
        self.worker = spawn.Process(
            target=_smolagents_worker, daemon=True, args=(theirs, context_path, imports, timeout)
        )
        self.failure: str | None = None

    def __enter__(self) -> SmolagentsRunner:
        self.worker.start()
        if not self.conn.poll(WORKER_SETUP_TIMEOUT):
            self.failure = "the executor did not start"
        else:
            self.conn.recv()
        return self

    def __exit__(self, *exc: object) -> None:
        self.worker.kill()
        self.worker.join()

    def step(self, code: str, m: Measurement) -> None:
        """Run ``code`` once in the executor; record it in ``m``."""
        if self.failure:
            m.error = self.failure
            return
        try:
            self.conn.send(code)
            if not self.conn.poll(self.cap):
                m.over = self.cap
                return
            message = self.conn.recv()
        except (EOFError, OSError):
            m.error = self.failure = "the executor process died"
            return
        if message[0] == "timeout":
            m.over = message[1]
            return
        _, elapsed, stdout, error = message
        if error is not None:
            m.error = error
        else:
            m.times.append(elapsed)
            m.answer = stdout.strip()


# --- the report --------------------------------------------------------------------------------


@dataclass
class Row:
    """One cell's results: kernel_env per backend, CPython's ``exec``, and smolagents."""

    cell: Cell
    kernel: dict[str, Measurement]
    plain: Measurement = field(default_factory=Measurement)
    smol: Measurement = field(default_factory=Measurement)

    def systems(self) -> list[tuple[str, Measurement]]:
        """(name, measurement) of every system, smolagents last."""
        return [
            *((f"kernel_env ({b})", m) for b, m in self.kernel.items()),
            ("CPython `exec`", self.plain),
            ("smolagents", self.smol),
        ]


def ratio(kernel: Measurement, smol: Measurement) -> tuple[float | None, str]:
    """How many times faster kernel_env is: (value, text); a lower bound when smol was stopped."""
    if kernel.median is None:
        return None, "—"
    if smol.over:
        value = smol.over / kernel.median
        return value, f"> {value:,.0f}{TIMES}"
    if smol.median is None:
        return None, "—"
    value = smol.median / kernel.median
    digits = ".2g" if value < 1 else ".1f" if value < 10 else ",.0f"
    return value, f"{value:{digits}}{TIMES}"


def same_answer(row: Row) -> str:
    """Whether every system that ran the cell printed the same value (floats to 1e-9)."""
    answers = [m.answer for _, m in row.systems() if m.answer is not None]
    if row.smol.answer is None or len(answers) < 2:
        return "—"
    try:
        first = float(answers[0])
        same = all(math.isclose(float(a), first, rel_tol=1e-9) for a in answers)
    except ValueError:
        same = len(set(answers)) == 1
    return "yes" if same else "NO: " + " / ".join(answers)


def table(rows: list[Row]) -> str:
    """A Markdown table of the rows."""
    backends = list(rows[0].kernel)
    head = [
        "cell",
        *[f"kernel_env ({b})" for b in backends],
        "CPython `exec`",
        "smolagents",
        *[f"{TIMES} faster ({b})" for b in backends],
        "same answer",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [
            row.cell.label,
            *[m.text() for _, m in row.systems()],
            *[ratio(m, row.smol)[1] for m in row.kernel.values()],
            same_answer(row),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(rows: list[Row]) -> list[str]:
    """Why a cell failed on a system, and the verdict on the P4 target."""
    out = [
        f"{row.cell.label}, on {name}: `{m.error}`"
        for row in rows
        for name, m in row.systems()
        if m.error
    ]
    for backend in rows[0].kernel:
        verdicts = []
        for row in rows:
            if row.cell.target:
                value, text = ratio(row.kernel[backend], row.smol)
                met = value is not None and value >= TARGET_RATIO
                verdicts.append(f"{row.cell.label} {text} ({'met' if met else 'NOT met'})")
        out.append(
            f"P4 target ≥ {TARGET_RATIO:g}{TIMES}, kernel_env ({backend}): " + "; ".join(verdicts)
        )
    return out


def machine(context_mb: float, repeats: int) -> str:
    """One line naming the machine and the software measured."""
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    load = Path("/proc/loadavg").read_text().split()[0]
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem_kib / 2**20:.0f} GiB; Python "
        f"{platform.python_version()}; smolagents {version('smolagents')}, kernel_env "
        f"{version('kernel-env')}, numpy {version('numpy')}; {datetime.date.today()}; "
        f"load average {load} at start (shared machine); {context_mb:g} MB context; "
        f"median of {repeats} runs per cell"
    )


def chart(rows: list[Row], path: Path) -> None:
    """Log-scale time bars per cell, one bar per system; stopped runs hatched, failures marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = [name for name, _ in rows[0].systems()]
    names[-2:] = ["CPython exec (reference)", "smolagents LocalPythonExecutor, as repl_env runs it"]
    colors = [f"C{i}" for i in range(len(names) - 2)] + ["0.6", "C2"]
    values = [v for r in rows for _, m in r.systems() if (v := m.over or m.median)]
    floor = 10 ** math.floor(math.log10(min(values) / 2))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(11, 5.5))
    for x, row in enumerate(rows):
        for i, (_, m) in enumerate(row.systems()):
            pos, value = x + (i - (len(names) - 1) / 2) * width, m.over or m.median
            if value is None:
                ax.text(
                    pos,
                    floor * 1.5,
                    "not supported",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    rotation=90,
                    color=colors[i],
                )
                continue
            ax.bar(pos, value, width, color=colors[i], hatch="//" if m.over else None)
            if m.over:
                ax.text(pos, value * 1.1, f"> {m.over:g} s", ha="center", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(floor, max(values) * 4)
    ax.set_ylabel("seconds per step (median, log scale)")
    ax.set_xticks(range(len(rows)), [r.cell.short for r in rows], fontsize=8)
    ax.set_title("The same cell as one step: kernel_env vs smolagents' LocalPythonExecutor")
    handles = [Patch(color=color, label=name) for color, name in zip(colors, names, strict=True)]
    if any(m.over for r in rows for _, m in r.systems()):
        handles.append(
            Patch(facecolor="white", edgecolor="black", hatch="//", label="stopped at the limit")
        )
    ax.legend(handles=handles, fontsize=8, loc="upper left", ncol=2)
    ax.grid(axis="y", which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _wrap(text: str, first: str = "", rest: str = "") -> str:
    return textwrap.fill(
        " ".join(text.split()),
        width=100,
        break_on_hyphens=False,
        initial_indent=first,
        subsequent_indent=rest,
    )


def section(rows: list[Row], about: str, limit: str) -> str:
    """The README section: how to run, what is measured, the machine, the table, the chart."""
    method = _wrap(f"""
        The same cells run as the steps of one episode on each system, run by run in turn (so a
        busy moment of the shared machine hits every system alike). kernel_env: the public client,
        `KernelEnv()` with a local kernel, with the default backend (`local_source()`: the
        bubblewrap sandbox where it works) and with `local_source(sandbox="none")`. smolagents:
        `LocalPythonExecutor` set up as OpenEnv's repl_env sets it up (its `PythonExecutor`:
        repl_env's authorized imports, its helpers sent with `send_tools`, `answer` and `context`
        sent with `send_variables`, {limit}) and stepped with repl_env's per-step bookkeeping, in
        a child process that is killed if one run exceeds the cap. For reference, "CPython
        `exec`" is the same code run by `exec` in the measuring process: no kernel, no protocol.
        Times are wall-clock medians of one step as the caller sees it. The cells are the same
        code everywhere; the "numpy authorized" rows add `numpy` to smolagents' imports, which
        stock repl_env does not allow.
        """)
    reading = _wrap("""
        How to read it: where a cell's work is Python bytecode (the loop; the generator over
        the context's lines) smolagents walks the AST node by node while kernel_env runs CPython's
        bytecode, so kernel_env's ratio is about CPython `exec`'s at best; where the work is in C
        (`re`, numpy, `str.splitlines`) all run the same C code and the step's fixed cost
        decides. That fixed cost is a kernel round trip for kernel_env (a few ms) and a function
        call for smolagents, which runs in the caller's process.
        """)
    verdicts = "\n".join(_wrap(line, "- ", "  ") for line in notes(rows))
    return f"""{HEADING}

```
.venv/bin/python benchmarks/bench_compare.py                 # prints the table, ~3 min
.venv/bin/python benchmarks/bench_compare.py --write-readme  # + this section, compare.png
```

{method}

{_wrap(f"Machine: {about}.")}

{table(rows)}

{verdicts}

{reading}

![kernel_env vs smolagents, seconds per step, log scale](compare.png)
"""


def limit_text(timeout: float | None) -> str:
    """How smolagents' own time limit was set, for the README."""
    if timeout is None:
        from smolagents.local_python_executor import MAX_EXECUTION_TIME_SECONDS

        return f"smolagents' default {MAX_EXECUTION_TIME_SECONDS} s time limit, as repl_env has it"
    return f"a {timeout:g} s time limit" if timeout else "no time limit of its own"


def write_readme(text: str, readme: Path = README) -> None:
    """Replace the P4 section of ``readme`` (up to the next ``## `` heading), or append it."""
    lines = readme.read_text().splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == HEADING), None)
    if start is None:
        body = "".join(lines).rstrip("\n") + "\n\n" + text
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        rest = "".join(lines[end:])
        body = "".join(lines[:start]) + text + ("\n" + rest if rest else "")
    readme.write_text(body)


# --- main --------------------------------------------------------------------------------------


def backends_to_measure() -> dict[str, Any]:
    """The default local backend and the unsandboxed one (just one when they are the same)."""
    from kernel_env.kernel.factory import local_source
    from kernel_env.kernel.isolation.sandbox import sandbox_problem

    problem = sandbox_problem()
    if problem is not None:
        print(f"sandbox unavailable ({problem}): the default backend is the plain one")
        return {"no sandbox": local_source(sandbox="none")}
    return {"bwrap sandbox": local_source(), "no sandbox": local_source(sandbox="none")}


def measure_cell(
    cell: Cell,
    envs: dict[str, Any],
    plain: PlainExec,
    context_path: str,
    repeats: int,
    cap: float,
    timeout: float | None,
) -> Row:
    """``repeats`` runs of ``cell``, each on every system in turn."""
    row = Row(cell, {name: Measurement() for name in envs})
    with SmolagentsRunner(context_path, cell.smol_imports, cap, timeout) as smol:
        for _ in range(repeats):
            for name, env in envs.items():
                if not row.kernel[name].done:
                    kernel_step(env, cell.code, row.kernel[name], cap)
            if not row.plain.done:
                plain.step(cell.code, row.plain)
            if not row.smol.done:
                smol.step(cell.code, row.smol)
    return row


def measure(
    cells: list[Cell],
    backends: dict[str, Any],
    context: str,
    repeats: int,
    cap: float,
    timeout: float | None,
) -> list[Row]:
    """Every cell on every system: one episode per kernel_env backend, one executor per cell."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        context_path = Path(tmp, "context.txt")
        context_path.write_text(context)
        envs = {name: open_episode(stack, src, context, cap) for name, src in backends.items()}
        plain = PlainExec(context)
        for cell in cells:
            t0 = time.perf_counter()
            row = measure_cell(cell, envs, plain, str(context_path), repeats, cap, timeout)
            rows.append(row)
            timings = ", ".join(f"{name} {m.text()}" for name, m in row.systems())
            print(f"{cell.label}: {timings} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per cell (median reported)")
    parser.add_argument("--context-mb", type=float, default=50.0)
    parser.add_argument(
        "--cap", type=float, default=120.0, help="seconds one run may take before it is stopped"
    )
    parser.add_argument(
        "--executor-timeout",
        type=float,
        default=None,
        help="smolagents' own limit in seconds (default: its default, as "
        "repl_env uses it; 0 = none)",
    )
    parser.add_argument(
        "--write-readme",
        action="store_true",
        help=f"write the P4 section of {README.name} and {CHART.name}",
    )
    args = parser.parse_args()

    about = machine(args.context_mb, args.repeats)
    print(about)
    context = make_context(args.context_mb)
    print(f"context: {len(context):,} characters, {context.count('needle'):,} needles")
    cells = make_cells(args.context_mb)
    rows = measure(
        cells, backends_to_measure(), context, args.repeats, args.cap, args.executor_timeout
    )
    print()
    print(table(rows))
    print()
    print("\n".join(notes(rows)))
    if args.write_readme:
        chart(rows, CHART)
        write_readme(section(rows, about, limit_text(args.executor_timeout)))
        print(f"wrote {CHART} and the P4 section of {README}")


if __name__ == "__main__":
    main()
