"""A prefill's budget, steered by what its legs take. Pure: no clock, no I/O.

The flag's budget is a cap. Under it, each member's budget follows its own prefill legs
against a target time (a share of the top class's TTFT SLO), the way a latency-target
concurrency limiter does (TCP Vegas; Netflix's concurrency-limits):

- a leg slower than the target lowers the budget to the work the member would get
  through within the target at the speed that leg showed (`work x target / seconds`):
  a request admitted to it then waits inside the engine about the target, no more;
- a leg within the target, taken while the member's work was near its budget, raises
  the budget by GROWTH: an engine that batches (a GPU: more work, about the same time)
  is given more until its legs slow down, one that works serially is not.

A member's first budget is the cap; the state is one number per member, dropped when it
leaves.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Final

__all__ = ["GROWTH", "NEAR_LIMIT", "AdaptiveLimit"]

GROWTH: Final = 1.25  # per leg within target, while near the budget
NEAR_LIMIT: Final = 0.75  # work at this share of the budget or more counts as "near"
UNCAPPED_START: Final = 1 << 20  # a member's first budget when the flag sets no cap


class AdaptiveLimit:
    def __init__(self, *, cap: int, target_s: float) -> None:
        """`cap`: the flag's budget (0: none); `target_s`: the leg time to keep under."""
        if cap < 0 or target_s <= 0:
            raise ValueError("cap must be >= 0 and the target > 0")
        self.cap = cap
        self.target_s = target_s
        self._limits: dict[str, int] = {}

    def limit(self, member_id: str) -> int:
        return self._limits.get(member_id, self.cap or UNCAPPED_START)

    def observe(self, member_id: str, seconds: float, work: int) -> None:
        """One prefill leg: `seconds` long, taken with `work` units on the member."""
        if work <= 0 or not seconds >= 0.0:
            return
        current = self.limit(member_id)
        if seconds > self.target_s:
            current = min(current, max(1, int(work * self.target_s / seconds)))
        elif work >= NEAR_LIMIT * current:
            grown = max(current + 1, int(current * GROWTH))
            current = min(grown, self.cap) if self.cap else min(grown, UNCAPPED_START)
        self._limits[member_id] = current

    def retain(self, member_ids: Collection[str]) -> None:
        for member_id in [m for m in self._limits if m not in member_ids]:
            del self._limits[member_id]
