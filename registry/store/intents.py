"""The admin intents a registry holds, and what each one does to a member. Pure.

The store is the truth; this is the loop's copy of it, kept by `Membership` (its only
writer) from the changes the store's watch delivers, and consulted when a member
(re-)registers. The rules, each a function below:
- drain: an incarnation up to the drained one is draining, whatever it says of itself;
  a newer incarnation is a new process, and is not (a drain ends with its process).
- evict: an incarnation up to the evicted one, registered before the eviction, is
  removed; one registered since (its agent registered again) stays. A ban refuses every
  registration of the id until it ends, whatever the incarnation.
- cordon: the id is kept out of routing while the intent stands, across restarts of the
  member and of every registry, until an operator deletes it (uncordon).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from registry.store.records import CordonIntent, DrainIntent, EvictIntent, Intent, IntentKind

__all__ = ["IntentTable", "ban_left_s", "drains", "evicts"]

IntentChange = tuple[IntentKind, str, Intent | None]  # None: the intent was removed


def drains(intent: DrainIntent | None, incarnation: int) -> bool:
    """Whether `intent` drains this incarnation of its id."""
    return intent is not None and incarnation <= intent.incarnation


def evicts(intent: EvictIntent | None, incarnation: int, registered_at: float) -> bool:
    """Whether `intent` removes this incarnation, registered at unix time `registered_at`."""
    return (intent is not None and 0 < incarnation <= intent.incarnation
            and registered_at <= intent.at)


def ban_left_s(intent: EvictIntent | None, now: float) -> float:
    """Seconds the ban in `intent` has left at unix time `now` (0: none)."""
    return max(0.0, intent.ban_until - now) if intent is not None else 0.0


class IntentTable:
    """Intents by kind and member id, as the store last said."""

    def __init__(self) -> None:
        self._held: dict[IntentKind, dict[str, Intent]] = {kind: {} for kind in IntentKind}

    def __len__(self) -> int:
        return sum(len(held) for held in self._held.values())

    def get(self, kind: IntentKind, member_id: str) -> Intent | None:
        return self._held[kind].get(member_id)

    def drain(self, member_id: str) -> DrainIntent | None:
        intent = self._held[IntentKind.DRAIN].get(member_id)
        return intent if isinstance(intent, DrainIntent) else None

    def evict(self, member_id: str) -> EvictIntent | None:
        intent = self._held[IntentKind.EVICT].get(member_id)
        return intent if isinstance(intent, EvictIntent) else None

    def cordoned(self, member_id: str) -> bool:
        return isinstance(self._held[IntentKind.CORDON].get(member_id), CordonIntent)

    def count(self, kind: IntentKind) -> int:
        return len(self._held[kind])

    def items(self) -> Iterator[tuple[IntentKind, str, Intent]]:
        for kind, held in self._held.items():
            for member_id, intent in held.items():
                yield kind, member_id, intent

    def set(self, kind: IntentKind, member_id: str, intent: Intent | None) -> bool:
        """Hold `intent` (None: remove it); whether anything changed."""
        held = self._held[kind]
        if intent is None:
            return held.pop(member_id, None) is not None
        if held.get(member_id) == intent:
            return False
        held[member_id] = intent
        return True

    def replace(self, everything: Mapping[tuple[IntentKind, str], Intent]
                ) -> list[IntentChange]:
        """Hold exactly `everything` (a reload); the changes that made it so: removals
        first, then what is new or changed."""
        removed: list[IntentChange] = [
            (kind, member_id, None) for kind, member_id, _ in self.items()
            if (kind, member_id) not in everything]
        changed: list[IntentChange] = [
            (kind, member_id, intent) for (kind, member_id), intent in everything.items()
            if self.get(kind, member_id) != intent]
        for kind, member_id, intent in (*removed, *changed):
            self.set(kind, member_id, intent)
        return [*removed, *changed]
