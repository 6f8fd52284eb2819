"""Which members changed between two versions of a view: what a router's table follows.

A router of every model at 100k members must not walk the members on each update of
its view (a load digest comes up to 10 times a second, a membership change several):
the merge knows which ids each update touched (registry/merge.py), and this trail keeps
them per version, so a reader asks what changed since the version it last read and pays
for those ids alone.

- The view thread `publish`es each new version with the ids it changed (added, changed
  (a load included) or removed).
- Readers (any thread) call `since(version)`: the current version, its members, and the
  ids changed after `version`; `changed` is None when the trail no longer holds all of
  them (a reader far behind, or the first read): read the members whole.

Bounded: at most MAX_STEPS versions and MAX_HELD_IDS ids are held. Each step's ids are a
tuple of strings, which the collector stops tracking, so the trail adds nothing for it
to walk.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

__all__ = ["MAX_HELD_IDS", "MAX_STEPS", "ChangeTrail", "Changes"]

MAX_STEPS: Final = 1024  # versions remembered (~100 s of updates at 10 a second)
MAX_HELD_IDS: Final = 200_000  # ids remembered across them (two full syncs at 100k)

V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Changes(Generic[V]):
    """A view's version, its members, and what changed since the version asked about."""

    version: int
    members: Mapping[str, V]
    changed: frozenset[str] | None  # None: not known (read `members` whole)


class ChangeTrail(Generic[V]):
    def __init__(self, members: Mapping[str, V], *, max_steps: int = MAX_STEPS,
                 max_held_ids: int = MAX_HELD_IDS) -> None:
        self._max_steps = max_steps
        self._max_held = max_held_ids
        self._lock = threading.Lock()
        self._steps: deque[tuple[int, tuple[str, ...]]] = deque()  # (version, ids), in order
        self._held = 0
        # Swapped whole under the lock, read without it: the reader's fast path.
        self._latest: Changes[V] = Changes(0, members, frozenset())

    @property
    def version(self) -> int:
        return self._latest.version

    def publish(self, members: Mapping[str, V], changed: Collection[str]) -> int:
        """A new version: `members`, after changing `changed` (ids). Its version."""
        ids = tuple(changed)
        with self._lock:
            version = self._latest.version + 1
            self._steps.append((version, ids))
            self._held += len(ids)
            while self._steps and (len(self._steps) > self._max_steps
                                   or self._held > self._max_held):
                self._held -= len(self._steps.popleft()[1])
            self._latest = Changes(version, members, frozenset())
        return version

    def since(self, version: int) -> Changes[V]:
        """The current version and the ids changed after `version` (None: read all)."""
        latest = self._latest
        if latest.version == version:
            return latest  # nothing new: no lock taken (this runs on every request)
        with self._lock:
            latest = self._latest
            steps = self._steps
            if (version < 0 or version > latest.version or not steps
                    or steps[0][0] > version + 1):
                return Changes(latest.version, latest.members, None)
            changed: set[str] = set()
            for step, ids in reversed(steps):
                if step <= version:
                    break
                changed.update(ids)
        return Changes(latest.version, latest.members, frozenset(changed))
