"""Per topic (model), the version of its last membership event: what lets a view that
follows some models check its own topics for gaps.

The registry's `version` counts every change of every model, so a view that hears only
its models' topics sees it jump by the others' changes. So each event also says which
version its topic's previous event had (`previous_on_topic`), and each digest which
version its topic's last event had (`last_on_topic`); 0 when the topic had no event yet
in this epoch. Loop thread only (the publisher's).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Final

import msgspec

from wire.protocol import Event, LoadDigest, MemberLeft, MembershipEvent

__all__ = ["SPARE_TOPICS", "TopicVersions", "model_of"]

# Topics remembered beyond those of the models held now: a model that emptied keeps its
# last version while there is room, so a view that missed its last leave still sees a gap
# if the model comes back (a view that holds members of a silent topic resyncs anyway).
SPARE_TOPICS: Final = 4_096


class TopicVersions:
    def __init__(self) -> None:
        self._last: dict[str, int] = {}  # model -> version of its last event

    def stamp(self, event: MembershipEvent) -> MembershipEvent:
        """`event` saying its topic's previous version; it becomes the topic's last."""
        model = model_of(event)
        stamped = msgspec.structs.replace(event, previous_on_topic=self._last.get(model, 0))
        self._last[model] = event.version
        return stamped

    def last(self, model: str) -> int:
        """The version of `model`'s last event (0: none yet), for its digests."""
        return self._last.get(model, 0)

    def keep(self, models: Collection[str]) -> None:
        """Forget emptied topics once more than SPARE_TOPICS of them are remembered."""
        if len(self._last) > len(models) + SPARE_TOPICS:
            self._last = {m: v for m, v in self._last.items() if m in models}


def model_of(event: Event) -> str:
    """The model an event is about: its topic."""
    if isinstance(event, MemberLeft | LoadDigest):
        return event.model
    return event.member.spec.model
