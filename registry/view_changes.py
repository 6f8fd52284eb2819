"""Which members changed between two versions of a view: what a router's table follows.

A router of every model at 100k members must not walk the members on each update of
its view (a load digest comes up to 10 times a second, a membership change several):
the merge knows which ids each update touched (registry/merge.py), and this trail keeps
them per version, so a reader asks what changed since the version it last read and pays
for those ids alone.

- The view thread `publish`es each new version with the ids whose membership it
  changed (added, removed, a new record) and, apart and per model, those whose load
  alone changed (a digest: by far the most, ~5,000 a second at 100k members). A
  publisher that does not tell them apart passes every id as changed.
- Readers (any thread) call `since(version)`: the current version, its members, and the
  ids whose membership changed after `version`; `changed` is None when the trail no
  longer holds all of them (a reader far behind, or the first read): read the members
  whole. Loads are asked for per model, when that model is read (`loads`): a router of
  every model pays for the loads of the models it gets requests for, and a request
  costs its own model's loads, never the fleet's.

Bounded: at most MAX_STEPS versions and MAX_HELD_IDS ids are held. Each step holds its
ids as the keys of a dict whose values are None: such a dict is never tracked by the
collector (a set or a list always is, a new tuple until the first collection that walks
it), so the trail gives it nothing to walk. At 100k members a resync lists 100k loads;
held as tuples, the young collection after each resync walked them (5-10 ms).

A step that changed more than half the members (a first sync, a registry that came
back) is held as "read whole": a reader from before it is told to read the members
whole, which costs it what following that many ids would, and neither the trail nor the
reader holds a set of every id.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Final, Generic, TypeVar, cast

__all__ = ["MAX_HELD_IDS", "MAX_STEPS", "WHOLE_OVER", "ChangeTrail", "Changes"]

MAX_STEPS: Final = 1024  # versions remembered (~100 s of updates at 10 a second)
MAX_HELD_IDS: Final = 200_000  # ids remembered across them (two resyncs' loads at 100k)
# A step that changed more ids than this and than half the members is held as "read
# whole" (below this many, listing them costs a reader less than reading whole would).
WHOLE_OVER: Final = 1024

# Ids as the keys of a dict of None: the collector never tracks it (see above).
Ids = dict[str, None]

V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Changes(Generic[V]):
    """A view's version, its members, and what changed since the version asked about."""

    version: int
    members: Mapping[str, V]
    # Ids that joined, left or have a new record (None: not known, read `members`
    # whole); those whose load alone changed are asked for per model (`loads`).
    changed: frozenset[str] | None


class ChangeTrail(Generic[V]):
    def __init__(self, members: Mapping[str, V], *, max_steps: int = MAX_STEPS,
                 max_held_ids: int = MAX_HELD_IDS, whole_over: int = WHOLE_OVER) -> None:
        self._max_steps = max_steps
        self._max_held = max_held_ids
        self._whole_over = whole_over
        self._lock = threading.Lock()
        # (version, ids changed (None: read whole), model -> ids whose load alone
        # changed), in order
        self._steps: deque[tuple[int, Ids | None, Mapping[str, Ids]]] = deque()
        self._held = 0
        # Swapped whole under the lock, read without it: the reader's fast path.
        self._latest: Changes[V] = Changes(0, members, frozenset())

    @property
    def version(self) -> int:
        return self._latest.version

    def publish(self, members: Mapping[str, V], changed: Collection[str],
                loads: Mapping[str, Collection[str]] | None = None) -> int:
        """A new version: `members`, after changing `changed` (ids that joined, left or
        have a new record; any change, from a publisher that does not tell loads apart)
        and `loads` (model -> ids of that model, each name it serves, whose load alone
        changed). Its version. A dict given (ids as its keys) is kept, not copied: the
        publisher must not change it afterwards."""
        whole = len(changed) > max(self._whole_over, len(members) // 2)
        ids = None if whole else _ids(changed)
        by_model = {model: _ids(held) for model, held in loads.items()} if loads else {}
        with self._lock:
            version = self._latest.version + 1
            self._steps.append((version, ids, by_model))
            self._held += _size(ids, by_model)
            while self._steps and (len(self._steps) > self._max_steps
                                   or self._held > self._max_held):
                _, gone, gone_loads = self._steps.popleft()
                self._held -= _size(gone, gone_loads)
            self._latest = Changes(version, members, frozenset())
        return version

    def since(self, version: int) -> Changes[V]:
        """The current version and the ids changed after `version` (None: read all)."""
        latest = self._latest
        if latest.version == version:
            return latest  # nothing new: no lock taken (this runs on every request)
        with self._lock:
            latest = self._latest
            if not self._holds(version, latest.version):
                return Changes(latest.version, latest.members, None)
            changed: set[str] = set()
            for step, ids, _ in reversed(self._steps):
                if step <= version:
                    break
                if ids is None:  # more than half the members: read them whole
                    return Changes(latest.version, latest.members, None)
                changed.update(ids)
        return Changes(latest.version, latest.members, frozenset(changed))

    def loads(self, model: str, after: int, upto: int) -> frozenset[str] | None:
        """The ids of `model` whose load alone changed in versions (after, upto]; None
        when the trail no longer reaches back to `after` (read the model's members
        whole)."""
        if after >= upto:
            return frozenset()
        with self._lock:
            if not self._holds(after, self._latest.version):
                return None
            changed: set[str] = set()
            for step, _, by_model in reversed(self._steps):
                if step <= after:
                    break
                if step <= upto:
                    ids = by_model.get(model)
                    if ids:
                        changed.update(ids)
        return frozenset(changed)

    def _holds(self, version: int, latest: int) -> bool:
        """Whether every step after `version` is still held (under the lock)."""
        steps = self._steps
        return not (version < 0 or version > latest or not steps
                    or steps[0][0] > version + 1)


def _ids(ids: Collection[str]) -> Ids:
    """`ids` held as the collector never walks them (a dict of None is untracked); a
    dict is kept as it is (its publisher hands it over: registry/merge.py)."""
    return cast(Ids, ids) if type(ids) is dict else dict.fromkeys(ids)


def _size(ids: Ids | None, by_model: Mapping[str, Ids]) -> int:
    return (len(ids) if ids is not None else 0) + sum(map(len, by_model.values()))
