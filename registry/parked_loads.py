"""One model's loads held back, unapplied, while no reader asks for that model.

A router of every model in front of 100k members heartbeating every 5 s takes ~20,000
load changes a second, and applying one (a new member copy, the merge, the change
trail) costs ~4 µs: ~80 ms of CPU a second, paid by every request it serves, for the
loads of models it is never asked about. A view with loads on demand
(`registry.replica.Replica`, `loads_on_demand`) keeps a model's digests here until a
reader asks for that model: the newest entry per member and when it was measured (the
replica stores them, for the incarnation it holds only, ~0.3 µs each), then applies what
is held in one go.

Nothing here the collector tracks: the keys are strings, the entries `gc=False`
Structs, the times floats, so a parked model of 100k members gives it nothing to walk.
"""

from __future__ import annotations

import math

from wire.protocol import LoadEntry


class ParkedLoads:
    __slots__ = ("at", "confirmed_at", "entries")

    def __init__(self) -> None:
        self.entries: dict[str, LoadEntry] = {}  # id -> the newest entry held back
        self.at: dict[str, float] = {}  # id -> when that load was measured (monotonic)
        # When the newest digest came: it says the loads it does not list are unchanged
        # (-inf: none came since the model was parked)
        self.confirmed_at = -math.inf

    def discard(self, member_id: str) -> None:
        """`member_id` has a newer word (a new record carries its load) or left."""
        if self.entries.pop(member_id, None) is not None:
            del self.at[member_id]

    def clear(self) -> None:
        """A snapshot gave every member's current load: what is held is older."""
        self.entries.clear()
        self.at.clear()

    def __len__(self) -> int:
        return len(self.entries)
