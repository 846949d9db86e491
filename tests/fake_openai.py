"""A real OpenAI-compatible chat-completions server on loopback, with scripted answers.

The LLM is outside kernel_env, so tests run kernel_env's real HTTP client code against this:
``http.server`` on 127.0.0.1 port 0 in a thread, HTTP/1.1 keep-alive, concurrent requests.

    with FakeOpenAI(lambda request: "hi", fail_first=2) as server:
        backend = OpenAIBackend(server.url, "m", api_key="sk-test")
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Recorded:
    """One request the server received."""

    path: str
    headers: dict[str, str]  # lower-case names
    body: dict[str, Any]
    raw: str


@dataclass(frozen=True)
class Reply:
    """A non-default reply an answer function may return instead of a string."""

    status: int
    body: str = ""
    headers: tuple[tuple[str, str], ...] = ()


Answer = str | Reply
Answers = list[Answer] | Callable[[dict[str, Any]], Answer]


def count_tokens(text: str) -> int:
    """The fake's tokenizer: whitespace-separated words."""
    return len(text.split())


class FakeOpenAI:
    """Answers POST /v1/chat/completions from ``answers`` (a list in order, or a function of the
    request body). The first ``fail_first`` requests get ``fail_status`` with ``Retry-After``."""

    def __init__(
        self,
        answers: Answers,
        *,
        fail_first: int = 0,
        fail_status: int = 429,
        retry_after: str | None = "0",
        latency: float = 0.0,
        cost: float | None = None,
    ) -> None:
        self.answers = answers
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.retry_after = retry_after
        self.latency = latency
        self.cost = cost
        self.requests: list[Recorded] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _handler_for(self))
        # A short poll interval: shutdown() waits for the next poll.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def url(self) -> str:
        """The base URL a client is configured with (ends in /v1)."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def respond(self, request: Recorded) -> tuple[int, str, list[tuple[str, str]]]:
        """(status, body, headers) for one request; runs on a server thread."""
        with self._lock:
            index = len(self.requests)
            self.requests.append(request)
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if self.latency:
                time.sleep(self.latency)
            if index < self.fail_first:
                headers = [("Retry-After", self.retry_after)] if self.retry_after else []
                return self.fail_status, '{"error": {"message": "slow down"}}', headers
            answer = self._answer(index, request.body)
        finally:
            with self._lock:
                self.in_flight -= 1
        if isinstance(answer, Reply):
            return answer.status, answer.body, list(answer.headers)
        return 200, json.dumps(self._completion(request.body, answer)), []

    def _answer(self, index: int, body: dict[str, Any]) -> Answer:
        if callable(self.answers):
            return self.answers(body)
        position = index - self.fail_first
        if position >= len(self.answers):
            return Reply(500, '{"error": {"message": "no scripted answer left"}}')
        return self.answers[position]

    def _completion(self, body: dict[str, Any], text: str) -> dict[str, Any]:
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        usage: dict[str, Any] = {
            "prompt_tokens": count_tokens(prompt),
            "completion_tokens": count_tokens(text),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if self.cost is not None:
            usage["cost"] = self.cost
        return {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        }


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    # The default listen backlog of 5 drops the SYNs of a 16-connection burst; the client then
    # waits ~1 s to resend them.
    request_queue_size = 128


def _handler_for(fake: FakeOpenAI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real endpoints do
        # Headers and body go out in two writes; with Nagle on, the second waits ~40 ms for
        # the client's delayed ACK.
        disable_nagle_algorithm = True
        timeout = 10

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length).decode("utf-8")
            if self.path != "/v1/chat/completions":
                self._send(404, '{"error": {"message": "not found"}}', [])
                return
            try:
                body = json.loads(raw)
            except ValueError:
                self._send(400, '{"error": {"message": "not JSON"}}', [])
                return
            headers = {k.lower(): v for k, v in self.headers.items()}
            self._send(*fake.respond(Recorded(self.path, headers, body, raw)))

        def _send(self, status: int, body: str, headers: list[tuple[str, str]]) -> None:
            data = body.encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return None  # quiet: tests read `requests`, not stderr

    return Handler
