"""The client half of scripts/docker-smoke.sh: talks to a kernel-env container from the host.

    python scripts/docker_smoke_client.py health URL [--since T]     wait for GET /health
    python scripts/docker_smoke_client.py episode URL [--sandboxed]  one episode + its notebook
    python scripts/docker_smoke_client.py from-image IMAGE           the same, via from_docker_image
    python scripts/docker_smoke_client.py e2b URL                    a sandbox through E2B's SDK
    python scripts/docker_smoke_client.py languages URL bash,deno    an episode in each kernel

``episode``, ``e2b`` and ``languages`` send the server's bearer token from
``KERNEL_ENV_TOKEN`` when it is set (never on the command line). Each command prints one line
of facts and exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernel_env import KernelEnv

CONTEXT = "Hello World"
NOTEBOOK_TYPE = "application/x-ipynb+json"

# Runs inside the episode's kernel: its uid, the secret-looking variables in its environment,
# how many processes it can see whose environment holds the server's token variable or the
# given secret values, what its pid 1 is (bubblewrap's own PID namespace, or the container's),
# and what it could do to every other kernel it can see: read its connection file or its
# environment, or signal it. One JSON line.
PROBE_CODE = """\
import glob as _glob, json as _json, os as _os
_secrets = [s.encode() for s in {secrets!r}]
def _environ_with_secrets():
    found = 0
    for path in _glob.glob("/proc/[0-9]*/environ"):
        try:
            blob = open(path, "rb").read()
        except OSError:
            continue
        found += b"KERNEL_ENV_TOKEN=" in blob or any(s in blob for s in _secrets)
    return found
def _other_kernels():
    import sys as _sys
    mine = _sys.argv[_sys.argv.index("-f") + 1]
    reached = []
    for path in _glob.glob("/proc/[0-9]*/cmdline"):
        pid = int(path.split("/")[2])
        try:
            argv = open(path, "rb").read().split(b"\\0")
        except OSError:
            continue
        if pid == _os.getpid() or b"ipykernel_launcher" not in b" ".join(argv):
            continue
        connection = argv[argv.index(b"-f") + 1].decode()
        if connection == mine:  # this kernel's own launcher (bubblewrap's init)
            continue
        for what, attempt in [("connection file", lambda: open(connection).read()),
                              ("environ", lambda: open(f"/proc/{{pid}}/environ").read()),
                              ("signal", lambda: _os.kill(pid, 0))]:
            try:
                attempt()
                reached.append(f"{{what}} of {{pid}}")
            except OSError:
                pass
    return reached
print(_json.dumps({{
    "uid": _os.getuid(),
    "secret_vars": sorted(k for k in _os.environ if "TOKEN" in k or "API_KEY" in k),
    "environ_with_token": _environ_with_secrets(),
    "other_kernels_reached": _other_kernels(),
    "pid_1": open("/proc/1/cmdline", "rb").read().split(b"\\0")[0].decode(),
}}))
"""


class SmokeFailure(AssertionError):
    """The container did not behave as the image promises."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise SmokeFailure(message)


def wait_for_health(url: str, timeout: float, since: float | None) -> float:
    """Seconds from ``since`` (a wall-clock time; default now) until ``GET url/health``
    answers 200. Imports nothing of kernel_env, so it starts polling at once."""
    start = time.time() if since is None else since
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return time.time() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise SmokeFailure(f"{url}/health did not answer 200 within {timeout:.0f} s")
        time.sleep(0.05)


def run_episode(env: KernelEnv) -> tuple[str, dict[str, Any]]:
    """One short episode with a final answer; returns its session id and the kernel's probe."""
    result = env.reset(context=CONTEXT, task_prompt="How many characters?", expected_answer="11")
    session_id = result.observation.metadata.get("session_id")
    check(bool(session_id), f"no session_id in the reset observation: {result.observation}")
    step = env.execute("n = len(context)\nn")
    check(step.observation.result.stdout.strip() == "11", f"len(context): {step.observation}")
    secrets = [
        s for s in (os.environ.get("KERNEL_ENV_TOKEN"), os.environ.get("SMOKE_LLM_KEY")) if s
    ]
    probe = env.execute(PROBE_CODE.format(secrets=secrets))
    check(probe.observation.result.success, f"probe cell failed: {probe.observation}")
    facts = json.loads(probe.observation.result.stdout.strip().splitlines()[-1])
    final = env.execute("FINAL(n)")
    check(final.done and final.reward == 1.0, f"FINAL(n): done={final.done} reward={final.reward}")
    return str(session_id), facts


def fetch_notebook(url: str, session_id: str, token: str | None) -> dict[str, Any]:
    """``GET /sessions/{id}/notebook``, checked to be the episode just run."""
    request = urllib.request.Request(f"{url}/sessions/{session_id}/notebook")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=30) as response:
        media_type = response.headers.get_content_type()
        notebook = json.load(response)
    check(media_type == NOTEBOOK_TYPE, f"notebook media type {media_type!r}")
    check(notebook.get("nbformat") == 4, "the notebook is not nbformat 4")
    sources = ["".join(cell.get("source", "")) for cell in notebook.get("cells", [])]
    check(any("len(context)" in source for source in sources), "the step's cell is missing")
    check(any("FINAL(n)" in source for source in sources), "the final cell is missing")
    return notebook


