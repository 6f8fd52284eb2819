"""Members by role, model and state, and their heartbeat times, kept as they change.

What `/metrics` shows of the membership (`pdreg_members`, `pdreg_heartbeat_age_seconds`)
without walking the members at scrape time. Pure and single-writer, like `Membership`,
which owns one `FleetStats` and calls it at every transition:
    join, leave          a member's group (role, model) counts it, or stops
    restate              its state or suspicion changed (counted under one key)
    beat                 it heartbeat: O(1), two dict updates when its slot changed
Heartbeat times are kept per group in slots SLOT_S wide (absolute slot numbers, a dict
slot -> members whose last heartbeat fell in it); each member remembers its heartbeat
time in integer microseconds (which gives its slot). Slots older than the largest age
bucket are folded into one `older` count when figures are taken, so a group holds at
most ~AGE_BUCKETS_S[-1] / SLOT_S slots plus what members heartbeat since (and never more
slots than members). The sum of heartbeat times is kept exactly (integer microseconds), so
the histogram's sum is exact and its buckets exact to a slot.

`figures()` hands the HTTP thread an immutable copy: O(groups x occupied slots), never
O(members).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Final

from wire.protocol import MemberState, Role

__all__ = ["AGE_BUCKETS_S", "SLOT_S", "SUSPECT", "FleetFigures", "FleetStats", "GroupFigures",
           "state_key"]

# Heartbeat-age buckets (seconds): the interval is 1-5 s and the lease three intervals, so
# a healthy member sits in the first buckets and a late one walks up them.
AGE_BUCKETS_S: Final = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0)
# A tenth of the smallest bucket: a member near a bucket's bound is counted in the next
# one at most this much early or late. At a 5 s interval a healthy group spans ~100 slots.
SLOT_S: Final = 0.05
_SLOT_US: Final = 50_000
SUSPECT: Final = 0  # the count key of a suspect member; others count under their MemberState
_KEYS: Final = 1 + max(MemberState)
_NO_FOLD: Final = -(1 << 62)
_floor = math.floor  # a global, not an attribute lookup, on every heartbeat


def state_key(state: MemberState, suspect: bool) -> int:
    """Where a member is counted: suspect whatever its state (as `pdreg_members` shows)."""
    return SUSPECT if suspect else int(state)


def micros(at: float) -> int:
    """A heartbeat time as kept: whole microseconds (what the exact sum adds up)."""
    return math.floor(at * 1e6)


def slot_of(at: float) -> int:
    return micros(at) // _SLOT_US


class Group:
    """One (role, model): its members per count key, and their heartbeat slots."""

    __slots__ = ("members", "model", "older", "role", "slots", "states", "sum_us")

    def __init__(self, role: Role, model: str) -> None:
        self.role = role
        self.model = model
        self.members = 0
        self.states = [0] * _KEYS  # indexed by state_key
        self.slots: dict[int, int] = {}  # slot -> members whose last heartbeat is in it
        self.older = 0  # members in slots folded away (older than the largest bucket)
        self.sum_us = 0  # the sum of its members' heartbeat times, in microseconds


@dataclass(frozen=True, slots=True)
class GroupFigures:
    """A group as the HTTP thread sees it (an immutable copy)."""

    role: Role
    model: str
    members: int
    states: tuple[int, ...]  # indexed by state_key
    slots: tuple[tuple[int, int], ...]  # (slot, members)
    older: int
    sum_us: int

    def ages(self, now: float, bounds: tuple[float, ...] = AGE_BUCKETS_S
             ) -> tuple[list[int], float]:
        """Members per age bucket at `now` (the last is +Inf), and the sum of their ages.

        A slot counts at its middle: exact to half a slot. The sum is exact (to a
        microsecond) for heartbeats at or before `now`."""
        counts = [0] * (len(bounds) + 1)
        middle = 0.5 * SLOT_S
        for slot, members in self.slots:
            counts[bisect_left(bounds, now - slot * SLOT_S - middle)] += members
        counts[-1] += self.older
        return counts, (self.members * micros(now) - self.sum_us) / 1e6


@dataclass(frozen=True, slots=True)
class FleetFigures:
    """What a `/metrics` scrape (and `/healthz`) shows of the membership, taken by the
    loop at `taken_at`."""

    epoch: int
    version: int
    members: int
    groups: tuple[GroupFigures, ...]
    # (id, role, model, heartbeat time) of every member, only for a fleet small enough
    # for a series per member (None above that)
    per_member: tuple[tuple[str, Role, str, float], ...] | None
    heartbeat_interval_s: float
    self_preserving: bool
    taken_at: float  # monotonic, as the heartbeat times


class FleetStats:
    """The running counts (loop thread only; `figures` copies them for other threads)."""

    def __init__(self) -> None:
        self.groups: dict[tuple[Role, str], Group] = {}
        self.folded_below = _NO_FOLD  # slots below this are counted in `older`

    def join(self, role: Role, model: str, key: int, at: float) -> tuple[Group, int]:
        """Count a new member; its group and heartbeat time in microseconds (the member
        keeps both)."""
        group = self.groups.get((role, model))
        if group is None:
            group = self.groups[(role, model)] = Group(role, model)
        group.members += 1
        group.states[key] += 1
        us = micros(at)
        self._add(group, us // _SLOT_US)
        group.sum_us += us
        return group, us

    def leave(self, group: Group, key: int, us: int) -> None:
        group.members -= 1
        group.states[key] -= 1
        self._take(group, us // _SLOT_US)
        group.sum_us -= us
        if not group.members:  # a model nobody serves any more is not shown
            del self.groups[(group.role, group.model)]

    def restate(self, group: Group, before: int, after: int) -> None:
        group.states[before] -= 1
        group.states[after] += 1

    def beat(self, group: Group, us: int, at: float) -> int:
        """A heartbeat at `at` of a member last heard at `us` (microseconds); the new `us`.

        On every heartbeat's path: `_take` and `_add` written out (a call each saved)."""
        new_us = _floor(at * 1e6)
        group.sum_us += new_us - us
        slot, new = us // _SLOT_US, new_us // _SLOT_US
        if new == slot:
            return new_us
        folded_below, slots = self.folded_below, group.slots
        if slot < folded_below:
            group.older -= 1
        else:
            left = slots[slot] - 1
            if left:
                slots[slot] = left
            else:
                del slots[slot]
        if new < folded_below:  # (a clock that went back)
            group.older += 1
        else:
            slots[new] = slots.get(new, 0) + 1
        return new_us

    def figures(self, now: float) -> tuple[GroupFigures, ...]:
        """An immutable copy at `now` (folding slots past the largest bucket first)."""
        self._fold(now)
        return tuple(GroupFigures(g.role, g.model, g.members, tuple(g.states),
                                  tuple(g.slots.items()), g.older, g.sum_us)
                     for g in self.groups.values())

    def _fold(self, now: float) -> None:
        # Every member of a slot below this heard its last more than the largest bucket
        # ago, now and at any later scrape: it can only be in +Inf.
        below = slot_of(now - AGE_BUCKETS_S[-1]) - 1
        if below <= self.folded_below:
            return
        for group in self.groups.values():
            slots = group.slots
            for slot in [s for s in slots if s < below]:
                group.older += slots.pop(slot)
        self.folded_below = below

    def _add(self, group: Group, slot: int) -> None:
        if slot < self.folded_below:
            group.older += 1
            return
        slots = group.slots
        slots[slot] = slots.get(slot, 0) + 1

    def _take(self, group: Group, slot: int) -> None:
        if slot < self.folded_below:
            group.older -= 1
            return
        slots = group.slots
        left = slots[slot] - 1
        if left:
            slots[slot] = left
        else:
            del slots[slot]
