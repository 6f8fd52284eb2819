"""What the routers' KV indexes say of each member: the registry's side of `KvIndexReport`.

Pure and single-writer (the registry loop), clock passed in; readers on other threads use
`view`, an immutable `FrozenMap` swapped by reference, never the tables behind it.

Each router indexes the KV events of the members it follows (router/kv/index.py) and
reports, per member, its index state, blocks and event lag (router/kv/reporter.py). The
registry only shows them (`/v1/members` `kv_index`, the dashboard, `pdreg status`); a
report never changes membership, versions or events. The rules, each a guard below:

- Rate: a router gets KV_REPORT_BURST reports at once and one more per heartbeat
  interval (a token bucket); beyond that a report is refused whole (`admit`).
- A router that restarted (a new incarnation) starts from nothing: what its previous
  process said is dropped on its first report.
- An entry may describe only a registered member that publishes KV events, at the
  incarnation the registry holds; any other entry is ignored and counted.
- A member's figures from an older incarnation are dropped when its newer one appears,
  and a GONE entry drops what that router said of it.
- `sweep` (every SWEEP_PERIOD_S, O(members + routers)) drops routers that left or
  restarted and members that left or changed incarnation; readers also skip a summary
  whose incarnation is not the member's current one, so nothing stale is shown meanwhile.
- Readers see a change with the report that made it; a bulk change (over VIEW_BATCH
  members) with the first report VIEW_PERIOD_S later, VIEW_CHUNK members a report. Both
  `sweep` and a bulk change's publication ride on reports, which every router sends
  each interval while it follows any member (its rolling refresh).

Per member the summary is the worst state any router reports, with that router's blocks
and lag (the most pessimistic view: where routers disagree, one of them is behind), and
how many routers report each state. It is kept cheap to recompute: a router's entry is
one packed int, ordered so that `max()` over a member's entries (C speed) finds the worst
state and, within it, the longest lag; counts per state move by one per change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import msgspec

from registry.frozen_map import FrozenMap
from wire.protocol import (
    MAX_KV_BLOCKS,
    MAX_KV_LAG_MS,
    KvIndexEntry,
    KvIndexState,
    MemberRecord,
    Role,
)

__all__ = ["KV_REPORT_BURST", "SWEEP_PERIOD_S", "VIEW_BATCH", "VIEW_PERIOD_S", "Applied",
           "KvReports", "KvSummary", "kv_index_json", "summary_json"]

KV_REPORT_BURST: Final = 2.0  # reports a router may send back to back (jitter, a restart)
SWEEP_PERIOD_S: Final = 5.0  # how often departed routers and members are looked for
# Readers' view: changed members are published with the report that changed them, unless
# more than VIEW_BATCH are waiting, which then go out at most every VIEW_PERIOD_S (with
# the next report: every router sends one per interval). A new view costs a copy of the
# changes and now and then of every summary (`FrozenMap`): routers restating thousands of
# members at once (a registry restart) must not pay that per message.
VIEW_BATCH: Final = 256
VIEW_PERIOD_S: Final = 0.5
# Summaries recomputed per report at most (~5 us each with 100 routers): a departed
# router's 10,000 members are republished over a few reports, not in one long turn.
VIEW_CHUNK: Final = 2048
_STATES: Final = tuple(s for s in KvIndexState if s is not KvIndexState.GONE)
# A router's entry as one int: state, then lag, then blocks (see the module doc).
_LAG_SHIFT: Final = 40
_STATE_SHIFT: Final = 62
_BLOCKS_MASK: Final = MAX_KV_BLOCKS
_LAG_MASK: Final = MAX_KV_LAG_MS
_STATE_OF_INT: Final = tuple(KvIndexState)  # by value: no enum call per summary

# Which member incarnation the registry holds for an id, if it publishes KV events.
IncarnationOf = Callable[[str], "int | None"]


class KvSummary(msgspec.Struct, frozen=True, gc=False):
    """A member's KV index across routers (what readers see)."""

    incarnation: int
    state: KvIndexState  # the worst any router reports
    blocks: int  # as that router reports them
    lag_ms: int
    routers: tuple[int, ...]  # how many routers report each state of _STATES, in order


