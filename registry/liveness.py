"""The membership's timer side: who is late (suspect), who is gone (expired), and when a
silent fleet means the fault is the registry's own (self-preservation).

`Liveness` is mixed into `registry.membership.Membership`, which owns the state it reads
(the orders by `last_seen`, the lag, the timing) and the two changes it makes
(`_publish_update`, `_remove`). The loop calls `tick` on its timer, never on messages.

Work per tick is O(members crossing a threshold), not O(members): each step pops from
the front of an order while its member is past the threshold, and re-checks the age it
acts on (see the module doc of `registry.membership` for the orders).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from registry.detector import DetectorConfig, Timing, loop_lag
from registry.member_entry import Entry, first, last
from registry.preservation import Change, SelfPreservation
from wire.protocol import LeaveReason

logger = logging.getLogger(__name__)

LAG_WARNING_S = 0.5  # a loop stall this long is logged as a warning (always compensated)


class Liveness:
    """Suspicion, expiry and self-preservation over the state `Membership` owns."""

    # Owned by Membership (set in its __init__); named here for the reader.
    config: DetectorConfig
    timing: Timing
    last_lag_s: float
    _members: OrderedDict[str, Entry]
    _unsuspected: OrderedDict[str, Entry]
    _unsilent: OrderedDict[str, Entry]
    _silent: OrderedDict[str, Entry]
    _lag_s: float
    _last_tick: float | None
    _preservation: SelfPreservation
    # ...and the two changes a tick makes.
    _publish_update: Callable[[Entry], None]
    _remove: Callable[[str, LeaveReason], None]

    def next_deadline(self, now: float) -> float:
        """When `tick` next has something to do (at the latest one tick period away)."""
        deadline = now + self.config.tick_period_s
        timing = self.timing
        if self._members:
            oldest = first(self._members)
            deadline = min(deadline, oldest.last_seen + self._lag_s + timing.lease_s)
        if self._unsuspected:
            latest = first(self._unsuspected)
            deadline = min(deadline, latest.last_seen + self._lag_s + timing.suspect_after_s)
        return deadline

    def tick(self, now: float) -> None:
        """Suspect the late, expire the long gone. Run on the loop's timer, not on messages."""
        t = self._take_lag(now)  # the registry's clock, which last_seen runs on
        self._suspect_late(t)
        self._count_silent(t)
        if self._expiry_paused(t, now):
            return
        self._expire_gone(t)

    # --- the steps of a tick -------------------------------------------------------------

    def _take_lag(self, now: float) -> float:
        """Give every member back the time the loop itself was stalled; the registry's
        clock at `now` (monotonic minus every stall compensated so far)."""
        previous, self._last_tick = self._last_tick, now
        lag = 0.0 if previous is None else loop_lag(previous, now, self.config.tick_period_s)
        if lag > 0:
            # The registry was stalled, not the members: give everyone that time back.
            self.last_lag_s = lag
            self._lag_s += lag
            # Small stalls are routine on a busy host; only a long one is worth a warning.
            log = logger.warning if lag >= LAG_WARNING_S else logger.debug
            log("[registry] loop lag %.3fs: deadlines moved", lag)
        return now - self._lag_s

    def _suspect_late(self, t: float) -> None:
        """Suspect each member whose heartbeat is overdue at registry time `t`."""
        threshold = self.timing.suspect_after_s
        unsuspected = self._unsuspected
        while unsuspected:
            entry = first(unsuspected)
            age = t - entry.last_seen
            if age <= threshold:
                break  # ordered by last_seen: everyone after this one is fresher
            del unsuspected[entry.spec.id]
            entry.suspect = True
            self._publish_update(entry)
            logger.info("[registry] suspect id=%s age=%.1fs", entry.spec.id, age)

    def _expiry_paused(self, t: float, now: float) -> bool:
        """Whether self-preservation holds expiry back this tick.

        Decided when someone is due to expire (the oldest member is past its lease), and
        re-checked every tick while it holds. The decision counts who was silent when
        that lease ran out, not at this tick: members that woke in between must not make
        a fleet-wide silence look like a few deaths.
        """
        lease_s = self.timing.lease_s
        preservation = self._preservation
        change = Change.NONE
        if preservation.active:
            change = preservation.update(len(self._silent), len(self._members), now)
        elif self._members and t - first(self._members).last_seen > lease_s:
            expired_at = first(self._members).last_seen + lease_s
            change = preservation.update(self._silent_at(expired_at), len(self._members),
                                         now)
        if change is Change.OFF:
            self._wake_silent(t)
            return True
        return preservation.active

    def _wake_silent(self, t: float) -> None:
        """Self-preservation ended. A silent fleet wakes one member at a time: the first
        ones back end the pause, and the rest, a moment behind, must not be expired in
        that moment. Those still silent get what is left of a lease from now on (and so
        are not silent)."""
        floor = t - self.timing.silent_after_s
        woken = list(self._silent.values())
        self._silent.clear()
        for entry in reversed(woken):  # oldest ends up first, as the order requires
            entry.last_seen = max(entry.last_seen, floor)
            entry.silent = False
            self._unsilent[entry.spec.id] = entry
            self._unsilent.move_to_end(entry.spec.id, last=False)

    def _expire_gone(self, t: float) -> None:
        """Remove each member silent past its lease at registry time `t`."""
        lease_s = self.timing.lease_s
        members = self._members
        while members:
            entry = first(members)
            age = t - entry.last_seen
            if age <= lease_s:
                break
            logger.info("[registry] expire id=%s age=%.1fs", entry.spec.id, age)
            self._remove(entry.spec.id, LeaveReason.EXPIRED)

    # --- silence ---------------------------------------------------------------------------

    def _count_silent(self, t: float) -> None:
        """Bring `_silent` up to date at registry time `t`: exactly the members whose age
        is past silent_after_s (that threshold grows with the fleet, so both ends move)."""
        limit = self.timing.silent_after_s
        silent, unsilent = self._silent, self._unsilent
        while silent:
            entry = last(silent)
            if t - entry.last_seen > limit:
                break
            del silent[entry.spec.id]
            entry.silent = False
            unsilent[entry.spec.id] = entry
            unsilent.move_to_end(entry.spec.id, last=False)
        while unsilent:
            entry = first(unsilent)
            if t - entry.last_seen <= limit:
                break
            del unsilent[entry.spec.id]
            entry.silent = True
            silent[entry.spec.id] = entry

    def _age(self, entry: Entry, now: float) -> float:
        """Seconds since `entry` was last heard, less any registry stall since (the age
        every deadline rule uses; `entry.last_seen` is on the registry's clock)."""
        return now - self._lag_s - entry.last_seen

    def _silent_at(self, moment: float) -> int:
        """How many members had been silent for silent_after_s at `moment` (in the past).

        A member counts if its last heartbeat at that moment was before `limit`: either it
        has not been heard since (a prefix of `_members`), or its latest heartbeat came
        after `moment` and the one before it was before `limit` (a suffix). The walks stop
        at the first member that cannot count, so they cost what changed, not the fleet.
        """
        limit = moment - self.timing.silent_after_s
        count = 0
        for entry in self._members.values():
            if entry.last_seen >= limit:
                break
            count += 1
        for entry in reversed(self._members.values()):
            if entry.last_seen <= moment:
                break
            if entry.seen_before < limit:
                count += 1
        return count
