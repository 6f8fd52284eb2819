"""A member as the registry holds it, and the orders `Membership` keeps members in.

`Entry` is mutable and never sent: `record()` is what clients see. `first`/`last` read
the ends of the OrderedDicts ordered by `last_seen` (see `registry.membership`).
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from registry.fleet_stats import Group
from wire.protocol import Load, MemberRecord, MemberSpec, MemberState

__all__ = ["ALLOWED", "Entry", "first", "last"]

_NO_LOAD = Load()  # frozen, so one instance serves every default


class Entry(msgspec.Struct, gc=False):
    """A member as the registry holds it (mutable; never sent).

    Not tracked by the cyclic GC (`gc=False`): it holds only leaf data (specs, loads,
    bytes, numbers, a dict of floats, its `fleet_stats.Group`, which holds no entry) and
    nothing that can refer back to it, so it can
    never be in a reference cycle. At 100k members this takes 100k objects out of every
    full collection, which otherwise paused the loop for 0.1-0.2 s now and then.
    """

    spec: MemberSpec
    state: MemberState
    load: Load
    registered_at: float  # monotonic
    last_seen: float  # monotonic; moved forward by loop lag
    heartbeat_at: float  # monotonic, never moved: what clients see as heartbeat age
    session: bytes  # the secret every later message of this incarnation is proved with
    nonce: bytes  # the registrant's own secret: a retried Register must repeat it
    # Where Membership.fleet_stats counts it: its group, heartbeat_at in microseconds
    # (which gives its slot) and state key.
    group: Group
    beat_us: int
    counted: int
    last_seq: int = 0  # the highest seq accepted; anything at or below it is a replay
    suspect: bool = False
    # last_seen before the latest heartbeat: whether the member was silent at a moment
    # that its latest heartbeat has since passed (self-preservation looks back to when
    # the first lease ran out).
    seen_before: float = 0.0
    admin_draining: bool = False  # an operator's drain sticks whatever the member says
    reports: dict[str, float] | None = None  # reporter id -> when it last reported this one
    silent: bool = False  # in Membership._silent (counted toward self-preservation)
    sent_load: Load = _NO_LOAD  # the load views were last sent (digest or record)
    held_since: float = 0.0  # when a change inside the deadband was first held back
    cordoned: bool = False  # an operator's cordon: shown as DRAINING, `state` kept as said
    # Registered again after it lapsed (expired or replaced), and no heartbeat proved with
    # its session since: a replayed Register can bring it back, so it does not count as
    # alive against a newer incarnation (`Sessions._contested`).
    unproven: bool = False

    @property
    def shown_state(self) -> MemberState:
        """The state views see: a cordoned member is out of routing, whatever it says."""
        return MemberState.DRAINING if self.cordoned else self.state

    def record(self, wall_offset: float) -> MemberRecord:
        return MemberRecord(
            spec=self.spec,
            state=MemberState.DRAINING if self.cordoned else self.state,
            suspect=self.suspect,
            load=self.load,
            registered_at=self.registered_at + wall_offset,
            heartbeat_at=self.heartbeat_at + wall_offset,
            cordoned=self.cordoned,
        )


# Which self-reported state changes are accepted. DRAINING is one-way: a member that
# started draining leaves with bye (or expires); it never turns ready again.
ALLOWED = {
    MemberState.JOINING: {MemberState.JOINING, MemberState.READY, MemberState.DRAINING},
    MemberState.READY: {MemberState.JOINING, MemberState.READY, MemberState.DRAINING},
    MemberState.DRAINING: {MemberState.DRAINING},
}


def first(order: OrderedDict[str, Entry]) -> Entry:
    return next(iter(order.values()))


def last(order: OrderedDict[str, Entry]) -> Entry:
    return next(reversed(order.values()))
