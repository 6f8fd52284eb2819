"""The membership state machine: pure, single-writer, clock passed in.

No sockets, no threads. The registry loop is the only caller; it hands every message
to one transition (`register`, `heartbeat`, `bye`, `report`, `drain`, `evict`) and calls
`tick` on its timer. Each transition states its rules as guards, stale incarnation first.

Sessions: `register` hands out a secret per member; `heartbeat`, `bye` and `report` take
the message and its encoded bytes and change nothing unless its proof is the member's and
its `seq` is new (`_authenticate`). So whoever lacks a member's secret cannot touch its record.

Every membership change goes through `_publish`, the one place `version` is bumped, and
lands in an outbox the loop drains with `take_events()`. Load figures are not changes:
they are coalesced into per-model digests (`take_load_digests()`).

Times: `now` is a monotonic clock (seconds). `wall_offset` turns it into unix time for the
records clients see (`registered_at`, `heartbeat_at`). Deadlines (`last_seen`,
`seen_before`) run on the registry's own clock, `now` minus every loop stall compensated so
far (`_lag_s`): moving that one offset gives every member the stall back at once.

Work per call grows with what changed, not with the fleet (a 100k-member registry turns
its loop thousands of times a second). Members are kept in three orders by `last_seen`,
each an OrderedDict whose front is the next to cross one threshold:
    _members      all of them          -> the oldest is the next to expire
    _unsuspected  those not suspect    -> the front is the next to turn suspect
    _unsilent     those not yet silent -> the front is the next to count as silent
(`_silent` holds the rest, also in order). A heartbeat moves its member to the end of each;
a tick pops from the fronts only while something is due, and re-checks the age it acts
on. Records are cached per member (`_records`) and rebuilt only for members that changed.

One class, its parts in modules by what they do (each a mixin over the state kept here):
    registry.member_entry     the entry per member, the allowed state changes
    registry.liveness         the timer: suspect, expire, self-preservation (`tick`)
    registry.member_sessions  proofs, replays, take-overs, routers' reports
    registry.member_admin     what operators change (drain, evict, bans)
This module keeps the state, registration, heartbeats, byes and the outputs.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

from registry import sessions
from registry.admission import Admission, Limits
from registry.deadband import Deadband, is_news
from registry.detector import DetectorConfig, Timing, timing_for
from registry.fleet_stats import FleetFigures, FleetStats, state_key
from registry.liveness import Liveness
from registry.member_admin import AdminActions
from registry.member_entry import ALLOWED, Entry, first
from registry.member_sessions import MAX_SEQ_STEP, Sessions
from registry.outcome import DRAIN, OK, UNKNOWN, Outcome
from registry.preservation import SelfPreservation
from registry.store.intents import IntentTable, drains
from wire.protocol import (
    Bye,
    ByeReason,
    Heartbeat,
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
    role_name,
)

logger = logging.getLogger(__name__)

__all__ = ["OK", "UNKNOWN", "Limits", "Membership", "Outcome"]


class Membership(Liveness, Sessions, AdminActions):
    """The members and every transition of theirs; see the module doc."""

    def __init__(self, epoch: int, config: DetectorConfig | None = None, *,
                 limits: Limits | None = None, wall_offset: float = 0.0,
                 new_session: Callable[[], bytes] = sessions.new_session,
                 deadband: Deadband | None = None) -> None:
        self.epoch = epoch
        # No deadband unless asked: pure-state users (and tests) see every change.
        self.deadband = deadband or Deadband(max_age_s=0.0)
        self.config = config or DetectorConfig()
        self.limits = limits or Limits()
        self.version = 0
        self.wall_offset = wall_offset
        self._new_session = new_session
        self.admission = Admission(self.limits, wall_offset)
        # The admin intents the store holds (registry.store), applied by `apply_intent`
        # and to every member that registers.
        self.intents = IntentTable()
        # Ordered by last_seen: a heartbeat moves its member to the end, so the silent
        # ones gather at the front and a tick only looks at those (see the module doc).
        self._members: OrderedDict[str, Entry] = OrderedDict()
        self._unsuspected: OrderedDict[str, Entry] = OrderedDict()
        self._unsilent: OrderedDict[str, Entry] = OrderedDict()
        self._silent: OrderedDict[str, Entry] = OrderedDict()
        self._lag_s = 0.0  # every loop stall compensated so far (see the module doc)
        # The current record of each member, per model; ids in _stale are rebuilt on read
        # (a heartbeat only marks its member: most records are never read between two).
        self._records: dict[str, dict[str, MemberRecord]] = {}
        self._stale: set[str] = set()
        self._outbox: list[MembershipEvent] = []
        self._dirty_loads: dict[str, set[str]] = {}  # model -> ids whose load changed
        # Load changes inside the deadband, oldest first: they go out max_age_s late.
        self._held: OrderedDict[str, Entry] = OrderedDict()
        self._last_tick: float | None = None  # lag is measured from the first tick on
        self._preservation = SelfPreservation(self.config)
        self.last_lag_s = 0.0
        self.timing: Timing = timing_for(self.config, 0)
        # Members by role, model and state, and their heartbeat times, for /metrics.
        self.fleet_stats = FleetStats()

    # --- reads -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, member_id: object) -> bool:
        return member_id in self._members

    @property
    def self_preserving(self) -> bool:
        return self._preservation.active

    def get(self, member_id: str) -> MemberRecord | None:
        entry = self._members.get(member_id)
        return entry.record(self.wall_offset) if entry else None

    def spec_of(self, member_id: str) -> MemberSpec | None:
        """A member's spec, without building its record (per-entry checks of KV reports)."""
        entry = self._members.get(member_id)
        return entry.spec if entry is not None else None

    def records(self, models: Iterable[str] = ()) -> list[MemberRecord]:
        """Every member's record (of `models`, if any): O(members returned + changed)."""
        self._refresh_records()
        wanted = set(models) if models else self._records.keys()
        out: list[MemberRecord] = []
        for model in wanted:
            held = self._records.get(model)
            if held:
                out.extend(held.values())
        return out

    def count(self, models: Iterable[str] = ()) -> int:
        """How many records `records(models)` returns, without building them."""
        wanted = set(models)
        if not wanted:
            return len(self._members)
        return sum(self.admission.per_model.get(model, 0) for model in wanted)

    def models(self) -> set[str]:
        return set(self.admission.per_model)

    def figures(self, now: float, per_member_max: int) -> FleetFigures:
        """What /metrics shows of the membership: O(groups x heartbeat slots), plus
        O(members) only for a fleet of at most `per_member_max` (a series per member)."""
        per_member = None
        if len(self._members) <= per_member_max:
            per_member = tuple((e.spec.id, e.spec.role, e.spec.model, e.heartbeat_at)
                               for e in self._members.values())
        return FleetFigures(self.epoch, self.version, len(self._members),
                            self.fleet_stats.figures(now),
                            per_member, self.timing.heartbeat_interval_s,
                            self.self_preserving, now)

    # --- transitions -------------------------------------------------------------------

    def register(self, spec: MemberSpec, state: MemberState, load: Load, now: float, *,
                 nonce: bytes) -> Outcome:
        """Admit `spec` (token and spec were checked by the caller); the reply's session."""
        problem = self.admission.problem(spec, now)
        if problem is not None:
            return problem
        current = self._members.get(spec.id)
        if current is not None:
            held = current.spec.incarnation
            # Ignore old incarnations: a process that was replaced must not come back.
            if spec.incarnation < held:
                return Outcome(ReplyStatus.STALE,
                               f"incarnation {spec.incarnation} is older than {held}",
                               kind="stale")
            if spec.incarnation == held:
                return self._register_again(current, spec, nonce)
            contested = self._contested(current, spec, now)
            if contested is not None:
                return contested
            cap = self.admission.cap_problem(len(self), spec.model, current.spec)
            if cap is not None:
                return cap
            # A newer incarnation replaces the old one: routers must see a new peer.
            self._remove(spec.id, LeaveReason.REPLACED)
        else:
            cap = self.admission.cap_problem(len(self), spec.model, None)
            if cap is not None:
                return cap
        entry = self._admit(spec, state, load, now, nonce)
        record = entry.record(self.wall_offset)
        self._records.setdefault(spec.model, {})[spec.id] = record
        self._publish(MemberJoined(self.epoch, self._next_version(), record))
        logger.info("[registry] join id=%s incarnation=%d role=%s model=%s state=%s%s",
                    spec.id, spec.incarnation, role_name(spec.role), spec.model,
                    entry.state.name.lower(), " (cordoned)" if entry.cordoned else "")
        return Outcome(ReplyStatus.OK, session=entry.session)

    def _admit(self, spec: MemberSpec, state: MemberState, load: Load, now: float,
               nonce: bytes) -> Entry:
        """A new entry for `spec`, in every order, with the admin intents held for its id
        applied (registry.store.intents: a drain of this incarnation, a cordon)."""
        drained = drains(self.intents.drain(spec.id), spec.incarnation)
        cordoned = self.intents.cordoned(spec.id)
        own = MemberState.DRAINING if drained else state
        counted = state_key(MemberState.DRAINING if cordoned else own, False)
        group, beat_us = self.fleet_stats.join(spec.role, spec.model, counted, now)
        seen = now - self._lag_s
        entry = Entry(spec=spec, state=own, load=load, registered_at=now, last_seen=seen,
                      seen_before=seen, sent_load=load, heartbeat_at=now,
                      session=self._new_session(), nonce=nonce, group=group,
                      beat_us=beat_us, counted=counted, admin_draining=drained,
                      cordoned=cordoned,
                      unproven=self.admission.has_lapsed(spec.id, spec.incarnation))
        self._members[spec.id] = entry
        self._unsuspected[spec.id] = entry
        self._unsilent[spec.id] = entry
        self.admission.joined(spec.model)
        self._retime()
        return entry

    def heartbeat(self, beat: Heartbeat, payload: bytes, now: float) -> Outcome:
        """`payload` is `beat` as it arrived (what its proof seals)."""
        entry = self._members.get(beat.id)
        # The hot path checks what `_authenticate` checks, inline; any refusal goes there
        # to be told apart (it changes nothing either).
        if (entry is None or entry.spec.incarnation != beat.incarnation
                or not entry.last_seq < beat.seq <= entry.last_seq + MAX_SEQ_STEP
                or not sessions.verify(entry.session, payload, beat.proof)):
            refusal = self._authenticate(beat.id, beat.incarnation, beat.seq, payload,
                                         beat.proof)
            assert isinstance(refusal, Outcome)
            return refusal
        entry.last_seq = beat.seq
        entry.unproven = False  # its own session proved it: alive
        self._seen(entry, beat.load, now)
        self._set_state(entry, beat.state, now)
        # Drained by an operator here: say so in every reply until the member announces
        # DRAINING itself, so that its other registries (and a restarted one) hear it too.
        if entry.admin_draining and beat.state is not MemberState.DRAINING:
            return DRAIN
        return OK

    def bye(self, bye: Bye, payload: bytes) -> Outcome:
        if bye.id not in self._members:
            return OK  # already gone: a bye is idempotent
        entry = self._authenticate(bye.id, bye.incarnation, bye.seq, payload, bye.proof)
        if isinstance(entry, Outcome):
            return entry
        leave = LeaveReason.CRASHED if bye.reason is ByeReason.CRASHED else LeaveReason.BYE
        self._remove(bye.id, leave)
        self.admission.said_bye(bye.id, bye.incarnation)
        return OK


    # --- outputs -----------------------------------------------------------------------

    @property
    def has_events(self) -> bool:
        """Whether take_events() has something (cheap: asked after every message)."""
        return bool(self._outbox)

    def take_events(self) -> list[MembershipEvent]:
        events, self._outbox = self._outbox, []
        return events

    def take_load_digests(self, now: float) -> dict[str, list[LoadEntry]]:
        """Loads that changed since the last call (past the deadband, or held back for
        its max age), grouped by model."""
        held = self._held
        max_age_s = self.deadband.max_age_for(self.timing.heartbeat_interval_s)
        while held:
            entry = first(held)
            if now - entry.held_since < max_age_s:
                break
            del held[entry.spec.id]
            self._dirty_loads.setdefault(entry.spec.model, set()).add(entry.spec.id)
        digests: dict[str, list[LoadEntry]] = {}
        for model, ids in self._dirty_loads.items():
            entries = []
            for member_id in ids:
                entry = self._members.get(member_id)
                if entry is not None:
                    held.pop(member_id, None)
                    entry.sent_load = entry.load
                    entries.append(LoadEntry(member_id, entry.spec.incarnation, entry.load,
                                             now - entry.heartbeat_at))
            if entries:
                digests[model] = entries
        self._dirty_loads = {}
        return digests

    # --- internals ---------------------------------------------------------------------
    def _seen(self, entry: Entry, load: Load, now: float) -> None:
        member_id = entry.spec.id
        entry.seen_before, entry.last_seen = entry.last_seen, now - self._lag_s
        entry.beat_us = self.fleet_stats.beat(entry.group, entry.beat_us, now)
        entry.heartbeat_at = now
        self._stale.add(member_id)
        # To the end of every order: it is now the freshest.
        self._members.move_to_end(member_id)
        if entry.silent:
            entry.silent = False
            del self._silent[member_id]
            self._unsilent[member_id] = entry
        else:
            self._unsilent.move_to_end(member_id)
        if load != entry.load:
            entry.load = load
            self._load_changed(entry, now)
        if entry.suspect:
            entry.suspect = False
            self._unsuspected[member_id] = entry
            self._publish_update(entry)
            logger.info("[registry] alive again id=%s", member_id)
        else:
            self._unsuspected.move_to_end(member_id)

    def _load_changed(self, entry: Entry, now: float) -> None:
        """Queue a changed load for the next digest, or hold it if it is not news yet."""
        member_id = entry.spec.id
        dirty = self._dirty_loads.setdefault(entry.spec.model, set())
        if member_id in dirty:
            return  # going out anyway, with whatever load it has then
        if is_news(entry.sent_load, entry.load, self.deadband):
            dirty.add(member_id)
            self._held.pop(member_id, None)
        elif member_id not in self._held:
            entry.held_since = now
            self._held[member_id] = entry

    def _set_state(self, entry: Entry, state: MemberState, now: float) -> None:
        if entry.admin_draining or state is entry.state:
            return  # an operator's drain stands until the member leaves
        if state not in ALLOWED[entry.state]:
            return  # draining is one-way
        logger.info("[registry] state id=%s %s -> %s", entry.spec.id,
                    entry.state.name.lower(), state.name.lower())
        entry.state = state
        self._publish_update(entry)

    def _remove(self, member_id: str, reason: LeaveReason) -> None:
        entry = self._members.pop(member_id)
        self._unsuspected.pop(member_id, None)
        (self._silent if entry.silent else self._unsilent).pop(member_id)
        held = self._records[entry.spec.model]
        del held[member_id]
        if not held:
            del self._records[entry.spec.model]
        self._stale.discard(member_id)
        self._held.pop(member_id, None)
        self.fleet_stats.leave(entry.group, entry.counted, entry.beat_us)
        self.admission.left(entry.spec.model)
        if reason in (LeaveReason.EXPIRED, LeaveReason.REPLACED):
            self.admission.lapsed(member_id, entry.spec.incarnation)
        self._retime()
        self._publish(MemberLeft(self.epoch, self._next_version(), member_id,
                                 entry.spec.incarnation, entry.spec.model, reason))
        if reason is not LeaveReason.EXPIRED:
            logger.info("[registry] leave id=%s reason=%s", member_id, reason.name.lower())

    def _publish_update(self, entry: Entry) -> None:
        # Every change of state or suspicion comes through here: recount it.
        counted = state_key(entry.shown_state, entry.suspect)
        if counted != entry.counted:
            self.fleet_stats.restate(entry.group, entry.counted, counted)
            entry.counted = counted
        record = entry.record(self.wall_offset)
        entry.sent_load = entry.load  # the event carries it to every view
        self._records[entry.spec.model][entry.spec.id] = record
        self._stale.discard(entry.spec.id)
        self._publish(MemberUpdated(self.epoch, self._next_version(), record))

    def refresh_some_records(self, limit: int) -> int:
        """Rebuild up to `limit` of the records heartbeats made stale; how many are left.

        Lets the loop spread that work over turns before a snapshot, instead of rebuilding
        every member that heartbeat since the last one in a single turn.
        """
        members, records, offset, stale = self._members, self._records, self.wall_offset, \
            self._stale
        for _ in range(min(limit, len(stale))):
            entry = members[stale.pop()]
            records[entry.spec.model][entry.spec.id] = entry.record(offset)
        return len(stale)

    def _refresh_records(self) -> None:
        """Rebuild the cached records of the members that heartbeat since the last read."""
        members, records, offset = self._members, self._records, self.wall_offset
        for member_id in self._stale:
            entry = members[member_id]
            records[entry.spec.model][member_id] = entry.record(offset)
        self._stale.clear()

    def _next_version(self) -> int:
        # The one place the version moves: each change gets the next number.
        self.version += 1
        return self.version

    def _publish(self, event: MembershipEvent) -> None:
        self._outbox.append(event)

    def _retime(self) -> None:
        self.timing = timing_for(self.config, len(self._members))

