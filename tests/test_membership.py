"""The membership state machine: table tests of each rule and Hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from membership_ops import (
    DRAINING,
    IDS,
    JOINING,
    READY,
    apply,
    essence,
    fresh,
    ops,
    signed,
    spec,
    ticks,
)

from registry.detector import DetectorConfig
from wire.protocol import (
    ByeReason,
    LeaveReason,
    Load,
    MemberJoined,
    MemberLeft,
    MemberRecord,
    MemberUpdated,
    ReplyStatus,
    Report,
    Role,
)

# --- one rule at a time ------------------------------------------------------------------


def test_register_then_ready_emits_joined_then_updated():
    m = fresh()
    assert m.join(spec(), JOINING, Load(), 0.0).status is ReplyStatus.OK
    assert m.beat("p0", 1, READY, Load(running=2), 0.5).status is ReplyStatus.OK
    events = m.take_events()
    assert [type(e) for e in events] == [MemberJoined, MemberUpdated]
    assert [e.version for e in events] == [1, 2]
    assert m.get("p0").routable


@pytest.mark.parametrize(("held", "sent", "at", "expected", "holder"), [
    (5, 4, 0.1, ReplyStatus.STALE, 5),    # an older process must not come back
    (5, 5, 0.1, ReplyStatus.OK, 5),       # a retried registration
    (5, 6, 0.1, ReplyStatus.REJECTED, 5),  # contested: the holder heartbeats
    (5, 6, 3.5, ReplyStatus.OK, 6),       # a restart replaces a holder silent past its lease
])
def test_register_incarnation_rules(held, sent, at, expected, holder):
    m = fresh()
    m.join(spec(incarnation=held), READY, Load(), 0.0)
    assert m.join(spec(incarnation=sent), READY, Load(), at).status is expected
    assert m.get("p0").spec.incarnation == holder


def test_newer_incarnation_leaves_as_replaced_and_joins_again():
    m = fresh()
    m.join(spec(incarnation=1), READY, Load(), 0.0)
    m.take_events()
    m.join(spec(incarnation=2), READY, Load(), 3.5)  # the first one went silent
    left, joined = m.take_events()
    assert isinstance(left, MemberLeft) and left.reason is LeaveReason.REPLACED
    assert left.incarnation == 1
    assert isinstance(joined, MemberJoined) and joined.member.spec.incarnation == 2


@pytest.mark.parametrize(("incarnation", "expected"), [
    (0, ReplyStatus.STALE),
    (1, ReplyStatus.OK),
    (2, ReplyStatus.UNKNOWN),  # a restarted process we have not seen register
])
def test_heartbeat_incarnation_rules(incarnation, expected):
    m = fresh()
    m.join(spec(incarnation=1), READY, Load(), 0.0)
    assert m.beat("p0", incarnation, READY, Load(), 0.5).status is expected


def test_heartbeat_from_unknown_member_says_register_again():
    outcome = fresh().beat("ghost", 1, READY, Load(), 0.0)
    assert outcome.status is ReplyStatus.UNKNOWN
    assert "register again" in outcome.reason


def test_draining_is_one_way():
    m = fresh()
    m.join(spec(), READY, Load(), 0.0)
    m.beat("p0", 1, DRAINING, Load(), 0.1)
    m.beat("p0", 1, READY, Load(), 0.2)
    assert m.get("p0").state is DRAINING


def test_admin_drain_sticks_against_member_claims():
    m = fresh()
    m.join(spec(), READY, Load(), 0.0)
    assert m.drain("p0").status is ReplyStatus.OK
    m.beat("p0", 1, READY, Load(), 0.1)
    assert m.get("p0").state is DRAINING
    assert m.drain("nobody").status is ReplyStatus.UNKNOWN


@pytest.mark.parametrize(("reason", "leave"), [
    (ByeReason.SHUTDOWN, LeaveReason.BYE),
    (ByeReason.CRASHED, LeaveReason.CRASHED),
])
def test_bye_removes_at_once(reason, leave):
    m = fresh()
    m.join(spec(), READY, Load(), 0.0)
    m.take_events()
    assert m.leave("p0", 1, reason).status is ReplyStatus.OK
    (event,) = m.take_events()
    assert isinstance(event, MemberLeft) and event.reason is leave
    assert "p0" not in m


def test_bye_from_an_old_incarnation_is_ignored():
    m = fresh()
    m.join(spec(incarnation=2), READY, Load(), 0.0)
    assert m.leave("p0", 1, ByeReason.SHUTDOWN).status is ReplyStatus.STALE
    assert "p0" in m


def test_suspect_then_expire_on_the_timer():
    m = fresh()
    m.join(spec(), READY, Load(), 0.0)
    ticks(m, 0.0, 2.0)
    assert not m.get("p0").suspect  # age 2.0 is not past 2 intervals
    ticks(m, 2.0, 2.2)
    assert m.get("p0").suspect and not m.get("p0").routable
    ticks(m, 2.2, 3.0)
    assert "p0" in m
    ticks(m, 3.0, 3.2)
    assert "p0" not in m
    assert m.take_events()[-1].reason is LeaveReason.EXPIRED


def test_heartbeat_clears_suspicion():
    m = fresh()
    m.join(spec(), READY, Load(), 0.0)
    ticks(m, 0.0, 2.5)
    assert m.get("p0").suspect
    m.beat("p0", 1, READY, Load(), 2.5)
    assert not m.get("p0").suspect


def test_router_report_suspects_until_next_heartbeat():
    m = fresh()
    m.join(spec(), READY, Load(), 0.0)
    # Its heartbeat is 2 s old (over 1.5 intervals): one router's word is enough.
    assert m.accuse("p0", 1, 2.0).status is ReplyStatus.OK
    assert m.get("p0").suspect
    outcome = m.accuse("p0", 9, 2.0)  # about another incarnation: nothing to do
    assert outcome.status is ReplyStatus.OK and outcome.kind == "ignored"
    m.beat("p0", 1, READY, Load(), 2.1)
    assert not m.get("p0").suspect


@pytest.mark.parametrize(("reports", "heartbeat_age_s", "suspect", "kinds"), [
    ([("r1", 0.5)], 0.5, False, ["outweighed"]),  # one router against a fresh heartbeat
    ([("r1", 0.5), ("r1", 0.7)], 0.7, False, ["outweighed", "limited"]),  # rate
    ([("r1", 0.5), ("r2", 0.6)], 0.6, True, ["outweighed", "accepted"]),  # two routers
    ([("r1", 0.5), ("r2", 4.0)], 0.0, False, ["outweighed", "outweighed"]),  # out of window
    ([("r1", 2.0)], 2.0, True, ["accepted"]),  # its heartbeats stopped
])
def test_reports_are_weighed_against_fresh_heartbeats(reports, heartbeat_age_s, suspect,
                                                       kinds):
    m = fresh()
    m.join(spec(), READY, Load(), 0.0)
    for router in {r for r, _ in reports}:
        m.join(spec(router, 1, role=Role.API_SERVER), now=0.0)
    seqs = {}
    got = []
    for router, at in reports:
        if at - heartbeat_age_s > 0:
            m.beat("p0", 1, READY, Load(), at - heartbeat_age_s)
        seqs[router] = seqs.get(router, 0) + 1
        report = Report(router, 1, seqs[router], "p0", 1, "refused")
        got.append(m.report(*signed(m.sessions[(router, 1)], report), at).kind)
    assert got == kinds
    assert m.get("p0").suspect is suspect


def test_loop_lag_moves_deadlines():
    m = fresh()
    m.join(spec(), READY, Load(), 0.0)
    m.tick(0.1)
    m.tick(10.0)  # the registry was stalled for ~10 s
    assert "p0" in m and not m.get("p0").suspect
    assert m.last_lag_s == pytest.approx(9.7)


def test_self_preservation_pauses_expiry_when_most_go_silent_at_once():
    m = fresh()
    for i in range(4):
        m.join(spec(f"p{i}"), READY, Load(), 0.0)
    ticks(m, 0.0, 10.0)  # nobody heard from
    assert len(m) == 4 and m.self_preserving
    for i in range(4):
        m.beat(f"p{i}", 1, READY, Load(), 10.0)
    m.tick(10.1)
    assert not m.self_preserving


def test_self_preservation_gives_up_after_its_limit():
    config = DetectorConfig(heartbeat_interval_s=1.0, lease_s=3.0,
                            self_preservation_max_s=5.0)
    m = fresh(config)
    for i in range(4):
        m.join(spec(f"p{i}"), READY, Load(), 0.0)
    ticks(m, 0.0, 3.5)  # the pause starts when the first lease runs out (at 3 s) ...
    assert len(m) == 4 and m.self_preserving
    ticks(m, 3.5, 8.5)  # ... and lasts at most 5 s
    assert len(m) == 0 and not m.self_preserving


def test_a_lone_death_is_not_self_preservation():
    m = fresh()
    m.join(spec("dead"), READY, Load(), 0.0)
    for i in range(3):
        m.join(spec(f"alive{i}"), READY, Load(), 0.0)
    t = 0.0
    while t < 4.0:
        t += 0.1
        for i in range(3):
            m.beat(f"alive{i}", 1, READY, Load(), t)
        m.tick(t)
    assert "dead" not in m and len(m) == 3


def test_load_changes_are_digested_not_published_as_events():
    m = fresh()
    m.join(spec(), READY, Load(), 0.0)
    m.take_events()
    m.beat("p0", 1, READY, Load(running=1), 0.1)
    m.beat("p0", 1, READY, Load(running=3), 0.2)
    assert m.take_events() == []
    digests = m.take_load_digests(0.3)
    assert [entry.load.running for entry in digests["m"]] == [3]
    assert m.take_load_digests(0.4) == {}


def test_interval_grows_with_fleet_size():
    config = DetectorConfig(heartbeat_interval_s=1.0, lease_s=3.0, max_ingest_per_s=10)
    m = fresh(config)
    for i in range(30):
        m.join(spec(f"p{i}"), READY, Load(), 0.0)
    assert m.timing.heartbeat_interval_s == pytest.approx(3.0)
    assert m.timing.lease_s >= 3 * m.timing.heartbeat_interval_s


# --- properties --------------------------------------------------------------------------


def replay(snapshot: dict[str, MemberRecord], events: list) -> dict[str, MemberRecord]:
    state = dict(snapshot)
    for event in events:
        if isinstance(event, MemberLeft):
            if state.get(event.id) and state[event.id].spec.incarnation == event.incarnation:
                del state[event.id]
        else:
            state[event.member.spec.id] = event.member
    return state


@given(st.lists(ops, max_size=60), st.integers(0, 60))
def test_clone_replaying_events_on_a_snapshot_reproduces_state(sequence, cut):
    cut = min(cut, len(sequence))
    m = fresh()
    now = 0.0
    for op in sequence[:cut]:
        now = apply(m, op, now)
    before = m.take_events()
    snapshot = {r.spec.id: r for r in m.records()}
    assert m.version == len(before)
    for op in sequence[cut:]:
        now = apply(m, op, now)
    after = m.take_events()
    # Versions strictly increase, one per change, with no gaps.
    assert [e.version for e in before + after] == list(range(1, m.version + 1))
    replayed = replay(snapshot, after)
    assert {k: essence(v) for k, v in replayed.items()} == {
        r.spec.id: essence(r) for r in m.records()}


@given(st.lists(ops, max_size=60))
def test_a_stale_incarnation_never_overrides_a_newer_one(sequence):
    m = fresh()
    now = 0.0
    highest: dict[str, int] = {}
    for op in sequence:
        now = apply(m, op, now)
        for record in m.records():
            member_id = record.spec.id
            # Whatever is held is at least as new as anything held before, while it stays.
            assert record.spec.incarnation >= highest.get(member_id, 0) or \
                highest.get(member_id) is None
            highest[member_id] = record.spec.incarnation
        for member_id in list(highest):
            if member_id not in m:
                del highest[member_id]


@given(st.lists(ops, max_size=40), st.floats(0.0, 1.0), st.booleans())
def test_without_heartbeats_everyone_is_gone_after_the_lease(sequence, extra, preserve):
    config = DetectorConfig(heartbeat_interval_s=1.0, lease_s=3.0,
                            self_preservation_min_silent=3 if preserve else 1000)
    m = fresh(config)
    now = 0.0
    for op in sequence:
        now = apply(m, op, now)
    ticks(m, now, now + config.lease_s + config.tick_period_s + extra)
    if m.self_preserving:
        # Only a mass silence may keep members past their lease (one that fell silent
        # alone before the others may already be gone).
        assert preserve and len(m) >= config.self_preservation_min_silent
    else:
        assert len(m) == 0


@given(st.lists(st.sampled_from(IDS), min_size=1, max_size=4, unique=True),
       st.floats(3.5, 600.0))
def test_a_lagging_loop_expires_nobody_early(members, stall):
    m = fresh()
    for member_id in members:
        m.join(spec(member_id), READY, Load(), 0.0)
    m.tick(0.05)
    m.tick(0.05 + stall)  # the loop did not run for `stall` seconds
    assert len(m) == len(members)
    assert not any(r.suspect for r in m.records())
