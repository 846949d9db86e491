"""Episodes in R (IRkernel), Bash (bash_kernel) and JavaScript/TypeScript (Deno), against the
real kernels that ``make kernels`` installs, sandboxed where bubblewrap works.

Per language, one episode walks through what an agent does: it reads ``context``, keeps a
variable, gets an error with the language's traceback, asks ``llm_query`` and
``llm_query_batched`` (answered by the host's backend), runs into the step timeout (the next
step still works), and ends with ``FINAL``, scored by the rubric. Its export re-runs offline
in the language's kernel with the recorded answers. Then the sandbox's defense-in-depth
checks, in each language: nothing of the host is writable, no secret file is readable.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

from kernel_env import KernelEnv
from kernel_env.errors import InvalidInput
from kernel_env.kernel.isolation.sandbox import sandbox_problem
from kernel_env.languages.catalog import LANGUAGES, installed_kernels
from kernel_env.notebook import cells_match, recorded_steps
from kernel_env.replay import replay_notebook

pytestmark = pytest.mark.integration

INSTALLED = installed_kernels()
CHECKOUT = Path(__file__).resolve().parent.parent
CONTEXT = "alpha beta gamma"  # 16 chars


@dataclass(frozen=True)
class Case:
    """One language's cells for the same episode."""

    read_context: str  # prints len(context)
    set_var: str  # a variable worth 42
    use_var: str  # shows it
    error: str  # fails with "boom"
    traceback: str  # what the language's traceback shows besides the message
    loop: str  # never ends
    after: str  # prints "after"
    llm: str  # prints llm_query("ping")
    batched: str  # prints llm_query_batched(["a", "b"]) joined with ","
    final: str  # FINAL(42)
    probe: str  # writes into each of DIRS and reads each of SECRETS: prints WROTE/READ lines


R_PROBE = """
for (d in DIRS) {
  f <- file.path(d, ".kernel-env-probe")
  ok <- suppressWarnings(tryCatch(file.create(f, showWarnings = FALSE), error = function(e) FALSE))
  if (isTRUE(ok)) cat("WROTE", d, "\\n")
}
for (p in SECRETS) {
  text <- suppressWarnings(tryCatch(paste(readLines(p), collapse = ""), error = function(e) ""))
  if (nzchar(text)) cat("READ", p, text, "\\n")
}
cat("probed\\n")
"""
BASH_PROBE = """
for d in DIRS; do touch "$d/.kernel-env-probe" 2>/dev/null && echo "WROTE $d"; done
for p in SECRETS; do text=$(cat "$p" 2>/dev/null) && [ -n "$text" ] && echo "READ $p $text"; done
echo probed
"""
DENO_PROBE = """
for (const d of DIRS) {
  try { Deno.writeTextFileSync(`${d}/.kernel-env-probe`, "x"); console.log("WROTE", d); } catch {}
}
for (const p of SECRETS) {
  try { const t = Deno.readTextFileSync(p); if (t) console.log("READ", p, t); } catch {}
}
console.log("probed");
"""

CASES = {
    "ir": Case(
        read_context="cat(nchar(context))",
        set_var="x <- 1:10",
        use_var="sum(x)",
        error='f <- function() stop("boom"); f()',
        traceback="Traceback",
        loop="repeat {}",
        after='cat("after")',
        llm='cat(llm_query("ping"))',
        batched='cat(llm_query_batched(c("a", "b")), sep = ",")',
        final="FINAL(42)",
        probe=R_PROBE,
    ),
    "bash": Case(
        read_context="echo ${#context}",
        set_var="x=7",
        use_var="echo $((x * 6))",
        error="ls /no-such-dir-boom",
        traceback="No such file or directory",
        loop="while true; do :; done",
        after="echo after",
        llm="llm_query ping",
        batched="llm_query_batched a b | paste -sd,",
        final="FINAL 42",
        probe=BASH_PROBE,
    ),
    "deno": Case(
        read_context="console.log(context.length)",
        set_var="const a: number = 6 * 7",
        use_var="a",
        error='function f(): never { throw new Error("boom"); }\nf()',
        traceback="at f",
        loop="while (true) {}",
        after='console.log("after")',
        llm='console.log(llm_query("ping"))',
        batched='console.log(llm_query_batched(["a", "b"]).join(","))',
        final="FINAL(42)",
        probe=DENO_PROBE,
    ),
}
SHOWN = {"ir": "55", "bash": "42", "deno": "42"}


