"""HTTP/1.1 messages for `HttpApp` (the router's and the planner's server): a parsed
`Request`, a fixed-length `Response`, a `StreamResponse` written event by event (SSE),
and `openai_error`, the one JSON error shape every answer of ours uses.

The server (serving/http_server.py) reads a whole request, body included, before a
handler sees it; a handler returns a `Response`, or a `StreamResponse` it has prepared
and written itself. An answer's head is built as bytes in one go and goes out with its
body in one `transport.write`.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Final, Protocol

import msgspec

__all__ = ["CHUNKED", "INVALID_REQUEST", "UNTIL_CLOSE", "Request", "Response",
           "StreamResponse", "encode_head", "openai_error"]

INVALID_REQUEST: Final = "invalid_request_error"
MAX_ERROR_MESSAGE_CHARS: Final = 512  # an error message quotes at most this much input

_STATUS_LINES: Final = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode()
                        for s in HTTPStatus}
_CLOSE: Final = b"Connection: close\r\n"
_HEADS: dict[tuple[int, str, bool], bytes] = {}  # (status, content type, close) -> start
MAX_KEPT_HEADS: Final = 256  # engines' content types are few; a flood of odd ones is not kept


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % status


CHUNKED: Final = -1  # encode_head's `length` for a chunked answer
UNTIL_CLOSE: Final = -2  # and for one that ends when the connection does (HTTP/1.0)


def encode_head(status: int, content_type: str, headers: Mapping[str, str] | None,
                close: bool, length: int) -> bytes:
    """Status line and headers; `length` the body's, or CHUNKED, or UNTIL_CLOSE."""
    if headers is None and length >= 0:  # the usual answer: its head but the length, kept
        key = (status, content_type, close)
        start = _HEADS.get(key)
        if start is None:
            start = _status_line(status) + b"Content-Type: " + \
                content_type.encode("latin-1") + b"\r\n" + (_CLOSE if close else b"") + \
                b"Content-Length: "
            if len(_HEADS) < MAX_KEPT_HEADS:
                _HEADS[key] = start
        return start + b"%d\r\n\r\n" % length
    head = _status_line(status) + b"Content-Type: " + content_type.encode("latin-1")
    if length >= 0:
        head += b"\r\nContent-Length: %d\r\n" % length
    elif length == CHUNKED:
        head += b"\r\nTransfer-Encoding: chunked\r\n"
    else:
        head += b"\r\n"
    if headers:
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("latin-1")
    if close:
        head += _CLOSE
    return head + b"\r\n"


class Connection(Protocol):
    """What a `StreamResponse` writes through (the server's protocol)."""

    def send(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


class Request:
    """One client request, whole. `headers`: lower-case names to raw values. `client`:
    the peer's address ("" when the transport does not say)."""

    __slots__ = ("body", "client", "connection", "headers", "http_11", "keep_alive", "method",
                 "path", "query")

    def __init__(self, method: str, path: str, query: str, headers: dict[bytes, bytes],
                 body: bytes, *, keep_alive: bool, http_11: bool,
                 connection: Connection, client: str = "") -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http_11 = http_11  # chunked answers need HTTP/1.1; 1.0 gets close-delimited
        self.connection = connection
        self.client = client

    def header(self, name: bytes, default: str = "") -> str:
        """A header's value (`name` in lower case), `default` when absent."""
        value = self.headers.get(name)
        return default if value is None else value.decode("latin-1")


class Response:
    """A whole answer: status, body, content type, extra headers."""

    __slots__ = ("body", "close", "content_type", "headers", "status")

    def __init__(self, status: int = 200, body: bytes = b"", *,
                 content_type: str = "application/json",
                 headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers
        self.close = False  # close the connection after this answer

    def force_close(self) -> None:
        self.close = True

    def encode(self, close: bool) -> bytes:
        body = self.body
        return encode_head(self.status, self.content_type, self.headers, close,
                           len(body)) + body


def openai_error(status: int, message: str, kind: str, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> Response:
    """`{"error": {"message", "type", "param", "code"}}`: what OpenAI's clients parse.
    Messages quote the client's input (a path, a model name): cut to
    MAX_ERROR_MESSAGE_CHARS, so an error answer is small whatever the request was."""
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = message[:MAX_ERROR_MESSAGE_CHARS] + "..."
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return Response(status, msgspec.json.encode(body), headers=headers)


class StreamResponse:
    """An answer written as it comes: chunked on HTTP/1.1, close-delimited on 1.0.
    `write` waits while the client's socket is backed up (flow control) and raises
    ConnectionResetError once the client is gone."""

    __slots__ = ("_chunked", "_connection", "close", "content_type", "ended", "headers",
                 "prepared", "status")

    def __init__(self, status: int = 200, *, content_type: str = "text/event-stream",
                 headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.content_type = content_type
        self.headers = headers
        self.close = False
        self.prepared = False
        self.ended = False
        self._chunked = True
        self._connection: Connection | None = None

    def force_close(self) -> None:
        self.close = True

    async def prepare(self, request: Request) -> None:
        """Send the head (the first write does not wait for more)."""
        self._connection = request.connection
        self._chunked = request.http_11
        if not self._chunked:
            self.close = True
        self.prepared = True
        request.connection.send(encode_head(
            self.status, self.content_type, self.headers,
            self.close or not request.keep_alive, CHUNKED if self._chunked else UNTIL_CLOSE))

    async def write(self, data: bytes) -> None:
        connection = self._connection
        assert connection is not None, "prepare() first"
        if not data:
            return
        connection.send(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        await connection.drain()

    async def write_eof(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self._connection is not None and self._chunked:
            self._connection.send(b"0\r\n\r\n")


