"""The view side of the Clone pattern: snapshot + numbered events over a lossy channel."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from membership_ops import READY, Fleet, apply, essence, fresh, ops, spec

from registry.membership import Membership
from registry.replica import CARRY_OVER_INTERVALS, Applied, Replica
from wire.protocol import (
    LeaveReason,
    Load,
    LoadDigest,
    LoadEntry,
    MemberJoined,
    MemberLeft,
    MemberRecord,
    MemberState,
    Snapshot,
)

SOURCE = "127.0.0.1:7600"


def snapshot_of(m: Membership) -> Snapshot:
    return Snapshot(m.epoch, m.version, m.records(), m.timing.heartbeat_interval_s)


def pulse_of(m: Membership) -> LoadDigest:
    """The registry's periodic digest: current version, no bump."""
    return LoadDigest(m.epoch, m.version, "m", [], m.timing.heartbeat_interval_s)


def held(replica: Replica) -> dict[str, tuple]:
    return {mid: essence(member.record) for mid, member in replica.members.items()}


def truth(m: Membership) -> dict[str, tuple]:
    return {r.spec.id: essence(r) for r in m.records()}


@given(st.lists(ops, max_size=50), st.integers(0, 50), st.sets(st.integers(0, 200)))
def test_lossy_stream_converges_or_says_gap(sequence, cut, dropped):
    cut = min(cut, len(sequence))
    m = fresh()
    now = 0.0
    for op in sequence[:cut]:
        now = apply(m, op, now)
    m.take_events()
    replica = Replica(SOURCE)
    replica.apply_snapshot(snapshot_of(m), now, now)
    for op in sequence[cut:]:
        now = apply(m, op, now)
    events = [*m.take_events(), pulse_of(m)]
    delivered = [e for i, e in enumerate(events) if i not in dropped or i == len(events) - 1]
    gap = False
    for event in delivered:
        if replica.apply(event, now) is Applied.GAP:
            gap = True
            break
    lost = len(delivered) < len(events)
    # Every loss is noticed (the pulse carries the version), and nothing else is.
    assert gap == lost
    if gap:
        replica.apply_snapshot(snapshot_of(m), now, now)
    assert held(replica) == truth(m)
    assert replica.version == m.version


@given(st.lists(ops, max_size=40))
def test_replaying_the_same_events_twice_changes_nothing(sequence):
    m = fresh()
    now = 0.0
    replica = Replica(SOURCE)
    replica.apply_snapshot(snapshot_of(m), now, now)
    for op in sequence:
        now = apply(m, op, now)
    events = m.take_events()
    for event in events:
        assert replica.apply(event, now) is Applied.CHANGED
    for event in events:
        assert replica.apply(event, now) is Applied.UNCHANGED
    assert held(replica) == truth(m)


def registered(*ids: str, epoch: int = 7) -> Fleet:
    m = fresh(epoch=epoch)
    for member_id in ids:
        m.join(spec(member_id), READY, Load(), 0.0)
    return m


def test_a_restarted_registry_does_not_empty_the_view():
    replica = Replica(SOURCE)
    replica.apply_snapshot(snapshot_of(registered("a", "b")), 0.0, 0.0)
    restarted = registered("a", epoch=8)  # b has not re-registered yet
    replica.apply_snapshot(snapshot_of(restarted), 1.0, 1.0)
    assert set(replica.members) == {"a", "b"}
    assert replica.carried == {"b"}
    assert not replica.drop_carried(1.0 + CARRY_OVER_INTERVALS - 0.1)
    # b comes back: it is a member of the new epoch now, no longer carried.
    restarted.join(spec("b"), READY, Load(), 2.0)
    (joined,) = restarted.take_events()[-1:]
    assert isinstance(joined, MemberJoined)
    assert replica.apply(joined, 2.0) is Applied.CHANGED
    assert replica.carried == set()
    assert not replica.drop_carried(100.0)
    assert set(replica.members) == {"a", "b"}


def test_members_that_never_come_back_are_dropped():
    replica = Replica(SOURCE)
    replica.apply_snapshot(snapshot_of(registered("a", "b")), 0.0, 0.0)
    replica.apply_snapshot(snapshot_of(registered("a", epoch=8)), 1.0, 1.0)
    assert replica.drop_carried(1.0 + CARRY_OVER_INTERVALS)
    assert set(replica.members) == {"a"}


def test_an_event_from_another_epoch_is_a_gap():
    replica = Replica(SOURCE)
    replica.apply_snapshot(snapshot_of(registered("a")), 0.0, 0.0)
    record = MemberRecord(spec("z"), MemberState.READY)
    assert replica.apply(MemberJoined(99, 2, record), 0.0) is Applied.GAP
    assert "z" not in replica.members


def test_digests_refresh_load_for_the_incarnation_held_only():
    replica = Replica(SOURCE)
    m = registered("a")
    replica.apply_snapshot(snapshot_of(m), 0.0, 0.0)
    digest = LoadDigest(m.epoch, m.version, "m", [
        LoadEntry("a", 1, Load(running=4), 0.25),
        LoadEntry("a", 2, Load(running=9), 0.0),   # another incarnation: ignored
        LoadEntry("ghost", 1, Load(running=9), 0.0),
    ], 1.0)
    assert replica.apply(digest, 10.0) is Applied.CHANGED
    assert replica.members["a"].load.running == 4
    assert replica.members["a"].load_at == 9.75
    assert "ghost" not in replica.members


def test_a_digest_confirms_the_unlisted_loads_of_its_model():
    """A pulse lists no load, yet says every member of its model still reports the same
    one: the view records when, per model, so an idle member's load is not stale."""
    replica = Replica(SOURCE)
    m = registered("a")
    replica.apply_snapshot(snapshot_of(m), 0.0, 0.0)
    assert replica.loads_confirmed_at.get("m") is None
    assert replica.apply(pulse_of(m), 30.0) is Applied.UNCHANGED
    assert replica.loads_confirmed_at["m"] == 30.0
    assert replica.members["a"].load_at == 0.0  # the load itself is as old as it was
    assert "other" not in replica.loads_confirmed_at


def test_a_left_event_for_an_older_incarnation_keeps_the_newer():
    replica = Replica(SOURCE)
    m = registered("a")
    replica.apply_snapshot(snapshot_of(m), 0.0, 0.0)
    stale = MemberLeft(m.epoch, m.version + 1, "a", 0, "m", LeaveReason.BYE)
    assert replica.apply(stale, 0.0) is Applied.CHANGED  # the version moves on ...
    assert "a" in replica.members  # ... but the member held is not that one


def test_a_resync_keeps_the_record_of_a_member_it_did_not_change():
    """A resync within the epoch: a member whose spec and state are the same keeps its
    record object (a new load is a load change, not a new member, to the merge and a
    router's table); one whose state changed gets the snapshot's record."""
    m = registered("a", "b")
    replica = Replica(SOURCE)
    replica.apply_snapshot(snapshot_of(m), 0.0, 0.0)
    before = dict(replica.members)
    m.beat("a", 1, READY, Load(running=5), 1.0)
    m.beat("b", 1, MemberState.DRAINING, Load(), 1.0)
    replica.apply_snapshot(snapshot_of(m), 1.0, 1.0)
    a, b = replica.members["a"], replica.members["b"]
    assert a.record is before["a"].record and a.load.running == 5 and a.load_at == 1.0
    assert b.record is not before["b"].record and b.record.state is MemberState.DRAINING
    assert held(replica) == truth(m)
