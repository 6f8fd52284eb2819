"""The one pooled HTTP/1.1 client every request to an engine goes through.

Lean on purpose: a profile of the router under load put a third of its CPU in aiohttp's
client machinery (request objects, header multidicts, payload registry, tasks). Here a
request is one `transport.write` of bytes built in one go, and the answer is parsed by
httptools straight into a status, a few headers and body chunks.

Keep-alive connections are the point: a new TCP connection per leg would cost more CPU
than the rest of the router together. A connection goes back to the pool only when its
answer was read to the end; otherwise it is closed, which is how an engine learns to
stop generating.

Engines answer HTTP/1.1 with Content-Length or chunked bodies (uvicorn, aiohttp); an
answer delimited only by the connection closing counts as dropped.

Errors are `OSError`s: `UpstreamError` (a `ConnectionError`) for a dropped connection, a
malformed or oversized answer, an engine that stops answering (first-byte and idle-read
timeouts) or an address the `UpstreamPolicy` forbids; `kind` says which. A connect that
takes too long raises `TimeoutError`, a refused one whatever the socket raises (e.g.
`ConnectionRefusedError`).

Every request carries the router's hop header (see router/guard.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections import deque
from functools import lru_cache
from typing import Final
from urllib.parse import urlsplit

import httptools

from router.guard import HOP_HEADER, UpstreamPolicy, kv_address_problem
from router.http.bounds import MAX_BODY_BYTES, FailureKind, Timeouts, UpstreamError
from serving.deadline import Deadline

__all__ = ["UpstreamPool", "UpstreamResponse"]

logger = logging.getLogger(__name__)

# Idle pooled connections live this long: under the 5 s keep-alive of uvicorn (vLLM's and
# SGLang's servers), so the router never sends on a connection the engine is closing.
KEEPALIVE_S: Final = 4.0
# A stream the client reads slower than the engine writes: stop reading the engine's
# socket above this many buffered bytes (TCP then slows the engine), resume below half.
READ_HIGH_WATER_BYTES: Final = 2 * 1024 * 1024
DEFAULT_CONTENT_TYPE: Final = "application/json"  # an answer that names none
# A KV host name's check (resolved, every address against the policy) is kept this long.
KV_HOST_CHECK_TTL_S: Final = 30.0
MAX_KV_HOST_CHECKS: Final = 4096


_HOP: Final = HOP_HEADER.encode()


@lru_cache(maxsize=1024)
def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@lru_cache(maxsize=1024)
def _address(base_url: str) -> tuple[str, int, bytes]:
    """(host, port, Host header value) of an engine's base URL, e.g. http://10.0.0.5:8000."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise UpstreamError(f"only http://host:port upstreams are supported, got {base_url!r}",
                            FailureKind.MALFORMED)
    port = parts.port or 80
    return parts.hostname, port, parts.netloc.encode()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request/response at a time.

    The httptools callbacks (`on_*`) fill the current `UpstreamResponse`.
    """

    def __init__(self, key: tuple[str, int], loop: asyncio.AbstractEventLoop) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.idle_since = 0.0
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
        response = self.response
        assert response is not None
        response.status = self._parser.get_status_code()
        if self._content_type:
            response.content_type = self._content_type.decode("latin-1")
            self._content_type = b""
        response._wake()

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        response._keep_alive = self._parser.should_keep_alive()
        response._feed_eof()

    # --- used by the pool and the response ----------------------------------------------

    def arm(self, timeout_s: float) -> None:
        """The response's wait must end within `timeout_s`."""
        self._deadline.arm(timeout_s)

    def disarm(self) -> None:
        self._deadline.disarm()

    def _timed_out(self) -> None:
        if self.response is not None:
            self.response._time_out()

    def _fail(self, error: UpstreamError) -> None:
        response = self.response
        if response is not None and not response._complete:
            response._set_error(error)

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


