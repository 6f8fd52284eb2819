"""bench_kv's open loop: each request at its arrival time, however the earlier ones fare,
with changes to the fleet (`Changes`) made beside the arrivals."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import httpx

from bench.load import first_token_s


class Changes(Protocol):
    """What happens to the fleet during a run: `before(i)` as request i is due (it may
    start a thread), `join()` once every request was sent."""

    def before(self, i: int) -> None: ...

    def join(self) -> None: ...


class OpenLoop:
    """Each request at its arrival time, however the earlier ones fare (a closed loop of
    a few clients keeps every prefill queued, whatever the router does): streamed
    completions, one HTTP client per worker thread, time to first token each. Several
    `urls` (router replicas): request i goes to urls[i % len(urls)]."""

    def __init__(self, urls: Sequence[str], *, max_tokens: int, workers: int) -> None:
        self.urls = list(urls)
        self.max_tokens, self.workers = max_tokens, workers
        self.lock = threading.Lock()
        self.ttfts: list[float] = []
        self.by_request: dict[int, float] = {}
        self.errors = 0
        self._local = threading.local()
        self._clients: list[httpx.Client] = []

    def run(self, trace: list[str], times: list[float], mid: Changes,
            max_tokens: Sequence[int] | None = None, window: range | None = None) -> None:
        """`max_tokens`: each request's own (a chat's answers), else `self.max_tokens`.
        `window`: only these requests of the trace, the first due at once (the others
        at their arrival times after it), else all; returns once every one is answered."""
        window = window if window is not None else range(len(times))
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            started = time.monotonic() - (times[window[0]] if window else 0.0)
            for i in window:
                at = times[i]
                mid.before(i)
                delay = started + at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                pool.submit(self._one, i, trace[i],
                            max_tokens[i] if max_tokens else self.max_tokens)
        mid.join()
        for c in self._clients:
            c.close()

    def _one(self, i: int, prompt: str, max_tokens: int) -> None:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(timeout=120)
            with self.lock:
                self._clients.append(client)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "ignore_eos": True}
        try:
            t = first_token_s(client, self.urls[i % len(self.urls)], body)
            with self.lock:
                self.ttfts.append(t)
                self.by_request[i] = t
        except Exception as exc:
            with self.lock:
                self.errors += 1
                if self.errors <= 3:
                    print(f"   request {i} failed: {exc!r}", flush=True)
