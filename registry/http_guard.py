"""Deadlines on reading an HTTP request, and a bound on its body: no slowloris.

uvicorn arms no timer on a new connection until its first response, so a client that
trickles its headers one byte a second holds a connection (and a task) for as long as it
likes. `GuardedHttpToolsProtocol` is uvicorn's own httptools protocol plus one timer: a
request must arrive whole, headers and body, within REQUEST_READ_TIMEOUT_S of its first
byte (of the connection, for the first request), or the connection is closed.
`BodyLimit` refuses a body larger than the app's endpoints can use, with 413.

Counts are kept in `guard_stats` for /metrics.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Final

logger = logging.getLogger(__name__)

REQUEST_READ_TIMEOUT_S: Final = 10.0  # headers + body of one request, from its first byte
MAX_BODY_BYTES: Final = 64 * 1024  # the registry's endpoints take no body at all


@dataclass(slots=True)
class GuardStats:
    read_timeouts: int = 0  # connections closed for a request that did not arrive in time
    bodies_refused: int = 0  # requests answered 413


guard_stats = GuardStats()

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # uvicorn without httptools: its default protocol, unguarded
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


def guarded_protocol() -> Any:
    """The protocol class to give uvicorn (`http=`): the guarded one, or "auto"."""
    if HttpToolsProtocol is None:
        logger.warning("[http] httptools is missing: no request read deadline")
        return "auto"
    return GuardedHttpToolsProtocol


if HttpToolsProtocol is not None:

    class GuardedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        """uvicorn's protocol with a deadline per request read (see the module doc)."""

        _read_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # the next request on a kept-alive connection starts its clock

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _arm(self) -> None:
            if self._read_deadline is None:
                self._read_deadline = self.loop.call_later(REQUEST_READ_TIMEOUT_S,
                                                           self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def _read_timed_out(self) -> None:
            self._read_deadline = None
            guard_stats.read_timeouts += 1
            logger.debug("[http] closing %s: request not read within %.0fs", self.client,
                         REQUEST_READ_TIMEOUT_S)
            if not self.transport.is_closing():
                self.transport.close()


class BodyLimit:
    """ASGI middleware: 413 for a request whose body exceeds `max_bytes`.

    Checks Content-Length up front and counts chunked bodies as they arrive, so nothing
    larger is ever buffered. Bodies are never parsed here: no endpoint of the registry
    reads one, so a deeply nested JSON body costs no recursion either.
    """

    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = True
                if too_big:
                    await self._refuse(send)
                    return
        seen = 0
        started = False

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        async def bounded_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, bounded_receive, tracked_send)
        except _BodyTooLarge:
            if not started:  # else the answer is on its way: just stop reading
                await self._refuse(send)

    async def _refuse(self, send: Any) -> None:
        guard_stats.bodies_refused += 1
        body = b'{"detail":"request body too large"}'
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass
