"""Clients that keep one engine busy with long completions, back to back, until stopped.

The sidecar samples vLLM's /metrics every 0.5 s, and on a free core a batch of long
completions can start and finish between two samples. Checks that must see an engine
busy (load reports, a drain with requests in flight) keep it busy until they have seen
it, instead of betting on one batch lasting long enough.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 120.0


class BusyClients:
    def __init__(self, url: str, concurrency: int, body: dict[str, Any]) -> None:
        self.url = url
        self.body = body
        self.outcomes: list[str] = []  # "ok", or the HTTP status or error of each request
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(concurrency)]

    def start(self) -> BusyClients:
        for thread in self._threads:
            thread.start()
        return self

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def stop(self) -> None:
        """No new requests; those under way run to their end."""
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        self.stop()
        for thread in self._threads:
            thread.join(timeout_s)

    def failures(self) -> list[str]:
        return [outcome for outcome in self.outcomes if outcome != "ok"]

    def _client(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._in_flight += 1
            try:
                response = httpx.post(f"{self.url}/v1/completions", json=self.body,
                                      timeout=REQUEST_TIMEOUT_S)
                outcome = "ok" if response.status_code == 200 else f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                outcome = repr(exc)
            with self._lock:
                self._in_flight -= 1
                self.outcomes.append(outcome)
