"""Time to first token, predicted at admission. Pure: the clock is a parameter.

A prefill's speed is measured from its grants: a grant held `t` seconds while the
member had `work` uncached tokens of this router's in flight (its own included) is a
sample of `t / work` seconds per token, the member's throughput as the router sees it
(queueing inside the engine included). Samples go into the same peak-EWMA as the
latency tracker's (router/latency.py): a slowdown shows at once, a recovery slowly.

A request that waits behind `ahead` tokens (queued before it, and in flight on the
model's prefills) and brings `own` is predicted to see its first token after
`(ahead + own) x seconds_per_token / prefills + decode`, where `decode` is the decodes'
typical time per output token (their first token). Before any sample the prediction is
the decode part alone: admission sheds nothing it has not measured.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from router.latency import DECAY_S, PeakEwma

__all__ = ["TtftPredictor"]


class TtftPredictor:
    def __init__(self, *, decay_s: float = DECAY_S) -> None:
        self.decay_s = decay_s
        self._members: dict[str, PeakEwma] = {}
        self._typical: PeakEwma | None = None

    def observe(self, member_id: str, seconds: float, work: int, now: float) -> None:
        """One released prefill grant. A sample without work or time says nothing."""
        if work <= 0 or not (seconds >= 0.0 and math.isfinite(seconds)):
            return
        sample = seconds / work
        held = self._members.get(member_id)
        if held is None:
            self._members[member_id] = PeakEwma(sample, now)
        else:
            held.observe(sample, now, self.decay_s)
        typical = self._typical
        if typical is None:
            self._typical = PeakEwma(sample, now)
        else:  # a plain EWMA: one slow member must not set the fleet's speed
            weight = math.exp(-max(0.0, now - typical.stamp) / self.decay_s)
            typical.cost = typical.cost * weight + sample * (1.0 - weight)
            typical.stamp = now

    def seconds_per_token(self, member_ids: Collection[str] = ()) -> float:
        """The mean of the members' estimates (those measured), else the fleet's."""
        known = [self._members[m].cost for m in member_ids if m in self._members]
        if known:
            return sum(known) / len(known)
        return self._typical.cost if self._typical is not None else 0.0

    def predict(self, *, ahead: int, own: int, prefills: Collection[str],
                decode_s: float) -> float:
        per_token = self.seconds_per_token(prefills)
        return (max(0, ahead) + max(0, own)) * per_token / max(1, len(prefills)) + decode_s

    def retain(self, member_ids: Collection[str]) -> None:
        for member_id in [m for m in self._members if m not in member_ids]:
            del self._members[member_id]
