"""Which load changes are news: a deadband per figure, with a maximum age. Pure.

Heartbeats carry loads that wobble by a request or a percent of KV every second; sending
every wobble to every router is most of the PUB traffic of a big fleet, and a router
pairing on least-loaded cannot tell 51 running requests from 52 anyway. So a change goes
into the next digest only when it moved a figure past its band since what the views were
last sent, or when it has been held back for `max_age_s` (a view's load is then never off
by more than the band for longer than that). Small values keep a band of one: 0 -> 1
running, or a queue forming, is always news.

    running, waiting  |new - sent| >= max(1, relative * sent)
    kv_usage          |new - sent| >= kv_usage_abs
    extra figures     |new - sent| >= relative * |sent|, or any change from or to 0
"""

from __future__ import annotations

from dataclasses import dataclass

from registry.protocol import Load

RELATIVE = 0.1  # a tenth of the value last sent
KV_USAGE_ABS = 0.02  # two points of KV cache use
MAX_AGE_S = 1.0  # a held-back change goes out at most this late (about one interval)


@dataclass(frozen=True, slots=True)
class Deadband:
    relative: float = RELATIVE
    kv_usage_abs: float = KV_USAGE_ABS
    max_age_s: float = MAX_AGE_S  # 0: no deadband, every change is news

    def __post_init__(self) -> None:
        if self.relative < 0 or self.kv_usage_abs < 0 or self.max_age_s < 0:
            raise ValueError("deadband settings must be >= 0")

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
