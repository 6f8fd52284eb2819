"""The HTTP/1.1 server of the router and the planner: httptools on uvloop, one protocol
object per connection.

Lean on purpose, like router/http/upstream.py on the client side: a profile of the router
under load put about 37 µs of every request in aiohttp's server (its request, response
and routing objects, multidicts, a task and a stream reader per request). Here a request
is parsed by httptools straight into a `Request`, routed by exact path in a dict, and
answered with one `transport.write`.

Per connection, in order:

    head     the request line and headers arrive within `header_timeout_s` of connecting
             or of the previous answer (slowloris), at most `max_head_bytes` (431),
             whether they span reads or come in one
    body     Content-Length or chunked, within `body_timeout_s` (408), at most
             `max_body_bytes` (413: sent, then what the client still sends is read and
             dropped for up to LINGER_S, so it sees the 413 rather than a reset)
    handle   the handler runs in the connection's task (one per connection, not one
             per request: a task costs more than the rest of this file's work);
             the client leaving cancels it
    answer   a `Response` in one write, or a `StreamResponse` the handler wrote itself,
             paced by the client's socket (transport pause/resume)

Keep-alive is HTTP/1.1's default; pipelined requests are answered in order (reading
pauses while one waits), and not one more while the client leaves its answers unread
(the write buffer above its high-water mark): it holds one answer's memory, not one per
request. Malformed HTTP gets a 400 and closes that connection only; every refusal is
counted through `HttpApp.count`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Final

import httptools

from serving.deadline import Deadline
from serving.http_limits import HEADER_OVERHEAD, LINGER_S, HeadBudget, Limits
from serving.http_messages import (
    INVALID_REQUEST,
    Request,
    Response,
    StreamResponse,
    openai_error,
)

__all__ = ["ClientConnection", "HttpApp", "HttpServer", "Limits"]

logger = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response | StreamResponse]]
Hook = Callable[[], Awaitable[None]]

LISTEN_BACKLOG: Final = 1024
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
_METHODS: Final = {m.encode(): m for m in ("GET", "POST", "PUT", "DELETE", "HEAD",
                                            "OPTIONS", "PATCH")}


def _no_count(reason: str) -> None:
    pass


class HttpApp:
    """Routes (exact path, then method), start-up and clean-up hooks, limits.

    `count(reason)` is told of every request the server itself refuses or cuts:
    malformed_http, head_too_large, body_too_large, body_timeout, header_timeout."""

    def __init__(self, *, limits: Limits | None = None,
                 count: Callable[[str], None] = _no_count) -> None:
        self.limits = limits or Limits()
        self.count = count
        self.routes: dict[str, dict[str, Handler]] = {}
        self.on_startup: list[Hook] = []
        self.on_cleanup: list[Hook] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        self.routes.setdefault(path, {})[method] = handler

    async def start_serving(self, host: str, port: int, *,
                            backlog: int = LISTEN_BACKLOG) -> HttpServer:
        """Run the start-up hooks, bind, accept (how `ServingThread` serves it)."""
        server = HttpServer(self)
        await server.start(host, port, backlog)
        return server


class HttpServer:
    """One listening socket of an `HttpApp` and its connections."""

    def __init__(self, app: HttpApp) -> None:
        self.app = app
        self.port = 0
        self.closing = False
        self.connections: set[ClientConnection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._idle = asyncio.Event()  # set when no connection has a request in hand

    async def start(self, host: str, port: int, backlog: int) -> None:
        for hook in self.app.on_startup:
            await hook()
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: ClientConnection(self), host, port, backlog=backlog, reuse_address=True)
        except BaseException:
            await self._cleanup()
            raise
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop accepting; close idle connections; let requests in hand finish (up to
        `drain_timeout_s`), each closing after its answer; cancel the rest; run the
        clean-up hooks. Safe twice."""
        if self.closing:
            return
        self.closing = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            if not connection.busy:
                connection.close()
        self._check_idle()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), self.app.limits.drain_timeout_s)
        tasks = [c.task for c in self.connections if c.task is not None]
        for connection in list(self.connections):
            connection.close()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await self._cleanup()

    async def _cleanup(self) -> None:
        for hook in self.app.on_cleanup:
            try:
                await hook()
            except Exception:
                logger.exception("[http] a clean-up hook failed")

    def _check_idle(self) -> None:
        if self.closing and not any(c.busy for c in self.connections):
            self._idle.set()


