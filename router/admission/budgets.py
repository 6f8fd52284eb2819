"""What this router has in flight on each member, in the units P/D spends. Pure: the
clock is a parameter, nothing here does I/O.

One `Budgets` per role: a prefill's budget is uncached prompt tokens (what it must
compute), a decode's is tokens of KV it must hold (prompt + answer). A `Grant` is one
request's units on one member; it is taken when the request is held on a pair and
released when that leg ends (a prefill's when the handshake is done, a decode's when
the answer is). `release` is safe twice, so a cancellation, a retry on a new pair or a
migration can never free a unit twice or leave one behind: the counts are exactly the
sum of the grants not yet released, never negative.

A grant counts against the member's request limit (its running slots) from `count()`
on: a prefill's and a mixed member's at once, a decode's only once its prefill's part
is done. A request spends its prefill leg off the decode, so counting it there from
admission would hold a decode's slot idle for a whole prefill and cap the fleet below
its prefills' capacity (measured: 3.3 requests/s served against 4.2 on the overload
bench's 2P2D). Its units (KV it will hold) count from the take.

A member fits a request when the request's units fit under its limit, or when nothing
of this router's is in flight there: a prompt larger than the whole budget is still
served, alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

__all__ = ["UNLIMITED", "Budgets", "Grant", "Limit", "Releasable", "ThenCount", "Together"]


@dataclass(frozen=True, slots=True)
class Limit:
    """What one member may have in flight from this router. 0: no limit of that kind."""

    units: int = 0
    requests: int = 0


UNLIMITED = Limit()


class Releasable(Protocol):
    def release(self) -> None:
        """Give back what was taken; safe twice."""

# Called after every release: (member id, seconds the grant was held (-1.0 when it was
# not timed), units in flight on the member when it was taken, its own included): how
# fast the member works through units.
OnRelease = Callable[[str, float, int], None]


class Grant:
    __slots__ = ("_budgets", "counted", "member_id", "taken_at", "timed", "units", "work")

    def __init__(self, budgets: Budgets, member_id: str, units: int, taken_at: float,
                 work: int, timed: bool) -> None:
        self._budgets: Budgets | None = budgets
        self.member_id = member_id
        self.units = units
        self.taken_at = taken_at
        self.work = work
        self.timed = timed  # its release is a sample of the member's speed
        self.counted = False  # it holds one of the member's request slots

    @property
    def released(self) -> bool:
        return self._budgets is None

    def count(self) -> None:
        """From now on the grant holds one of the member's request slots. Safe twice; a
        no-op once released (a leg that failed before its decode part began)."""
        if self._budgets is not None and not self.counted:
            self.counted = True
            self._budgets._count(self.member_id)

    def release(self) -> None:
        """Give the units back. Safe twice."""
        budgets, self._budgets = self._budgets, None
        if budgets is not None:
            budgets._give_back(self)


class Budgets:
    """member id -> (units, counted requests, grants) in flight. One event loop uses it;
    no locks."""

    def __init__(self, clock: Callable[[], float], on_release: OnRelease | None = None
                 ) -> None:
        self._clock = clock
        self._on_release = on_release
        self._units: dict[str, int] = {}
        self._requests: dict[str, int] = {}  # grants counted (holding a request slot)
        self._grants: dict[str, int] = {}  # grants not yet released

    def used(self, member_id: str) -> int:
        return self._units.get(member_id, 0)

    def requests(self, member_id: str) -> int:
        return self._requests.get(member_id, 0)

    def members(self) -> Iterator[tuple[str, int, int]]:
        """(member id, units, grants) for every member with something in flight."""
        for member_id, grants in self._grants.items():
            yield member_id, self._units.get(member_id, 0), grants

    def fits(self, member_id: str, units: int, limit: Limit) -> bool:
        """Room for one more request that counts at once (`limit.requests`)."""
        if not self._grants.get(member_id, 0):
            return True  # alone, anything fits: a large prompt must not wait forever
        if limit.requests and self._requests.get(member_id, 0) + 1 > limit.requests:
            return False
        return not limit.units or self._units.get(member_id, 0) + units <= limit.units

    def full(self, member_id: str, limit: Limit) -> bool:
        """No request at all may be added (pairing skips such a member)."""
        if not self._grants.get(member_id, 0):
            return False
        return bool(limit.requests and self._requests.get(member_id, 0) >= limit.requests
                    ) or bool(limit.units and self._units.get(member_id, 0) >= limit.units)

    def free(self, member_id: str, limit: Limit) -> float:
        """Units left under the limit (inf when it has none)."""
        if not limit.units:
            return float("inf")
        return max(0, limit.units - self._units.get(member_id, 0))

    def take(self, member_id: str, units: int, *, timed: bool = False,
             counted: bool = True, replaces: int = 0) -> Grant:
        """`timed`: the grant spans the member's work on it, so its release is reported
        (`on_release`); a reservation's is not. `counted`: it holds a request slot now;
        else from its `count()` on. `replaces`: units of this same request's reservation
        on the member, given back right after: not work in flight beside it."""
        if units < 0 or replaces < 0:
            raise ValueError("units must be >= 0")
        used = self._units.get(member_id, 0) + units
        self._units[member_id] = used
        self._grants[member_id] = self._grants.get(member_id, 0) + 1
        work = max(units, used - replaces)
        grant = Grant(self, member_id, units, self._clock(), work, timed)
        if counted:
            grant.count()
        return grant

    def _count(self, member_id: str) -> None:
        self._requests[member_id] = self._requests.get(member_id, 0) + 1

    def _give_back(self, grant: Grant) -> None:
        member_id = grant.member_id
        if grant.counted:
            requests = self._requests[member_id] - 1
            if requests:
                self._requests[member_id] = requests
            else:
                del self._requests[member_id]
        grants = self._grants[member_id] - 1
        if grants:
            self._grants[member_id] = grants
            self._units[member_id] -= grant.units
        else:  # nothing left: drop the entry, so the maps are bounded by what is in flight
            del self._grants[member_id]
            self._units.pop(member_id, None)
        if self._on_release is not None:
            seconds = self._clock() - grant.taken_at if grant.timed else -1.0
            self._on_release(member_id, seconds, grant.work)


class Together:
    """A mixed member's two grants as one (released together)."""

    __slots__ = ("_grants",)

    def __init__(self, *grants: Grant) -> None:
        self._grants = grants

    def release(self) -> None:
        for grant in self._grants:
            grant.release()


class ThenCount:
    """A split pair's prefill grant: when it ends the request moves on to its decode,
    whose grant then takes a request slot (before the prefill's room is given out, so
    the next admission sees the decode as it is)."""

    __slots__ = ("_decode", "_prefill")

    def __init__(self, prefill: Grant, decode: Grant) -> None:
        self._prefill = prefill
        self._decode = decode

    def release(self) -> None:
        self._decode.count()
        self._prefill.release()