@dataclass(slots=True)
class Applied:
    """What one report did, for the reply and the metrics."""

    stored: int = 0  # entries that changed what a router says of a member
    unchanged: int = 0  # entries equal to what the router said before
    removed: int = 0  # GONE entries that dropped something
    ignored: int = 0  # entries about no such member (or incarnation, or one without events)


@dataclass(slots=True)
class _Router:
    key: str
    incarnation: int
    tokens: float
    refilled_at: float


@dataclass(slots=True)
class _Member:
    incarnation: int
    by_router: dict[str, int] = field(default_factory=dict)  # router id -> packed entry
    counts: list[int] = field(default_factory=lambda: [0] * (len(_STATES) + 1))


def _state_of(packed: int) -> int:
    return packed >> _STATE_SHIFT


class KvReports:
    def __init__(self) -> None:
        self._routers: dict[str, _Router] = {}
        self._members: dict[str, _Member] = {}
        self._next_sweep = 0.0
        self._held = 0
        self._dirty: set[str] = set()  # members whose summary readers have not seen yet
        self._next_view = 0.0
        self.view: FrozenMap[KvSummary] = FrozenMap()  # swapped whole: any thread may read
        # Told each batch of changes to `view` (the registry's dashboard change log).
        self.on_changes: Callable[[dict[str, KvSummary | None]], None] | None = None

    @property
    def held(self) -> int:
        """(router, member) entries held: the memory this costs grows with it."""
        return self._held

    def admit(self, router_id: str, incarnation: int, now: float, interval_s: float) -> float:
        """0 when `router_id` may report now (and charge it), else seconds until it may."""
        router = self._routers.get(router_id)
        if router is not None and router.incarnation != incarnation:
            # A restarted router starts from nothing: its old process's figures go.
            del self._routers[router_id]
            self._drop_router(router_id)
            router = None
        if router is None:
            router = self._routers[router_id] = _Router(router_id, incarnation,
                                                        KV_REPORT_BURST, now)
        router.tokens = min(KV_REPORT_BURST,
                            router.tokens + (now - router.refilled_at) / interval_s)
        router.refilled_at = now
        if router.tokens < 1.0:
            return (1.0 - router.tokens) * interval_s
        router.tokens -= 1.0
        return 0.0

    def apply(self, router_id: str, entries: Iterable[KvIndexEntry],
              incarnation_of: IncarnationOf, now: float) -> Applied:
        """Store what `router_id` (admitted just before) says of each member."""
        applied = Applied()
        dirty = self._dirty
        members = self._members
        router = self._routers.get(router_id)
        # One string object per router, shared by every member's entry.
        router_key = router.key if router is not None else router_id
        for entry in entries:
            member_id = entry.member_id
            current = incarnation_of(member_id)
            if current is None or current != entry.incarnation:
                applied.ignored += 1  # a router describes only members as registered
                continue
            member = members.get(member_id)
            if member is None or member.incarnation != current:
                if entry.state is KvIndexState.GONE:
                    applied.unchanged += 1
                    continue
                # Figures about an older incarnation go with it (a restart starts afresh).
                if member is not None:
                    self._held -= len(member.by_router)
                member = members[member_id] = _Member(current)
            if entry.state is KvIndexState.GONE:
                old = member.by_router.pop(router_key, None)
                if old is None:
                    applied.unchanged += 1
                    continue
                member.counts[old >> _STATE_SHIFT] -= 1
                self._held -= 1
                applied.removed += 1
            else:
                # The entry as one int (see the module doc); inline: the per-entry path.
                packed = (entry.state << _STATE_SHIFT) | (entry.lag_ms << _LAG_SHIFT) \
                    | entry.blocks
                old = member.by_router.get(router_key)
                if old == packed:
                    applied.unchanged += 1
                    continue
                if old is not None:
                    member.counts[old >> _STATE_SHIFT] -= 1
                else:
                    self._held += 1
                member.by_router[router_key] = packed
                member.counts[entry.state] += 1
                applied.stored += 1
            dirty.add(member_id)
            if not member.by_router:
                del members[member_id]
        self._publish(now)
        return applied

    def sweep(self, now: float, incarnation_of: IncarnationOf,
              router_incarnation_of: Callable[[str], int | None]) -> int:
        """Drop what departed routers said, and departed members; every SWEEP_PERIOD_S.
        Returns how many routers and members were dropped."""
        if now < self._next_sweep:
            return 0
        self._next_sweep = now + SWEEP_PERIOD_S
        gone_routers = [r for r, held in self._routers.items()
                        if router_incarnation_of(r) != held.incarnation]
        for router_id in gone_routers:
            del self._routers[router_id]
            self._drop_router(router_id)
        gone_members = [m for m, held in self._members.items()
                        if incarnation_of(m) != held.incarnation]
        for member_id in gone_members:
            self._held -= len(self._members.pop(member_id).by_router)
        self._dirty.update(gone_members)
        self._publish(now)
        return len(gone_routers) + len(gone_members)

    # --- internals ---------------------------------------------------------------------

    def _drop_router(self, router_id: str) -> None:
        """Forget everything `router_id` said: O(members), once per router departure."""
        emptied = []
        for member_id, member in self._members.items():
            old = member.by_router.pop(router_id, None)
            if old is not None:
                member.counts[_state_of(old)] -= 1
                self._held -= 1
                self._dirty.add(member_id)
                if not member.by_router:
                    emptied.append(member_id)
        for member_id in emptied:
            del self._members[member_id]

    def _publish(self, now: float) -> None:
        """A new view with the changed members' summaries (see VIEW_BATCH)."""
        dirty = self._dirty
        if not dirty or (len(dirty) > VIEW_BATCH and now < self._next_view):
            return
        members = self._members
        changes: dict[str, KvSummary | None] = {}
        for _ in range(min(len(dirty), VIEW_CHUNK)):
            member_id = dirty.pop()
            member = members.get(member_id)
            changes[member_id] = None if member is None else _summary_of(member)
        if not dirty:
            self._next_view = now + VIEW_PERIOD_S
        self.view = self.view.updated(changes)
        if self.on_changes is not None:
            self.on_changes(changes)


