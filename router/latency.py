"""What each member's service time has been, as the router saw it: peak-EWMA.

Every leg the router runs times its member: a prefill's leg (request to KV ready), a
decode's time per output token. `PeakEwma` keeps one estimate per member and role, the
way Finagle's and Linkerd's peak-EWMA balancers do: a sample above the estimate replaces
it at once (a member that slows down is avoided at once), a sample below pulls it down by
an exponentially time-weighted average (a member must stay fast for a while to be trusted
again). Pairing multiplies the estimate by the member's outstanding work, so a member
twice as slow takes about half as much.

Two rules keep the estimates honest:
- A member with no samples yet is costed at the fleet's typical value (an EWMA of every
  sample of that role), so a new member gets traffic at once and is measured.
- A member whose estimate has not been refreshed for PROBE_INTERVAL_S is due a probe:
  pairing sends it the next request it is sampled for, one request, then waits for the
  answer's sample. A member that was slow and has recovered wins its traffic back (a low
  sample after a long gap outweighs the old estimate); one still slow costs one request
  per interval, not a share of the traffic.

Pure: the clock is a parameter; the router's loop is the only user (no locks).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Final

__all__ = ["DECAY_S", "PROBE_INTERVAL_S", "LatencyTracker", "PeakEwma"]

# How fast an estimate forgets: the weight of the old estimate after t seconds is
# exp(-t / DECAY_S). Finagle and Linkerd use 10 s.
DECAY_S: Final = 10.0
# An estimate this old makes its member due a probe (one request, to be measured again).
PROBE_INTERVAL_S: Final = 30.0


@dataclass(slots=True)
class PeakEwma:
    """One estimate (seconds) and when it was last refreshed."""

    cost: float
    stamp: float

    def observe(self, sample: float, now: float, decay_s: float) -> None:
        if sample > self.cost:
            self.cost = sample  # the peak: a slowdown shows at once
        else:
            weight = math.exp(-max(0.0, now - self.stamp) / decay_s)
            self.cost = self.cost * weight + sample * (1.0 - weight)
        self.stamp = now


class LatencyTracker:
    """Estimates per (role, member id), reset when the member's incarnation changes."""

    def __init__(self, *, decay_s: float = DECAY_S,
                 probe_interval_s: float = PROBE_INTERVAL_S) -> None:
        if decay_s <= 0 or probe_interval_s <= 0:
            raise ValueError("decay and probe interval must be positive")
        self.decay_s = decay_s
        self.probe_interval_s = probe_interval_s
        self._members: dict[tuple[str, str], tuple[int, PeakEwma]] = {}
        self._typical: dict[str, PeakEwma] = {}
        self._probing: dict[tuple[str, str], float] = {}  # probes sent, awaiting a sample

    def observe(self, role: str, member_id: str, incarnation: int, sample_s: float,
                now: float) -> None:
        """Record one service time. Negative or non-finite samples are ignored."""
        if not (sample_s >= 0.0 and math.isfinite(sample_s)):
            return
        key = (role, member_id)
        self._probing.pop(key, None)
        held = self._members.get(key)
        if held is None or held[0] != incarnation:
            self._members[key] = (incarnation, PeakEwma(sample_s, now))
        else:
            held[1].observe(sample_s, now, self.decay_s)
        typical = self._typical.get(role)
        if typical is None:
            self._typical[role] = PeakEwma(sample_s, now)
        else:  # a plain EWMA: one slow member must not make the fleet's typical value
            weight = math.exp(-max(0.0, now - typical.stamp) / self.decay_s)
            typical.cost = typical.cost * weight + sample_s * (1.0 - weight)
            typical.stamp = now

    def typical(self, role: str) -> float:
        """The fleet's typical service time for `role` (0 before any sample)."""
        held = self._typical.get(role)
        return held.cost if held is not None else 0.0

    def cost(self, role: str, member_id: str, incarnation: int) -> float:
        """The estimate for one member: its own, or the typical value if it has none."""
        held = self._members.get((role, member_id))
        if held is None or held[0] != incarnation:
            return self.typical(role)
        return held[1].cost

    def weight(self, role: str, member_id: str, incarnation: int, now: float) -> float:
        """`cost`, or -1.0 when the member is due a probe (`probe_due`): what pairing
        multiplies a member's outstanding work by, in one lookup (it runs four times
        per request)."""
        key = (role, member_id)
        held = self._members.get(key)
        if held is None or held[0] != incarnation:
            return self.typical(role)
        estimate = held[1]
        if now - estimate.stamp >= self.probe_interval_s:
            sent = self._probing.get(key)
            if sent is None or now - sent >= self.probe_interval_s:
                return -1.0
        return estimate.cost

    def probe_due(self, role: str, member_id: str, incarnation: int, now: float) -> bool:
        """Its estimate is PROBE_INTERVAL_S old and no probe is out (or the last one is
        that old too: its answer never came)."""
        key = (role, member_id)
        held = self._members.get(key)
        if held is None or held[0] != incarnation:
            return False
        if now - held[1].stamp < self.probe_interval_s:
            return False
        sent = self._probing.get(key)
        return sent is None or now - sent >= self.probe_interval_s

    def probing(self, role: str, member_id: str, now: float) -> None:
        """A probe went out to the member; no other until its sample (or an interval)."""
        self._probing[(role, member_id)] = now

    def retain(self, member_ids: Collection[str]) -> None:
        """Forget every member not in `member_ids` (a view read whole)."""
        for key in [k for k in self._members if k[1] not in member_ids]:
            del self._members[key]
            self._probing.pop(key, None)

    def forget(self, member_ids: Iterable[str]) -> None:
        """Forget members that left the view: costs them, not the members tracked."""
        roles = self._typical.keys()  # every role a sample came for
        for member_id in member_ids:
            for role in roles:
                key = (role, member_id)
                self._members.pop(key, None)
                self._probing.pop(key, None)

    def estimates(self) -> dict[tuple[str, str], float]:
        """(role, member id) -> current estimate, for metrics and tests."""
        return {key: held.cost for key, (_, held) in self._members.items()}
