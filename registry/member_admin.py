"""What an operator changes: drain, evict (with a ban), cordon, and a ban passed on by a
member. Intents from the store (`apply_intent`) come through here too.

`AdminActions` is mixed into `registry.membership.Membership`, which owns the members.
The loop runs these for the HTTP side's admin endpoints; they change membership through
the same `_remove` and `_publish_update` as every other transition.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping

from registry.admission import Admission
from registry.member_entry import Entry
from registry.outcome import OK, Outcome
from registry.store.intents import IntentTable, ban_left_s, drains, evicts
from registry.store.records import EvictIntent, Intent, IntentKind
from wire.protocol import BannedBye, LeaveReason, MemberState, ReplyStatus

logger = logging.getLogger(__name__)


class AdminActions:
    """Operators' changes to the members `Membership` owns."""

    # Owned by Membership (set in its __init__); named here for the reader.
    admission: Admission
    intents: IntentTable
    wall_offset: float
    _members: OrderedDict[str, Entry]
    _authenticate: Callable[[str, int, int, bytes, bytes], Entry | Outcome]
    _remove: Callable[[str, LeaveReason], None]
    _publish_update: Callable[[Entry], None]

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

    def apply_intent(self, kind: IntentKind, member_id: str, intent: Intent | None,
                     now: float) -> None:
        """The store says `intent` is now held for `member_id` (None: removed). Hold it,
        and apply it to the member it names (the rules: `registry.store.intents`).

        A store change reaches every registry this way, the one that took the write
        included, so all of them act alike. Removing a drain undrains nothing (draining
        is one-way); removing an eviction lifts its ban; removing a cordon uncordons.
        """
        if self.intents.set(kind, member_id, intent):
            self._take_effect(kind, member_id, now)

    def reload_intents(self, everything: Mapping[tuple[IntentKind, str], Intent],
                       now: float) -> None:
        """The store's whole content (read again: at start, after an outage, after a
        compacted watch). Hold exactly it; what changed takes effect as one by one."""
        for kind, member_id, _ in self.intents.replace(everything):
            self._take_effect(kind, member_id, now)

    def _take_effect(self, kind: IntentKind, member_id: str, now: float) -> None:
        entry = self._members.get(member_id)
        if kind is IntentKind.DRAIN:
            if entry is not None and drains(self.intents.drain(member_id),
                                            entry.spec.incarnation):
                self.drain(member_id)
        elif kind is IntentKind.EVICT:
            self._apply_evict(member_id, self.intents.evict(member_id), now)
        elif entry is not None and entry.cordoned is not self.intents.cordoned(member_id):
            entry.cordoned = not entry.cordoned
            self._publish_update(entry)
            logger.info("[registry] %s id=%s (admin)",
                        "cordon" if entry.cordoned else "uncordon", member_id)

    def _apply_evict(self, member_id: str, intent: EvictIntent | None, now: float) -> None:
        wall_now = now + self.wall_offset
        if intent is None:
            self.admission.lift_ban(member_id)
            return
        ban_s = ban_left_s(intent, wall_now)
        if ban_s > 0 and self.admission.ban(member_id, now, ban_s) is not None:
            logger.warning("[registry] ban id=%s from the store not held: the ban table is "
                           "full", member_id)
        entry = self._members.get(member_id)
        if entry is not None and evicts(intent, entry.spec.incarnation,
                                        entry.registered_at + self.wall_offset):
            logger.info("[registry] evict id=%s (admin)", member_id)
            self._remove(member_id, LeaveReason.EVICTED)

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