class UpstreamResponse:
    """An engine's answer: `status` and `content_type` once `post` returns, the body
    through `read()` or `readany()`. Always `release()` or `close()` it."""

    def __init__(self, pool: UpstreamPool, connection: _Connection) -> None:
        self.idle_timeout_s = pool.timeouts.idle_read_s  # 0 = wait for ever
        self.status = 0
        self.content_type = DEFAULT_CONTENT_TYPE
        self._pool = pool
        self._connection: _Connection | None = connection
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._complete = False
        self._keep_alive = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._wait_for = (0.0, FailureKind.IDLE_TIMEOUT)  # the current wait's bound

    # --- reading ------------------------------------------------------------------------

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole (rest of the) body; UpstreamError (too_large) beyond `max_bytes`
        (default: the pool's `max_body_bytes`)."""
        if max_bytes is None:
            max_bytes = self._pool.max_body_bytes
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
        # The pool's loop: asyncio.get_running_loop() costs a getpid() system call.
        loop = self._pool._loop or asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
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

    def _time_out(self) -> None:
        """The connection's deadline for the current wait passed."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            timeout_s, kind = self._wait_for
            what = "status line" if kind is FailureKind.FIRST_BYTE_TIMEOUT else "data"
            self._set_error(UpstreamError(f"no {what} from the engine for {timeout_s:g} s",
                                          kind))

    # --- fed by the connection ----------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > READ_HIGH_WATER_BYTES and not self._paused:
            self._paused = True
            if self._connection is not None:
                self._connection.pause_reading()
        self._wake()

    def _feed_eof(self) -> None:
        self._complete = True
        self._wake()

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
            self._pool._put(connection)
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


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections per engine address. Use on one event loop."""

    def __init__(self, *, timeouts: Timeouts | None = None, keepalive_s: float = KEEPALIVE_S,
                 policy: UpstreamPolicy | None = None) -> None:
        self.timeouts = timeouts or Timeouts()
        self.keepalive_s = keepalive_s
        self.policy = policy or UpstreamPolicy.build()
        self.max_body_bytes = MAX_BODY_BYTES
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._kv_checks: dict[str, tuple[float, str | None]] = {}
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the one it is used on

    async def kv_host_problem(self, host: str) -> str | None:
        """Why a KV host from a member's record may not be handed to an engine, or None.

        An IP literal must be canonical and allowed (`kv_address_problem`). A name must
        not be a number in disguise (glibc's inet_aton reads `2852039166` and
        `0xa9fea9fe` as 169.254.169.254) and must resolve, here, only to allowed
        addresses; the answer is kept for KV_HOST_CHECK_TTL_S."""
        now = time.monotonic()
        cached = self._kv_checks.get(host)
        if cached is not None and cached[0] > now:
            return cached[1]
        if _is_ip(host.strip("[]")):
            problem = kv_address_problem(host, self.policy)
        else:
            problem = await self._check_kv_name(host)
        if len(self._kv_checks) >= MAX_KV_HOST_CHECKS:
            self._kv_checks.clear()
        self._kv_checks[host] = (now + KV_HOST_CHECK_TTL_S, problem)
        return problem

    async def _check_kv_name(self, host: str) -> str | None:
        try:
            socket.inet_aton(host)
        except OSError:
            pass
        else:
            return f"KV host {host!r} is an IPv4 address in non-canonical form"
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None,
                                                                 type=socket.SOCK_STREAM)
        except OSError as exc:
            return f"KV host {host!r} does not resolve: {exc}"
        for info in infos:
            problem = kv_address_problem(str(info[4][0]), self.policy)
            if problem is not None:
                return f"KV host {host!r} resolves to {info[4][0]}: {problem}"
        return None

    async def post(self, base_url: str, path: str, body: bytes,
                   request_id: str) -> UpstreamResponse:
        """POST JSON `body` to `base_url + path`; returns once status and headers are in."""
        host, port, host_header = _address(base_url)
        head = (b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                b"X-Request-Id: %s\r\n%s: 1\r\nContent-Length: %d\r\n\r\n"
                % (path.encode(), host_header, request_id.encode(), _HOP, len(body)))
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        key = (host, port)
        connection = self._take_idle(key) or await self._get(key)
        response = UpstreamResponse(self, connection)
        connection.response = response
        assert connection.transport is not None
        connection.transport.write(head + body)  # one send: headers and body together
        try:
            while response.status == 0:
                if response._error is not None:
                    raise response._error
                await response._wait(self.timeouts.first_byte_s,
                                     FailureKind.FIRST_BYTE_TIMEOUT)
        except BaseException:  # dropped, or the caller cancelled: the connection is spent
            response.close()
            raise
        return response

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        """A pooled connection still fit for use, or None (no coroutine: the usual case)."""
        idle = self._idle.get(key)
        if idle:
            oldest_usable = time.monotonic() - self.keepalive_s
            while idle:
                connection = idle.pop()  # the most recent: least likely to be timed out
                if connection.usable and connection.idle_since > oldest_usable:
                    return connection
                connection.close()
        return None

    async def _get(self, key: tuple[str, int]) -> _Connection:
        """A new connection (the pool had none fit for use)."""
        loop = asyncio.get_running_loop()
        _, connection = await asyncio.wait_for(self._connect(loop, key),
                                               self.timeouts.connect_s)
        if not connection.usable:  # accepted, then lost before this task resumed
            raise UpstreamError("connection lost right after connecting")
        return connection

    async def _connect(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int]
                       ) -> tuple[asyncio.BaseTransport, _Connection]:
        """Resolve, keep only addresses the policy allows, connect to the first that
        accepts. Connecting to the checked address itself leaves no second lookup for a
        DNS answer to change."""
        host, port = key
        if _is_ip(host):
            addresses = [host]
        else:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        allowed = [a for a in addresses if self.policy.allows(a)]
        if not allowed:
            raise UpstreamError(f"{host} resolves to {', '.join(addresses) or 'nothing'}, "
                                "outside --allow-upstream", FailureKind.FORBIDDEN)
        error: OSError | None = None
        for address in allowed:
            try:
                return await loop.create_connection(lambda: _Connection(key, loop), address,
                                                    port)
            except OSError as exc:
                error = exc
        assert error is not None
        raise error

    async def warm(self, base_url: str, count: int) -> int:
        """Open connections to an engine until `count` are idle in the pool, so its first
        requests do not pay for connecting; how many were opened. A failure is logged
        and ends the warm-up (a request will meet it, and handle it, for itself)."""
        host, port, _ = _address(base_url)
        key = (host, port)
        loop = asyncio.get_running_loop()
        opened = 0
        while len(self._idle.get(key, ())) < count and not self._closed:
            try:
                _, connection = await asyncio.wait_for(self._connect(loop, key),
                                                       self.timeouts.connect_s)
            except OSError as exc:  # incl. a connect timeout and a forbidden address
                logger.debug("[router] warm-up of %s stopped: %s", base_url, exc)
                break
            self._put(connection)
            opened += 1
        return opened

    def _put(self, connection: _Connection) -> None:
        if self._closed or not connection.usable:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.key, []).append(connection)

    async def close(self) -> None:
        """Close every idle connection; connections in use close when released. Safe twice."""
        self._closed = True
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