def _needs(name: str) -> None:
    if name not in INSTALLED:
        message = f"no {name!r} kernelspec: run `make kernels`"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs them: a missing kernel is a failure there
        pytest.skip(message)


def _text(result: Any) -> str:
    return result.stdout + result.stderr


def _shown(result: Any) -> str:
    """What a step printed and displayed, as text."""
    plain = [str((o.get("data") or {}).get("text/plain", "")) for o in result.outputs]
    return result.stdout + "".join(plain)


def _probe(name: str, dirs: list[str], secrets: list[str]) -> str:
    """The language's cell that tries to write into ``dirs`` and read ``secrets``."""
    if name == "ir":
        quoted = ["c(" + ", ".join(json.dumps(x) for x in xs) + ")" for xs in (dirs, secrets)]
    elif name == "bash":
        quoted = [" ".join(shlex.quote(x) for x in xs) for xs in (dirs, secrets)]
    else:
        quoted = [json.dumps(xs) for xs in (dirs, secrets)]
    return CASES[name].probe.replace("DIRS", quoted[0]).replace("SECRETS", quoted[1])


@pytest.fixture
def secret_file(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A secret a ``*_FILE`` variable of the host names, readable by every uid (0644), where
    the sandbox hides nothing else (/var/tmp)."""
    secret = Path("/var/tmp") / f"kernel-env-language-secret-{os.getpid()}"
    secret.write_text("language-SECRET")
    secret.chmod(0o644)
    monkeypatch.setenv("KERNEL_ENV_TOKEN_FILE", str(secret))
    try:
        yield secret
    finally:
        secret.unlink()


def _landed(directory: str) -> bool:
    """Whether a kernel's probe file is in ``directory`` on the host. A directory this uid
    cannot search (/root, for an unprivileged user) holds none: the kernels run as this uid
    or one with fewer rights, so none of them could have written there either."""
    try:
        return (Path(directory) / ".kernel-env-probe").exists()
    except PermissionError:
        return False


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_episode_in_each_language(name: str, tmp_path: Path, secret_file: Path) -> None:
    """Context, a variable, a traceback, llm_query (single and batched), a timeout after
    which the next step works, FINAL with the rubric's reward; the export re-runs offline.
    In the sandbox (defense in depth, per language): the kernel writes nowhere on the host
    (the checkout, /etc, /usr, /var/tmp, /root, a temporary directory of the host) and reads
    neither a file a ``*_FILE`` variable of the host names nor /etc/shadow."""
    _needs(name)
    case = CASES[name]
    prompts: list[str] = []

    def answer(prompt: str) -> str:
        prompts.append(prompt)
        return f"echo:{prompt}"

    # Where a write would land on the host; /root and the host's /tmp (tmp_path) are behind
    # the sandbox's own empty tmpfs, where a write lands in the sandbox and vanishes with it.
    dirs = [str(CHECKOUT), "/etc", "/usr", "/var/tmp"]
    with KernelEnv(llm_query_fn=answer, step_timeout=2) as env:
        reset = env.reset(context=CONTEXT, expected_answer="42", kernel_name=name)
        if sandbox_problem() is None:
            masked = ["/root", str(tmp_path)]
            probed = env.run(_probe(name, [*dirs, *masked], [str(secret_file), "/etc/shadow"]))
            assert "probed" in probed.stdout, _text(probed)
            assert "SECRET" not in probed.stdout, probed.stdout
            assert not [d for d in dirs if f"WROTE {d}" in probed.stdout], probed.stdout
            assert not any(_landed(d) for d in [*dirs, *masked])
        assert "FINAL(answer)" in reset.observation.result.stdout
        assert env.run(case.read_context).stdout.strip() == str(len(CONTEXT))
        assert env.run(case.set_var).success
        assert SHOWN[name] in _shown(env.run(case.use_var))
        error = env.run(case.error)
        assert not error.success
        assert "boom" in _text(error) and case.traceback in _text(error), error
        assert env.run(case.llm).stdout.strip() == "echo:ping"
        assert env.run(case.batched).stdout.strip() == "echo:a,echo:b"
        assert prompts == ["ping", "a", "b"]
        loop = env.run(case.loop)
        assert loop.timed_out and not loop.success
        assert env.run(case.after).stdout.strip() == "after"
        final = env.execute(case.final)
        assert final.done and final.reward == 1.0
        assert final.observation.metadata["final_answer"] == "42"
        path = env.export_notebook(tmp_path / "episode.ipynb")

    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == name
    assert nb.metadata["language_info"]["name"].lower() == LANGUAGES[name].language.lower()
    # The re-run is not sandboxed: the sandbox's probe stays out of it.
    nb.cells = [c for c in nb.cells if ".kernel-env-probe" not in c.source]
    rerun = copy.deepcopy(nb)
    NotebookClient(rerun, timeout=60, resources={"metadata": {"path": str(tmp_path)}}).execute()
    # A kernel that may send a cell's output after its idle (Deno's: why kernel_env waits its
    # idle_grace) can lose it in nbclient's re-run, which stops reading at the idle: such a
    # cell may come back empty, never different, and one at least must match.
    late = LANGUAGES[name].idle_grace > 0
    answered = []
    for recorded, actual in zip(recorded_steps(nb), recorded_steps(rerun), strict=True):
        if recorded.source.lstrip().startswith(LANGUAGES[name].comment + " kernel_env:"):
            continue  # the timed-out step, kept as comments
        if "llm_query" in recorded.source:  # answered offline from the recording
            matched = cells_match(recorded.outputs, actual.outputs)
            assert matched or (late and not actual.outputs), recorded.source
            answered.append(matched)
    assert any(answered), answered
    # ... and replays as an episode in the same language (`kernel-env replay`).
    report = replay_notebook(path, step_timeout=10)
    assert report.final_answer == "42", report.as_dict()
    assert report.counts()["match"] >= 3, report.as_dict()


def test_an_unknown_kernel_name_names_the_available_ones() -> None:
    """A reset naming a kernel that is not installed is refused, with the available names."""
    with KernelEnv() as env, pytest.raises(InvalidInput) as refused:
        env.reset(kernel_name="no-such-kernel")
    assert "'no-such-kernel' is not available" in str(refused.value)
    assert "python3" in str(refused.value)


# The issue's own cells, over /ws: each language's first step, then FINAL(42).
WS_STEPS = {
    "ir": ("x <- 1:10; sum(x)", "55", "FINAL(42)"),
    "bash": ("echo $((6*7))", "42", "FINAL 42"),
    "deno": ("const a: number = 6*7; a", "42", "FINAL(42)"),
}


def test_over_ws_and_http_each_language_ends_with_the_rubrics_reward() -> None:
    """A server started with ``kernels=python3,ir,bash,deno``: /metadata lists them; over
    /ws a reset with ``kernel_name`` runs the language's cell and ``FINAL(42)`` ends the
    episode with reward 1.0 against ``expected_answer`` 42; over HTTP too; an unknown name is
    a VALIDATION_ERROR that names the available kernels."""
    import httpx
    from serverkit import small_settings, thread_server

    for name in WS_STEPS:
        _needs(name)
    settings = small_settings(kernels=("python3", *WS_STEPS), pool_size=0)
    with thread_server(settings) as url:
        described = httpx.get(f"{url}/metadata", timeout=60).json()["kernel_names"]
        assert sorted(described["available"]) == sorted(["python3", *WS_STEPS])
        assert described["available"]["ir"]["helpers"][:2] == ["context", "task_prompt"]
        for name, (code, shown, final) in WS_STEPS.items():
            with KernelEnv(base_url=url) as env:
                env.reset(kernel_name=name, expected_answer="42")
                assert shown in _shown(env.run(code)), name
                result = env.execute(final)
                assert result.done and result.reward == 1.0, (name, result)
        with httpx.Client(base_url=url, timeout=60) as http:
            reset = http.post("/reset", json={"kernel_name": "bash", "expected_answer": "42"})
            assert reset.status_code == 200, reset.text
            session = {"X-Session-Id": reset.headers["X-Session-Id"]}
            step = http.post("/step", json={"action": {"code": "FINAL 42"}}, headers=session)
            assert step.json()["done"] is True and step.json()["reward"] == 1.0, step.text
            refused = http.post("/reset", json={"kernel_name": "cobol"})
            assert refused.status_code == 422, refused.text
            assert "available: bash, deno, ir, python3" in refused.text
        with KernelEnv(base_url=url) as env, pytest.raises(InvalidInput) as over_ws:
            env.reset(kernel_name="cobol")
        assert over_ws.value.code == "VALIDATION_ERROR"  # type: ignore[attr-defined]
        assert "available: bash, deno, ir, python3" in str(over_ws.value)


def test_on_an_unprivileged_server_each_language_writes_nothing_and_reads_no_secret() -> None:
    """The same defense-in-depth checks on a server run by an ordinary uid (its kernels then
    run as that uid, mapped to nobody): the server's token file (0400, the server's own,
    named by ``KERNEL_ENV_TOKEN_FILE``) and the rest stay out of every language's reach."""
    import unprivileged

    if unprivileged.problem() is not None:
        pytest.skip(str(unprivileged.problem()))
    for name in WS_STEPS:
        _needs(name)
    kernelspecs = str(Path(sys.prefix) / "share" / "jupyter")
    with unprivileged.fresh_user() as user:
        secrets_dir = Path(f"/run/secrets/kernel-env-languages-{os.getpid()}")
        secrets_dir.mkdir(parents=True)
        token = secrets_dir / "token"
        token.write_text("language-token-SECRET")
        token.chmod(0o400)
        os.chown(token, user[0], user[0])
        env = {"KERNEL_ENV_TOKEN_FILE": str(token), "JUPYTER_PATH": kernelspecs}
        args = ("--kernels", ",".join(["python3", *WS_STEPS]), "--pool-size", "0")
        dirs = [str(CHECKOUT), "/etc", "/usr", "/var/tmp", str(user[1])]
        try:
            with unprivileged.serve_unprivileged(*args, env=env, user=user) as served:
                for name in WS_STEPS:
                    with KernelEnv(base_url=served.url, token="language-token-SECRET") as remote:
                        remote.reset(kernel_name=name)
                        probed = remote.run(_probe(name, dirs, [str(token), "/etc/shadow"]))
                    assert "probed" in probed.stdout, (name, _text(probed))
                    assert "WROTE" not in probed.stdout, (name, probed.stdout)
                    assert "SECRET" not in probed.stdout, (name, probed.stdout)
        finally:
            token.unlink()
            secrets_dir.rmdir()
        assert not any(_landed(d) for d in dirs)


