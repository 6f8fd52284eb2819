"""Windowed figures from cumulative Prometheus series, the way `rate()` and
`histogram_quantile()` compute them. Pure: samples and the clock come in as arguments.

Routers expose cumulative histograms (TTFT, inter-token latency) and counters (requests).
The planner samples every router each tick and keeps, per (router, series), the samples
of the last window. The window's figure is the newest sample minus the one at the
window's start, summed over routers. A counter that went down means its router restarted:
as in Prometheus, the newer value then counts from zero.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["Cumulative", "Window", "quantile"]


@dataclass(frozen=True, slots=True)
class Cumulative:
    """A cumulative histogram (or, with one +Inf bucket, a counter).

    `bounds` are the buckets' upper bounds, ascending, ending with +Inf; `counts` the
    cumulative counts, non-decreasing, one per bound.
    """

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.bounds or len(self.bounds) != len(self.counts):
            raise ValueError("a histogram needs one count per bound, at least one")
        if self.bounds[-1] != math.inf:
            raise ValueError("the last bound must be +Inf")
        if any(b <= a for a, b in zip(self.bounds, self.bounds[1:], strict=False)):
            raise ValueError("bounds must ascend")
        if any(not math.isfinite(c) or c < 0 for c in self.counts):
            raise ValueError("counts must be finite and non-negative")
        if any(b < a for a, b in zip(self.counts, self.counts[1:], strict=False)):
            raise ValueError("cumulative counts must not decrease")

    @classmethod
    def counter(cls, value: float) -> Cumulative:
        return cls((math.inf,), (value,))

    @property
    def total(self) -> float:
        return self.counts[-1]

    def minus(self, older: Cumulative) -> Cumulative:
        """What happened between `older` and self; self whole if the series restarted."""
        if older.bounds != self.bounds or any(
                new < old for new, old in zip(self.counts, older.counts, strict=True)):
            return self
        return Cumulative(self.bounds, tuple(
            new - old for new, old in zip(self.counts, older.counts, strict=True)))

    def plus(self, other: Cumulative) -> Cumulative:
        if other.bounds != self.bounds:
            raise ValueError("cannot add histograms with different buckets")
        return Cumulative(self.bounds, tuple(
            a + b for a, b in zip(self.counts, other.counts, strict=True)))


def quantile(histogram: Cumulative, q: float) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket the rank falls in; the
    highest finite bound if it falls in +Inf. None when there is no observation."""
    total = histogram.total
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in zip(histogram.bounds, histogram.counts, strict=True):
        if count >= rank and count > below:
            if bound == math.inf:
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


class Window:
    """Samples of cumulative series from several sources, over the last `span_s`."""

    def __init__(self, span_s: float) -> None:
        if span_s <= 0:
            raise ValueError("the window must be positive")
        self.span_s = span_s
        self._samples: dict[tuple[Hashable, Hashable], deque[tuple[float, Cumulative]]] = {}

    def add(self, source: Hashable, key: Hashable, value: Cumulative, now: float) -> None:
        samples = self._samples.setdefault((source, key), deque())
        samples.append((now, value))
        # Keep one sample at or before the window's start: the delta's baseline.
        while len(samples) >= 2 and samples[1][0] <= now - self.span_s:
            samples.popleft()

    def forget(self, now: float) -> None:
        """Drop series whose newest sample has left the window (their router is gone)."""
        for series in [k for k, s in self._samples.items() if s[-1][0] < now - self.span_s]:
            del self._samples[series]

    def forget_source(self, source: Hashable) -> None:
        """Drop every series of SOURCE (a router left out of the decision)."""
        for series in [k for k in self._samples if k[0] == source]:
            del self._samples[series]

    def delta(self, key: Hashable, now: float) -> tuple[Cumulative, float] | None:
        """The series summed over sources, newest minus baseline, and the span it covers.

        None until some source has two samples of it in the window. Sources whose
        buckets differ from the first one's are left out (a mixed-version fleet).
        """
        total: Cumulative | None = None
        span = 0.0
        for (_, series_key), samples in self._samples.items():
            if series_key != key or len(samples) < 2 or samples[-1][0] < now - self.span_s:
                continue
            (t0, old), (t1, new) = samples[0], samples[-1]
            change = new.minus(old)
            if total is None:
                total = change
            elif change.bounds == total.bounds:
                total = total.plus(change)
            else:
                continue
            span = max(span, t1 - t0)
        if total is None or span <= 0:
            return None
        return total, span
