"""SGLang's bootstrap port: where a decode engine learns how to reach a prefill's KV.

A prefill engine is named by (bootstrap host, bootstrap port), as SGLang's router names
it. The bootstrap server answers `GET /route` with the prefill's KV server address and
engine id; the decode then pulls the room's KV from that KV server (see `kv_transfer`).
"""

from __future__ import annotations

import logging

import aiohttp
import msgspec
from aiohttp import web

logger = logging.getLogger(__name__)

ROUTE_TIMEOUT_S = 5.0


class Route(msgspec.Struct, frozen=True):
    engine_id: str
    kv_host: str
    kv_port: int


def bootstrap_app(route: Route) -> web.Application:
    body = msgspec.json.encode(route)

    async def get_route(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/route", get_route)
    app.router.add_get("/health", health)
    return app


class RouteResolver:
    """Looks up (and caches) prefill routes; `forget` after a failed fetch."""

    def __init__(self) -> None:
        self._routes: dict[tuple[str, int], Route] = {}
        self._session: aiohttp.ClientSession | None = None
        self._decoder = msgspec.json.Decoder(Route)

    async def resolve(self, host: str, port: int) -> Route:
        cached = self._routes.get((host, port))
        if cached is not None:
            return cached
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=ROUTE_TIMEOUT_S))
        url = f"http://{host}:{port}/route"
        async with self._session.get(url) as response:
            response.raise_for_status()
            route = self._decoder.decode(await response.read())
        self._routes[(host, port)] = route
        return route

    def forget(self, host: str, port: int) -> None:
        self._routes.pop((host, port), None)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
