"""One keep-alive HTTP/1.1 connection to an engine: bytes out, httptools in.

A connection carries one request and its answer at a time. The parser's callbacks
(`on_*`) tell the answer being read (an `Answer`: router/http/response.py's
`UpstreamResponse`) what arrived; the answer paces the socket (`pause_reading`,
`resume_reading`) and bounds each of its waits with the connection's one timer (`arm`).
A connection that drops, or closes before the answer's end, fails the answer.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Protocol

import httptools

from router.http.bounds import FailureKind, UpstreamError
from serving.deadline import Deadline

__all__ = ["Answer", "UpstreamConnection"]


class Answer(Protocol):
    """What a connection tells the answer it is reading."""

    def headers_in(self, status: int, content_type: str | None) -> None:
        """The status line and headers are in (`content_type` None: it named none)."""

    def body_in(self, data: bytes) -> None: ...
    def ended(self, keep_alive: bool) -> None:
        """The whole answer is in; the connection may be reused if `keep_alive`."""

    def failed(self, error: UpstreamError) -> None:
        """The connection broke; ignored once the answer is complete."""

    def timed_out(self) -> None:
        """The current wait's deadline passed."""


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to an engine, keyed by its (host, port)."""

    def __init__(self, key: tuple[str, int], loop: asyncio.AbstractEventLoop) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.response: Answer | None = None  # the answer being read, if any
        self.idle_since = 0.0  # when it went back to the pool (monotonic)
        self._parser = httptools.HttpResponseParser(self)
        self._content_type = b""
        # One timer for every wait on this connection (serving.deadline).
        self._deadline = Deadline(loop, self._timed_out)

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:  # small requests and SSE events must not wait for Nagle
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing asked: an engine talking out of turn
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed HTTP answer: {exc}", FailureKind.MALFORMED))
            self.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._deadline.cancel()
        if exc is not None:
            self._fail(UpstreamError(f"connection lost: {exc}", FailureKind.RESET))
        else:
            self._fail(UpstreamError("connection closed by the engine before the answer "
                                     "was complete", FailureKind.EOF))

    # --- httptools callbacks ------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        # Only Content-Type is read (relayed to the client); the rest is not kept.
        if len(name) == 12 and name.lower() == b"content-type":
            self._content_type = value

    def on_headers_complete(self) -> None:
        assert self.response is not None
        content_type = self._content_type.decode("latin-1") if self._content_type else None
        self._content_type = b""
        self.response.headers_in(self._parser.get_status_code(), content_type)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response.body_in(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        self.response.ended(self._parser.should_keep_alive())

    # --- used by the pool and the answer ------------------------------------------------

    def arm(self, timeout_s: float) -> None:
        """The answer's current wait must end within `timeout_s`."""
        self._deadline.arm(timeout_s)

    def disarm(self) -> None:
        self._deadline.disarm()

    def _timed_out(self) -> None:
        if self.response is not None:
            self.response.timed_out()

    def _fail(self, error: UpstreamError) -> None:
        if self.response is not None:
            self.response.failed(error)

    def pause_reading(self) -> None:
        if self.usable:
            assert self.transport is not None
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.usable:
            assert self.transport is not None
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
