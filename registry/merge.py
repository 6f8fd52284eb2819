"""Several registries' views merged into one: what a router sees when some of them fail.

Pure state, no sockets, the clock passed in: `MembershipView` feeds each registry's
`Replica`, says when it heard from each, and hands readers `members`. The rules:

- Freshness is per registry. A registry is live while it has been heard from within its
  lease (`away_after_s`: AWAY_AFTER_INTERVALS of its heartbeat interval; it pulses every
  interval). One silent longer leaves the merge, and a member that only such registries
  hold leaves the view: a frozen registry's last word keeps nobody alive.
- A member is in the view while at least one live registry holds it. An expiry (or an
  eviction) at one registry is only that registry's view: the member may be cut off from
  it alone.
- A leave that is final for an incarnation (the member said bye or crashed, or a newer
  incarnation replaced it: `replica.FINAL_LEAVES`), recorded by any registry, is final
  here: no registry's copy of that incarnation shows again, including the copy of a
  registry the member could not reach to say it, which holds it until its lease runs out
  (remembered for FINAL_KEEP_S, at most MAX_FINAL of them).
- Of the copies the live registries hold, the newest incarnation wins; then one that is
  not suspect (suspicion, too, is one registry's view); then the registry listed first,
  so that while it is live a model's members come from one registry.
- Loads are confirmed per registry: `loads_confirmed_at(model)` is the oldest
  confirmation among the registries the model's members come from, never the newest of
  any (another registry's pulse must not make a frozen one's loads look current).
- When no registry is live nothing changes: a router serves from its last view (a
  registry outage never empties it) and catches up when one comes back.

An update costs the ids that changed, plus the members of a registry that joins or
leaves the merge; never a walk over the whole membership while a registry is live.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence
from typing import Final

from registry.frozen_map import FrozenMap
from registry.replica import LiveMember, Replica
from wire.protocol import MemberSpec

__all__ = ["AWAY_AFTER_INTERVALS", "MIN_AWAY_AFTER_S", "Merge"]

AWAY_AFTER_INTERVALS: Final = 3.0  # a registry silent this long (the default lease) is away
MIN_AWAY_AFTER_S: Final = 1.0
# A final leave is remembered this long (far beyond any lease: a registry that missed the
# bye drops the member by then), and at most this many (~100 B each).
FINAL_KEEP_S: Final = 600.0
MAX_FINAL: Final = 100_000


class Merge:
    def __init__(self, replicas: Sequence[Replica]) -> None:
        self.replicas = list(replicas)
        self.members: FrozenMap[LiveMember] = FrozenMap()
        # model -> the registries its members come from. Replaced, never changed, so a
        # reader on another thread may hold it (`loads_confirmed_at`).
        self.sources: dict[str, tuple[str, ...]] = {}
        self._by_source = {replica.source: replica for replica in self.replicas}
        self._heard = [-math.inf] * len(self.replicas)
        self._live = [False] * len(self.replicas)
        # id -> (the newest incarnation that left for good, when), oldest first
        self._final: OrderedDict[str, tuple[int, float]] = OrderedDict()
        # Ids to look at again once a registry is live (a dict of None, as the replicas')
        self._pending: dict[str, None] = {}
        self._counts: dict[str, Counter[str]] = {}  # model -> source -> members from it
        # adapter -> base model -> members serving the adapter on that base: what a
        # request naming an adapter reads the loads of (`bases_of`)
        self._bases: dict[str, Counter[str]] = {}
        # adapter -> its base models: `_bases` as another thread may read it (replaced,
        # never changed), for `loads_confirmed_at`
        self.adapter_bases: dict[str, tuple[str, ...]] = {}
        self._moved: set[str] = set()  # models whose set of sources changed
        self._moved_adapters: set[str] = set()  # adapters whose set of bases changed
        # What the last update that changed `members` changed (registry/view_changes.py:
        # what a router's table follows): the ids it added, removed or gave a new
        # record, and apart, per model name a member serves (its base model and
        # adapters), those whose load alone changed (a router reads them per model).
        # Ids are the keys of dicts of None, which the collector never tracks (a resync
        # at 100k lists 100k loads; lists of them were walked by the next collection).
        self.last_changed: dict[str, None] = {}
        self.last_loaded: dict[str, dict[str, None]] = {}

    # --- liveness ----------------------------------------------------------------------

    def heard(self, index: int, now: float) -> None:
        """Something came from registry `index` (an event, a digest, a snapshot)."""
        self._heard[index] = now

    def heard_at(self, index: int) -> float:
        return self._heard[index]

    def away_after_s(self, index: int) -> float:
        return max(MIN_AWAY_AFTER_S, AWAY_AFTER_INTERVALS * self.replicas[index].interval_s)

    def live(self, index: int, now: float) -> bool:
        """Registry `index` has given a snapshot and was heard within its lease."""
        return (self.replicas[index].synced
                and now - self._heard[index] <= self.away_after_s(index))

    # --- reads -------------------------------------------------------------------------

    def loads_confirmed_at(self, model: str) -> float:
        """When the registries `model`'s members come from last confirmed their loads: the
        oldest of those (monotonic; -inf if one never did). A name served as an adapter
        counts its base models' too: their digests carry its members' loads (without them
        every member serving an adapter looked stale once its load had not changed for
        a few heartbeats). Safe from any thread."""
        sources, bases = self.sources, self.adapter_bases.get(model, ())
        confirmed = [self._by_source[source].loads_confirmed_at.get(base, -math.inf)
                     for base in (model, *bases) for source in sources.get(base, ())]
        return min(confirmed) if confirmed else -math.inf

    def bases_of(self, names: Collection[str]) -> set[str]:
        """The models whose digests carry the loads a request for one of `names` reads:
        each name (a base model) and the base models of the members serving it as an
        adapter. The view thread's."""
        bases = set(names)
        for name in names:
            serving = self._bases.get(name)
            if serving:
                bases.update(serving)
        return bases

    # --- the merge ---------------------------------------------------------------------

    def update(self, now: float) -> bool:
        """Take what changed in the replicas into `members`; whether `members` changed."""
        pending = self._pending
        for replica in self.replicas:
            for member_id, incarnation in replica.take_left():
                self._left_for_good(member_id, incarnation, now)
                pending[member_id] = None
        live = [self.live(i, now) for i in range(len(self.replicas))]
        if not any(live):
            # Every registry away (or none synced yet): keep the last view. What changes
            # meanwhile stays in the replicas until one is back.
            self._live = live
            return False
        loaded: dict[str, None] = {}
        for replica in self.replicas:
            changed = replica.take_changed()
            if pending:
                pending.update(changed)
            else:  # (the common case, one registry: its ids as they are, not copied)
                pending = changed
            if loaded:
                loaded.update(replica.take_loaded())
            else:
                loaded = replica.take_loaded()
        if not any(self._live):
            # The first registry back, or the first ever: look at everyone.
            pending.update(dict.fromkeys(self.members))
            for replica in self.replicas:
                pending.update(dict.fromkeys(replica.members))
        else:
            for was, replica, is_live in zip(self._live, self.replicas, live, strict=True):
                if was != is_live:  # a registry joined or left the merge: its members
                    pending.update(dict.fromkeys(replica.members))
        self._live = live
        self._pending = {}
        return self._apply(pending, loaded, live)

    def _apply(self, ids: dict[str, None], loads: dict[str, None], live: list[bool]) -> bool:
        """Take `ids` (anything may have changed) and `loads` (a load alone changed at
        one registry) into `members`."""
        updates: dict[str, LiveMember | None] = {}
        moved: dict[str, None] = {}
        loaded: dict[str, dict[str, None]] = {}
        members = self.members
        by_source = self._by_source
        for member_id in loads:
            # The shorter path: the copy shown comes from a registry whose copy has the
            # same record with a new load. Nothing that ranks the copies changed (a new
            # record, a leave, a registry joining or leaving the merge put the id in
            # `ids`), so the new copy is the one shown; anything else takes the long path.
            if member_id in ids:
                continue
            current = members.get(member_id)
            fresh = None if current is None else \
                by_source[current.registry].members.get(member_id)
            if fresh is None or current is None or fresh.record is not current.record:
                ids[member_id] = None
            elif fresh is not current:
                updates[member_id] = fresh
                _note_load(loaded, member_id, fresh.record.spec)
        for member_id in ids:
            best = self._choose(member_id, live)
            current = members.get(member_id)
            if best is current:
                continue
            updates[member_id] = best
            if current is not None and best is not None and current.record is best.record:
                _note_load(loaded, member_id, best.record.spec)
            else:
                moved[member_id] = None
            if (current is None or best is None or current.registry != best.registry
                    or current.record.spec.model != best.record.spec.model
                    or current.record.spec.adapters != best.record.spec.adapters):
                self._count(current, -1)
                self._count(best, 1)
        if self._moved or self._moved_adapters:
            self._publish_sources()
        if not updates:
            return False
        self.members = members.updated(updates)
        self.last_changed = moved
        self.last_loaded = loaded
        return True

    def _left_for_good(self, member_id: str, incarnation: int, now: float) -> None:
        final = self._final
        held = final.pop(member_id, None)
        final[member_id] = (max(incarnation, held[0] if held else -1), now)
        while final and (len(final) > MAX_FINAL
                         or next(iter(final.values()))[1] < now - FINAL_KEEP_S):
            final.popitem(last=False)

    def _choose(self, member_id: str, live: list[bool]) -> LiveMember | None:
        """The copy the view shows: the live registries' best, or None."""
        left = self._final.get(member_id)
        final = left[0] if left is not None else -1
        best: LiveMember | None = None
        for replica, is_live in zip(self.replicas, live, strict=True):
            member = replica.members.get(member_id)
            if member is None or not is_live or member.record.spec.incarnation <= final:
                continue  # (an incarnation that left for good, whatever a registry says)
            if best is None or _better(member, best):
                best = member
        return best

    def _count(self, member: LiveMember | None, delta: int) -> None:
        if member is None:
            return
        model = member.record.spec.model
        for adapter in member.record.spec.adapters:
            bases = self._bases.setdefault(adapter, Counter())
            bases[model] += delta
            if not bases[model]:
                del bases[model]
                self._moved_adapters.add(adapter)
                if not bases:
                    del self._bases[adapter]
            elif delta > 0 and bases[model] == 1:
                self._moved_adapters.add(adapter)
        counts = self._counts.setdefault(model, Counter())
        counts[member.registry] += delta
        if counts[member.registry] == 0:
            del counts[member.registry]
            self._moved.add(model)
        elif delta > 0 and counts[member.registry] == 1:
            self._moved.add(model)
        if not counts:
            del self._counts[model]

    def _publish_sources(self) -> None:
        if self._moved:
            self.sources = _republished(self.sources, self._moved, self._counts)
            self._moved.clear()
        if self._moved_adapters:
            self.adapter_bases = _republished(self.adapter_bases, self._moved_adapters,
                                              self._bases)
            self._moved_adapters.clear()


