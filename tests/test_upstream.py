"""The router's upstream HTTP client at its edges, over real loopback sockets."""

from __future__ import annotations

import asyncio

import pytest

from router.guard import LOOPBACK_ALLOW, UpstreamPolicy
from router.http.bounds import FailureKind, UpstreamError
from router.http.upstream import UpstreamPool


def test_a_connection_lost_before_the_request_is_a_leg_failure_not_a_crash() -> None:
    """An engine killed between accepting and the router's task resuming: the request
    fails as a reset (retried on another pair), not with an AssertionError (a 500)."""
    async def run() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool(policy=UpstreamPolicy.build(LOOPBACK_ALLOW))
        connect = pool._connect
        opened: list[asyncio.BaseTransport] = []

        async def connect_then_lose(loop, key):  # type: ignore[no-untyped-def]
            transport, connection = await connect(loop, key)
            opened.append(transport)
            connection.connection_lost(None)  # before post() resumes
            return transport, connection

        pool._connect = connect_then_lose  # type: ignore[method-assign]
        try:
            with pytest.raises(UpstreamError) as caught:
                await pool.post(f"http://127.0.0.1:{port}", "/v1/completions", b"{}", "r1")
            assert caught.value.kind is FailureKind.RESET
        finally:
            for transport in opened:
                transport.close()
            await pool.close()
            server.close()
            await server.wait_closed()

    asyncio.run(run())
