"""A steady OpenAI-compatible load: a few clients, each streaming one completion after another.

Runs on its own event loop in a background thread. Every request leaves a `RequestRecord`
(start, first token, end, outcome), so figures can be computed for any time window and a
failure can be placed against the moment something was killed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 70.0  # a client finishes the request it is in before it stops
PROMPTS = ("The quick brown fox", "Hello there", "Once upon a time", "Elastic serving is",
           "Prefill then decode", "A short prompt")
# Every other prompt starts with one of a few shared documents (eleven 16-token blocks),
# as a chat's system prompt or a RAG context would: what KV-aware pairing (the router's
# default) sends to the prefill that holds it, and what the engines' HIT% shows. The
# others start with their own number, cached nowhere: the router spreads those over
# every prefill (its ring), so an engine that joins gets traffic at once.
DOCUMENTS = tuple(f"Document {name}: " + (f"{name} notes for the elastic serving demo. " * 4)
                  for name in ("alpha", "beta", "gamma"))


@dataclass(frozen=True, slots=True)
class RequestRecord:
    started: float  # time.monotonic()
    finished: float
    ttft_s: float | None  # first streamed text, from `started`
    ok: bool
    error: str = ""

    def in_flight_at(self, moment: float) -> bool:
        return self.started <= moment < self.finished


@dataclass(frozen=True, slots=True)
class TrafficFigures:
    ok: int
    failed: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    requests_per_s: float

    def line(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1e3:.0f} ms"
        return (f"requests ok {self.ok}, failed {self.failed}, "
                f"{self.requests_per_s:.1f} req/s, TTFT p50 {ms(self.ttft_p50_s)}, "
                f"p99 {ms(self.ttft_p99_s)}")


@dataclass(frozen=True, slots=True)
class StreamRead:
    """What a client saw of one streamed completion."""

    token_times: list[float]  # monotonic, one per chunk that carried text
    error: str | None  # None: it ended with [DONE]


async def read_completion_stream(session: aiohttp.ClientSession, url: str,
                                 body: dict[str, object],
                                 on_first_token: Callable[[], object] | None = None
                                 ) -> StreamRead:
    """POST a streaming completion and read its SSE to the end; never raises for the
    request's own failures (status, error event, no [DONE], connection), it says them.
    `on_first_token`: called once, when the first text arrives."""
    token_times: list[float] = []
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                text = (await response.text())[:200]
                return StreamRead(token_times, f"HTTP {response.status}: {text}")
            async for raw in response.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return StreamRead(token_times, None)
                chunk = json.loads(data)
                if "error" in chunk:
                    return StreamRead(token_times,
                                      f"stream error: {chunk['error'].get('message')}")
                if any(c.get("text") for c in chunk.get("choices", ())):
                    token_times.append(time.monotonic())
                    if on_first_token is not None and len(token_times) == 1:
                        on_first_token()
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        return StreamRead(token_times, repr(exc)[:200])
    return StreamRead(token_times, "stream ended without [DONE]")


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def figures(records: Sequence[RequestRecord], start: float, end: float) -> TrafficFigures:
    """Figures for requests that finished in [start, end)."""
    window = [r for r in records if start <= r.finished < end]
    ttfts = [r.ttft_s for r in window if r.ok and r.ttft_s is not None]
    ok = sum(r.ok for r in window)
    return TrafficFigures(ok=ok, failed=len(window) - ok, ttft_p50_s=percentile(ttfts, 50),
                          ttft_p99_s=percentile(ttfts, 99),
                          requests_per_s=ok / (end - start) if end > start else 0.0)


class TrafficGenerator:
    """`clients` concurrent streaming completions against `url`, until `stop()`."""

    def __init__(self, url: str, *, model: str = "tiny", clients: int = 3,
                 max_tokens: int = 8) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.clients = clients
        self.max_tokens = max_tokens
        self._records: list[RequestRecord] = []  # appended by the loop thread only
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._numbers = itertools.count()

    # --- control (any thread) ----------------------------------------------------------

    def start(self) -> TrafficGenerator:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()),
                                        name="demo-traffic", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Let every client finish its current request, then end. Safe twice."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("[demo] traffic did not stop within %.0fs", STOP_TIMEOUT_S)

    def records(self) -> list[RequestRecord]:
        return list(self._records)

    @property
    def ok_count(self) -> int:
        return sum(r.ok for r in self.records())

    def wait_ok(self, count: int, timeout_s: float) -> bool:
        """Block until `count` more requests succeeded than now, or timeout."""
        target = self.ok_count + count
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ok_count >= target:
                return True
            time.sleep(0.05)
        return self.ok_count >= target

    # --- the load (loop thread) --------------------------------------------------------

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._client(session) for _ in range(self.clients)))

    async def _client(self, session: aiohttp.ClientSession) -> None:
        while not self._stopping.is_set():
            record = await self._one_request(session, next(self._numbers))
            self._records.append(record)
            if not record.ok:
                logger.info("[demo] request failed: %s", record.error)
                await asyncio.sleep(0.05)  # a failing cluster is not hammered in a spin

    async def _one_request(self, session: aiohttp.ClientSession, number: int
                           ) -> RequestRecord:
        question = PROMPTS[number % len(PROMPTS)]
        prompt = (f"{DOCUMENTS[number // 2 % len(DOCUMENTS)]}{question} {number}"
                  if number % 2 == 0 else f"Request {number}: {question}")
        body = {"model": self.model, "prompt": prompt,
                "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        started = time.monotonic()
        read = await read_completion_stream(session, f"{self.url}/v1/completions", body)
        ttft = read.token_times[0] - started if read.token_times else None
        return RequestRecord(started, time.monotonic(), ttft, read.error is None, read.error)


class HeldStreams:
    """`count` long streamed completions at once, on a thread of their own: streams a
    step can be sure are mid-answer (every one has its first token) when it acts."""

    def __init__(self, url: str, *, model: str, count: int, max_tokens: int) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.count = count
        self.max_tokens = max_tokens
        self.reads: list[StreamRead] = []
        self._started = 0
        self._all_started = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HeldStreams:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()),
                                        name="demo-held-streams", daemon=True)
        self._thread.start()
        return self

    def wait_started(self, timeout_s: float) -> bool:
        """Block until every stream has its first token."""
        return self._all_started.wait(timeout_s)

    def wait_done(self, timeout_s: float) -> list[StreamRead]:
        """Block until every stream ended; what each client saw."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return list(self.reads)

    def _first_token(self) -> None:
        self._started += 1
        if self._started == self.count:
            self._all_started.set()

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            bodies = [{"model": self.model, "prompt": f"held stream {i}",
                       "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
                      for i in range(self.count)]
            self.reads = list(await asyncio.gather(*(
                read_completion_stream(session, f"{self.url}/v1/completions", body,
                                       self._first_token) for body in bodies)))