def _summary_of(member: _Member) -> KvSummary:
    worst = max(member.by_router.values())
    return KvSummary(member.incarnation, _STATE_OF_INT[worst >> _STATE_SHIFT],
                     worst & _BLOCKS_MASK, (worst >> _LAG_SHIFT) & _LAG_MASK,
                     tuple(member.counts[1:]))  # counts[0] is GONE's, always 0


def summary_json(summary: KvSummary) -> dict[str, object]:
    """`kv_index` of a member in /v1/members, the dashboard and `pdreg status --json`."""
    return {
        "state": summary.state.name.lower(),
        "blocks": summary.blocks,
        "lag_s": round(summary.lag_ms / 1000, 3),
        "routers": {state.name.lower(): n
                    for state, n in zip(_STATES, summary.routers, strict=True) if n},
    }


def kv_index_json(records: Sequence[MemberRecord],
                  view: Mapping[str, KvSummary]) -> dict[str, dict[str, object]]:
    """Per member id, its `kv_index` as readers see it (members with none are absent).

    Only a summary of the incarnation registered now is shown, and only while some router
    is registered: the loop sweeps departed routers when another one reports, so with no
    router left a summary could otherwise stay on screen that nobody updates.
    """
    if not view or not any(r.spec.role is Role.API_SERVER for r in records):
        return {}
    shown: dict[str, dict[str, object]] = {}
    for record in records:
        summary = view.get(record.spec.id)
        if summary is not None and summary.incarnation == record.spec.incarnation:
            shown[record.spec.id] = summary_json(summary)
    return shown
