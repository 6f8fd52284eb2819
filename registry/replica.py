"""One registry's membership as a view holds it: the client side of the Clone pattern.

Pure state, no sockets: `MembershipView` feeds it snapshots and events and acts on what
`apply` answers. Rules (ZeroMQ Guide ch. 5):

- events at or below the snapshot's version are already in it: drop them;
- the next version applies; anything further means a change was missed: GAP, resync;
- a load digest carries the current version without bumping it: a digest newer than
  what we hold also means a missed change;
- another epoch means the registry restarted: GAP, resync.

A view that follows some models only (`per_model`) hears only their topics, where the
version jumps by every other model's changes. It checks each topic on its own instead:
an event applies when the topic's previous event (`previous_on_topic`) is one we hold,
and a digest shows a gap when its topic's last event (`last_on_topic`) is newer than what
we hold of that topic. A model whose topic has been silent past the registry's lease
while we hold members of it (every model with members is pulsed each interval) means
we missed its last leave: `silent_model` names it, and the view resyncs. Against a
registry that does not say these (NOT_SAID), the version alone rules, as above.

A view with loads on demand (`loads_on_demand`: a router of every model) applies the
loads of the models it is told to (`want`: those its requests ask for) as they come, and
passes over every other model's digests (the view decodes no more of them than their
versions, `registry.view_demand.LoadDigestHead`): those models are `missed`, their members keep
the loads they had and their `loads_confirmed_at` stays where it was, so a reader that
looks all the same sees loads as old as they are. When a missed model is wanted again,
the view asks the registry for its current loads (a Sync for that model) and hands the
answer to `apply_loads`; until then its digests apply but confirm nothing. A snapshot
gives every model's loads: nothing is missed after it.

A registry that restarted comes back with a new, empty epoch while its agents
re-register, so members of the old epoch are carried over for a while and dropped only
if they do not reappear: a registry restart never empties a router's view.

A leave the member said itself (bye, crashed) or a newer incarnation's arrival
(replaced) is final for that incarnation at every registry; `take_left` hands those to
the merge of several registries (registry/merge.py). An expiry or an eviction is only
this registry's view.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import Counter
from collections.abc import Collection
from typing import Final

import msgspec

from registry.topic_versions import model_of
from wire.protocol import (
    NOT_SAID,
    Event,
    LeaveReason,
    Load,
    LoadDigest,
    MemberLeft,
    MemberRecord,
    Role,
    Snapshot,
)

logger = logging.getLogger(__name__)

CARRY_OVER_INTERVALS = 6.0  # old-epoch members are kept this long after a restart
# Leaves that no registry can undo for that incarnation: the registry refuses it again.
FINAL_LEAVES: Final = frozenset({LeaveReason.BYE, LeaveReason.CRASHED, LeaveReason.REPLACED})


class LiveMember(msgspec.Struct, frozen=True, gc=False):
    """One member as a view sees it: the registry's record plus the freshest load.

    A Struct without the collector (`gc=False`): it holds only strings, numbers and
    `gc=False` Structs, so it cannot form a cycle, and a view of 100k members then
    gives the collector nothing to walk (it paused a router for ~100 ms at a time)."""

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


def same_membership(held: MemberRecord, fresh: MemberRecord) -> bool:
    """Whether `fresh` says what `held` says of a member but its load and heartbeat time
    (which a `LiveMember` carries apart): the same spec, state, suspicion and cordon."""
    return (held.spec == fresh.spec and held.state is fresh.state
            and held.suspect == fresh.suspect and held.cordoned == fresh.cordoned
            and held.registered_at == fresh.registered_at)


class Replica:
    def __init__(self, source: str, *, per_model: bool = False,
                 loads_on_demand: bool = False) -> None:
        """`per_model`: the view follows some models only (their topics and the empty
        one), so versions are checked per topic where the registry says them.
        `loads_on_demand`: only the loads of the models `want`ed apply as they come."""
        self.source = source
        self.per_model = per_model
        self.epoch = 0  # 0 until the first snapshot
        self.version = 0
        self.snapshots = 0  # applied: the first, then one per gap or restart
        self.interval_s = 1.0
        self.members: dict[str, LiveMember] = {}
        self._carried: dict[str, float] = {}  # id -> when to drop it (old-epoch members)
        # model -> when a digest for it last came. A digest lists only the loads that
        # changed, so it also says every other member of that model still reports the
        # same load: their loads are current as of then (a member whose heartbeats stop
        # is marked suspect by the registry instead).
        self.loads_confirmed_at: dict[str, float] = {}
        # Ids whose member changed or went since `take_changed()`: what a view merges,
        # so an update costs what changed, not the whole membership. The keys of a dict
        # of None, which the collector never tracks (a set always is: at 100k members a
        # resync's set of every id was alive when a young collection came).
        self._changed: dict[str, None] = {}
        # Apart, ids whose load alone changed (a digest: ~20,000 a second at 100k members
        # heartbeating every 5 s): the merge takes those by a shorter path.
        self._loaded: dict[str, None] = {}
        self._left: list[tuple[str, int]] = []  # final leaves since `take_left()`
        # Per topic (per_model only): the version of the last event applied on it, and
        # when the topic was last heard; the snapshot's version stands for the rest.
        self._snapshot_version = 0
        self._on_topic: dict[str, int] = {}
        self._heard: dict[str, float] = {}
        self._per_model: Counter[str] = Counter()  # members held, per model
        # Loads on demand: the models whose loads apply as they come (None: every
        # model's); those whose digests were passed over since the last snapshot, whose
        # loads are not current until the registry's answer comes (`apply_loads`); and of
        # those, the wanted ones the view is to ask the registry for (`take_to_fetch`).
        self._eager: frozenset[str] | None = frozenset() if loads_on_demand else None
        self._missed: set[str] = set()
        self._to_fetch: set[str] = set()

    @property
    def synced(self) -> bool:
        return self.epoch != 0

    @property
    def carried(self) -> frozenset[str]:
        return frozenset(self._carried)

    def next_drop_at(self) -> float | None:
        """When `drop_carried` next has something to do (None: nothing carried)."""
        return min(self._carried.values()) if self._carried else None

    def take_changed(self) -> dict[str, None]:
        """Ids whose member joined, left or has a new record since the last call (the
        keys; a resync lists every member); those whose load alone changed are in
        `take_loaded()`."""
        changed, self._changed = self._changed, {}
        return changed

    def take_loaded(self) -> dict[str, None]:
        """Ids whose load alone changed since the last call (the keys); an id may be
        in `take_changed()` too."""
        loaded, self._loaded = self._loaded, {}
        return loaded

    def take_left(self) -> list[tuple[str, int]]:
        """(id, incarnation) of the final leaves applied since the last call."""
        left, self._left = self._left, []
        return left

    def apply_snapshot(self, snapshot: Snapshot, now: float, wall_now: float) -> None:
        """Replace what we hold with `snapshot` (keeping old-epoch members a while)."""
        self.interval_s = snapshot.heartbeat_interval_s
        held = self.members
        fresh: dict[str, LiveMember] = {}
        for r in snapshot.members:
            old = held.get(r.spec.id)
            # A member the resync did not change keeps its record object: the merge and a
            # router's table see a new load, not a new member (at 100k members a resync
            # otherwise made every router remake its whole table, pausing it for seconds).
            record = old.record if old is not None and same_membership(old.record, r) else r
            fresh[r.spec.id] = LiveMember(record, r.load,
                                          now - max(0.0, wall_now - r.heartbeat_at),
                                          self.source)
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
        self._changed.update(dict.fromkeys(self.members))
        self._changed.update(dict.fromkeys(fresh))
        self.members = fresh
        self._missed.clear()  # the snapshot has every load
        self._to_fetch.clear()
        self.snapshots += 1
        self.epoch = snapshot.epoch
        self.version = self._snapshot_version = snapshot.version
        self._on_topic.clear()
        if self.per_model:
            self._per_model = Counter(m.record.spec.model for m in fresh.values())
            self._heard = dict.fromkeys(self._per_model, now)

    def apply(self, event: Event, now: float) -> Applied:
        """Apply one event in order."""
        if event.epoch != self.epoch:
            return self._gap(event)
        if self.per_model:
            said = event.last_on_topic if isinstance(event, LoadDigest) else \
                event.previous_on_topic
            if said != NOT_SAID:
                return self._apply_on_topic(event, said, now)
        step = 0 if isinstance(event, LoadDigest) else 1
        if event.version > self.version + step:
            return self._gap(event)
        if isinstance(event, LoadDigest):
            return self._apply_loads(event, now)
        if event.version <= self.version:
            return Applied.UNCHANGED  # already in the snapshot
        self.version = event.version
        return self._apply_change(event, now)

    def want(self, models: Collection[str]) -> None:
        """Loads on demand: apply `models`' loads as they come, and pass over every other
        model's from its next digest. A wanted model whose digests were passed over is
        to be fetched (`take_to_fetch`)."""
        if self._eager is None:
            return
        self._eager = frozenset(models)
        self._to_fetch.update(self._missed & self._eager)

    def take_to_fetch(self) -> set[str]:
        """The wanted models whose loads the view is to ask the registry for (a Sync for
        them, answered to `apply_loads`), since the last call."""
        to_fetch, self._to_fetch = self._to_fetch, set()
        return to_fetch

    @property
    def missed(self) -> frozenset[str]:
        """Models whose loads are not current here (their digests were passed over)."""
        return frozenset(self._missed)

    def apply_loads(self, snapshot: Snapshot, models: Collection[str], now: float,
                    wall_now: float) -> bool:
        """The registry's answer to a Sync for `models`: their members' current loads.
        Nothing else is taken from it (events say membership), and a load no newer than
        the one held is not. Whether a load changed."""
        if snapshot.epoch != self.epoch:
            return False  # a restart: the resync it causes gives every load
        wanted = set(models)
        changed = False
        members, loaded, source = self.members, self._loaded, self.source
        for r in snapshot.members:
            spec = r.spec
            held = members.get(spec.id)
            if held is None or spec.model not in wanted or \
                    held.record.spec.incarnation != spec.incarnation:
                continue
            load_at = now - max(0.0, wall_now - r.heartbeat_at)
            if load_at > held.load_at:
                members[spec.id] = LiveMember(held.record, r.load, load_at, source)
                loaded[spec.id] = None
                changed = True
        for model in wanted:
            self._missed.discard(model)
            self.loads_confirmed_at[model] = now
        return changed

    def silent_model(self, now: float, after_s: float) -> str | None:
        """A model we hold members of whose topic was silent for `after_s` (per_model):
        its last leave was missed, or it would have been pulsed. None if there is none."""
        for model, heard in self._heard.items():
            if now - heard > after_s and self._per_model[model]:
                return model
        return None

    def next_silence_at(self, after_s: float) -> float:
        """When `silent_model` could first name a model (inf: no topic to watch)."""
        return min((heard + after_s for model, heard in self._heard.items()
                    if self._per_model[model]), default=math.inf)

    def drop_carried(self, now: float) -> bool:
        """Forget old-epoch members that did not re-register in time; whether any went."""
        due = [member_id for member_id, drop_at in self._carried.items() if now >= drop_at]
        for member_id in due:
            del self._carried[member_id]
            self._forget(member_id)
            logger.info("[view] %s: %s did not re-register; dropped", self.source, member_id)
        return bool(due)

    def _gap(self, event: Event) -> Applied:
        logger.info("[view] %s: gap (have %d/%d, got %d/%d on %r): resync", self.source,
                    self.epoch, self.version, event.epoch, event.version, model_of(event))
        return Applied.GAP

    def _apply_on_topic(self, event: Event, said: int, now: float) -> Applied:
        """The per-topic rule: `said` is the topic's previous event (an event) or last
        event (a digest); the snapshot's version stands for every topic's past."""
        model = model_of(event)
        held = max(self._snapshot_version, self._on_topic.get(model, 0))
        if said > held:
            return self._gap(event)
        if isinstance(event, LoadDigest):
            return self._apply_loads(event, now)
        if event.version <= held:
            return Applied.UNCHANGED  # already in the snapshot
        self._on_topic[model] = event.version
        self.version = max(self.version, event.version)
        return self._apply_change(event, now)

    def _apply_change(self, event: Event, now: float) -> Applied:
        if isinstance(event, MemberLeft):
            current = self.members.get(event.id)
            if current is not None and current.record.spec.incarnation == event.incarnation:
                self._forget(event.id)
                self._carried.pop(event.id, None)
            if event.reason in FINAL_LEAVES:
                self._left.append((event.id, event.incarnation))
            return Applied.CHANGED
        assert not isinstance(event, LoadDigest)
        record = event.member
        member_id = record.spec.id
        old = self.members.get(member_id)
        if self.per_model:
            if old is not None:
                self._per_model[old.record.spec.model] -= 1
            self._per_model[record.spec.model] += 1
            self._heard[record.spec.model] = now
        self.members[member_id] = LiveMember(record, record.load, now, self.source)
        self._changed[member_id] = None
        self._carried.pop(member_id, None)
        return Applied.CHANGED

    def _forget(self, member_id: str) -> None:
        old = self.members.pop(member_id)
        self._changed[member_id] = None
        if self.per_model:
            self._per_model[old.record.spec.model] -= 1

    def _apply_loads(self, digest: LoadDigest, now: float) -> Applied:
        self.interval_s = digest.heartbeat_interval_s
        model = digest.model
        if self.per_model:
            self._heard[model] = now
        if self._eager is not None and (model not in self._eager
                                        or not isinstance(digest.loads, list)):
            # Passed over (or decoded no further than its versions, the view deciding by
            # its topic before this model was wanted): this model's loads are missed.
            self._missed.add(model)
            if model in self._eager:
                self._to_fetch.add(model)
            return Applied.UNCHANGED
        if model not in self._missed:  # (else the loads it does not list may be old)
            self.loads_confirmed_at[model] = now
        applied = Applied.UNCHANGED
        members, loaded, source = self.members, self._loaded, self.source
        for entry in digest.loads:  # (~5,000 a second at 100k members: names hoisted)
            member_id = entry.id
            current = members.get(member_id)
            if current is None:
                continue
            spec = current.record.spec  # (an entry for another model's member: not its)
            if spec.incarnation == entry.incarnation and spec.model == model:
                members[member_id] = LiveMember(current.record, entry.load,
                                                now - entry.heartbeat_age_s, source)
                loaded[member_id] = None
                applied = Applied.CHANGED
        return applied
