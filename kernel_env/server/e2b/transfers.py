"""envd's file transfers (``POST /files``, ``GET /files``), in bounded chunks.

A file moves between the client and the sandbox's kernel a chunk at a time, each chunk one
kernel call (:mod:`.kernelcalls`): an upload is read from the request as it arrives
(``application/octet-stream``, gzipped or not, or ``multipart/form-data`` parsed as it
streams) and written
by the kernel :data:`UP_CHUNK` bytes at a time; a download is read by the kernel
:data:`DOWN_CHUNK` bytes at a time and streamed to the client. So whatever the file's size,
a transfer holds a chunk or two in the server, and a download's chunk fits the kernel's
output cap. The kernel reads and writes the files, as the sandbox's own user inside its
sandbox: the server never opens a sandbox's file itself.

A sandbox has at most :data:`MAX_TRANSFERS` transfers under way; one more is answered 429
(E2B's rate limit, which the SDK raises as ``RateLimitException``) before its body is read.
A transfer cut short (the client gone, the body over its limit, the kernel refusing a
chunk) leaves in the sandbox what was written of the file, as envd does.
"""

from __future__ import annotations

import base64
import contextlib
import weakref
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from connectrpc.errors import ConnectError
from python_multipart import MultipartParser
from python_multipart.multipart import parse_options_header
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kernel_env.server.e2b.door import sandbox_in
from kernel_env.server.e2b.failures import error_response, file_error, too_large
from kernel_env.server.e2b.sandboxes import Sandbox
from kernel_env.server.limits import BodyTooLarge

__all__ = [
    "DOWN_CHUNK",
    "MAX_TRANSFERS",
    "UP_CHUNK",
    "Call",
    "Transfers",
    "UploadRefused",
    "download",
    "file_routes",
    "upload",
]

UP_CHUNK = 1 << 20  # bytes of an upload written by one kernel call
# Bytes of a download read by one kernel call: their base64 (683 KiB), in the call's JSON
# answer, must stay under the kernel's output cap (DEFAULT_OUTPUT_CAP, 1,000,000 chars),
# which would cut it (tests/test_e2b_parts.py checks it does).
DOWN_CHUNK = 512 << 10
MAX_TRANSFERS = 4  # a sandbox's uploads and downloads under way at once

Call = Callable[..., Awaitable[Any]]  # an envd operation in the sandbox's kernel


class UploadRefused(Exception):
    """An upload the server will not take: the answer to send, in E2B's shape."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class Transfers:
    """The transfers under way, per sandbox: at most :data:`MAX_TRANSFERS` each."""

    def __init__(self, limit: int = MAX_TRANSFERS) -> None:
        self.limit = limit
        self._under_way: weakref.WeakKeyDictionary[Sandbox, int] = weakref.WeakKeyDictionary()

    def take(self, sandbox: Sandbox) -> JSONResponse | None:
        """Count one more transfer of ``sandbox``; E2B's 429 (counting nothing) past the limit."""
        count = self._under_way.get(sandbox, 0)
        if count >= self.limit:
            return error_response(
                429,
                f"the sandbox has {count} file transfers under way, the most it takes at once",
            )
        self._under_way[sandbox] = count + 1
        return None

    def give_back(self, sandbox: Sandbox) -> None:
        left = self._under_way.get(sandbox, 1) - 1
        if left > 0:
            self._under_way[sandbox] = left
        else:
            self._under_way.pop(sandbox, None)

    @contextlib.contextmanager
    def held(self, sandbox: Sandbox) -> Iterator[JSONResponse | None]:
        """One transfer of ``sandbox`` for the block (or the 429 that refuses it)."""
        refused = self.take(sandbox)
        try:
            yield refused
        finally:
            if refused is None:
                self.give_back(sandbox)


def file_routes(calls: Callable[[Sandbox], Call]) -> list[Route]:
    """envd's ``GET /files`` and ``POST /files``, for the sandbox of each request (``calls``:
    the envd operations of a sandbox, in its kernel)."""
    under_way = Transfers()

    async def get(request: Request) -> Response:
        path = request.query_params.get("path")
        if not path:
            return error_response(400, "path is required")
        sandbox = sandbox_in(request.scope)
        refused = under_way.take(sandbox)
        if refused is not None:
            return refused
        try:
            return await download(calls(sandbox), path, lambda: under_way.give_back(sandbox))
        except ConnectError as exc:
            return file_error(exc, missing=404)

    async def post(request: Request) -> Response:
        sandbox = sandbox_in(request.scope)
        with under_way.held(sandbox) as refused:
            if refused is not None:
                return refused
            try:
                return JSONResponse(await upload(calls(sandbox), request))
            except UploadRefused as exc:
                return exc.response
            except BodyTooLarge as exc:
                refusal = too_large(exc.limit, request.url.path)
                refusal.headers["connection"] = "close"  # the rest of the body is never read
                return refusal
            except ClientDisconnect:
                return error_response(400, "the upload was cut short")
            except ConnectError as exc:
                return file_error(exc)

    return [Route("/files", get, methods=["GET"]), Route("/files", post, methods=["POST"])]


# -- downloads ---------------------------------------------------------------------------


async def download(call: Call, path: str, done: Callable[[], None]) -> Response:
    """The file at ``path``, streamed from the kernel a chunk at a time (``done`` is called
    once the answer is over, sent or not). A file that cannot be read fails before the
    answer starts; a failure later cuts the stream short, which the client sees as an error."""
    try:
        first = base64.b64decode(await call("read", path=path, offset=0, size=DOWN_CHUNK))
    except BaseException:
        done()
        raise

    async def chunks() -> AsyncIterator[bytes]:
        piece, offset = first, 0
        while True:
            yield piece
            offset += len(piece)
            if len(piece) < DOWN_CHUNK:
                return
            piece = base64.b64decode(await call("read", path=path, offset=offset, size=DOWN_CHUNK))

    return _Streamed(chunks(), done)


