"""Failure-detection rules: pure functions of the configuration and the clock.

pdreg uses the "k missed intervals" detector rather than phi accrual. Engines send a
heartbeat every interval from a dedicated thread, so inter-arrival jitter is small and
a fixed multiple of the interval is easy to reason about and to document:

    age = now - last heartbeat
    age > suspect_after_s  -> suspect  (routers stop preferring it; reversible)
    age > lease_s          -> expired  (removed, event LEFT reason=expired)

Self-preservation: if a large share of the fleet is silent at the same time, the likelier
fault is the registry's (partition, overload), so expiry pauses — for at most
`self_preservation_max_s`, after which expiry resumes (a real mass failure is then
cleaned up, and agents behind a healed partition simply register again).

The guarantee: a fleet that falls silent at once loses nobody. Members heartbeat in their
own phases, so their last heartbeats before a common silence are spread over up to one
interval, plus however late each was. "Silent", for self-preservation, therefore starts
SIMULTANEOUS_SPREAD_INTERVALS before the lease: when the first of them reaches its lease,
every other one already counts as silent, and the decision covers them all. It holds
while heartbeats arrive within one interval of when they are due. A healthy member is
never that old (its age stays below one interval plus a round trip), so counting from
there adds no false alarms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HEARTBEAT_INTERVAL_S = 1.0
SUSPECT_AFTER_INTERVALS = 2.0  # two missed heartbeats: well past normal jitter
LEASE_INTERVALS = 3.0  # the design's floor: a lease is never shorter than 3 intervals
TICK_PERIOD_S = 0.1  # the loop ticks at least this often
MAX_INGEST_PER_S = 20_000.0  # heartbeats/s the registry budgets for; the interval grows past it
SELF_PRESERVATION_SHARE = 0.5  # at least this share of members silent at once ...
SELF_PRESERVATION_MIN_SILENT = 3  # ... and at least this many (a lone death is just a death)
SELF_PRESERVATION_MAX_S = 60.0
# One interval of phase spread plus one of lateness (see the module docstring).
SIMULTANEOUS_SPREAD_INTERVALS = 2.0


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    lease_s: float = LEASE_INTERVALS * HEARTBEAT_INTERVAL_S
    suspect_after_intervals: float = SUSPECT_AFTER_INTERVALS
    tick_period_s: float = TICK_PERIOD_S
    max_ingest_per_s: float = MAX_INGEST_PER_S
    self_preservation_share: float = SELF_PRESERVATION_SHARE
    self_preservation_min_silent: int = SELF_PRESERVATION_MIN_SILENT
    self_preservation_max_s: float = SELF_PRESERVATION_MAX_S

    def __post_init__(self) -> None:
        if not self.heartbeat_interval_s > 0:
            raise ValueError("heartbeat_interval_s must be positive")
        if not self.lease_s > 0:
            raise ValueError("lease_s must be positive")
        if not self.tick_period_s > 0:
            raise ValueError("tick_period_s must be positive")
        if not 0 < self.self_preservation_share <= 1:
            raise ValueError("self_preservation_share must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class Timing:
    """The detector's thresholds for the current fleet size."""

    heartbeat_interval_s: float
    suspect_after_s: float
    lease_s: float
    silent_after_s: float  # counts toward self-preservation past this age


def timing_for(config: DetectorConfig, members: int) -> Timing:
    """Thresholds for a fleet of `members`: the interval grows to keep ingest bounded.

    The lease never drops below LEASE_INTERVALS intervals, and suspicion always comes
    before expiry.
    """
    interval = max(config.heartbeat_interval_s, members / config.max_ingest_per_s)
    scale = interval / config.heartbeat_interval_s
    lease = max(config.lease_s * scale, LEASE_INTERVALS * interval)
    suspect_after = min(config.suspect_after_intervals * interval, lease)
    silent_after = lease - SIMULTANEOUS_SPREAD_INTERVALS * interval
    return Timing(interval, suspect_after, lease, silent_after)


def loop_lag(previous_tick: float, now: float, tick_period_s: float) -> float:
    """How late the loop is: time since the previous tick beyond two tick periods.

    The loop never sleeps longer than one tick period, so anything past the allowance is
    time the registry itself was stalled (GC pause, overload, a stopped VM). Deadlines move
    by that much: a slow registry must not evict healthy engines.
    """
    return max(0.0, now - previous_tick - 2 * tick_period_s)


def is_self_preserving(silent: int, total: int, config: DetectorConfig) -> bool:
    if total == 0 or silent < config.self_preservation_min_silent:
        return False
    return silent >= math.ceil(config.self_preservation_share * total)
