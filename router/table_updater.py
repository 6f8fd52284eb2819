"""The pairing table kept current from the view's changes, never from a walk of the view.

A router of every model at 100k members sees up to 10 load digests a second and several
membership changes: rebuilding the table (`PairingTable.build`) or comparing every member
to find what changed cost it its core. The view says which ids changed since the version
the table was made from (registry/view_changes.py), and for each:

- the same record with a new load (a digest): its new candidate waits with its model's
  other new loads, and goes into the model's pools (found by bisection in each sorted
  tier, `ProtocolPool.with_candidates`) when that model's pools are next read
  (`pools_of`, a request for the model); a model nobody asks for costs its digests a
  dict entry per member, never a copy of its pools;
- anything else (joined, left, another state, suspicion, spec): its candidate is
  added, removed or replaced at once, and its model's pools alone are made again, from
  the candidates this keeps per model, when that model is next read; every other
  model's pools are the same objects as before.

After any sequence of changes `table` (every waiting load swapped in) equals
`PairingTable.build` of the members, and `pools_of(model)` is its pools of `model`
(tests/test_table_updater.py checks both with Hypothesis). Pure: no clock, no threads;
the router's loop is its only user.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Final

from registry.client import LiveMember
from router.table import (
    Candidate,
    PairingTable,
    ProtocolPool,
    model_pools,
    served,
    takes_requests,
)

__all__ = ["LoadsSince", "TableUpdate", "TableUpdater"]


@dataclass(frozen=True, slots=True)
class TableUpdate:
    """What one `apply` changed beyond loads: `moved`, the ids that joined, left or have
    a new record (None: everything was read again); `gone`, the changed ids no longer in
    the view."""

    moved: tuple[str, ...] | None
    gone: tuple[str, ...]


MAX_NAME_SETS: Final = 10_000  # distinct (model, adapters...) tuples shared, at most

# (model, after, upto) -> the ids of `model` whose load alone changed in view versions
# (after, upto], None when that is no longer known (registry/view_changes.py `loads`)
LoadsSince = Callable[[str, int, int], Collection[str] | None]


class TableUpdater:
    def __init__(self, locality_key: str = "", protocols: Collection[str] | None = None,
                 loads_since: LoadsSince | None = None) -> None:
        """`loads_since`: where the loads the view did not list as changes are (a view
        that tells loads apart lists only membership changes); None: every change is
        in what `apply` is given."""
        self.locality_key = locality_key
        self.protocols = protocols
        self._loads_since = loads_since
        self._members: Mapping[str, LiveMember] = {}  # the view the table follows
        self._version = 0  # its version
        # model -> the version up to which the trail's loads are in its candidates
        # (absent: `_reset_at`, when everything was read whole)
        self._loads_at: dict[str, int] = {}
        self._reset_at = 0
        self._pools: dict[str, tuple[ProtocolPool, ...]] = {}  # model -> its pools
        # model -> id -> its candidate with a newer load than its model's pools hold
        self._waiting: dict[str, dict[str, Candidate]] = {}
        self._table: PairingTable | None = PairingTable({})  # None: to be made again
        self._stale: set[str] = set()  # models whose pools are made again when read
        # model -> id -> candidate: every member pairing may choose. Nothing here per
        # member that the collector tracks (a first read of 100k members made 200k new
        # tuples, walked by the young collections that followed; a dict is tracked once
        # it holds one): suspicion is a set, the model names a member serves an index
        # into one shared list of the distinct sets of names, the URLs a plain dict.
        self._by_model: dict[str, dict[str, Candidate]] = {}
        self._suspect: set[str] = set()  # ids of the candidates that are suspect
        self._names: dict[tuple[str, ...], int] = {}  # a set of names -> its index
        self._name_sets: list[tuple[str, ...]] = []  # index -> the set of names
        # id -> the models it serves: an index into `_name_sets`
        self._models_of: dict[str, int | tuple[str, ...]] = {}
        self._urls: dict[str, int] = {}  # base URL -> routable members with it
        self._url_set: frozenset[str] | None = frozenset()  # None: to be made again
        # The routable URLs, in the order they became routable, each with the number of
        # its arrival (`_arrived` counts them): the warm-up asks for those after its last
        # look (`urls_since`) instead of comparing every URL ten times a second (at
        # 100k members that, and the URL set made again on each flip, cost a router
        # ~50 ms of CPU a second).
        self._arrivals: dict[str, int] = {}
        self._arrived = 0

    def reset(self, members: Mapping[str, LiveMember], version: int = 0) -> TableUpdate:
        """Read `members` whole (the first view, or one whose changes are not known),
        the view's `version`."""
        self._members = members
        self._version = self._reset_at = version
        self._loads_at.clear()
        self._waiting.clear()
        self._by_model.clear()
        self._suspect.clear()
        self._models_of.clear()
        self._urls.clear()
        self._url_set = None
        self._pools.clear()
        self._stale.clear()
        dirty: set[str] = set()
        for member_id, member in members.items():
            self._add(member_id, member, dirty)
        self._rebuild(dirty)
        # A URL routable before and after keeps its arrival (it is not warmed again).
        for url in [url for url in self._arrivals if url not in self._urls]:
            del self._arrivals[url]
        return TableUpdate(None, ())

    def apply(self, previous: Mapping[str, LiveMember], members: Mapping[str, LiveMember],
              changed: Collection[str], version: int = 0) -> TableUpdate:
        """`members` (the view's `version`) is `previous` with `changed` (ids) changed:
        follow them. Loads listed apart (`loads_since`) are read when their model is."""
        self._members = members
        self._version = version
        dirty: set[str] = set()  # models whose pools are made again
        moved: list[str] = []
        gone: list[str] = []
        for member_id in changed:
            old = previous.get(member_id)
            new = members.get(member_id)
            if old is new:
                continue
            if old is not None and new is not None and old.record is new.record:
                self._loaded(member_id, new)
                continue
            moved.append(member_id)
            if new is None:
                gone.append(member_id)
            self._remove(member_id, dirty)
            if new is not None:
                self._add(member_id, new, dirty)
        if dirty:
            self._rebuild(dirty)
        return TableUpdate(tuple(moved), tuple(gone))

    def _loaded(self, member_id: str, member: LiveMember) -> None:
        """`member_id`'s load alone changed: its new candidate waits for its models' next
        read."""
        models = self._models(member_id)
        if not models:
            return  # not a candidate
        fresh = self._by_model[models[0]][member_id].with_load(member)
        for model in models:  # its base model and its adapters
            self._by_model[model][member_id] = fresh
            waiting = self._waiting.get(model)
            if waiting is None:
                waiting = self._waiting[model] = {}
            waiting[member_id] = fresh

    @property
    def table(self) -> PairingTable:
        """The whole table, every load swapped in: what `PairingTable.build` makes of
        the members. Costs every model's loads since its last read; a request reads
        `pools_of` its model instead."""
        for model in [*self._stale, *self._by_model]:
            self.pools_of(model)
        return self.membership

    @property
    def membership(self) -> PairingTable:
        """The table as far as membership goes: who is in which pool (the same as
        `table`'s), with loads that may be older than the view's for models whose pools
        were not read since (for what loads do not decide: /v1/models, eligibility)."""
        for model in list(self._stale):
            self._remake(model)
        if self._table is None:
            self._table = PairingTable(dict(sorted(self._pools.items())))
        return self._table

    def pools_of(self, model: str) -> tuple[ProtocolPool, ...]:
        """`model`'s pools with every load the view has (what `table` holds for it);
        costs the loads waiting for this model alone, never another model's."""
        self._take_loads(model)
        if model in self._stale:
            self._remake(model)
        elif model in self._waiting:
            self._swap_loads(model)
        return self._pools.get(model, ())

    def serves(self, model: str) -> bool:
        """A member of a handshake we speak serves `model` now (it has pools)."""
        return model in self._by_model

    def routable_urls(self) -> frozenset[str]:
        """The base URLs of the routable (ready, not suspect) candidates."""
        if self._url_set is None:
            self._url_set = frozenset(self._urls)
        return self._url_set

    def urls_since(self, mark: int) -> tuple[int, list[str]]:
        """The routable URLs that became routable after `mark` (0: every one), newest
        first, and the mark to ask with next time: costs those URLs."""
        arrivals = self._arrivals
        fresh: list[str] = []
        for url in reversed(arrivals):
            if arrivals[url] <= mark:
                break
            fresh.append(url)
        return self._arrived, fresh

    def _add(self, member_id: str, member: LiveMember, dirty: set[str]) -> None:
        if not takes_requests(member, self.protocols):
            return
        models = served(member.record.spec)
        index: int | tuple[str, ...] | None = self._names.get(models)
        if index is None and len(self._name_sets) < MAX_NAME_SETS:
            index = self._names[models] = len(self._name_sets)
            self._name_sets.append(models)
        candidate = Candidate.of(member, self.locality_key)
        suspect = member.record.suspect
        if suspect:
            self._suspect.add(member_id)
        for model in models:
            self._by_model.setdefault(model, {})[member_id] = candidate
        # (past MAX_NAME_SETS, the names themselves: the dict is tracked from then on)
        self._models_of[member_id] = models if index is None else index
        dirty.update(models)
        if not suspect:
            held = self._urls.get(candidate.http, 0)
            self._urls[candidate.http] = held + 1
            if not held:
                self._url_set = None
                if candidate.http not in self._arrivals:
                    self._arrived += 1
                    self._arrivals[candidate.http] = self._arrived

    def _remove(self, member_id: str, dirty: set[str]) -> None:
        models = self._names_at(self._models_of.pop(member_id, None))
        if not models:
            return
        for model in models:
            slots = self._by_model[model]
            candidate = slots.pop(member_id)
            if not slots:
                del self._by_model[model]
        dirty.update(models)
        if member_id in self._suspect:
            self._suspect.discard(member_id)
        else:
            held = self._urls[candidate.http] - 1
            if held:
                self._urls[candidate.http] = held
            else:
                del self._urls[candidate.http]
                self._arrivals.pop(candidate.http, None)
                self._url_set = None

    def _models(self, member_id: str) -> tuple[str, ...]:
        """The model names `member_id` serves (none: not a candidate)."""
        return self._names_at(self._models_of.get(member_id))

    def _names_at(self, held: int | tuple[str, ...] | None) -> tuple[str, ...]:
        """What `_models_of` holds for a member, as the names it serves."""
        if held is None:
            return ()
        return self._name_sets[held] if isinstance(held, int) else held

    def _rebuild(self, dirty: set[str]) -> None:
        """The `dirty` models' pools are made again when next read: a model nobody asks
        for costs its membership changes nothing but this."""
        self._stale.update(dirty)
        self._table = None

    def _remake(self, model: str) -> None:
        """`model`'s pools made again from its candidates (every load waiting for them
        is in its candidates already)."""
        self._stale.discard(model)
        self._waiting.pop(model, None)
        slots = self._by_model.get(model)
        if slots:
            self._pools[model] = model_pools(slots.values(), self._suspect)
        else:
            self._pools.pop(model, None)
        self._table = None

    def _take_loads(self, model: str) -> None:
        """The loads of `model` the view listed apart since they were last taken, into
        its candidates (and waiting for its pools). The trail is asked per name: a
        member with adapters gets a candidate per name it serves this way."""
        after = self._loads_at.get(model, self._reset_at)
        if self._loads_since is None or after >= self._version:
            return
        self._loads_at[model] = self._version
        slots = self._by_model.get(model)
        if not slots:
            return
        ids = self._loads_since(model, after, self._version)
        if ids is None:  # the trail no longer reaches back: look at each of the model's
            ids = list(slots)
        members = self._members
        waiting = self._waiting.get(model)
        for member_id in ids:
            held = slots.get(member_id)
            member = members.get(member_id)
            if held is None or member is None:
                continue  # not a candidate (any more)
            known = held.member
            if known is member or known is None or known.record is not member.record:
                continue  # nothing new, or a membership change (`apply` makes those)
            fresh = held.with_load(member)
            slots[member_id] = fresh
            if waiting is None:
                waiting = self._waiting[model] = {}
            waiting[member_id] = fresh

    def _swap_loads(self, model: str) -> None:
        fresh = self._waiting.pop(model)
        pools = self._pools.get(model)
        if pools:
            self._pools[model] = tuple(pool.with_candidates(fresh) for pool in pools)
            self._table = None
