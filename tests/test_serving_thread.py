"""One HTTP server on a side thread, for the router's own server, aiohttp (planner) and ASGI
(registry)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from aiohttp import web

from registry.lifecycle import ServingThread, ShutdownState
from router.http_messages import Request, Response
from router.http_server import HttpApp


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


def http_app(events: list[str]) -> HttpApp:
    async def hello(request: Request) -> Response:
        return Response(200, b"http", content_type="text/plain")

    async def started() -> None:
        events.append("startup")

    async def cleaned() -> None:
        events.append("cleanup")
    app = HttpApp()
    app.add("GET", "/", hello)
    app.on_startup.append(started)
    app.on_cleanup.append(cleaned)
    return app


async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"asgi"})


@pytest.mark.parametrize("kind", ["http", "aiohttp", "asgi"])
def test_serves_on_port_0_and_closes_twice(kind: str) -> None:
    events: list[str] = []
    app = {"http": http_app, "aiohttp": aiohttp_app}.get(kind, lambda _: asgi_app)(events)
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
    if kind != "asgi":
        assert events == ["startup", "cleanup"]


@pytest.mark.parametrize("kind", ["http", "aiohttp"])
def test_a_port_in_use_fails_the_start_and_leaves_nothing_running(kind: str) -> None:
    first = ServingThread(asgi_app, "127.0.0.1", 0, name="first").start()
    try:
        events: list[str] = []
        app = http_app(events) if kind == "http" else aiohttp_app(events)
        second = ServingThread(app, "127.0.0.1", first.port, name="second")
        with pytest.raises(OSError):
            second.start()
        assert second.state is ShutdownState.STOPPED
        second.close()
        if kind == "http":  # what started is cleaned up
            assert events == ["startup", "cleanup"]
    finally:
        first.close()
