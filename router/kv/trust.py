"""Whether a member's KV events can be believed: its own reports against what they claim.

A member's KV events say which blocks it holds; the `kv` policy sends it the prompts it
claims, predicting how many prompt tokens it will not compute (`Choice.cached_tokens`,
carried by the `Pair`). The engine then says how many it found cached (vLLM's and the
reference engine's usage `prompt_tokens_details.cached_tokens`). An insider with the fleet
token can publish events for a popular prefix it does not hold and draw every request for
it; nothing else compares the claim with the deed. This does. Pure: the time comes in.

Rules, per member id (not incarnation: a liar must not wash its record by restarting):
- a report counts only when the prediction was at least one token: a member predicted to
  hold nothing cannot fall short;
- a report *falls short* when the engine found fewer than SHORT_RATIO of the predicted
  tokens (an honest engine may have evicted a block the router has not heard about yet:
  a little short is not a lie); otherwise it is *kept*;
- a shortfall adds a strike, a kept prediction takes one away. Time alone takes none
  away: a liar that lies slowly must not start afresh each time (an honest engine's
  rare shortfall, a block evicted before the router heard of it, is outweighed by the
  predictions it keeps);
- at STRIKES strikes the member is distrusted for its distrust period: the `kv` policy
  scores it as holding nothing (it still gets the requests its load earns). The period
  starts at DISTRUST_S and doubles at each new distrust, up to MAX_DISTRUST_S: a member
  that lies again once trusted wins fewer requests each time;
- when the period ends the member is trusted again with no strikes; its next period stays
  doubled (the record of offences is kept while the member is tracked).

At most MAX_TRACKED members are tracked; past that the one seen longest ago is dropped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

__all__ = ["DISTRUST_S", "MAX_DISTRUST_S", "SHORT_RATIO", "STRIKES", "CacheTrust",
           "Verdict"]

SHORT_RATIO: Final = 0.5  # found fewer than half the predicted tokens: a shortfall
STRIKES: Final = 3  # shortfalls (net of kept predictions) that make a member distrusted
DISTRUST_S: Final = 60.0  # the first distrust period...
MAX_DISTRUST_S: Final = 960.0  # ... doubling up to this (16 minutes)
MAX_TRACKED: Final = 10_000  # members tracked at once (a fleet's prefills and more)


class Verdict(enum.Enum):
    IGNORED = "ignored"  # nothing was predicted: nothing to check
    KEPT = "kept"  # the engine found (about) what its events claimed
    SHORT = "short"  # it found much less: a strike
    DISTRUSTED = "distrusted"  # the strike that made it distrusted (from now)


@dataclass(slots=True)
class _Record:
    strikes: int = 0
    offences: int = 0  # distrust periods so far (the next one is DISTRUST_S x 2^offences)
    distrusted_until: float = 0.0


class CacheTrust:
    def __init__(self, *, short_ratio: float = SHORT_RATIO, strikes: int = STRIKES,
                 distrust_s: float = DISTRUST_S, max_distrust_s: float = MAX_DISTRUST_S,
                 max_tracked: int = MAX_TRACKED) -> None:
        self.short_ratio = short_ratio
        self.strikes = strikes
        self.distrust_s = distrust_s
        self.max_distrust_s = max_distrust_s
        self.max_tracked = max_tracked
        self._records: dict[str, _Record] = {}  # insertion order = least recently seen first

    def observe(self, member_id: str, predicted: int, reported: int, now: float) -> Verdict:
        """One request's prediction for `member_id` against what its engine reported."""
        if predicted <= 0:
            return Verdict.IGNORED  # no claim was relied on
        record = self._record(member_id)
        if reported >= self.short_ratio * predicted:
            record.strikes = max(0, record.strikes - 1)
            return Verdict.KEPT
        record.strikes += 1
        if record.strikes < self.strikes or now < record.distrusted_until:
            return Verdict.SHORT
        period = min(self.max_distrust_s, self.distrust_s * 2 ** record.offences)
        record.offences += 1
        record.strikes = 0
        record.distrusted_until = now + period
        return Verdict.DISTRUSTED

    def distrusts(self, member_id: str, now: float) -> bool:
        """Whether `member_id`'s claims are to be ignored now."""
        record = self._records.get(member_id)
        return record is not None and now < record.distrusted_until

    def distrusted(self, now: float) -> dict[str, float]:
        """Member id -> seconds of distrust left, for every member distrusted now."""
        return {member_id: record.distrusted_until - now
                for member_id, record in self._records.items()
                if now < record.distrusted_until}

    def _record(self, member_id: str) -> _Record:
        record = self._records.pop(member_id, None)
        if record is None:
            record = _Record()
            while len(self._records) >= self.max_tracked:
                del self._records[next(iter(self._records))]  # the one seen longest ago
        self._records[member_id] = record  # to the end: seen most recently
        return record
