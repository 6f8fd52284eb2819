"""Which routers the planner decides from: read, stale, or left out. Pure: the clock is
a parameter.

Routers are other processes on other machines; one that cannot be read must not freeze
the fleet's scaling, and must not make it scale down either. The rules, per router:

- read        scraped this round: its figures count.
- stale       not read this round, but within `stale_after_s` of its last good scrape:
              its last figures still count (one failed scrape changes nothing).
- left out    not read for longer than that, or never read: its figures leave the
              latency windows, and the planner decides from the other routers.

And for the round: routers are registered but every one is left out, so the planner
cannot see the latency users get. It then holds: the registry's load figures may still
scale a role up, but nothing scales down (`can_scale_down`). With no router registered
at all there is no latency to miss: the rule decides from load alone, as before.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Hashable, Iterable
from dataclasses import dataclass

__all__ = ["STALE_AFTER_S", "RouterFreshness", "Standing", "can_scale_down", "standing"]

# Five planning rounds at the default 2 s interval: a restart or a slow scrape passes,
# a router that is gone is left out well before KEDA's next poll but one (15 s).
STALE_AFTER_S = 10.0


class Standing(enum.StrEnum):
    """A router's part in this round (a metric label: a small fixed set)."""

    READ = "read"
    STALE = "stale"
    LEFT_OUT = "left_out"


def standing(read_now: bool, last_read: float | None, now: float,
             stale_after_s: float) -> Standing:
    """The rule above for one router: `last_read` is its last good scrape (None: never)."""
    if read_now:
        return Standing.READ
    if last_read is not None and now - last_read <= stale_after_s:
        return Standing.STALE
    return Standing.LEFT_OUT


def can_scale_down(standings: Collection[Standing]) -> bool:
    """False when routers are registered and every one is left out: latency is unknown,
    so a lower count might be the one that misses the SLO."""
    return not standings or any(s is not Standing.LEFT_OUT for s in standings)


@dataclass(frozen=True, slots=True)
class Change:
    """A router whose standing changed this round (worth a log line)."""

    key: Hashable
    before: Standing | None  # None: first seen
    after: Standing
    unread_s: float | None  # since its last good scrape; None: never read


class RouterFreshness:
    """Each router's last good scrape, keyed by (id, incarnation): a restarted router is
    a new one. Not thread-safe: the planning loop is the one caller."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        if stale_after_s < 0:
            raise ValueError("the staleness bound must not be negative")
        self.stale_after_s = stale_after_s
        self._last_read: dict[Hashable, float | None] = {}
        self._standing: dict[Hashable, Standing] = {}

    def observe(self, key: Hashable, read_now: bool, now: float) -> tuple[Standing,
                                                                          Change | None]:
        """Record this round's scrape of KEY; its standing, and the change if any."""
        last = now if read_now else self._last_read.get(key)
        self._last_read[key] = last
        after = standing(read_now, last, now, self.stale_after_s)
        before = self._standing.get(key)
        self._standing[key] = after
        if before is after or (before is None and after is Standing.READ):
            return after, None
        return after, Change(key, before, after, None if last is None else now - last)

    def forget_except(self, keys: Iterable[Hashable]) -> None:
        """Drop routers no longer registered (gone, or a new incarnation)."""
        keep = set(keys)
        for key in [k for k in self._standing if k not in keep]:
            del self._standing[key]
            self._last_read.pop(key, None)

    def counts(self) -> dict[Standing, int]:
        out = dict.fromkeys(Standing, 0)
        for value in self._standing.values():
            out[value] += 1
        return out
