"""Several registries merged into one view (registry/merge.py), against a small model.

Real `Membership` state machines stand for the registries and real `Replica`s for what a
view holds of each; members heartbeat to the registries they can reach (partitions), a
registry may freeze (SIGSTOP: it takes nothing and says nothing), the view may be cut off
from one, and a registry's stream may lose events (the replica resyncs). After every
step the merged view must be what the rules say, recounted from scratch: a member is in
the view while a live registry holds it, with the newest incarnation any live registry
holds, unless a final leave of that incarnation reached the view; while no registry is
live the view does not change.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st
from membership_ops import CONFIG, READY, Fleet, spec, ticks

from registry.merge import AWAY_AFTER_INTERVALS, Merge
from registry.replica import FINAL_LEAVES, Applied, Replica
from wire.protocol import (
    ByeReason,
    Load,
    LoadDigest,
    LoadEntry,
    MemberLeft,
    MemberRecord,
    MemberState,
    Snapshot,
)

REGISTRIES = 3
IDS = ("a", "b", "c")
AWAY_S = AWAY_AFTER_INTERVALS * CONFIG.heartbeat_interval_s


def snapshot_of(m: Fleet) -> Snapshot:
    return Snapshot(m.epoch, m.version, m.records(), m.timing.heartbeat_interval_s)


def pulse_of(m: Fleet, loads: list[LoadEntry] | None = None) -> LoadDigest:
    return LoadDigest(m.epoch, m.version, "m", loads or [], m.timing.heartbeat_interval_s)


@dataclass
class World:
    """N registries, the view's replicas and merge, and the model's own bookkeeping."""

    fleets: list[Fleet] = field(default_factory=lambda: [
        Fleet(epoch=7 + i) for i in range(REGISTRIES)])
    replicas: list[Replica] = field(default_factory=lambda: [
        Replica(f"r{i}") for i in range(REGISTRIES)])
    merge: Merge = field(init=False)
    now: float = 0.0
    frozen: list[bool] = field(default_factory=lambda: [False] * REGISTRIES)
    cut: list[bool] = field(default_factory=lambda: [False] * REGISTRIES)
    lose_next: list[bool] = field(default_factory=lambda: [False] * REGISTRIES)
    # The model: when the view last heard each registry, what it had from it then, and
    # the final leaves that reached it.
    heard: list[float] = field(default_factory=lambda: [-math.inf] * REGISTRIES)
    seen: list[dict[str, MemberRecord]] = field(default_factory=lambda: [
        {} for _ in range(REGISTRIES)])
    final: dict[str, int] = field(default_factory=dict)
    newest: dict[str, int] = field(default_factory=dict)  # id -> the incarnation running
    gone: set[str] = field(default_factory=set)  # ids whose running incarnation said bye

    def __post_init__(self) -> None:
        self.merge = Merge(self.replicas)
        for i in range(REGISTRIES):
            self.replicas[i].apply_snapshot(snapshot_of(self.fleets[i]), 0.0, 0.0)
            self._heard(i)

    def reachable(self, mask: int) -> list[Fleet]:
        return [f for i, f in enumerate(self.fleets) if mask >> i & 1 and not self.frozen[i]]

    def deliver(self) -> None:
        """Each registry the view can hear: its events (maybe lossy), then its pulse."""
        for i, (fleet, replica) in enumerate(zip(self.fleets, self.replicas, strict=True)):
            if self.frozen[i] or self.cut[i]:
                continue
            # the pulse lists the loads that changed, as the registry's digest does
            loads = fleet.take_load_digests(self.now).get("m", [])
            events = [*fleet.take_events(), pulse_of(fleet, loads)]
            if self.lose_next[i] and len(events) > 1:
                events.pop(0)
            self.lose_next[i] = False
            for event in events:
                applied = replica.apply(event, self.now)
                if applied is Applied.GAP:
                    replica.apply_snapshot(snapshot_of(fleet), self.now, self.now)
                    break
                if (applied is Applied.CHANGED and isinstance(event, MemberLeft)
                        and event.reason in FINAL_LEAVES):
                    self.final[event.id] = max(self.final.get(event.id, -1),
                                               event.incarnation)
            self._heard(i)

    def _heard(self, i: int) -> None:
        self.merge.heard(i, self.now)
        self.heard[i] = self.now
        self.seen[i] = {r.spec.id: r for r in self.fleets[i].records()}

    def expected(self) -> dict[str, tuple[int, bool]] | None:
        """id -> (incarnation, suspect) the view must show; None: no registry is live."""
        live = [i for i in range(REGISTRIES) if self.now - self.heard[i] <= AWAY_S]
        if not live:
            return None
        out: dict[str, tuple[int, bool]] = {}
        for member_id in {m for i in live for m in self.seen[i]}:
            copies = [self.seen[i][member_id] for i in live if member_id in self.seen[i]]
            copies = [r for r in copies if r.spec.incarnation > self.final.get(member_id, -1)]
            if copies:
                newest = max(r.spec.incarnation for r in copies)
                suspect = all(r.suspect for r in copies if r.spec.incarnation == newest)
                out[member_id] = (newest, suspect)
        return out


@dataclass(frozen=True)
class Op:
    kind: str
    member: str = "a"
    mask: int = 0b111  # the registries the member can reach
    registry: int = 0
    dt: float = 0.0


masks = st.integers(1, 2**REGISTRIES - 1)
registries = st.integers(0, REGISTRIES - 1)
merge_ops = st.one_of(
    st.builds(Op, st.just("start"), st.sampled_from(IDS), masks),
    st.builds(Op, st.just("beat"), st.sampled_from(IDS), masks),
    st.builds(Op, st.just("bye"), st.sampled_from(IDS), masks),
    st.builds(Op, st.just("crash"), st.sampled_from(IDS), masks),
    st.builds(Op, st.just("wait"), dt=st.floats(0.05, 2.5)),
    st.builds(Op, st.sampled_from(["freeze", "thaw", "cut", "heal", "lose"]),
              registry=registries),
)


def step(w: World, op: Op) -> None:
    member = op.member
    incarnation = w.newest.get(member, 0)
    if op.kind == "start":  # a new process: the old one is dead
        w.newest[member] = incarnation = incarnation + 1
        w.gone.discard(member)
        for fleet in w.reachable(op.mask):
            fleet.join(spec(member, incarnation), READY, Load(), w.now)
    elif op.kind == "beat" and incarnation and member not in w.gone:
        for fleet in w.reachable(op.mask):
            held = fleet.get(member)
            if held is None or held.spec.incarnation != incarnation:
                fleet.join(spec(member, incarnation), READY, Load(), w.now)  # UNKNOWN
            else:
                # a load that changes beat by beat (each beat's digest lists it)
                fleet.beat(member, incarnation, READY,
                           Load(running=int(w.now * 20) % 7 + 1), w.now)
    elif op.kind in ("bye", "crash") and incarnation and member not in w.gone:
        reason = ByeReason.CRASHED if op.kind == "crash" else ByeReason.SHUTDOWN
        for fleet in w.reachable(op.mask):
            fleet.leave(member, incarnation, reason)
        w.gone.add(member)
    elif op.kind == "wait":
        end = w.now + op.dt
        for i, fleet in enumerate(w.fleets):
            if not w.frozen[i]:
                ticks(fleet, w.now, end)
        w.now = end
    elif op.kind in ("freeze", "thaw"):
        w.frozen[op.registry] = op.kind == "freeze"
    elif op.kind in ("cut", "heal"):
        w.cut[op.registry] = op.kind == "cut"
    elif op.kind == "lose":
        w.lose_next[op.registry] = True


@given(st.lists(merge_ops, max_size=40))
def test_the_merged_view_follows_the_live_registries(sequence):
    w = World()
    w.merge.update(w.now)
    before = dict(w.merge.members.items())
    for op in sequence:
        step(w, op)
        w.deliver()
        changed = w.merge.update(w.now)
        expected = w.expected()
        view = dict(w.merge.members.items())
        if changed:  # what a router's table follows: every id that differs, and loads
            # apart (the same record), under the member's model
            differs = {i for i in before.keys() | view.keys() if before.get(i) is not view.get(i)}
            loaded = {i for ids in w.merge.last_loaded.values() for i in ids}
            assert set(w.merge.last_changed) | loaded == differs
            assert not loaded & set(w.merge.last_changed)
            # held where the collector never walks them (100k at a resync)
            assert not any(map(gc.is_tracked, (w.merge.last_changed,
                                               *w.merge.last_loaded.values())))
            assert all(before[i].record is view[i].record and view[i].model == model
                       for model, ids in w.merge.last_loaded.items() for i in ids)
        if expected is None:
            assert view == before  # every registry away: the last view stands
            continue
        shown = {m: (v.record.spec.incarnation, v.record.suspect) for m, v in view.items()}
        # Never a member every live registry dropped (or that left for good); never one
        # missing that a live registry holds; the newest incarnation, not suspect if a
        # live registry holds it unsuspected.
        assert shown == expected
        # The copy shown is the one its registry holds now: its freshest load too.
        held = {r.source: r.members for r in w.merge.replicas}
        assert all(held[v.registry].get(m) is v for m, v in view.items())
        before = view
        # Loads are confirmed by the registries members come from, all of them live.
        sources = {v.registry for v in view.values()}
        assert set(w.merge.sources.get("m", ())) == sources
        live = {f"r{i}" for i in range(REGISTRIES) if w.merge.live(i, w.now)}
        assert sources <= live


def world_with(member: str = "d0", at: tuple[int, ...] = (0, 1)) -> World:
    w = World()
    w.newest[member] = 1
    for i in at:
        w.fleets[i].join(spec(member), READY, Load(), 0.0)
    w.deliver()
    w.merge.update(w.now)
    return w


def test_a_frozen_registry_keeps_nobody_alive():
    """Registry 1 frozen, then the member dies: registry 0 expires it, and once registry
    1 has been silent past its lease the member is gone from the view."""
    w = world_with()
    w.frozen[1] = True
    w.frozen[2] = False
    lease_s = w.fleets[0].timing.lease_s
    for _ in range(int((lease_s + AWAY_S) / 0.5) + 2):
        step(w, Op("wait", dt=0.5))
        w.deliver()
        w.merge.update(w.now)
    assert "d0" not in w.merge.members
    assert "d0" in w.replicas[1].members  # what the frozen registry last said


def test_an_expiry_at_one_registry_is_only_its_view():
    """Cut off from registry 0 alone, the member still heartbeats registry 1: it stays."""
    w = world_with()
    for _ in range(12):
        step(w, Op("beat", "d0", mask=0b010))
        step(w, Op("wait", dt=0.5))
        w.deliver()
        w.merge.update(w.now)
    assert "d0" not in w.replicas[0].members  # expired there
    assert w.merge.members["d0"].registry == "r1"


def test_a_bye_at_one_registry_is_final_while_another_is_silent():
    w = world_with()
    w.frozen[1] = True
    step(w, Op("bye", "d0", mask=0b011))  # registry 1 is frozen: only 0 records the bye
    w.deliver()
    assert w.merge.update(w.now)
    assert "d0" not in w.merge.members
    assert "d0" in w.replicas[1].members


def test_suspicion_at_one_registry_prefers_the_other_copy():
    w = world_with()
    while not w.replicas[0].members["d0"].record.suspect:  # late at registry 0 only
        step(w, Op("beat", "d0", mask=0b010))
        step(w, Op("wait", dt=0.2))
        w.deliver()
        w.merge.update(w.now)
    assert w.merge.members["d0"].registry == "r1"
    assert w.merge.members["d0"].routable


def test_every_registry_away_keeps_the_last_view_and_catches_up_after():
    w = world_with()
    for i in range(REGISTRIES):
        w.frozen[i] = True
    step(w, Op("wait", dt=AWAY_S + 1.0))
    w.deliver()
    assert not w.merge.update(w.now)
    assert "d0" in w.merge.members  # a registry outage never empties the view
    w.frozen[0] = False
    w.fleets[0].leave("d0", 1)
    w.deliver()
    assert w.merge.update(w.now)
    assert "d0" not in w.merge.members


def test_loads_are_confirmed_by_the_registry_a_member_comes_from():
    """Registry 1 frozen holds the only copy of `x`: another registry's pulse must not
    make its load look current (the old rule took the newest confirmation of any)."""
    w = World()
    w.newest["d0"] = 1
    w.fleets[0].join(spec("d0"), READY, Load(), 0.0)
    w.fleets[1].join(spec("x"), READY, Load(), 0.0)
    w.deliver()
    w.merge.update(w.now)
    w.frozen[1] = True

    def second() -> None:
        step(w, Op("beat", "d0", mask=0b001))
        step(w, Op("wait", dt=1.0))
        w.deliver()
        w.merge.update(w.now)
    second()
    second()
    assert w.merge.members["x"].registry == "r1"
    assert w.merge.loads_confirmed_at("m") == 0.0  # r1's last pulse, not r0's at 2.0
    while w.merge.live(1, w.now):
        second()
    assert "x" not in w.merge.members
    assert w.merge.loads_confirmed_at("m") == w.now  # r0's alone now


def test_a_digest_for_a_member_moves_no_source():
    w = world_with()
    entry = LoadEntry("d0", 1, Load(running=3), 0.0)
    w.replicas[0].apply(pulse_of(w.fleets[0], [entry]), 1.0)
    sources_before = w.merge.sources
    assert w.merge.update(1.0)
    assert w.merge.members["d0"].load.running == 3
    assert w.merge.sources is sources_before  # nothing to republish on a load change
    assert not w.merge.last_changed and w.merge.last_loaded == {"m": {"d0": None}}


def test_a_draining_member_shows_draining():
    w = world_with()
    for fleet in w.fleets[:2]:
        fleet.beat("d0", 1, MemberState.DRAINING, Load(), 0.1)
    w.deliver()
    w.merge.update(w.now)
    assert w.merge.members["d0"].record.state is MemberState.DRAINING