# 6 GB in Uint8Arrays of 512 MiB, never touched: no page is resident, so the test costs the
# host nothing, yet each is a writable private mapping that a bound on memory must refuse.
DENO_ARRAYS = """
const held: Uint8Array[] = [];
try {
  while (held.length * 512 < 6144) held.push(new Uint8Array(512 * 1024 * 1024));
  console.log(`allocated ${held.length * 512} MiB`);
} catch (e) {
  console.log(`refused after ${held.length * 512} MiB: ${e}`);
}
"""


def _deno_limits(server_pid: int) -> dict[str, str]:
    """The deno process under ``server_pid``: its ``/proc/<pid>/limits``, by name."""
    from procs import comm, descendants

    deno = next(pid for pid in descendants(server_pid) if comm(pid) == "deno")
    lines = Path(f"/proc/{deno}/limits").read_text().splitlines()[1:]
    return {line[:26].strip(): line[26:47].strip() for line in lines}


@pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox: {sandbox_problem()}")
@pytest.mark.parametrize("who", ["root", "unprivileged"])
def test_a_deno_kernel_has_the_memory_bound_health_states(who: str) -> None:
    """A Deno cell asks for 6 GB of ArrayBuffers: refused at 4 GiB, on a root server (its
    memory cgroup) and on an unprivileged one, which has no cgroup and where V8's reserved
    address space rules out RLIMIT_AS: RLIMIT_DATA bounds it. ``/health`` states the bound
    the deno process really has (its ``/proc/<pid>/limits``), not Python's."""
    import unprivileged
    from serverkit import serve_process

    _needs("deno")
    args = ("--kernels", "python3,deno", "--pool-size", "0")
    env = {"JUPYTER_PATH": str(Path(sys.prefix) / "share" / "jupyter")}
    if who == "root":
        serving = serve_process(*args, env={**os.environ, **env})
    else:
        if unprivileged.problem() is not None:
            pytest.skip(str(unprivileged.problem()))
        serving = unprivileged.serve_unprivileged(*args, env=env)
    with serving as served, KernelEnv(base_url=served.url) as remote:
        import httpx

        kernels = httpx.get(f"{served.url}/health").json()["kernels"]
        remote.reset(kernel_name="deno")
        said = remote.run(DENO_ARRAYS).stdout
        limits = _deno_limits(served.pid)
    assert said.startswith("refused after ") and "MiB" in said, said
    assert int(said.split()[2]) < 4096, said
    assert limits["Max data size"] == str(4 * 1024**3), limits
    assert limits["Max address space"] == str(1024**4), limits
    memory = kernels["memory (deno)"]
    assert "4 GiB of writable memory per process (RLIMIT_DATA)" in memory, kernels
    assert "1024 GiB of address space per process" in memory, kernels
    assert "1024 GiB" not in kernels["memory"], kernels  # Python's: 4 GiB of address space
