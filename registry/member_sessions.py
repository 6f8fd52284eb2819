"""Who may speak for a member: session proofs, replays, take-overs, and routers' reports.

`Sessions` is mixed into `registry.membership.Membership`, which owns the members. A
message changes nothing unless its proof is the member's session and its `seq` is new
(`_authenticate`); a newer incarnation takes an id over only from a process that is
evidently gone (`_contested`); a repeated Register is a retry or an impostor
(`_register_again`). Reports come only from routers and are weighed (`_weigh_report`).
"""

from __future__ import annotations

import hmac
import logging
from collections import OrderedDict
from collections.abc import Callable

from registry import sessions
from registry.detector import Timing
from registry.member_entry import Entry
from registry.outcome import BAD_PROOF, UNKNOWN, Outcome, Refusal, refused
from wire.protocol import MemberSpec, ReplyStatus, Report, Role, role_name

logger = logging.getLogger(__name__)

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


class Sessions:
    """Session checks and router reports over the members `Membership` owns."""

    # Owned by Membership (set in its __init__); named here for the reader.
    timing: Timing
    _members: OrderedDict[str, Entry]
    _unsuspected: OrderedDict[str, Entry]
    _age: Callable[[Entry, float], float]
    _publish_update: Callable[[Entry], None]

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

    def _weigh_report(self, entry: Entry, reporter: str, now: float) -> Outcome | None:
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


    def _authenticate(self, member_id: str, incarnation: int, seq: int, payload: bytes,
                      proof: bytes) -> Entry | Outcome:
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

    def _contested(self, current: Entry, spec: MemberSpec, now: float) -> Outcome | None:
        """Why the newer incarnation `spec` may not replace `current` yet, or None.

        An incarnation is whatever its registrant says, so a fleet-token holder could
        claim any live member's id with a higher one and take its traffic. A newer
        incarnation therefore replaces only a process that is evidently gone: silent past
        its lease (it crashed; the lease bounds how long a real restart waits, and its
        agent keeps registering until then). One that left said bye: its entry is gone
        already. While the holder heartbeats, the claim is refused as "contested",
        counted and logged, and the holder notices nothing.

        Only a heartbeat proved with the holder's session shows it alive: an incarnation
        that lapsed and was registered again (a sniffed Register replayed after its
        process crashed re-creates it) holds nothing against a newer one until it does.
        """
        if current.unproven:
            return None  # back by a Register alone, which anyone who sniffed one can send
        silent_s = self._age(current, now)
        if silent_s > self.timing.lease_s:
            return None
        return refused(f"id {spec.id!r} is held by incarnation {current.spec.incarnation}, "
                       f"which heartbeat {silent_s:.1f}s ago; a newer incarnation takes an "
                       f"id over only after its holder said bye or went silent for "
                       f"{self.timing.lease_s:.1f}s (contested)", Refusal.CONTESTED)

    def _register_again(self, entry: Entry, spec: MemberSpec, nonce: bytes) -> Outcome:
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

