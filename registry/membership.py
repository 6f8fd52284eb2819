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
"""

from __future__ import annotations

import hmac
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

import msgspec

from registry import sessions
from registry.admission import Admission, Limits
from registry.deadband import Deadband, is_news
from registry.detector import DetectorConfig, Timing, loop_lag, timing_for
from registry.fleet_stats import FleetFigures, FleetStats, Group, state_key
from registry.outcome import BAD_PROOF, DRAIN, OK, UNKNOWN, Outcome, Refusal, refused
from registry.preservation import Change, SelfPreservation
from wire.protocol import (
    BannedBye,
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
    Report,
    Role,
    role_name,
)

logger = logging.getLogger(__name__)

_NO_LOAD = Load()  # frozen, so one instance serves every default
LAG_WARNING_S = 0.5  # a loop stall this long is logged as a warning (always compensated)
# A seq may jump ahead of the last one accepted by at most this much. An agent adds one
# per request (2**32 is over a year of requests at 100/s), so only a forger jumps
# further, and what it sends is refused without moving `last_seq`: nobody is locked out.
MAX_SEQ_STEP = 2**32
# Reports (see `report`). A member whose own heartbeat is this many intervals old or
# less is "fresh": one reporter alone cannot quarantine it.
REPORT_FRESH_INTERVALS = 1.5
REPORT_WINDOW_INTERVALS = 3.0  # reports from distinct routers within this many intervals add up
REPORTERS_TO_OVERRULE = 2  # distinct routers that outweigh a fresh heartbeat
MAX_REPORTERS_TRACKED = 16  # per member; the oldest report is forgotten first

__all__ = ["OK", "UNKNOWN", "Limits", "Membership", "Outcome"]


class _Entry(msgspec.Struct, gc=False):
    """A member as the registry holds it (mutable; never sent).

    Not tracked by the cyclic GC (`gc=False`): it holds only leaf data (specs, loads,
    bytes, numbers, a dict of floats, its `fleet_stats.Group`, which holds no entry) and
    nothing that can refer back to it, so it can
    never be in a reference cycle. At 100k members this takes 100k objects out of every
    full collection, which otherwise paused the loop for 0.1-0.2 s now and then.
    """

    spec: MemberSpec
    state: MemberState
    load: Load
    registered_at: float  # monotonic
    last_seen: float  # monotonic; moved forward by loop lag
    heartbeat_at: float  # monotonic, never moved: what clients see as heartbeat age
    session: bytes  # the secret every later message of this incarnation is proved with
    nonce: bytes  # the registrant's own secret: a retried Register must repeat it
    # Where Membership.fleet_stats counts it: its group, heartbeat_at in microseconds
    # (which gives its slot) and state key.
    group: Group
    beat_us: int
    counted: int
    last_seq: int = 0  # the highest seq accepted; anything at or below it is a replay
    suspect: bool = False
    # last_seen before the latest heartbeat: whether the member was silent at a moment
    # that its latest heartbeat has since passed (self-preservation looks back to when
    # the first lease ran out).
    seen_before: float = 0.0
    admin_draining: bool = False  # an operator's drain sticks whatever the member says
    reports: dict[str, float] | None = None  # reporter id -> when it last reported this one
    silent: bool = False  # in Membership._silent (counted toward self-preservation)
    sent_load: Load = _NO_LOAD  # the load views were last sent (digest or record)
    held_since: float = 0.0  # when a change inside the deadband was first held back

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
        # Ordered by last_seen: a heartbeat moves its member to the end, so the silent
        # ones gather at the front and a tick only looks at those (see the module doc).
        self._members: OrderedDict[str, _Entry] = OrderedDict()
        self._unsuspected: OrderedDict[str, _Entry] = OrderedDict()
        self._unsilent: OrderedDict[str, _Entry] = OrderedDict()
        self._silent: OrderedDict[str, _Entry] = OrderedDict()
        self._lag_s = 0.0  # every loop stall compensated so far (see the module doc)
        # The current record of each member, per model; ids in _stale are rebuilt on read
        # (a heartbeat only marks its member: most records are never read between two).
        self._records: dict[str, dict[str, MemberRecord]] = {}
        self._stale: set[str] = set()
        self._outbox: list[MembershipEvent] = []
        self._dirty_loads: dict[str, set[str]] = {}  # model -> ids whose load changed
        # Load changes inside the deadband, oldest first: they go out max_age_s late.
        self._held: OrderedDict[str, _Entry] = OrderedDict()
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

    def next_deadline(self, now: float) -> float:
        """When `tick` next has something to do (at the latest one tick period away)."""
        deadline = now + self.config.tick_period_s
        timing = self.timing
        if self._members:
            oldest = _first(self._members)
            deadline = min(deadline, oldest.last_seen + self._lag_s + timing.lease_s)
        if self._unsuspected:
            first = _first(self._unsuspected)
            deadline = min(deadline, first.last_seen + self._lag_s + timing.suspect_after_s)
        return deadline

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
        seen = now - self._lag_s
        counted = state_key(state, False)
        group, beat_us = self.fleet_stats.join(spec.role, spec.model, counted, now)
        entry = _Entry(spec=spec, state=state, load=load, registered_at=now, last_seen=seen,
                       seen_before=seen, sent_load=load,
                       heartbeat_at=now, session=self._new_session(), nonce=nonce,
                       group=group, beat_us=beat_us, counted=counted)
        self._members[spec.id] = entry
        self._unsuspected[spec.id] = entry
        self._unsilent[spec.id] = entry
        self.admission.joined(spec.model)
        self._retime()
        record = entry.record(self.wall_offset)
        self._records.setdefault(spec.model, {})[spec.id] = record
        self._publish(MemberJoined(self.epoch, self._next_version(), record))
        logger.info("[registry] join id=%s incarnation=%d role=%s model=%s state=%s",
                    spec.id, spec.incarnation, role_name(spec.role), spec.model,
                    state.name.lower())
        return Outcome(ReplyStatus.OK, session=entry.session)

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

    def banned_bye(self, bye: BannedBye, payload: bytes, now: float) -> Outcome:
        """A member an operator banned at another registry leaves, and the ban with it.

        How a ban reaches every registry and survives a restart of any (the member
        carries it, as with a drain):
        - An operator bans an id at registry A (`evict --ban`). A refuses its Registers
          with `Reply.banned_s`; the member's agent then sends this to every registry
          where it holds a session, and stops registering anywhere.
        - A later process with that id registers everywhere. Any registry still holding
          the ban refuses it with `banned_s`, so the ones that accepted it (a restarted
          A that forgot) hear this and hold the ban again.
        Guards:
        - Sealed with the member's own session, `seq` new (`_authenticate`): only the
          member itself can send it, and it can only ban its own id. A stranger, a forged
          proof or a replay changes nothing.
        - An id not held here changes nothing (nobody to authenticate).
        - The length is capped and only ever lengthens a ban (`Admission.ban_passed_on`).
          It is no more than the member could do by leaving and staying away; a fleet-
          token holder gets nothing it could not by keeping the id registered.
        """
        if bye.id not in self._members:
            return OK  # already gone, and unproven: nothing to record
        entry = self._authenticate(bye.id, bye.incarnation, bye.seq, payload, bye.proof)
        if isinstance(entry, Outcome):
            return entry
        self.admission.ban_passed_on(bye.id, now, bye.ban_s)
        self._remove(bye.id, LeaveReason.EVICTED)
        self.admission.said_bye(bye.id, bye.incarnation)
        return OK

    def report(self, report: Report, payload: bytes, now: float) -> Outcome:
        """A router saw `report.member` fail: suspect it now; its next heartbeat clears that."""
        reporter = self._authenticate(report.id, report.incarnation, report.seq, payload,
                                      report.proof)
        if isinstance(reporter, Outcome):
            return reporter
        if reporter.spec.role is not Role.API_SERVER:
            return refused(f"reports are accepted only from api_server members; {report.id} "
                           f"is {role_name(reporter.spec.role)}", Refusal.REPORTER)
        entry = self._members.get(report.member)
        if entry is None or entry.spec.incarnation != report.member_incarnation:
            return Outcome(ReplyStatus.OK, "ignored: no such member incarnation",
                           kind="ignored")
        weighed = self._weigh_report(entry, report.id, now)
        if weighed is not None:
            return weighed
        if not entry.suspect:
            entry.suspect = True
            del self._unsuspected[report.member]
            self._publish_update(entry)
            logger.info("[registry] suspect id=%s reported by %s: %s", report.member,
                        report.id, report.problem[:200].encode("unicode_escape").decode())
        return Outcome(ReplyStatus.OK, kind="accepted")

    def authenticate_router(self, member_id: str, incarnation: int, seq: int,
                            payload: bytes, proof: bytes) -> Outcome | None:
        """None when a message is a registered router's own (proved with its session, a
        new seq, which is taken), else why not. For router messages that change no
        member (`KvIndexReport`): the same guards as `report`."""
        reporter = self._authenticate(member_id, incarnation, seq, payload, proof)
        if isinstance(reporter, Outcome):
            return reporter
        if reporter.spec.role is not Role.API_SERVER:
            return refused(f"only api_server members may send this; {member_id} is "
                           f"{role_name(reporter.spec.role)}", Refusal.REPORTER)
        return None

    def _weigh_report(self, entry: _Entry, reporter: str, now: float) -> Outcome | None:
        """Why a report about `entry` does not suspect it (answered OK), or None.

        Reports come from routers, and one router can be wrong or hostile: a stream of
        reports from it alone must not keep a member out that says it is alive.
        - Rate: one report per (reporter, member) per heartbeat interval; more are noted
          and dropped (the member's state cannot flap faster than it heartbeats anyway).
        - Weight: while the member's own heartbeats are fresh, it takes reports from
          REPORTERS_TO_OVERRULE distinct routers within the window to suspect it. A member
          that stopped heartbeating is suspected on one report, as before.
        """
        interval = self.timing.heartbeat_interval_s
        reports = entry.reports if entry.reports is not None else {}
        entry.reports = reports
        last = reports.get(reporter)
        if last is not None and now - last < interval:
            return Outcome(ReplyStatus.OK, "limited: one report per member and interval",
                           kind="limited")
        reports[reporter] = now
        window = REPORT_WINDOW_INTERVALS * interval
        for other, at in list(reports.items()):
            if now - at > window:
                del reports[other]
        while len(reports) > MAX_REPORTERS_TRACKED:
            del reports[min(reports, key=reports.__getitem__)]
        fresh = self._age(entry, now) <= REPORT_FRESH_INTERVALS * interval
        if fresh and len(reports) < REPORTERS_TO_OVERRULE:
            return Outcome(ReplyStatus.OK, "outweighed: its own heartbeats are fresh",
                           kind="outweighed")
        return None

    def drain(self, member_id: str) -> Outcome:
        entry = self._members.get(member_id)
        if entry is None:
            return Outcome(ReplyStatus.UNKNOWN, f"no member {member_id!r}")
        entry.admin_draining = True
        if entry.state is not MemberState.DRAINING:
            entry.state = MemberState.DRAINING
            self._publish_update(entry)
            logger.info("[registry] drain id=%s (admin)", member_id)
        return OK

    def evict(self, member_id: str, now: float, ban_s: float = 0.0) -> Outcome:
        """Remove a member; with `ban_s`, refuse its id's registrations for that long."""
        present = member_id in self._members
        if not present and ban_s <= 0:
            return Outcome(ReplyStatus.UNKNOWN, f"no member {member_id!r}")
        if ban_s > 0:
            problem = self.admission.ban(member_id, now, ban_s)
            if problem is not None:
                return problem
        if present:
            self._remove(member_id, LeaveReason.EVICTED)
        return OK

    def tick(self, now: float) -> None:
        """Suspect the late, expire the long gone. Run on the loop's timer, not on messages.

        O(members crossing a threshold), not O(members): each step pops from the front of
        an order while its member is past the threshold, and checks the age it acts on.
        """
        previous, self._last_tick = self._last_tick, now
        lag = 0.0 if previous is None else loop_lag(previous, now, self.config.tick_period_s)
        if lag > 0:
            # The registry was stalled, not the members: give everyone that time back.
            self.last_lag_s = lag
            self._lag_s += lag
            # Small stalls are routine on a busy host; only a long one is worth a warning.
            log = logger.warning if lag >= LAG_WARNING_S else logger.debug
            log("[registry] loop lag %.3fs: deadlines moved", lag)
        t = now - self._lag_s  # the registry's clock, which last_seen runs on
        timing = self.timing
        unsuspected = self._unsuspected
        while unsuspected:
            entry = _first(unsuspected)
            age = t - entry.last_seen
            if age <= timing.suspect_after_s:
                break  # ordered by last_seen: everyone after this one is fresher
            del unsuspected[entry.spec.id]
            entry.suspect = True
            self._publish_update(entry)
            logger.info("[registry] suspect id=%s age=%.1fs", entry.spec.id, age)
        self._count_silent(t)
        # Self-preservation is decided when someone is due to expire (the oldest member is
        # past its lease), and re-checked every tick while it holds. The decision counts
        # who was silent when that lease ran out, not at this tick: members that woke in
        # between must not make a fleet-wide silence look like a few deaths.
        oldest = _first(self._members) if self._members else None
        due = oldest is not None and t - oldest.last_seen > timing.lease_s
        change = Change.NONE
        if self._preservation.active:
            change = self._preservation.update(len(self._silent), len(self._members), now)
        elif due:
            assert oldest is not None
            expired_at = oldest.last_seen + timing.lease_s
            change = self._preservation.update(self._silent_at(expired_at),
                                               len(self._members), now)
        if change is Change.OFF:
            # A silent fleet wakes one member at a time: the first ones back end the pause,
            # and the rest, a moment behind, must not be expired in that moment. Those
            # still silent get what is left of a lease from now on (and so are not silent).
            floor = t - timing.silent_after_s
            woken = list(self._silent.values())
            self._silent.clear()
            for entry in reversed(woken):  # oldest ends up first, as the order requires
                entry.last_seen = max(entry.last_seen, floor)
                entry.silent = False
                self._unsilent[entry.spec.id] = entry
                self._unsilent.move_to_end(entry.spec.id, last=False)
            return
        if self._preservation.active:
            return
        members = self._members
        while members:
            entry = _first(members)
            age = t - entry.last_seen
            if age <= timing.lease_s:
                break
            logger.info("[registry] expire id=%s age=%.1fs", entry.spec.id, age)
            self._remove(entry.spec.id, LeaveReason.EXPIRED)

    def _count_silent(self, t: float) -> None:
        """Bring `_silent` up to date at registry time `t`: exactly the members whose age
        is past silent_after_s (that threshold grows with the fleet, so both ends move)."""
        limit = self.timing.silent_after_s
        silent, unsilent = self._silent, self._unsilent
        while silent:
            entry = _last(silent)
            if t - entry.last_seen > limit:
                break
            del silent[entry.spec.id]
            entry.silent = False
            unsilent[entry.spec.id] = entry
            unsilent.move_to_end(entry.spec.id, last=False)
        while unsilent:
            entry = _first(unsilent)
            if t - entry.last_seen <= limit:
                break
            del unsilent[entry.spec.id]
            entry.silent = True
            silent[entry.spec.id] = entry

    def _age(self, entry: _Entry, now: float) -> float:
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
            entry = _first(held)
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

    def _authenticate(self, member_id: str, incarnation: int, seq: int, payload: bytes,
                      proof: bytes) -> _Entry | Outcome:
        """The member's entry if `proof` is its session's and `seq` is new; else why not.

        Nothing is changed on a refusal, so a message without the secret is harmless.
        """
        entry = self._members.get(member_id)
        if entry is None:
            return UNKNOWN
        held = entry.spec.incarnation
        if incarnation != held:
            if incarnation < held:
                return Outcome(ReplyStatus.STALE,
                               f"incarnation {incarnation} is older than {held}", kind="stale")
            return UNKNOWN  # a restarted process we have not heard register: no spec yet
        if not sessions.verify(entry.session, payload, proof):
            return BAD_PROOF
        if seq <= entry.last_seq:
            return refused(f"seq {seq} is not above {entry.last_seq} (a replay?)", Refusal.REPLAY)
        if seq > entry.last_seq + MAX_SEQ_STEP:
            return refused(f"seq {seq} is more than {MAX_SEQ_STEP} above {entry.last_seq}",
                           Refusal.SEQ)
        entry.last_seq = seq
        return entry

    def _contested(self, current: _Entry, spec: MemberSpec, now: float) -> Outcome | None:
        """Why the newer incarnation `spec` may not replace `current` yet, or None.

        An incarnation is whatever its registrant says, so a fleet-token holder could
        claim any live member's id with a higher one and take its traffic. A newer
        incarnation therefore replaces only a process that is evidently gone: silent past
        its lease (it crashed; the lease bounds how long a real restart waits, and its
        agent keeps registering until then). One that left said bye: its entry is gone
        already. While the holder heartbeats, the claim is refused as "contested",
        counted and logged, and the holder notices nothing.
        """
        silent_s = self._age(current, now)
        if silent_s > self.timing.lease_s:
            return None
        return refused(f"id {spec.id!r} is held by incarnation {current.spec.incarnation}, "
                       f"which heartbeat {silent_s:.1f}s ago; a newer incarnation takes an "
                       f"id over only after its holder said bye or went silent for "
                       f"{self.timing.lease_s:.1f}s (contested)", Refusal.CONTESTED)

    def _register_again(self, entry: _Entry, spec: MemberSpec, nonce: bytes) -> Outcome:
        """The same (id, incarnation) again: a retry by its registrant, or an impostor.

        A retry (the first reply was lost) gets the same session and changes nothing:
        the member's next heartbeat says what is new. So a replayed Register is harmless.
        """
        if not hmac.compare_digest(nonce, entry.nonce):
            return refused(f"id {spec.id!r} incarnation {spec.incarnation} is registered "
                           f"already; a restarted process registers a newer incarnation",
                           Refusal.TAKEOVER)
        if spec != entry.spec:
            return refused(f"id {spec.id!r} incarnation {spec.incarnation} is registered "
                           f"with another spec; a changed spec needs a new incarnation",
                           Refusal.TAKEOVER)
        return Outcome(ReplyStatus.OK, session=entry.session)

    def _seen(self, entry: _Entry, load: Load, now: float) -> None:
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

    def _load_changed(self, entry: _Entry, now: float) -> None:
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
        self._retime()
        self._publish(MemberLeft(self.epoch, self._next_version(), member_id,
                                 entry.spec.incarnation, entry.spec.model, reason))
        if reason is not LeaveReason.EXPIRED:
            logger.info("[registry] leave id=%s reason=%s", member_id, reason.name.lower())

    def _publish_update(self, entry: _Entry) -> None:
        # Every change of state or suspicion comes through here: recount it.
        counted = state_key(entry.state, entry.suspect)
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


def _first(order: OrderedDict[str, _Entry]) -> _Entry:
    return next(iter(order.values()))


def _last(order: OrderedDict[str, _Entry]) -> _Entry:
    return next(reversed(order.values()))
