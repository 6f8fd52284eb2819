"""Which load changes are news: a deadband per figure, with a maximum age. Pure.

Heartbeats carry loads that wobble by a request or a percent of KV every second; sending
every wobble to every router is most of the PUB traffic of a big fleet, and a router
pairing on least-loaded cannot tell 51 running requests from 52 anyway. So a change goes
into the next digest only when it moved a figure past its band since what the views were
last sent, or when it has been held back for `max_age_s`, or `max_age_intervals`
heartbeat intervals if that is longer (a view's load is then never off by more than the
band for longer than that). The interval grows with the fleet (5 s at 100k members), and
a change inside the band is by definition not worth routing on: holding it for two
intervals lets the next heartbeat fold into it: members whose loads wobble on every 5 s
beat send ~60% fewer entries than with a fixed 1 s, which let every beat through
(`bench_scale.py --deadband`). Small values keep a band of one: 0 -> 1 running, or a
queue forming, is always news.

    running, waiting  |new - sent| >= max(1, relative * sent)
    kv_usage          |new - sent| >= kv_usage_abs
    extra figures     |new - sent| >= relative * |sent|, or any change from or to 0
"""

from __future__ import annotations

from dataclasses import dataclass

from wire.protocol import Load

RELATIVE = 0.1  # a tenth of the value last sent
KV_USAGE_ABS = 0.02  # two points of KV cache use
MAX_AGE_S = 1.0  # a held-back change goes out at most this late (about one interval)...
MAX_AGE_INTERVALS = 2.0  # ... or this many heartbeat intervals, whichever is longer


@dataclass(frozen=True, slots=True)
class Deadband:
    relative: float = RELATIVE
    kv_usage_abs: float = KV_USAGE_ABS
    max_age_s: float = MAX_AGE_S  # 0: no deadband, every change is news
    max_age_intervals: float = 0.0  # the registry sets MAX_AGE_INTERVALS

    def __post_init__(self) -> None:
        if (self.relative < 0 or self.kv_usage_abs < 0 or self.max_age_s < 0
                or self.max_age_intervals < 0):
            raise ValueError("deadband settings must be >= 0")

    def max_age_for(self, heartbeat_interval_s: float) -> float:
        """How long a change inside the band may be held at this heartbeat interval."""
        return max(self.max_age_s, self.max_age_intervals * heartbeat_interval_s)

    @property
    def enabled(self) -> bool:
        return self.max_age_s > 0


def is_news(sent: Load, new: Load, band: Deadband) -> bool:
    """Whether `new` differs from `sent` (what the views hold) by more than the band."""
    if not band.enabled:
        return new != sent
    if abs(new.running - sent.running) >= max(1.0, band.relative * sent.running):
        return True
    if abs(new.waiting - sent.waiting) >= max(1.0, band.relative * sent.waiting):
        return True
    if abs(new.kv_usage - sent.kv_usage) >= band.kv_usage_abs and new.kv_usage != sent.kv_usage:
        return True
    if new.extra == sent.extra:
        return False
    for name in new.extra.keys() | sent.extra.keys():
        before, after = sent.extra.get(name), new.extra.get(name)
        if before == after:
            continue
        if before is None or after is None or (before == 0) != (after == 0):
            return True
        if abs(after - before) >= band.relative * abs(before):
            return True
    return False
