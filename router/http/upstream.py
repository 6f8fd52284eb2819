"""The one pooled HTTP/1.1 client every request to an engine goes through: keep-alive
connections per engine address.

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

    router/http/connection.py  one connection: bytes out, the parser's callbacks in
    router/http/response.py    the answer as the caller reads it, each wait bounded
    router/http/kv_hosts.py    whether a KV address may be handed to an engine
    router/http/bounds.py      the timeouts and caps, and the error naming which one hit
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from functools import lru_cache
from typing import Final
from urllib.parse import urlsplit

from router.guard import HOP_HEADER, UpstreamPolicy
from router.http.bounds import MAX_BODY_BYTES, FailureKind, Timeouts, UpstreamError
from router.http.connection import UpstreamConnection
from router.http.kv_hosts import KvHostChecks, is_ip
from router.http.response import UpstreamResponse

__all__ = ["KEEPALIVE_S", "UpstreamPool"]

logger = logging.getLogger(__name__)

# Idle pooled connections live this long: under the 5 s keep-alive of uvicorn (vLLM's and
# SGLang's servers), so the router never sends on a connection the engine is closing.
KEEPALIVE_S: Final = 4.0

_HOP: Final = HOP_HEADER.encode()


@lru_cache(maxsize=1024)
def _address(base_url: str) -> tuple[str, int, bytes]:
    """(host, port, Host header value) of an engine's base URL, e.g. http://10.0.0.5:8000."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise UpstreamError(f"only http://host:port upstreams are supported, got {base_url!r}",
                            FailureKind.MALFORMED)
    port = parts.port or 80
    return parts.hostname, port, parts.netloc.encode()


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections per engine address. Use on one event loop."""

    def __init__(self, *, timeouts: Timeouts | None = None, keepalive_s: float = KEEPALIVE_S,
                 policy: UpstreamPolicy | None = None) -> None:
        self.timeouts = timeouts or Timeouts()
        self.keepalive_s = keepalive_s
        self.policy = policy or UpstreamPolicy.build()
        self.max_body_bytes = MAX_BODY_BYTES
        self._idle: dict[tuple[str, int], list[UpstreamConnection]] = {}
        self._kv_hosts = KvHostChecks(self.policy)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the one it is used on

    async def kv_host_problem(self, host: str) -> str | None:
        """Why a KV host from a member's record may not be handed to an engine, or None
        (router/http/kv_hosts.py)."""
        return await self._kv_hosts.problem(host)

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
        response = UpstreamResponse(connection, loop=self._loop,
                                    idle_timeout_s=self.timeouts.idle_read_s,
                                    max_body_bytes=self.max_body_bytes, give_back=self._put)
        connection.response = response
        assert connection.transport is not None
        connection.transport.write(head + body)  # one send: headers and body together
        try:
            await response.wait_head(self.timeouts.first_byte_s)
        except BaseException:  # dropped, or the caller cancelled: the connection is spent
            response.close()
            raise
        return response

    def _take_idle(self, key: tuple[str, int]) -> UpstreamConnection | None:
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

    async def _get(self, key: tuple[str, int]) -> UpstreamConnection:
        """A new connection (the pool had none fit for use)."""
        loop = asyncio.get_running_loop()
        _, connection = await asyncio.wait_for(self._connect(loop, key),
                                               self.timeouts.connect_s)
        if not connection.usable:  # accepted, then lost before this task resumed
            raise UpstreamError("connection lost right after connecting")
        return connection

    async def _connect(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int]
                       ) -> tuple[asyncio.BaseTransport, UpstreamConnection]:
        """Resolve, keep only addresses the policy allows, connect to the first that
        accepts. Connecting to the checked address itself leaves no second lookup for a
        DNS answer to change."""
        host, port = key
        if is_ip(host):
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
                return await loop.create_connection(
                    lambda: UpstreamConnection(key, loop), address, port)
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

    def _put(self, connection: UpstreamConnection) -> None:
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
