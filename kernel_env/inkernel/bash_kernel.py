"""bash_kernel with kernel_env's stdin bridge: it runs in the bash kernel's own process.

bash_kernel drives bash through a terminal and has no stdin requests: a program in the
terminal just reads it. So the shim's helpers (``shims/bash.sh``, sourced when the shell
starts) write a request line to the terminal: this kernel's tag (random per kernel, so no
output matches it by chance), an operation and a file of NUL-separated arguments. This
kernel sees the line among the shell's output, asks the host over the Jupyter stdin channel
(``raw_input``: an ``input_request`` in the language-neutral requests of
:mod:`kernel_env.inkernel.contract`), writes the answers into the file and sends the shell a
one-line status. ``FINAL`` becomes a display under the final-answer MIME type.

Run as ``python -m kernel_env.inkernel.bash_kernel -f <connection file>``. Imports only what
the bash kernel's process has: ipykernel, bash_kernel, the standard library and the contract.
"""

from __future__ import annotations

import json
import secrets
import shlex
from pathlib import Path
from typing import Any

from bash_kernel.kernel import BashKernel

from kernel_env.inkernel.contract import (
    FINAL_MIME,
    LANGUAGE_PROBE_REPLY,
    LANGUAGE_REQUEST_TAG,
    PROBE_REPLY,
    SHIMS,
    take_recorded,
)

__all__ = ["EpisodeBashKernel"]

_SHIM = SHIMS / "bash.sh"
_OPS = ("llm_query", "llm_query_batched", "FINAL", "probe", "notebook")
# Spare answers to the host's readiness probe: never a reply to a request.
_SPARES = (LANGUAGE_PROBE_REPLY, PROBE_REPLY)


class EpisodeBashKernel(BashKernel):
    """bash_kernel whose shell can ask the host through the Jupyter stdin channel."""

    implementation = "kernel_env_bash"
    # An exported notebook's recorded (prompt, response) pairs, once its setup cell ran.
    replay: list[Any] | None = None

    def _start_bash(self) -> None:
        self._request_tag = f"__kernel_env_{secrets.token_hex(8)}__"
        super()._start_bash()
        self.bashwrapper.run_command(
            f"__KERNEL_ENV_TAG={self._request_tag}; source {shlex.quote(str(_SHIM))}"
        )

    def do_execute(
        self,
        code: str,
        silent: bool,
        store_history: bool = True,
        user_expressions: dict[str, Any] | None = None,
        allow_stdin: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        # ipykernel's raw_input asks only while the request allows stdin; IPython's kernel
        # records that per request, a plain Kernel subclass must do it itself.
        self._allow_stdin = allow_stdin
        return super().do_execute(code, silent, store_history, user_expressions, allow_stdin)

    def send_response(
        self, stream: Any, msg_or_type: Any, content: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        # bash_kernel's error for a failing command has no name and the bare status: name it.
        if msg_or_type == "error" and isinstance(content, dict) and not content.get("ename"):
            status = f"exit status {content.get('evalue')}"
            content = {**content, "ename": "ExitStatus", "evalue": status, "traceback": [status]}
        return super().send_response(stream, msg_or_type, content, *args, **kwargs)

    def process_output(self, output: str) -> None:
        before, tag, request = output.partition(self._request_tag)
        if not tag:
            super().process_output(output)
            return
        if before:
            super().process_output(before)
        op, _, path = request.strip().partition(" ")
        if op not in _OPS:  # not one of our requests after all: shown as it came
            super().process_output(tag + request)
            return
        status = self._serve(op, Path(path))
        self.bashwrapper.child.sendline(status)

    def _serve(self, op: str, path: Path) -> str:
        """Answer one request of the shell: "ok", or "error" with the message in ``path``."""
        try:
            args = [a.decode("utf-8", "replace") for a in path.read_bytes().split(b"\0")[:-1]]
            if op == "probe":
                self.raw_input("")
                return "ok"
            if op == "FINAL":
                self._final(args[0] if args else "")
                return "ok"
            answers = self._notebook(Path(args[0])) if op == "notebook" else self._ask(op, args)
            path.write_bytes(b"".join(a.encode("utf-8") + b"\0" for a in answers))
            return "ok"
        except Exception as exc:  # the shell gets the reason; the kernel goes on
            path.write_text(str(exc) or type(exc).__name__)
            return "error"

    def _notebook(self, path: Path) -> list[str]:
        """An exported notebook's setup: its context and task prompt; its recorded answers
        replay from now on."""
        params = json.loads(path.read_text())
        self.replay = list(params.get("replay") or [])
        context_path = params.get("context_path")
        context = Path(context_path).read_text() if context_path else params.get("context", "")
        return [str(context or ""), str(params.get("task_prompt") or "")]

    def _replayed(self, prompt: str) -> str:
        response = take_recorded(self.replay or [], prompt)
        if response is None:
            raise RuntimeError(f"no recorded response for this prompt: {prompt[:80]!r}")
        return str(response)

    def _ask(self, op: str, args: list[str]) -> list[str]:
        if self.replay is not None:
            return [self._replayed(p) for p in (args[:1] if op == "llm_query" else args)]
        payload: dict[str, Any] = (
            {"prompt": args[0] if args else ""} if op == "llm_query" else {"prompts": args}
        )
        request = LANGUAGE_REQUEST_TAG + json.dumps({"op": op, "args": payload})
        raw = self.raw_input(request)
        while raw in _SPARES:
            raw = self.raw_input(request)
        reply = json.loads(raw)
        if not reply.get("ok"):
            raise RuntimeError(str(reply.get("error") or f"{op} failed"))
        result = reply.get("result")
        return [str(result)] if op == "llm_query" else [str(r) for r in result or []]

    def _final(self, answer: str) -> None:
        content = {
            "data": {FINAL_MIME: {"answer": answer}, "text/plain": f"FINAL({answer})"},
            "metadata": {},
        }
        self.send_response(self.iopub_socket, "display_data", content)


if __name__ == "__main__":
    from ipykernel.kernelapp import IPKernelApp

    IPKernelApp.launch_instance(kernel_class=EpisodeBashKernel)
