"""One HTTP server on a side thread, for `HttpApp` (the router and the planner) and ASGI
(the registry)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from serving.http_messages import Request, Response
from serving.http_server import HttpApp
from serving.lifecycle import ServingThread, ShutdownState


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


@pytest.mark.parametrize("kind", ["http", "asgi"])
def test_serves_on_port_0_and_closes_twice(kind: str) -> None:
    events: list[str] = []
    app = http_app(events) if kind == "http" else asgi_app
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


def test_a_port_in_use_fails_the_start_and_leaves_nothing_running() -> None:
    first = ServingThread(asgi_app, "127.0.0.1", 0, name="first").start()
    try:
        events: list[str] = []
        second = ServingThread(http_app(events), "127.0.0.1", first.port, name="second")
        with pytest.raises(OSError):
            second.start()
        assert second.state is ShutdownState.STOPPED
        second.close()
        assert events == ["startup", "cleanup"]  # what started is cleaned up
    finally:
        first.close()
