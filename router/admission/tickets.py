"""What admission is handed and hands back for one request: its cost, its class and
tenant (`Who`), and the `Ticket` of an admitted request, which holds the budget
reserved for it until it is held on a pair. Plain values: no clock, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.admission.budgets import Grant
from router.admission.classes import TrafficClass

__all__ = ["Cost", "Ticket", "Who"]


@dataclass(frozen=True, slots=True)
class Cost:
    """What a request will spend: its prompt tokens and the answer tokens it may ask."""

    prompt_tokens: int
    answer_tokens: int

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.answer_tokens


@dataclass(frozen=True, slots=True)
class Who:
    """A request's class and tenant, and the tenant's weight in the fair queue."""

    klass: TrafficClass
    tenant: str
    weight: float


class Ticket:
    """An admitted request: its cost and the budget reserved for it until it is held on
    a pair (`settle`, safe twice)."""

    __slots__ = ("_reserved", "cost")

    def __init__(self, cost: Cost, reserved: Sequence[Grant] = ()) -> None:
        self.cost = cost
        self._reserved = list(reserved)

    @property
    def reserved_on(self) -> frozenset[str]:
        """The members its reservation holds room on (none once settled)."""
        return frozenset(grant.member_id for grant in self._reserved if not grant.released)

    def reserved(self, member_id: str) -> int:
        """Units its reservation holds on `member_id`."""
        return sum(grant.units for grant in self._reserved
                   if grant.member_id == member_id and not grant.released)

    def settle(self) -> None:
        reserved, self._reserved = self._reserved, []
        for grant in reserved:
            grant.release()
