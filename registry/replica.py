"""One registry's membership as a view holds it: the client side of the Clone pattern.

Pure state, no sockets: `MembershipView` feeds it snapshots and events and acts on what
`apply` answers. Rules (ZeroMQ Guide ch. 5):

- events at or below the snapshot's version are already in it: drop them;
- the next version applies; anything further means a change was missed: GAP, resync;
- a load digest carries the current version without bumping it: a digest newer than
  what we hold also means a missed change;
- another epoch means the registry restarted: GAP, resync.

A registry that restarted comes back with a new, empty epoch while its agents
re-register, so members of the old epoch are carried over for a while and dropped only
if they do not reappear: a registry restart never empties a router's view.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from wire.protocol import Event, Load, LoadDigest, MemberLeft, MemberRecord, Role, Snapshot

logger = logging.getLogger(__name__)

CARRY_OVER_INTERVALS = 6.0  # old-epoch members are kept this long after a restart


@dataclass(frozen=True, slots=True)
class LiveMember:
    """One member as a view sees it: the registry's record plus the freshest load."""

    record: MemberRecord
    load: Load
    load_at: float  # monotonic time that load was measured (receipt minus reported age)
    registry: str  # the control address it was learned from

    @property
    def id(self) -> str:
        return self.record.spec.id

    @property
    def role(self) -> Role:
        return self.record.spec.role

    @property
    def model(self) -> str:
        return self.record.spec.model

    @property
    def routable(self) -> bool:
        return self.record.routable


class Applied(enum.Enum):
    CHANGED = "changed"
    UNCHANGED = "unchanged"
    GAP = "gap"  # a change was missed or the epoch moved: take a new snapshot


class Replica:
    def __init__(self, source: str) -> None:
        self.source = source
        self.epoch = 0  # 0 until the first snapshot
        self.version = 0
        self.interval_s = 1.0
        self.members: dict[str, LiveMember] = {}
        self._carried: dict[str, float] = {}  # id -> when to drop it (old-epoch members)
        # model -> when a digest for it last came. A digest lists only the loads that
        # changed, so it also says every other member of that model still reports the
        # same load: their loads are current as of then (a member whose heartbeats stop
        # is marked suspect by the registry instead).
        self.loads_confirmed_at: dict[str, float] = {}
        # Ids whose member changed or went since `take_changed()`: what a view merges,
        # so an update costs what changed, not the whole membership.
        self._changed: set[str] = set()

    @property
    def synced(self) -> bool:
        return self.epoch != 0

    @property
    def carried(self) -> frozenset[str]:
        return frozenset(self._carried)

    def next_drop_at(self) -> float | None:
        """When `drop_carried` next has something to do (None: nothing carried)."""
        return min(self._carried.values()) if self._carried else None

    def take_changed(self) -> set[str]:
        """Ids whose member changed or left since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def apply_snapshot(self, snapshot: Snapshot, now: float, wall_now: float) -> None:
        """Replace what we hold with `snapshot` (keeping old-epoch members a while)."""
        self.interval_s = snapshot.heartbeat_interval_s
        fresh = {r.spec.id: LiveMember(r, r.load, now - max(0.0, wall_now - r.heartbeat_at),
                                       self.source) for r in snapshot.members}
        if self.epoch and snapshot.epoch != self.epoch:
            drop_at = now + CARRY_OVER_INTERVALS * self.interval_s
            for member_id, old in self.members.items():
                if member_id not in fresh:
                    fresh[member_id] = old
                    self._carried[member_id] = drop_at
            logger.info("[view] %s: new epoch %d (was %d); carrying %d members over",
                        self.source, snapshot.epoch, self.epoch, len(self._carried))
        else:
            # A resync within the epoch: still-carried members stay until they show up.
            for member_id in list(self._carried):
                if member_id in fresh or member_id not in self.members:
                    del self._carried[member_id]
                else:
                    fresh[member_id] = self.members[member_id]
        self._changed.update(self.members)
        self._changed.update(fresh)
        self.members = fresh
        self.epoch = snapshot.epoch
        self.version = snapshot.version

    def apply(self, event: Event, now: float) -> Applied:
        """Apply one event in order."""
        step = 0 if isinstance(event, LoadDigest) else 1
        if event.epoch != self.epoch or event.version > self.version + step:
            logger.info("[view] %s: gap (have %d/%d, got %d/%d): resync", self.source,
                        self.epoch, self.version, event.epoch, event.version)
            return Applied.GAP
        if isinstance(event, LoadDigest):
            return self._apply_loads(event, now)
        if event.version <= self.version:
            return Applied.UNCHANGED  # already in the snapshot
        self.version = event.version
        if isinstance(event, MemberLeft):
            current = self.members.get(event.id)
            if current is not None and current.record.spec.incarnation == event.incarnation:
                del self.members[event.id]
                self._carried.pop(event.id, None)
                self._changed.add(event.id)
            return Applied.CHANGED
        record = event.member
        self.members[record.spec.id] = LiveMember(record, record.load, now, self.source)
        self._changed.add(record.spec.id)
        self._carried.pop(record.spec.id, None)
        return Applied.CHANGED

    def drop_carried(self, now: float) -> bool:
        """Forget old-epoch members that did not re-register in time; whether any went."""
        due = [member_id for member_id, drop_at in self._carried.items() if now >= drop_at]
        for member_id in due:
            del self._carried[member_id]
            del self.members[member_id]
            self._changed.add(member_id)
            logger.info("[view] %s: %s did not re-register; dropped", self.source, member_id)
        return bool(due)

    def _apply_loads(self, digest: LoadDigest, now: float) -> Applied:
        self.interval_s = digest.heartbeat_interval_s
        self.loads_confirmed_at[digest.model] = now
        applied = Applied.UNCHANGED
        for entry in digest.loads:
            current = self.members.get(entry.id)
            if current is not None and current.record.spec.incarnation == entry.incarnation:
                self.members[entry.id] = LiveMember(current.record, entry.load,
                                                    now - entry.heartbeat_age_s, self.source)
                self._changed.add(entry.id)
                applied = Applied.CHANGED
        return applied
