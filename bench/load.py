"""Load generation over HTTP: closed loops of requests, and one request's first token.

A closed loop (`closed_loop`) keeps `concurrency` requests in flight until `requests`
have been sent: each worker sends its next request when its last one is answered. What a
request is, is a `Send`: `completion(url, body)` posts an OpenAI completion (the body
encoded once, so the client's own CPU stays small beside the router's); a benchmark that
drives a handshake itself writes its own. Open loops (arrivals at fixed times, however
earlier requests fare) live with the benchmark that needs one (`kv_open_loop.py`) and in
`pdreg.demo.open_loop` (the planner's).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

# One request: True when it was answered as it should be (an HTTP error is False; an
# exception from aiohttp or a timeout counts as False too).
Send = Callable[[aiohttp.ClientSession], Awaitable[bool]]


@dataclass
class Load:
    """What a closed loop measured: the latencies (s) of the requests that succeeded, the
    wall time of the whole loop, and how many failed."""

    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    failed: int = 0


def completion(url: str, body: dict[str, Any]) -> Send:
    """POST `body` to `url`/v1/completions and read the answer whole; 200 is success."""
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}

    async def send(session: aiohttp.ClientSession) -> bool:
        async with session.post(url + "/v1/completions", data=payload,
                                headers=headers) as response:
            await response.read()
            return response.status == 200
    return send


async def closed_loop(send: Send, requests: int, concurrency: int,
                      timeout_s: float = 60.0) -> Load:
    """`requests` in all, `concurrency` at a time, on one connection pool without a limit."""
    load = Load()
    left = requests
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                started = time.perf_counter()
                try:
                    ok = await send(session)
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                if ok:
                    load.latencies.append(time.perf_counter() - started)
                else:
                    load.failed += 1
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        load.wall_s = time.perf_counter() - started
    return load


def run_closed_loop(send: Send, requests: int, concurrency: int,
                    timeout_s: float = 60.0) -> Load:
    """`closed_loop` from synchronous code (an event loop of its own)."""
    return asyncio.run(closed_loop(send, requests, concurrency, timeout_s))


def serves(send: Send) -> bool:
    """Whether one request succeeds now (a router or engine is up and routing)."""
    return run_closed_loop(send, 1, 1).failed == 0


def first_token_s(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    """A streamed completion's time to its first data event (the stream read to its end);
    raises on an HTTP error or a stream without one."""
    started = time.monotonic()
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}")
        ttft = None
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                ttft = time.monotonic() - started
    if ttft is None:
        raise RuntimeError("no token")
    return ttft
