"""The membership state machine: pure, single-writer, clock passed in.

No sockets, no threads. The registry loop is the only caller; it hands every message
to one transition (`register`, `heartbeat`, `bye`, `report`, `drain`, `evict`) and calls
`tick` on its timer. Each transition states its rules as guards, stale incarnation first.

Every membership change goes through `_publish`, the one place `version` is bumped, and
lands in an outbox the loop drains with `take_events()`. Load figures are not changes:
they are coalesced into per-model digests (`take_load_digests()`).

Times: `now` is a monotonic clock (seconds). `wall_offset` turns it into unix time for the
records clients see (`registered_at`, `heartbeat_at`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from registry.detector import DetectorConfig, Timing, is_self_preserving, loop_lag, timing_for
from registry.protocol import (
    ByeReason,
    LeaveReason,
    Load,
    LoadEntry,
    MemberJoined,
    MemberLeft,
    MemberRecord,
    MembershipEvent,
    MemberSpec,
    MemberState,
    MemberUpdated,
    ReplyStatus,
)

logger = logging.getLogger(__name__)

LAG_WARNING_S = 0.5  # a loop stall this long is logged as a warning (always compensated)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a transition tells the sender."""

    status: ReplyStatus
    reason: str = ""


OK = Outcome(ReplyStatus.OK)
UNKNOWN = Outcome(ReplyStatus.UNKNOWN, "unknown member, register again")


@dataclass(slots=True)
class _Entry:
    spec: MemberSpec
    state: MemberState
    load: Load
    registered_at: float  # monotonic
    last_seen: float  # monotonic; moved forward by loop lag
    heartbeat_at: float  # monotonic, never moved: what clients see as heartbeat age
    suspect: bool = False
    admin_draining: bool = False  # an operator's drain sticks whatever the member says

    def record(self, wall_offset: float) -> MemberRecord:
        return MemberRecord(
            spec=self.spec,
            state=self.state,
            suspect=self.suspect,
            load=self.load,
            registered_at=self.registered_at + wall_offset,
            heartbeat_at=self.heartbeat_at + wall_offset,
        )


# Which self-reported state changes are accepted. DRAINING is one-way: a member that
# started draining leaves with bye (or expires); it never turns ready again.
_ALLOWED = {
    MemberState.JOINING: {MemberState.JOINING, MemberState.READY, MemberState.DRAINING},
    MemberState.READY: {MemberState.JOINING, MemberState.READY, MemberState.DRAINING},
    MemberState.DRAINING: {MemberState.DRAINING},
}


