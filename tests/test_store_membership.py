"""What the store's intents do to members (Membership.apply_intent, and on registration)."""

from __future__ import annotations

from membership_ops import DRAINING, JOINING, READY, fresh, spec

from registry.outcome import Refusal
from registry.store.records import CordonIntent, DrainIntent, EvictIntent, IntentKind
from wire.protocol import (
    LeaveReason,
    MemberJoined,
    MemberLeft,
    MemberState,
    MemberUpdated,
    ReplyStatus,
)

DRAIN, EVICT, CORDON = IntentKind.DRAIN, IntentKind.EVICT, IntentKind.CORDON


def test_a_stored_drain_drains_the_incarnation_it_names_whatever_it_says():
    m = fresh()
    m.join(spec("d", 5), READY)
    m.take_events()
    m.apply_intent(DRAIN, "d", DrainIntent(incarnation=5, at=1.0), 1.0)
    [event] = m.take_events()
    assert isinstance(event, MemberUpdated) and event.member.state is DRAINING
    reply = m.beat("d", 5, READY, now=1.5)
    assert reply.drain  # the member is told, as with a drain taken here
    assert m.get("d").state is DRAINING


def test_a_stored_drain_holds_for_its_incarnation_when_it_registers_again():
    """A registry that restarted loads the drain; the same process registers again,
    saying READY, and is draining from its first record on."""
    m = fresh()
    m.apply_intent(DRAIN, "d", DrainIntent(incarnation=5, at=1.0), 1.0)
    m.join(spec("d", 5), READY, now=2.0)
    [joined] = m.take_events()
    assert isinstance(joined, MemberJoined) and joined.member.state is DRAINING
    assert m.beat("d", 5, READY, now=2.5).drain


def test_a_new_process_is_not_drained_by_its_predecessors_drain():
    m = fresh()
    m.apply_intent(DRAIN, "d", DrainIntent(incarnation=5, at=1.0), 1.0)
    m.join(spec("d", 6), READY, now=2.0)
    assert m.get("d").state is READY and m.get("d").routable
    assert not m.beat("d", 6, READY, now=2.5).drain


def test_removing_a_drain_undrains_nothing():
    m = fresh()
    m.join(spec("d", 5), READY)
    m.apply_intent(DRAIN, "d", DrainIntent(incarnation=5, at=1.0), 1.0)
    m.apply_intent(DRAIN, "d", None, 2.0)
    m.beat("d", 5, READY, now=2.5)
    assert m.get("d").state is DRAINING


def test_a_cordon_keeps_a_member_out_of_routing_without_draining_it():
    m = fresh()
    m.join(spec("d", 5), JOINING)
    m.take_events()
    m.apply_intent(CORDON, "d", CordonIntent(at=1.0), 1.0)
    [event] = m.take_events()
    assert isinstance(event, MemberUpdated)
    assert (event.member.state, event.member.cordoned, event.member.routable) == (
        DRAINING, True, False)
    reply = m.beat("d", 5, READY, now=1.5)  # it turns ready underneath
    assert reply.status is ReplyStatus.OK and not reply.drain  # and is not told to drain
    assert not m.get("d").routable
    m.apply_intent(CORDON, "d", None, 2.0)  # uncordon: what it said stands
    record = m.get("d")
    assert (record.state, record.cordoned, record.routable) == (READY, False, True)


def test_an_id_cordoned_before_it_joins_joins_cordoned():
    m = fresh()
    m.apply_intent(CORDON, "d", CordonIntent(at=1.0), 1.0)
    m.join(spec("d", 9), READY, now=2.0)
    [joined] = m.take_events()
    assert joined.member.cordoned and joined.member.state is DRAINING
    assert m.fleet_stats.groups[(spec("d").role, "m")].states[int(MemberState.DRAINING)] == 1


def test_a_stored_eviction_removes_what_registered_before_it_only():
    m = fresh()
    m.join(spec("d", 5), READY, now=0.0)
    m.take_events()
    evict = EvictIntent(incarnation=5, at=10.0)
    m.apply_intent(EVICT, "d", evict, 10.0)
    [left] = m.take_events()
    assert isinstance(left, MemberLeft) and left.reason is LeaveReason.EVICTED
    m.join(spec("d", 5), READY, now=11.0)  # its agent registers again
    m.apply_intent(EVICT, "d", None, 12.0)
    m.apply_intent(EVICT, "d", evict, 12.0)  # a reload brings the same eviction back
    assert "d" in m


def test_a_stored_ban_refuses_the_id_until_lifted():
    m = fresh()
    m.join(spec("d", 5), READY, now=0.0)
    m.apply_intent(EVICT, "d", EvictIntent(incarnation=5, at=10.0, ban_until=100.0), 10.0)
    assert "d" not in m
    refused = m.join(spec("d", 6), READY, now=20.0)
    assert refused.kind == Refusal.BANNED and refused.banned_s > 0
    m.apply_intent(EVICT, "d", None, 30.0)  # an operator removed the ban from the store
    assert m.join(spec("d", 6), READY, now=31.0).status is ReplyStatus.OK


def test_a_reload_applies_only_the_difference():
    m = fresh()
    m.join(spec("a", 1), READY)
    m.join(spec("b", 1), READY)
    m.reload_intents({(CORDON, "a"): CordonIntent(at=1.0)}, 1.0)
    m.take_events()
    m.reload_intents({(CORDON, "b"): CordonIntent(at=2.0)}, 2.0)
    assert not m.get("a").cordoned and m.get("b").cordoned
    assert len(m.take_events()) == 2  # a uncordoned, b cordoned; nothing else moved
