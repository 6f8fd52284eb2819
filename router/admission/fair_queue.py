"""The router's queue of requests no eligible pair has budget for yet. Pure: the clock
is a parameter, nothing here does I/O.

Rules, in the order `pop` applies them:
- Starvation guard first: a class whose oldest waiter has waited `starvation_s` or more
  is served before higher priorities (the class of the oldest such waiter first). So no
  class waits without bound, however much higher-priority traffic arrives.
- Otherwise strict priority across classes: the highest priority with a waiter.
- Within a class, weighted fair queueing across tenants by virtual token counters (VTC,
  "Fairness in Serving Large Language Models", OSDI '24): each tenant's counter grows by
  the tokens it is served over its weight; the backlogged tenant with the lowest
  counter goes next. A tenant that comes back after being idle starts at the lowest
  counter of the backlogged ones, so idleness banks no credit. When a class's queue
  empties its counters are dropped: the state is bounded by the waiters.
- Bounded: `push` refuses a waiter past `max_requests` or `max_bytes`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FairQueue", "Waiter"]


@dataclass(slots=True, eq=False)
class Waiter:
    """One queued request. `cost`: the tokens VTC charges its tenant; `size`: its bytes
    (the queue's memory); `ticket`: what the caller wakes (opaque here)."""

    klass: str
    priority: int
    tenant: str
    weight: float
    cost: int
    size: int
    arrived: float
    deadline: float
    ticket: Any = None
    queued: bool = field(default=False, repr=False)


@dataclass(slots=True)
class _ClassQueue:
    priority: int
    tenants: dict[str, deque[Waiter]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    length: int = 0
    cost: int = 0


class FairQueue:
    def __init__(self, *, max_requests: int, max_bytes: int, starvation_s: float) -> None:
        if max_requests < 0 or max_bytes < 0 or starvation_s <= 0:
            raise ValueError("bounds must be >= 0 and the starvation guard > 0")
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.starvation_s = starvation_s
        self._classes: dict[str, _ClassQueue] = {}
        self._length = 0
        self._bytes = 0

    def __len__(self) -> int:
        return self._length

    @property
    def bytes(self) -> int:
        return self._bytes

    def depth(self, klass: str) -> int:
        held = self._classes.get(klass)
        return held.length if held is not None else 0

    def push(self, waiter: Waiter) -> bool:
        """Queue `waiter`; False (nothing changed) if it would pass a bound."""
        if self._length + 1 > self.max_requests or self._bytes + waiter.size > self.max_bytes:
            return False
        queue = self._classes.get(waiter.klass)
        if queue is None:
            queue = self._classes[waiter.klass] = _ClassQueue(waiter.priority)
        line = queue.tenants.get(waiter.tenant)
        if line is None:
            # Back from idle: no credit banked (VTC's lift to the lowest backlogged counter).
            floor = min(queue.counters[t] for t in queue.tenants) if queue.tenants else 0.0
            queue.counters[waiter.tenant] = max(queue.counters.get(waiter.tenant, 0.0), floor)
            line = queue.tenants[waiter.tenant] = deque()
        line.append(waiter)
        queue.length += 1
        queue.cost += waiter.cost
        self._length += 1
        self._bytes += waiter.size
        waiter.queued = True
        return True

    def peek(self, now: float) -> Waiter | None:
        """Who `pop(now)` would serve."""
        queue = self._starved(now)
        if queue is None:
            for candidate in self._classes.values():
                if queue is None or candidate.priority > queue.priority:
                    queue = candidate
        if queue is None:
            return None
        counters, tenants = queue.counters, queue.tenants
        tenant = min(tenants, key=lambda t: (counters[t], tenants[t][0].arrived))
        return tenants[tenant][0]

    def pop(self, now: float) -> Waiter | None:
        waiter = self.peek(now)
        if waiter is not None:
            self._take(waiter, charge=True)
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        """Take out a waiter that leaves unserved (cancelled, past its deadline): its
        tenant is not charged. False if it was not queued. Safe twice."""
        if not waiter.queued:
            return False
        self._take(waiter, charge=False)
        return True

    def expired(self, now: float) -> list[Waiter]:
        """Remove and return the waiters whose deadline has passed."""
        late = [w for w in self.waiters() if w.deadline <= now]
        for waiter in late:
            self._take(waiter, charge=False)
        return late

    def ahead(self, priority: int) -> int:
        """Tokens queued at `priority` or above: what a new waiter of that priority waits
        behind (the starvation guard aside)."""
        return sum(q.cost for q in self._classes.values() if q.priority >= priority)

    def waiters(self) -> Iterator[Waiter]:
        for queue in list(self._classes.values()):
            for line in list(queue.tenants.values()):
                yield from list(line)

    def next_deadline(self) -> float | None:
        return min((w.deadline for w in self.waiters()), default=None)

    def _starved(self, now: float) -> _ClassQueue | None:
        """The class whose oldest waiter has waited `starvation_s` or more (the oldest
        such waiter's class), if any: it goes before higher priorities."""
        oldest: tuple[float, _ClassQueue] | None = None
        for queue in self._classes.values():
            arrived = min(line[0].arrived for line in queue.tenants.values())
            if now - arrived >= self.starvation_s and (oldest is None or arrived < oldest[0]):
                oldest = (arrived, queue)
        return oldest[1] if oldest is not None else None

    def _take(self, waiter: Waiter, *, charge: bool) -> None:
        queue = self._classes[waiter.klass]
        line = queue.tenants[waiter.tenant]
        if line[0] is waiter:
            line.popleft()
        else:
            line.remove(waiter)
        if charge:
            queue.counters[waiter.tenant] += waiter.cost / waiter.weight
        if not line:
            del queue.tenants[waiter.tenant]
        queue.length -= 1
        queue.cost -= waiter.cost
        self._length -= 1
        self._bytes -= waiter.size
        waiter.queued = False
        if not queue.length:
            del self._classes[waiter.klass]  # counters go with it: bounded by the waiters