def _republished(published: dict[str, tuple[str, ...]], moved: Collection[str],
                 counts: dict[str, Counter[str]]) -> dict[str, tuple[str, ...]]:
    """A copy of `published` (name -> the keys counted for it) with the `moved` names'
    entries made anew from `counts`: a reader on another thread keeps the one it holds."""
    fresh = dict(published)
    for name in moved:
        counted = counts.get(name)
        if counted:
            fresh[name] = tuple(counted)
        else:
            fresh.pop(name, None)
    return fresh


def _note_load(loaded: dict[str, dict[str, None]], member_id: str,
               spec: MemberSpec) -> None:
    """`member_id`'s load alone changed: listed under each model name it serves."""
    ids = loaded.get(spec.model)
    if ids is None:
        ids = loaded[spec.model] = {}
    ids[member_id] = None
    for adapter in spec.adapters:  # a request may name an adapter (vLLM's LoRA API)
        loaded.setdefault(adapter, {})[member_id] = None


def _better(candidate: LiveMember, held: LiveMember) -> bool:
    """Whether `candidate` beats `held` (a registry listed earlier): a newer incarnation,
    or the same one not suspect where `held` is."""
    c, h = candidate.record.spec.incarnation, held.record.spec.incarnation
    return c > h or (c == h and held.record.suspect and not candidate.record.suspect)