def check_kernel_facts(facts: dict[str, Any], sandboxed: bool) -> None:
    check(not facts["secret_vars"], f"the kernel sees secret variables {facts['secret_vars']}")
    check(facts["uid"] != 0, "the kernel runs as root")
    # Every container mode: no process environment the kernel can read holds the token or
    # the LLM key, and no other episode's kernel is within reach.
    check(facts["environ_with_token"] == 0, f"the kernel can read the server's secrets: {facts}")
    check(not facts["other_kernels_reached"], f"the kernel reaches another: {facts}")
    if sandboxed:
        # Inside bubblewrap the kernel is `nobody` in its own PID namespace: the server's
        # process, and so its environment, is out of sight.
        check(facts["uid"] == 65534, f"sandboxed kernel uid {facts['uid']}, expected 65534")
        check("tini" not in facts["pid_1"], f"the kernel sees the container's pid 1: {facts}")


def episode(url: str, sandboxed: bool) -> str:
    from kernel_env import KernelEnv

    token = os.environ.get("KERNEL_ENV_TOKEN") or None
    # A second episode's kernel runs beside the probed one: the probe must not reach it.
    with KernelEnv(base_url=url, token=token) as other, KernelEnv(base_url=url, token=token) as env:
        other.reset(context="the other episode")
        other.execute("secret_of_the_other_episode = 42")
        session_id, facts = run_episode(env)
        notebook = fetch_notebook(url, session_id, token)
    check_kernel_facts(facts, sandboxed)
    cells = len(notebook["cells"])
    return (
        f"episode ok: session {session_id}, notebook {cells} cells, kernel uid {facts['uid']}; "
        "no process environment it reads holds the token or the LLM key; the other "
        "episode's kernel is out of reach"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def from_image(image: str) -> str:
    """The episode through ``KernelEnv.from_docker_image``, which starts (and, on close,
    stops) its own container of ``image``."""
    from kernel_env import KernelEnv

    port = free_port()
    env = KernelEnv.from_docker_image(image, port=port)
    try:
        session_id, facts = run_episode(env)
        notebook = fetch_notebook(f"http://127.0.0.1:{port}", session_id, None)
    finally:
        env.close()
    check_kernel_facts(facts, sandboxed=False)
    cells = len(notebook["cells"])
    return f"from_docker_image ok: port {port}, notebook {cells} cells, kernel uid {facts['uid']}"


# A cell in each other language, what it prints, and its spelling of FINAL(42).
LANGUAGE_CELLS = {
    "bash": ("echo $((6*7))", "42", "FINAL 42"),
    "deno": ("const a: number = 6*7; console.log(a)", "42", "FINAL(42)"),
    "ir": ("x <- 1:10; cat(sum(x))", "55", "FINAL(42)"),
}


def languages(url: str, names: list[str]) -> str:
    """An episode in each of the image's other kernels (its KERNELS build argument), each
    ending with FINAL and the rubric's reward."""
    from kernel_env import KernelEnv

    token = os.environ.get("KERNEL_ENV_TOKEN") or None
    for name in names:
        code, printed, final_answer = LANGUAGE_CELLS[name]
        with KernelEnv(base_url=url, token=token) as env:
            env.reset(kernel_name=name, expected_answer="42")
            said = env.run(code).stdout.strip()
            check(said == printed, f"{name}: {code!r} printed {said!r}")
            final = env.execute(final_answer)
            check(final.done and final.reward == 1.0, f"{name}: {final_answer} gave {final}")
    return f"languages ok: {', '.join(names)}: a cell each, FINAL(42) rewarded 1.0"


def e2b_sandbox(url: str) -> str:
    """E2B's SDK, unchanged, against the container (its ``e2b`` extra): a sandbox runs a
    cell and a command in its kernel's environment, then is killed."""
    from e2b_code_interpreter import Sandbox

    token = os.environ["KERNEL_ENV_TOKEN"]
    sandbox = Sandbox.create(api_url=url, sandbox_url=url, api_key=token)
    try:
        value = sandbox.run_code("6 * 7").text
        check(value == "42", f"run_code('6 * 7') gave {value!r}")
        said = sandbox.commands.run("echo from-a-command").stdout
        check(said == "from-a-command\n", f"commands.run gave {said!r}")
    finally:
        sandbox.kill()
    listed = Sandbox.list(api_url=url, sandbox_url=url, api_key=token).next_items()
    check(sandbox.sandbox_id not in {s.sandbox_id for s in listed}, "a killed sandbox is listed")
    return f"e2b ok: sandbox {sandbox.sandbox_id}: run_code and commands.run answered, killed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    health = commands.add_parser("health")
    health.add_argument("url")
    health.add_argument("--timeout", type=float, default=60.0)
    health.add_argument("--since", type=float, help="count from this Unix time")
    run = commands.add_parser("episode")
    run.add_argument("url")
    run.add_argument("--sandboxed", action="store_true", help="expect bubblewrap kernels")
    image = commands.add_parser("from-image")
    image.add_argument("image")
    e2b = commands.add_parser("e2b")
    e2b.add_argument("url")
    kernels = commands.add_parser("languages")
    kernels.add_argument("url")
    kernels.add_argument("names", help="comma-separated kernel names")
    args = parser.parse_args(argv)
    try:
        if args.command == "health":
            print(f"{wait_for_health(args.url, args.timeout, args.since):.2f}")
        elif args.command == "episode":
            print(episode(args.url, args.sandboxed))
        elif args.command == "e2b":
            print(e2b_sandbox(args.url))
        elif args.command == "languages":
            print(languages(args.url, args.names.split(",")))
        else:
            print(from_image(args.image))
    except SmokeFailure as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
