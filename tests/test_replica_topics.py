"""A view that follows some models checks its own topics for gaps, never the others'.

The registry's version counts every model's changes; a view subscribed to one model's
topic (plus the empty one) used to see each other model's change as a gap and resync
(about 20 times a run where a full view resynced twice). Events now say their topic's
previous version, digests their topic's last (registry/topic_versions.py).
"""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from membership_ops import CONFIG, READY, Fleet, Op, spec, ticks
from raw_member import RawMember, member_spec

from registry.client import MembershipView
from registry.replica import Applied, Replica
from registry.topic_versions import TopicVersions, model_of
from wire.protocol import (
    Event,
    Load,
    LoadDigest,
    MemberJoined,
    MemberLeft,
    MemberRecord,
    MemberState,
    Snapshot,
    make_encoder,
)

SOURCE = "127.0.0.1:7600"
FOLLOWED = ("m", "")  # what a view of model m subscribes to
MODEL_OF = {"a": "m", "b": "m", "c": "n", "d": "n"}  # n: a model the view does not follow

topic_ops = st.one_of(
    st.builds(Op, st.just("register"), st.sampled_from(sorted(MODEL_OF)), st.integers(1, 3),
              st.sampled_from(list(MemberState))),
    st.builds(Op, st.just("heartbeat"), st.sampled_from(sorted(MODEL_OF)), st.integers(1, 3),
              st.sampled_from(list(MemberState))),
    st.builds(Op, st.just("bye"), st.sampled_from(sorted(MODEL_OF)), st.integers(1, 3)),
    st.builds(Op, st.just("wait"), dt=st.floats(0.01, 2.0)),
)


def run(m: Fleet, op: Op, now: float) -> float:
    if op.kind == "register":
        m.join(spec(op.member, op.incarnation, MODEL_OF[op.member]), op.state, Load(), now)
    elif op.kind == "heartbeat":
        m.beat(op.member, op.incarnation, op.state, Load(), now)
    elif op.kind == "bye":
        m.leave(op.member, op.incarnation)
    else:
        ticks(m, now, now + op.dt)
        return now + op.dt
    m.tick(now)
    return now


def snapshot_of(m: Fleet) -> Snapshot:
    return Snapshot(m.epoch, m.version, m.records(FOLLOWED), m.timing.heartbeat_interval_s)


def pulse(m: Fleet, topics: TopicVersions, model: str = "m") -> LoadDigest:
    return LoadDigest(m.epoch, m.version, model, [], m.timing.heartbeat_interval_s,
                      topics.last(model))


def essence(record: MemberRecord) -> tuple:
    return (record.spec, record.state, record.suspect)


@given(st.lists(topic_ops, max_size=40), st.integers(0, 40), st.sets(st.integers(0, 100)))
def test_gaps_are_seen_in_the_followed_topics_and_nowhere_else(sequence, cut, dropped):
    cut = min(cut, len(sequence))
    m = Fleet(CONFIG)
    topics = TopicVersions()
    now = 0.0
    for op in sequence[:cut]:
        now = run(m, op, now)
    for event in m.take_events():
        topics.stamp(event)
    replica = Replica(SOURCE, per_model=True)
    replica.apply_snapshot(snapshot_of(m), now, now)
    for op in sequence[cut:]:
        now = run(m, op, now)
    published = [topics.stamp(e) for e in m.take_events()]
    heard: list[Event] = [e for e in published if model_of(e) in FOLLOWED]  # the SUB filter
    delivered = [e for i, e in enumerate(heard) if i not in dropped]
    gap = False
    for event in [*delivered, pulse(m, topics), pulse(m, topics, "")]:
        if replica.apply(event, now) is Applied.GAP:
            gap = True
            break
    # A loss in a followed topic is noticed (at the latest by its pulse); the other
    # model's changes, however many, are not gaps.
    assert gap == (len(delivered) < len(heard))
    if gap:
        replica.apply_snapshot(snapshot_of(m), now, now)
    assert ({i: essence(r.record) for i, r in replica.members.items()}
            == {r.spec.id: essence(r) for r in m.records(FOLLOWED)})


def test_without_topic_versions_the_version_alone_rules():
    """A registry from before `previous_on_topic` (NOT_SAID): as before, a jump is a gap."""
    m = Fleet(CONFIG)
    replica = Replica(SOURCE, per_model=True)
    replica.apply_snapshot(snapshot_of(m), 0.0, 0.0)
    m.join(spec("c", model="n"), READY, Load(), 0.0)
    m.join(spec("a", model="m"), READY, Load(), 0.0)
    joined = m.take_events()[-1]
    assert isinstance(joined, MemberJoined) and joined.previous_on_topic == -1
    assert replica.apply(joined, 0.0) is Applied.GAP


def test_a_followed_model_gone_silent_means_a_missed_leave():
    """Its last member's leave was lost: no later event or pulse on its topic would say
    so, but a model with members is pulsed every interval, so silence does."""
    m = Fleet(CONFIG)
    topics = TopicVersions()
    m.join(spec("a", model="m"), READY, Load(), 0.0)
    for event in m.take_events():
        topics.stamp(event)
    replica = Replica(SOURCE, per_model=True)
    replica.apply_snapshot(snapshot_of(m), 0.0, 0.0)
    m.leave("a", 1)
    (left,) = [topics.stamp(e) for e in m.take_events()]
    assert isinstance(left, MemberLeft)  # ... and lost; the registry pulses "" only now
    assert replica.apply(pulse(m, topics, ""), 1.0) is Applied.UNCHANGED
    assert replica.silent_model(2.9, after_s=3.0) is None
    assert replica.next_silence_at(3.0) == 3.0
    assert replica.silent_model(3.1, after_s=3.0) == "m"


def test_old_views_decode_the_new_events():
    """The added fields trail with defaults: a view from before them decodes as before."""
    class OldJoined(msgspec.Struct, frozen=True, tag="MemberJoined", array_like=True):
        epoch: int
        version: int
        member: MemberRecord

    new = MemberJoined(7, 3, MemberRecord(spec("a"), READY), previous_on_topic=2)
    old = msgspec.msgpack.decode(make_encoder().encode(new), type=OldJoined)
    assert (old.epoch, old.version, old.member) == (7, 3, new.member)


def test_a_view_of_one_model_does_not_resync_on_the_others(registry_factory):
    """Real sockets: 30 changes of another model, then one of ours; one snapshot only."""
    registry = registry_factory()
    address = registry.control_address
    ours = RawMember(address, spec=member_spec("decode-ours", model="m"))
    theirs = [RawMember(address, spec=member_spec(f"decode-{i}", model="n"))
              for i in range(10)]
    try:
        with MembershipView(registry.control_address, models=["m"]) as view:
            assert view.wait_for(lambda members: view.synced, 10.0)
            for _ in range(3):
                for member in theirs:
                    member.register()
                for member in theirs:
                    member.bye()
            ours.register()
            assert view.wait_for(lambda members: "decode-ours" in members, 10.0)
            assert set(view.members()) == {"decode-ours"}
            assert [link.snapshots for link in view.links()] == [1]
    finally:
        for member in (ours, *theirs):
            member.close()
