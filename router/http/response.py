"""An engine's answer as the router reads it: status and content type first, then the
body, whole (`read`) or as it comes (`readany`), each wait bounded.

Fed by its connection (router/http/connection.py, the `Answer` it reads), the answer
buffers body chunks; above READ_HIGH_WATER_BYTES it stops reading the engine's socket
(TCP then slows the engine) until the caller catches up. When done, `release()` gives
the connection back for reuse if the answer was read to its end, else closes it, which
is how an engine learns to stop generating.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Final

from router.http.bounds import FailureKind, UpstreamError
from router.http.connection import UpstreamConnection

__all__ = ["DEFAULT_CONTENT_TYPE", "READ_HIGH_WATER_BYTES", "UpstreamResponse"]

# A stream the client reads slower than the engine writes: stop reading the engine's
# socket above this many buffered bytes (TCP then slows the engine), resume below half.
READ_HIGH_WATER_BYTES: Final = 2 * 1024 * 1024
DEFAULT_CONTENT_TYPE: Final = "application/json"  # an answer that names none


class UpstreamResponse:
    """An engine's answer: `status` and `content_type` once the pool's `post` returns,
    the body through `read()` or `readany()`. Always `release()` or `close()` it."""

    def __init__(self, connection: UpstreamConnection, *, loop: asyncio.AbstractEventLoop,
                 idle_timeout_s: float, max_body_bytes: int,
                 give_back: Callable[[UpstreamConnection], None]) -> None:
        """`idle_timeout_s`: the longest wait for more of the body (0: for ever);
        `give_back`: returns a connection whose answer was read to its end to the pool."""
        self.idle_timeout_s = idle_timeout_s
        self.max_body_bytes = max_body_bytes
        self.status = 0
        self.content_type = DEFAULT_CONTENT_TYPE
        # The pool's loop: asyncio.get_running_loop() costs a getpid() system call.
        self._loop = loop
        self._give_back = give_back
        self._connection: UpstreamConnection | None = connection
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._complete = False
        self._keep_alive = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._wait_for = (0.0, FailureKind.IDLE_TIMEOUT)  # the current wait's bound

    # --- reading ------------------------------------------------------------------------

    async def wait_head(self, timeout_s: float) -> None:
        """Until the status line and headers are in; UpstreamError if they cannot be
        (first_byte_timeout after `timeout_s`)."""
        while self.status == 0:
            if self._error is not None:
                raise self._error
            await self._wait(timeout_s, FailureKind.FIRST_BYTE_TIMEOUT)

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole (rest of the) body; UpstreamError (too_large) beyond `max_bytes`
        (default: the pool's `max_body_bytes`)."""
        if max_bytes is None:
            max_bytes = self.max_body_bytes
        chunks = self._chunks
        if self._complete and self._buffered <= max_bytes:
            # All of it is here (a small answer comes with its head): no waiting.
            data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self._buffered = 0
            return data
        parts = []
        size = 0
        while chunk := await self.readany():
            size += len(chunk)
            if size > max_bytes:
                self.close()
                raise UpstreamError(f"answer larger than {max_bytes} bytes",
                                    FailureKind.TOO_LARGE)
            parts.append(chunk)
        return b"".join(parts)

    async def readany(self) -> bytes:
        """What has arrived since the last call (waiting if nothing has); b"" at the end.
        Raises UpstreamError if the connection dropped before the end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            await self._wait(self.idle_timeout_s, FailureKind.IDLE_TIMEOUT)
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            if self._connection is not None:
                self._connection.resume_reading()
        return data

    async def _wait(self, timeout_s: float, kind: FailureKind) -> None:
        waiter = self._waiter = self._loop.create_future()
        connection = self._connection
        timed = timeout_s > 0 and connection is not None
        if timed:
            self._wait_for = (timeout_s, kind)
            connection.arm(timeout_s)  # type: ignore[union-attr]
        try:
            await waiter
        finally:
            self._waiter = None
            if timed:
                connection.disarm()  # type: ignore[union-attr]

    # --- fed by the connection (the `Answer` it reads) ----------------------------------

    def headers_in(self, status: int, content_type: str | None) -> None:
        self.status = status
        if content_type is not None:
            self.content_type = content_type
        self._wake()

    def body_in(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > READ_HIGH_WATER_BYTES and not self._paused:
            self._paused = True
            if self._connection is not None:
                self._connection.pause_reading()
        self._wake()

    def ended(self, keep_alive: bool) -> None:
        self._keep_alive = keep_alive
        self._complete = True
        self._wake()

    def failed(self, error: UpstreamError) -> None:
        if not self._complete:
            self._set_error(error)

    def timed_out(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            timeout_s, kind = self._wait_for
            what = "status line" if kind is FailureKind.FIRST_BYTE_TIMEOUT else "data"
            self._set_error(UpstreamError(f"no {what} from the engine for {timeout_s:g} s",
                                          kind))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _set_error(self, error: UpstreamError) -> None:
        self._error = error
        self._wake()

    @property
    def complete(self) -> bool:
        """The whole answer has arrived (some of it may still be unread)."""
        return self._complete

    # --- ending -------------------------------------------------------------------------

    def release(self) -> None:
        """Pool the connection if the answer was read to its end, else close it. Safe twice."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        connection.response = None
        if self._complete and self._keep_alive and self._error is None and not self._paused:
            self._give_back(connection)
        else:
            connection.close()

    def close(self) -> None:
        """Drop the connection (the engine sees the client leave). Safe twice."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        connection.response = None
        if not self._complete:
            self._set_error(UpstreamError("closed by the router"))
        connection.close()

    @property
    def broken(self) -> UpstreamError | None:
        """Why the answer cannot be read to its end (None while it can)."""
        return self._error
