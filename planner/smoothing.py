"""Load averaged over a short window. Pure: samples and the clock come in as arguments.

One heartbeat is one noisy sample of a queue: with one request in service per prefill,
a prefill's utilization reads 0 or 1 and nothing between. The rule gets each role's
running, waiting and KV use averaged over the last `span_s` (HPA, likewise, reads
metrics averaged over the metrics server's window).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["LoadMeans", "MeanLoad"]


@dataclass(frozen=True, slots=True)
class MeanLoad:
    running: float
    waiting: float
    kv_usage: float


class LoadMeans:
    def __init__(self, span_s: float) -> None:
        if span_s < 0:
            raise ValueError("the load window must not be negative")
        self.span_s = span_s
        self._samples: dict[Hashable, deque[tuple[float, MeanLoad]]] = {}

    def add(self, key: Hashable, sample: MeanLoad, now: float) -> MeanLoad:
        """Record `sample` and return the mean of the window (at least `sample`)."""
        samples = self._samples.setdefault(key, deque())
        samples.append((now, sample))
        while samples[0][0] < now - self.span_s:
            samples.popleft()
        n = len(samples)
        return MeanLoad(sum(s.running for _, s in samples) / n,
                        sum(s.waiting for _, s in samples) / n,
                        sum(s.kv_usage for _, s in samples) / n)

    def forget(self, key: Hashable) -> None:
        self._samples.pop(key, None)