class Membership:
    def __init__(self, epoch: int, config: DetectorConfig | None = None, *,
                 wall_offset: float = 0.0) -> None:
        self.epoch = epoch
        self.config = config or DetectorConfig()
        self.version = 0
        self.wall_offset = wall_offset
        # Ordered by last_seen: a heartbeat moves its member to the end, so the silent
        # ones gather at the front and a tick only looks at those.
        self._members: OrderedDict[str, _Entry] = OrderedDict()
        self._outbox: list[MembershipEvent] = []
        self._dirty_loads: dict[str, set[str]] = {}  # model -> ids whose load changed
        self._last_tick: float | None = None  # lag is measured from the first tick on
        self._preserving_since: float | None = None
        # Set when self-preservation timed out; cleared once the silent share drops, so
        # the same mass silence does not pause expiry a second time.
        self._preservation_spent = False
        self.last_lag_s = 0.0
        self.timing: Timing = timing_for(self.config, 0)

    # --- reads -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, member_id: object) -> bool:
        return member_id in self._members

    @property
    def self_preserving(self) -> bool:
        return self._preserving_since is not None

    def get(self, member_id: str) -> MemberRecord | None:
        entry = self._members.get(member_id)
        return entry.record(self.wall_offset) if entry else None

    def records(self, models: Iterable[str] = ()) -> list[MemberRecord]:
        wanted = set(models)
        return [e.record(self.wall_offset) for e in self._members.values()
                if not wanted or e.spec.model in wanted]

    def models(self) -> set[str]:
        return {e.spec.model for e in self._members.values()}

    def heartbeat_ages(self, now: float) -> dict[str, float]:
        return {mid: now - e.heartbeat_at for mid, e in self._members.items()}

    def next_deadline(self, now: float) -> float:
        """When `tick` next has something to do (at the latest one tick period away)."""
        deadline = now + self.config.tick_period_s
        timing = self.timing
        for entry in self._members.values():
            if entry.suspect:
                deadline = min(deadline, entry.last_seen + timing.lease_s)
                continue
            return min(deadline, entry.last_seen + timing.suspect_after_s)
        return deadline

    # --- transitions -------------------------------------------------------------------

    def register(self, spec: MemberSpec, state: MemberState, load: Load, now: float) -> Outcome:
        current = self._members.get(spec.id)
        if current is not None:
            held = current.spec.incarnation
            # Ignore old incarnations: a process that was replaced must not come back.
            if spec.incarnation < held:
                return Outcome(ReplyStatus.STALE,
                               f"incarnation {spec.incarnation} is older than {held}")
            if spec.incarnation == held:
                # A retried registration (the first reply was lost): refresh, no new member.
                current.spec = spec
                self._seen(current, load, now)
                self._set_state(current, state, now)
                return OK
            # A newer incarnation replaces the old one: routers must see a new peer.
            self._remove(spec.id, LeaveReason.REPLACED)
        entry = _Entry(spec=spec, state=state, load=load, registered_at=now,
                       last_seen=now, heartbeat_at=now)
        self._members[spec.id] = entry
        self._retime()
        self._publish(MemberJoined(self.epoch, self._next_version(),
                                   entry.record(self.wall_offset)))
        logger.info("[registry] join id=%s incarnation=%d role=%s model=%s state=%s",
                    spec.id, spec.incarnation, spec.role.name.lower(), spec.model,
                    state.name.lower())
        return OK

    def heartbeat(self, member_id: str, incarnation: int, state: MemberState, load: Load,
                  now: float) -> Outcome:
        entry = self._members.get(member_id)
        if entry is None:
            return UNKNOWN
        held = entry.spec.incarnation
        if incarnation < held:
            return Outcome(ReplyStatus.STALE, f"incarnation {incarnation} is older than {held}")
        if incarnation > held:
            # A restarted process we have not heard register: we lack its spec.
            return UNKNOWN
        self._seen(entry, load, now)
        self._set_state(entry, state, now)
        return OK

    def bye(self, member_id: str, incarnation: int, reason: ByeReason) -> Outcome:
        entry = self._members.get(member_id)
        if entry is None:
            return OK  # already gone: a bye is idempotent
        if incarnation != entry.spec.incarnation:
            # Only the incarnation we hold may remove itself; an old one's bye is late news.
            return Outcome(ReplyStatus.STALE, f"incarnation {incarnation} is not the one held")
        leave = LeaveReason.CRASHED if reason is ByeReason.CRASHED else LeaveReason.BYE
        self._remove(member_id, leave)
        return OK

    def report(self, member_id: str, incarnation: int, now: float) -> Outcome:
        """A router saw this member fail: suspect it now; its next heartbeat clears that."""
        entry = self._members.get(member_id)
        if entry is None:
            return UNKNOWN
        if incarnation != entry.spec.incarnation:
            return Outcome(ReplyStatus.STALE, "report names another incarnation")
        if not entry.suspect:
            entry.suspect = True
            self._publish_update(entry)
            logger.info("[registry] suspect id=%s reported by a router", member_id)
        return OK

    def drain(self, member_id: str) -> Outcome:
        entry = self._members.get(member_id)
        if entry is None:
            return Outcome(ReplyStatus.REJECTED, f"no member {member_id!r}")
        entry.admin_draining = True
        if entry.state is not MemberState.DRAINING:
            entry.state = MemberState.DRAINING
            self._publish_update(entry)
            logger.info("[registry] drain id=%s (admin)", member_id)
        return OK

    def evict(self, member_id: str) -> Outcome:
        if member_id not in self._members:
            return Outcome(ReplyStatus.REJECTED, f"no member {member_id!r}")
        self._remove(member_id, LeaveReason.EVICTED)
        return OK

    def tick(self, now: float) -> None:
        """Suspect the late, expire the long gone. Run on the loop's timer, not on messages."""
        previous, self._last_tick = self._last_tick, now
        lag = 0.0 if previous is None else loop_lag(previous, now, self.config.tick_period_s)
        if lag > 0:
            # The registry was stalled, not the members: give everyone that time back.
            self.last_lag_s = lag
            for entry in self._members.values():
                entry.last_seen += lag
            # Small stalls are routine on a busy host; only a long one is worth a warning.
            log = logger.warning if lag >= LAG_WARNING_S else logger.debug
            log("[registry] loop lag %.3fs: deadlines moved", lag)
        timing = self.timing
        silent: list[_Entry] = []
        for entry in self._members.values():
            age = now - entry.last_seen
            if age <= timing.suspect_after_s:
                break  # ordered by last_seen: everyone after this one is fresher
            silent.append(entry)
            if not entry.suspect:
                entry.suspect = True
                self._publish_update(entry)
                logger.info("[registry] suspect id=%s age=%.1fs", entry.spec.id, age)
        self._update_self_preservation(len(silent), now)
        if self._preserving_since is not None:
            return
        for entry in silent:
            age = now - entry.last_seen
            if age > timing.lease_s:
                logger.info("[registry] expire id=%s age=%.1fs", entry.spec.id, age)
                self._remove(entry.spec.id, LeaveReason.EXPIRED)

    # --- outputs -----------------------------------------------------------------------

    def take_events(self) -> list[MembershipEvent]:
        events, self._outbox = self._outbox, []
        return events

    def take_load_digests(self, now: float) -> dict[str, list[LoadEntry]]:
        """Loads that changed since the last call, grouped by model."""
        digests: dict[str, list[LoadEntry]] = {}
        for model, ids in self._dirty_loads.items():
            entries = []
            for member_id in ids:
                entry = self._members.get(member_id)
                if entry is not None:
                    entries.append(LoadEntry(member_id, entry.spec.incarnation, entry.load,
                                             now - entry.heartbeat_at))
            if entries:
                digests[model] = entries
        self._dirty_loads = {}
        return digests

    # --- internals ---------------------------------------------------------------------

    def _seen(self, entry: _Entry, load: Load, now: float) -> None:
        entry.last_seen = now
        entry.heartbeat_at = now
        self._members.move_to_end(entry.spec.id)
        if load != entry.load:
            entry.load = load
            self._dirty_loads.setdefault(entry.spec.model, set()).add(entry.spec.id)
        if entry.suspect:
            entry.suspect = False
            self._publish_update(entry)
            logger.info("[registry] alive again id=%s", entry.spec.id)

    def _set_state(self, entry: _Entry, state: MemberState, now: float) -> None:
        if entry.admin_draining or state is entry.state:
            return  # an operator's drain stands until the member leaves
        if state not in _ALLOWED[entry.state]:
            return  # draining is one-way
        logger.info("[registry] state id=%s %s -> %s", entry.spec.id,
                    entry.state.name.lower(), state.name.lower())
        entry.state = state
        self._publish_update(entry)

    def _remove(self, member_id: str, reason: LeaveReason) -> None:
        entry = self._members.pop(member_id)
        self._retime()
        self._publish(MemberLeft(self.epoch, self._next_version(), member_id,
                                 entry.spec.incarnation, entry.spec.model, reason))
        if reason is not LeaveReason.EXPIRED:
            logger.info("[registry] leave id=%s reason=%s", member_id, reason.name.lower())

    def _publish_update(self, entry: _Entry) -> None:
        self._publish(MemberUpdated(self.epoch, self._next_version(),
                                    entry.record(self.wall_offset)))

    def _next_version(self) -> int:
        # The one place the version moves: each change gets the next number.
        self.version += 1
        return self.version

    def _publish(self, event: MembershipEvent) -> None:
        self._outbox.append(event)

    def _retime(self) -> None:
        self.timing = timing_for(self.config, len(self._members))

    def _update_self_preservation(self, silent: int, now: float) -> None:
        preserving = is_self_preserving(silent, len(self._members), self.config)
        if not preserving:
            self._preservation_spent = False
        if preserving and self._preserving_since is None and not self._preservation_spent:
            self._preserving_since = now
            logger.warning("[registry] self-preservation on: %d of %d members silent at once; "
                           "expiry paused (fault assumed on the registry's side)",
                           silent, len(self._members))
        elif self._preserving_since is not None:
            held_for = now - self._preserving_since
            if not preserving:
                self._preserving_since = None
                logger.warning("[registry] self-preservation off after %.1fs", held_for)
            elif held_for > self.config.self_preservation_max_s:
                self._preserving_since = None
                self._preservation_spent = True
                logger.warning("[registry] self-preservation gave up after %.1fs: "
                               "expiring %d silent members", held_for, silent)