class _Streamed(StreamingResponse):
    """A streamed answer that calls ``done`` once it is over (sent, failed or abandoned)."""

    def __init__(self, chunks: AsyncIterator[bytes], done: Callable[[], None]) -> None:
        super().__init__(chunks, media_type="application/octet-stream")
        self.done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.done()


# -- uploads -----------------------------------------------------------------------------


class _File:
    """One file of an upload, written by the kernel a chunk at a time."""

    def __init__(self, call: Call, path: str) -> None:
        self.call, self.path = call, path
        self.pending = bytearray()
        self.written = False
        self.entry: Any = None

    async def add(self, data: bytes) -> None:
        self.pending += data
        while len(self.pending) >= UP_CHUNK:
            await self._write(bytes(self.pending[:UP_CHUNK]))
            del self.pending[:UP_CHUNK]

    async def finish(self) -> Any:
        if self.pending or not self.written:
            await self._write(bytes(self.pending))
            self.pending.clear()
        return self.entry

    async def _write(self, data: bytes) -> None:
        encoded = base64.b64encode(data).decode("ascii")
        self.entry = await self.call("write", path=self.path, data=encoded, append=self.written)
        self.written = True


async def upload(call: Call, request: Request) -> list[Any]:
    """The files of an upload, written in the sandbox as they arrive: an octet-stream body
    for ``?path=``, or multipart parts named ``file`` whose file names are their paths
    (``?path=`` names the first). Their entries, or :class:`UploadRefused`."""
    path = request.query_params.get("path")
    kind, options = parse_options_header(request.headers.get("content-type", ""))
    if kind == b"application/octet-stream":
        if not path:
            raise UploadRefused(error_response(400, "path is required"))
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding not in ("identity", "gzip"):
            raise UploadRefused(error_response(400, f"Content-Encoding {encoding} is not served"))
        file = _File(call, path)
        if encoding == "gzip":
            await _inflate(request.stream(), file)
        else:
            async for piece in request.stream():
                await file.add(piece)
        return [await file.finish()]
    if kind != b"multipart/form-data" or b"boundary" not in options:
        raise UploadRefused(
            error_response(400, "send multipart/form-data or application/octet-stream")
        )
    return await _Multipart(call, options[b"boundary"], path).read(request.stream())


async def _inflate(body: AsyncIterator[bytes], file: _File) -> None:
    """A gzip body (``Content-Encoding: gzip``) into ``file`` as it arrives: at most
    :data:`UP_CHUNK` inflated bytes at a time, so a small body that inflates to a large file
    still holds a chunk in the server (the file is bounded by the sandbox's workspace)."""
    inflate = zlib.decompressobj(wbits=31)  # a gzip header and trailer
    try:
        async for piece in body:
            data = piece
            while data and not inflate.eof:
                await file.add(inflate.decompress(data, UP_CHUNK))
                data = inflate.unconsumed_tail
        await file.add(inflate.flush())
    except zlib.error as exc:
        raise UploadRefused(error_response(400, f"the gzip body is not valid: {exc}")) from None
    if not inflate.eof:
        raise UploadRefused(error_response(400, "the gzip body was cut short"))


class _Multipart:
    """A ``multipart/form-data`` upload parsed as it streams: each file part's data goes to
    its :class:`_File` as it comes; other fields are skipped."""

    def __init__(self, call: Call, boundary: bytes, path: str | None) -> None:
        self.call, self.path = call, path
        self.events: list[tuple[str, bytes]] = []
        self.parser = MultipartParser(boundary, self._callbacks())
        self.header = b""
        self.disposition = b""
        self.file: _File | None = None
        self.entries: list[Any] = []

    def _callbacks(self) -> Any:
        def keep(name: str) -> Callable[..., None]:
            def event(data: bytes | None = None, start: int = 0, end: int = 0) -> None:
                self.events.append((name, data[start:end] if data is not None else b""))

            return event

        names = ["part_begin", "header_field", "header_value", "header_end", "part_data"]
        callbacks = {f"on_{name}": keep(name) for name in names}
        return {**callbacks, "on_headers_finished": keep("headers"), "on_part_end": keep("end")}

    async def read(self, body: AsyncIterator[bytes]) -> list[Any]:
        async for piece in body:
            self.parser.write(piece)
            await self._handle()
        self.parser.finalize()
        await self._handle()
        if not self.entries:
            raise UploadRefused(error_response(400, "no file in the upload"))
        return self.entries

    async def _handle(self) -> None:
        events, self.events = self.events, []
        for name, data in events:
            if name == "part_begin":
                self.header = self.disposition = b""
            elif name == "header_field":
                self.header += data
            elif name == "header_value" and self.header.lower() == b"content-disposition":
                self.disposition += data
            elif name == "header_end":
                self.header = b""
            elif name == "headers":
                self.file = self._file()
            elif name == "part_data" and self.file is not None:
                await self.file.add(data)
            elif name == "end" and self.file is not None:
                self.entries.append(await self.file.finish())
                self.file = None

    def _file(self) -> _File | None:
        """The file a part's headers name (None for a field that is not a file)."""
        _, options = parse_options_header(self.disposition)
        if b"filename" not in options:
            return None
        path = self.path if self.path and not self.entries else None
        path = path or options[b"filename"].decode("utf-8", "replace")
        if not path:
            raise UploadRefused(error_response(400, "each file needs a path"))
        return _File(self.call, path)
