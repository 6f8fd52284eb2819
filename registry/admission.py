"""Who may join: bans, member caps and incarnation bounds. Pure; `Membership` consults it.

These are the limits on a registrant that holds the fleet token: it may add members, but
not without bound, not under an id an operator banned, and not with an incarnation meant
to outlive every real restart of that id.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass

from registry.outcome import Outcome, Refusal, refused
from wire.protocol import MemberSpec, ReplyStatus

logger = logging.getLogger(__name__)

# --max-members default: what bench/bench_scale.py measured one registry to hold on 2
# shared cores (100k members at the 5 s interval it dictates then, every heartbeat
# answered, 10 changes/s, nobody wrongly suspected); 800k GPUs at TP 8.
MAX_MEMBERS = 100_000
# Incarnations are time_ns() at process start: one further ahead of the registry's clock
# than this could only be meant to outlive every real restart of that id.
MAX_INCARNATION_AHEAD_S = 60.0
MAX_BANS = 10_000
MAX_BAN_S = 30 * 24 * 3600.0  # the longest ban an operator (or a banned member) can set
MAX_DEPARTED = 10_000  # (id, incarnation) pairs that said bye, newest kept


@dataclass(frozen=True, slots=True)
class Limits:
    max_members: int = MAX_MEMBERS
    max_members_per_model: int = 0  # 0: only the total cap
    max_incarnation_ahead_s: float = MAX_INCARNATION_AHEAD_S

    def __post_init__(self) -> None:
        if self.max_members < 1 or self.max_members_per_model < 0:
            raise ValueError("member caps must be positive (--max-members, "
                             "--max-members-per-model)")


class Admission:
    def __init__(self, limits: Limits, wall_offset: float) -> None:
        self.limits = limits
        self.wall_offset = wall_offset
        self.per_model: Counter[str] = Counter()
        self._bans: dict[str, float] = {}  # id -> monotonic time the ban ends
        # A process that said bye never registers that incarnation again, so a Register
        # for one is a replay (of a sniffed message) trying to bring it back.
        self._departed: OrderedDict[tuple[str, int], None] = OrderedDict()
        # (id, incarnation) pairs that left without a bye (expired, replaced). One may
        # come back (a partitioned process registers again), but a Register is no proof
        # of life (it may be a sniffed one replayed): back, it holds its id against a
        # newer incarnation only once it heartbeats with its session (`Entry.unproven`).
        self._lapsed: OrderedDict[tuple[str, int], None] = OrderedDict()

    def problem(self, spec: MemberSpec, now: float) -> Outcome | None:
        """Why `spec` may not register now (ban, incarnation), or None."""
        banned_until = self._bans.get(spec.id)
        if banned_until is not None:
            if now < banned_until:
                # banned_s: the member passes the ban on to its other registries.
                return Outcome(ReplyStatus.REJECTED,
                               f"id {spec.id!r} is banned for another "
                               f"{banned_until - now:.0f}s (evicted by an operator)",
                               kind=Refusal.BANNED, banned_s=banned_until - now)
            del self._bans[spec.id]
        if (spec.id, spec.incarnation) in self._departed:
            return refused(f"id {spec.id!r} incarnation {spec.incarnation} said bye; a "
                           f"restarted process registers a newer incarnation", Refusal.DEPARTED)
        ahead_s = spec.incarnation / 1e9 - (now + self.wall_offset)
        limit_s = self.limits.max_incarnation_ahead_s
        if ahead_s > limit_s:
            return refused(f"incarnation {spec.incarnation} is {ahead_s:.0f}s ahead of the "
                           f"registry's clock (at most {limit_s:.0f}s; an incarnation is the "
                           f"process start time in ns)", Refusal.INCARNATION)
        return None

    def cap_problem(self, members: int, model: str, replacing: MemberSpec | None
                    ) -> Outcome | None:
        """Why one more member of `model` (in place of `replacing`) is over a cap, or None."""
        limits = self.limits
        if members - (replacing is not None) >= limits.max_members:
            return refused(f"member cap reached: {limits.max_members} members "
                           f"(--max-members)", Refusal.CAP)
        if limits.max_members_per_model:
            same = replacing is not None and replacing.model == model
            if self.per_model[model] - same >= limits.max_members_per_model:
                return refused(f"per-model cap reached: {limits.max_members_per_model} "
                               f"members serve model {model!r} (--max-members-per-model)",
                               Refusal.CAP)
        return None

    def joined(self, model: str) -> None:
        self.per_model[model] += 1

    def left(self, model: str) -> None:
        self.per_model[model] -= 1
        if not self.per_model[model]:
            del self.per_model[model]

    def said_bye(self, member_id: str, incarnation: int) -> None:
        self._departed[(member_id, incarnation)] = None
        if len(self._departed) > MAX_DEPARTED:
            self._departed.popitem(last=False)

    def lapsed(self, member_id: str, incarnation: int) -> None:
        """`(member_id, incarnation)` left without a bye (it expired, or was replaced)."""
        self._lapsed[(member_id, incarnation)] = None
        if len(self._lapsed) > MAX_DEPARTED:
            self._lapsed.popitem(last=False)

    def has_lapsed(self, member_id: str, incarnation: int) -> bool:
        return (member_id, incarnation) in self._lapsed

    def ban(self, member_id: str, now: float, ban_s: float) -> Outcome | None:
        """Refuse `member_id`'s registrations for `ban_s`; why not, or None."""
        if not self._room_for(member_id, now):
            return refused(f"{MAX_BANS} ids are banned already", Refusal.BANS)
        self._bans[member_id] = now + ban_s
        logger.warning("[registry] ban id=%s for %.0fs (admin)", member_id, ban_s)
        return None

    def ban_passed_on(self, member_id: str, now: float, ban_s: float) -> bool:
        """A ban another registry set, passed on by the banned member (`BannedBye`);
        whether it is held now.

        The rules, as the member can only ever speak for its own id:
        - at most MAX_BAN_S, the longest an operator here could set;
        - it only lengthens a ban held here, never shortens one an operator set;
        - within MAX_BANS, like an operator's ban.
        """
        ban_s = min(ban_s, MAX_BAN_S)
        if ban_s <= 0 or not self._room_for(member_id, now):
            return False
        end = max(now + ban_s, self._bans.get(member_id, 0.0))
        self._bans[member_id] = end
        logger.warning("[registry] ban id=%s for %.0fs (passed on by the member from "
                       "another registry)", member_id, end - now)
        return True

    def lift_ban(self, member_id: str) -> None:
        """The store no longer holds a ban on `member_id` (an operator removed it)."""
        if self._bans.pop(member_id, None) is not None:
            logger.warning("[registry] ban id=%s lifted", member_id)

    def _room_for(self, member_id: str, now: float) -> bool:
        self._bans = {i: end for i, end in self._bans.items() if end > now}
        return len(self._bans) < MAX_BANS or member_id in self._bans

    def banned(self, now: float) -> dict[str, float]:
        """Ids banned now and the seconds each ban has left."""
        return {i: end - now for i, end in self._bans.items() if end > now}
