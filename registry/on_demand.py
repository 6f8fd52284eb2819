"""A value the loop builds when a reader finds it stale, handed over by swapping a reference.

The registry's HTTP side reads two such values: the snapshot (`Published`, O(members) to
build) and the membership's counts for /metrics and /healthz (`FleetFigures`, O(roles x
models)). A reader on another thread that finds its value behind (a membership change,
or older than `max_age_s`) asks the loop for a new one and waits for it (at most
`wait_s`), so it sees every change acknowledged before its read. Later readers ride on the
first one's wake-up, and with nobody reading the loop builds nothing. Builds are at least
`min_gap_s` and `cost_factor` times their own duration apart, so a flood of readers costs
the loop at most about 1/cost_factor of its time.

The loop thread calls `due_at` (for its poll deadline), `wanted` and `built`, and
whoever stops the loop `stop`; readers call `read`. No locks: the value and its time are
swapped by reference; requests go through a thread-safe queue.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class OnDemand(Generic[T]):
    def __init__(self, value: T, *, max_age_s: float, min_gap_s: float, cost_factor: float,
                 wait_s: float) -> None:
        self.value = value
        self.built_at = time.monotonic()
        self.max_age_s = max_age_s
        self.min_gap_s = min_gap_s
        self.cost_factor = cost_factor
        self.wait_s = wait_s
        self._gap_s = min_gap_s  # grows with what a build costs
        self._requests: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()
        self._stopped = False

    # --- readers (any thread but the loop's) -------------------------------------------

    def read(self, current: Callable[[T], bool], wake: Callable[[], None]) -> T:
        """The value; a new one first if `current(value)` is false or it is older than
        max_age_s (`wake` gets the loop to build it)."""
        value = self.value
        if current(value) and time.monotonic() - self.built_at <= self.max_age_s:
            return value
        built = threading.Event()
        first = self._requests.empty()  # later readers ride on the first's wake
        self._requests.put(built)
        if self._stopped:  # after the put: `stop` answered the queue before it, or sees it
            return self.value
        if first:
            wake()
        built.wait(self.wait_s)
        return self.value

    # --- the loop thread ---------------------------------------------------------------

    def due_at(self) -> float:
        """When the loop should build next (never while nobody asked)."""
        return math.inf if self._requests.empty() else self.built_at + self._gap_s

    def wanted(self, now: float) -> bool:
        """Whether a reader asked and the gap since the last build has passed."""
        return not self._requests.empty() and now >= self.built_at + self._gap_s

    def built(self, value: T, started: float) -> float:
        """Swap in `value` (built since `started`, monotonic) and answer every reader
        waiting; what the build took, in seconds."""
        self.value = value
        self.built_at = done = time.monotonic()
        cost_s = done - started
        self._gap_s = max(self.min_gap_s, self.cost_factor * cost_s)
        self._answer_waiting()
        return cost_s

    def stop(self) -> None:
        """The loop builds no more: every reader waiting, and every later one, gets the
        value as it is at once rather than at the end of its wait."""
        self._stopped = True
        self._answer_waiting()

    def _answer_waiting(self) -> None:
        while True:
            try:
                self._requests.get_nowait().set()
            except queue.Empty:
                return
