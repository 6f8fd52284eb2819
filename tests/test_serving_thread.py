"""One HTTP server on a side thread, for aiohttp (router, planner) and ASGI (registry)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from aiohttp import web

from registry.lifecycle import ServingThread, ShutdownState


def aiohttp_app(events: list[str]) -> web.Application:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="aiohttp")

    async def started(app: web.Application) -> None:
        events.append("startup")

    async def cleaned(app: web.Application) -> None:
        events.append("cleanup")
    app = web.Application()
    app.router.add_get("/", hello)
    app.on_startup.append(started)
    app.on_cleanup.append(cleaned)
    return app


async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"asgi"})


@pytest.mark.parametrize("kind", ["aiohttp", "asgi"])
def test_serves_on_port_0_and_closes_twice(kind: str) -> None:
    events: list[str] = []
    app = aiohttp_app(events) if kind == "aiohttp" else asgi_app
    serving = ServingThread(app, "127.0.0.1", 0, name=f"test-{kind}").start()
    url = f"http://127.0.0.1:{serving.port}/"
    try:
        assert serving.port > 0
        assert httpx.get(url).text == kind
    finally:
        serving.close()
    serving.close()  # safe twice
    assert serving.state is ShutdownState.STOPPED
    with pytest.raises(httpx.ConnectError):
        httpx.get(url)
    if kind == "aiohttp":
        assert events == ["startup", "cleanup"]


def test_a_port_in_use_fails_the_start_and_leaves_nothing_running() -> None:
    first = ServingThread(asgi_app, "127.0.0.1", 0, name="first").start()
    try:
        second = ServingThread(aiohttp_app([]), "127.0.0.1", first.port, name="second")
        with pytest.raises(OSError):
            second.start()
        assert second.state is ShutdownState.STOPPED
        second.close()
    finally:
        first.close()