def _no_route(request: Request, handlers: dict[str, Handler] | None) -> Response:
    if handlers is None:
        return openai_error(404, f"no route {request.path}", INVALID_REQUEST, "not_found")
    return openai_error(405, f"{request.method} is not allowed on {request.path}",
                        INVALID_REQUEST, "method_not_allowed", {"Allow": ", ".join(handlers)})


class _Reading(enum.Enum):
    HEAD = enum.auto()  # waiting for (the rest of) a request line and headers
    BODY = enum.auto()  # headers in, body arriving
    DONE = enum.auto()  # a whole request is in; the next has not begun


class ClientConnection(asyncio.Protocol):
    """One client connection: httptools callbacks (`on_*`) build the `Request`."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.app = server.app
        self.limits = server.app.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.client = ""  # the peer's address, once connected
        self.task: asyncio.Task[None] | None = None  # serves this connection's requests
        self.busy = False  # a request is in hand (its handler runs or its answer goes out)
        self._next: asyncio.Future[None] | None = None  # the idle task waits on it
        self._parser = httptools.HttpRequestParser(self)
        self._reading = _Reading.HEAD
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._body_size = 0
        self._head = HeadBudget(self.limits.max_head_bytes)
        self._lingering = False  # refused with the body still coming: drop what comes
        self._refusal: tuple[int, str, str] | None = None  # set by a callback, then raised
        self._queue: deque[Request] = deque()  # pipelined requests, answered in order
        self._deadline = Deadline(self.loop, self._timed_out)  # of the current phase
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        sock = transport.get_extra_info("socket")
        if sock is not None:  # SSE events must not wait for Nagle
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)
        self._arm(self.limits.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the answer (413) is sent: drop the body until LINGER_S ends
        self._head.reading()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "malformed_http", "protocol upgrades are not supported")
            return
        except httptools.HttpParserError as exc:
            if self._refusal is not None:
                self._refuse(*self._refusal)
            else:
                self._refuse(400, "malformed_http", f"malformed HTTP request: {exc}")
            return
        if self._reading is _Reading.HEAD and self._head.unfinished(len(data)):
            self._refuse(*self._head.refusal())
        elif self._reading is _Reading.BODY and not self.busy:
            self._arm(self.limits.body_timeout_s, once=True)

    def eof_received(self) -> bool:
        return False  # the client is done: close our side too (its request is cancelled)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._deadline.cancel()
        if self.task is not None:
            self.task.cancel()  # the client left: its legs stop (engines see the close)
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client closed the connection"))
        self.server.connections.discard(self)
        self.server._check_idle()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reading = _Reading.HEAD
        self._head.begin()
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value
        self._count_head(len(name) + len(value) + HEADER_OVERHEAD)

    def _count_head(self, size: int) -> None:
        if self._head.parsed(size):
            self._refusal = self._head.refusal()
            raise ValueError("head too large")  # stops the parser

    def on_headers_complete(self) -> None:
        self._reading = _Reading.BODY
        self._head.done()
        self._deadline.disarm()  # the header deadline is met; a body's is armed if it waits
        length = self._headers.get(b"content-length")
        if length is not None and length.isdigit() and \
                int(length) > self.limits.max_body_bytes:
            self._refusal = (413, "body_too_large", "request body larger than "
                             f"{self.limits.max_body_bytes} bytes")
            raise ValueError("body too large")  # stops the parser
        if self._headers.get(b"expect", b"").lower() == b"100-continue" and \
                self.transport is not None:
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self.limits.max_body_bytes:
            self._refusal = (413, "body_too_large", "request body larger than "
                             f"{self.limits.max_body_bytes} bytes")
            raise ValueError("body too large")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._reading = _Reading.DONE
        self._head.completed()
        self._deadline.disarm()
        parser = self._parser
        url = self._url
        cut = url.find(b"?")
        path, query = (url, b"") if cut < 0 else (url[:cut], url[cut + 1:])
        method = parser.get_method()
        body = self._body
        request = Request(
            _METHODS.get(method) or method.decode("latin-1"), path.decode("latin-1"),
            query.decode("latin-1"), self._headers,
            body[0] if len(body) == 1 else b"".join(body),
            keep_alive=parser.should_keep_alive(),
            http_11=parser.get_http_version() == "1.1", connection=self, client=self.client)
        self._body = []
        queue = self._queue
        queue.append(request)
        if self.busy or len(queue) > 1:
            # pipelined: answered after the one in hand; stop reading more meanwhile
            if self.transport is not None:
                self.transport.pause_reading()
        elif self.task is None:
            self.task = self.loop.create_task(self._serve())
        elif self._next is not None and not self._next.done():
            self._next.set_result(None)

    # --- answering ----------------------------------------------------------------------

    async def _serve(self) -> None:
        """The connection's requests, in order, until it closes. The handler is awaited
        here, not in a helper coroutine: every resumption of a request passes through
        each coroutine it is nested in."""
        queue = self._queue
        routes = self.app.routes
        while self.transport is not None:
            if not queue:
                self._next = self.loop.create_future()
                await self._next
                continue
            request = queue.popleft()
            self.busy = True
            handlers = routes.get(request.path)
            handler = handlers.get(request.method) if handlers is not None else None
            if handler is None:
                answer: Response | StreamResponse = _no_route(request, handlers)
            else:
                try:
                    answer = await handler(request)
                except asyncio.CancelledError:  # the client left, or the server closes
                    self.busy = False
                    self.close()
                    self.server._check_idle()
                    raise
                except Exception:
                    logger.exception("[http] handler failed path=%s", request.path)
                    answer = openai_error(500, "internal error", "server_error")
            self.busy = False
            if not self._answered(request, answer):
                return
            if self._write_paused:
                # Its answers go unread: serve and read no more until its socket drains.
                try:
                    await self.drain()
                except ConnectionResetError:
                    return
            if not queue and self.transport is not None:
                self.transport.resume_reading()  # no-op unless a pipeline paused it

    def _answered(self, request: Request, answer: Response | StreamResponse) -> bool:
        """Send a whole answer (a stream has sent itself); whether the connection
        stays open for the next request."""
        transport = self.transport
        keep_alive = request.keep_alive and not answer.close and not self.server.closing
        if isinstance(answer, Response):
            if transport is not None and not transport.is_closing():
                transport.write(answer.encode(not keep_alive))
        elif not answer.ended:  # a stream the handler left unfinished: cut it
            keep_alive = False
        if self.server.closing:
            self.server._check_idle()
        if not keep_alive or transport is None:
            self.close()
            return False
        if not self._queue:
            self._arm(self.limits.body_timeout_s if self._reading is _Reading.BODY
                      else self.limits.header_timeout_s)
        return True

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer a request the server cannot take and close the connection. With a body
        still coming (413), close only our side at first and drop what comes for up to
        LINGER_S: closing with unread data would reset the connection, and the client
        would see the reset, not the answer."""
        self.app.count(reason)
        self._queue.clear()
        transport = self.transport
        if transport is None or transport.is_closing() or self.busy:
            self.close()
            return
        transport.write(openai_error(status, message, INVALID_REQUEST, reason).encode(True))
        if status != 413 or not transport.can_write_eof():
            return self.close()
        transport.write_eof()
        self._lingering = True
        self._deadline.arm(LINGER_S)  # `_timed_out` closes it

    # --- deadlines ----------------------------------------------------------------------

    def _arm(self, seconds: float, *, once: bool = False) -> None:
        """The current phase must end within `seconds` (serving.deadline). `once`: keep a
        deadline already set."""
        if once and self._deadline.at:
            return
        self._deadline.arm(seconds)

    def _timed_out(self) -> None:
        if self.transport is None:
            return
        if self._lingering:
            self.close()
        elif self._reading is _Reading.BODY and not self.busy:
            self._refuse(408, "body_timeout", "the request body did not arrive within "
                         f"{self.limits.body_timeout_s:g} s")
        else:
            self.app.count("header_timeout")
            self.close()

    # --- the `Connection` a StreamResponse writes through --------------------------------

    def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        transport.write(data)

    async def drain(self) -> None:
        """Wait while the client's socket is backed up."""
        if not self._write_paused:
            return
        if self.transport is None:
            raise ConnectionResetError("the client closed the connection")
        waiter = self._drain_waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self._drain_waiter = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
