"""An open-loop load that follows a rate profile: requests arrive on their own schedule
(Poisson, seeded), whether or not earlier ones have finished, as users do. A closed loop
of N clients slows down when the fleet does and hides the queue a planner must see.

Each request streams a completion and leaves an `Outcome`: time to first token, mean
inter-token latency (the time per output token after the first), success. `attainment`
turns outcomes into SLO attainment the way DistServe and Dynamo report it: the share of
requests that met the objective, failures counting as misses.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from pdreg.demo.traffic import read_completion_stream

__all__ = ["Attainment", "OpenLoopLoad", "Outcome", "Phase", "Workload", "attainment"]

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = REQUEST_TIMEOUT_S + 10.0
MAX_IN_FLIGHT = 2000  # beyond this the fleet is hopeless; arrivals are counted as failed
_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")


@dataclass(frozen=True, slots=True)
class Phase:
    """`duration_s` of arrivals whose rate moves linearly from `start_rate` to `end_rate`."""

    name: str
    duration_s: float
    start_rate: float
    end_rate: float

    def rate_at(self, elapsed_s: float) -> float:
        share = min(1.0, max(0.0, elapsed_s / self.duration_s)) if self.duration_s else 1.0
        return self.start_rate + (self.end_rate - self.start_rate) * share

    @property
    def rate_text(self) -> str:
        if self.start_rate == self.end_rate:
            return f"{self.start_rate:g}/s"
        return f"{self.start_rate:g}->{self.end_rate:g}/s"


@dataclass(frozen=True, slots=True)
class Workload:
    model: str = "tiny"
    prompt_tokens: int = 200  # the reference engines' tokens are bytes (+ BOS)
    max_tokens: int = 32


@dataclass(frozen=True, slots=True)
class Outcome:
    phase: str
    started: float  # time.monotonic()
    finished: float
    ttft_s: float | None
    itl_s: float | None  # mean gap between tokens after the first
    ok: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class Attainment:
    requests: int
    failed: int
    ttft: float  # share of requests that met the TTFT SLO (failures miss)
    itl: float
    both: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None

    def line(self, ttft_slo_s: float, itl_slo_s: float) -> str:
        if not self.requests:
            return "no requests"
        return (f"{self.requests} requests, {self.failed} failed; TTFT <= "
                f"{ttft_slo_s * 1e3:.0f} ms: {self.ttft:.0%}, ITL <= {itl_slo_s * 1e3:.0f} ms: "
                f"{self.itl:.0%}; TTFT p50 {_ms(self.ttft_p50_s)}, p90 {_ms(self.ttft_p90_s)}")


def attainment(outcomes: Sequence[Outcome], ttft_slo_s: float, itl_slo_s: float
               ) -> Attainment:
    n = len(outcomes)
    if not n:
        return Attainment(0, 0, 0.0, 0.0, 0.0, None, None)
    ttft_ok = [o.ok and o.ttft_s is not None and o.ttft_s <= ttft_slo_s for o in outcomes]
    itl_ok = [o.ok and (o.itl_s is None or o.itl_s <= itl_slo_s) for o in outcomes]
    ttfts = sorted(o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None)
    return Attainment(
        requests=n, failed=sum(not o.ok for o in outcomes), ttft=sum(ttft_ok) / n,
        itl=sum(itl_ok) / n, both=sum(a and b for a, b in zip(ttft_ok, itl_ok, strict=True)) / n,
        ttft_p50_s=_nearest_rank(ttfts, 0.5), ttft_p90_s=_nearest_rank(ttfts, 0.9))


def _nearest_rank(ordered: list[float], q: float) -> float | None:
    return ordered[max(1, math.ceil(q * len(ordered))) - 1] if ordered else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


class OpenLoopLoad:
    """Runs `profile` once against `url` on a background event loop."""

    def __init__(self, url: str, profile: Sequence[Phase], workload: Workload = Workload(),
                 seed: int = 0) -> None:
        self.url = url.rstrip("/")
        self.profile = tuple(profile)
        self.workload = workload
        self._rng = random.Random(seed)
        self._outcomes: list[Outcome] = []  # appended by the loop thread only
        self._done = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._in_flight = 0
        self.started_at = 0.0
        self.phase_started: dict[str, float] = {}  # name -> monotonic start

    def start(self) -> OpenLoopLoad:
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()),
                                        name="pdreg-open-loop", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until every phase ran and every request finished."""
        return self._done.wait(timeout_s)

    def stop(self) -> None:
        """No more arrivals; wait for requests in flight. Safe twice."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)

    def outcomes(self, phase: str | None = None) -> list[Outcome]:
        return [o for o in list(self._outcomes) if phase is None or o.phase == phase]

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=0)
        tasks: set[asyncio.Task[None]] = set()
        try:
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
                number = 0
                for phase in self.profile:
                    began = time.monotonic()
                    self.phase_started[phase.name] = began
                    next_at = began
                    while not self._stopping.is_set():
                        now = time.monotonic()
                        if now - began >= phase.duration_s:
                            break
                        if now < next_at:
                            await asyncio.sleep(min(next_at - now, 0.05))
                            continue
                        task = asyncio.create_task(self._one(session, phase.name, number))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                        number += 1
                        rate = phase.rate_at(next_at - began)
                        # A rate of 0 means a pause: look again in a moment.
                        next_at += self._rng.expovariate(rate) if rate > 0 else 0.1
                if tasks:
                    await asyncio.wait(tasks)
        finally:
            self._done.set()

    async def _one(self, session: aiohttp.ClientSession, phase: str, number: int) -> None:
        started = time.monotonic()
        if self._in_flight >= MAX_IN_FLIGHT:
            self._outcomes.append(Outcome(phase, started, started, None, None, False,
                                          "load generator: too many requests in flight"))
            return
        self._in_flight += 1
        try:
            self._outcomes.append(await self._stream(session, phase, number, started))
        finally:
            self._in_flight -= 1

    def _prompt(self, number: int) -> str:
        words = " ".join(_WORDS[(number + i) % len(_WORDS)] for i in range(8))
        text = f"request {number}: {words} "
        return (text * (self.workload.prompt_tokens // len(text) + 1))[
            : max(1, self.workload.prompt_tokens - 1)]

    async def _stream(self, session: aiohttp.ClientSession, phase: str, number: int,
                      started: float) -> Outcome:
        body = {"model": self.workload.model, "prompt": self._prompt(number),
                "max_tokens": self.workload.max_tokens, "ignore_eos": True, "stream": True}
        read = await read_completion_stream(session, f"{self.url}/v1/completions", body)
        finished, token_times = time.monotonic(), read.token_times
        if read.error is not None or not token_times:
            return Outcome(phase, started, finished, None, None, False, read.error or "no tokens")
        itl = ((token_times[-1] - token_times[0]) / (len(token_times) - 1)
               if len(token_times) > 1 else None)
        return Outcome(phase, started, finished, token_times[0] - started, itl, True)
