"""Membership's incremental structures against a from-scratch rebuild, and churn at size.

The registry keeps members in last_seen orders, a silent set, cached records and one lag
offset, so that a loop turn costs what changed rather than the fleet. Each of these must
equal what a rebuild from the member entries alone gives, after any sequence of
operations (Hypothesis); and a fleet under churn must keep every live member.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st
from membership_ops import READY, Fleet, Op, apply, fresh, ops, spec

from registry.admission import Limits
from registry.deadband import Deadband, is_news
from registry.detector import DetectorConfig
from registry.membership import Membership
from wire.protocol import LeaveReason, Load, MemberLeft, MemberUpdated

# A stall: time jumps with no tick in between (a GC pause, a stopped VM), then a tick.
stalls = st.builds(Op, st.just("stall"), dt=st.floats(0.25, 6.0))
histories = st.lists(st.one_of(ops, stalls), max_size=80)


def run(m: Fleet, op: Op, now: float) -> float:
    if op.kind == "stall":
        now += op.dt
        m.tick(now)
        return now
    return apply(m, op, now)


def rebuilt_problems(m: Membership, now: float) -> list[str]:
    """Where the incremental structures differ from a rebuild out of the entries alone.

    Call right after `m.tick(now)` (the silent set is brought up to date by ticks)."""
    entries = list(m._members.values())
    problems = []
    t = now - m._lag_s
    seen = [e.last_seen for e in entries]
    if seen != sorted(seen):
        problems.append(f"members not in last_seen order: {seen}")
    ids = [e.spec.id for e in entries]
    want_unsuspected = [i for i, e in zip(ids, entries, strict=True) if not e.suspect]
    if list(m._unsuspected) != want_unsuspected:
        problems.append(f"unsuspected {list(m._unsuspected)} != {want_unsuspected}")
    limit = m.timing.silent_after_s
    want_silent = [i for i, e in zip(ids, entries, strict=True) if t - e.last_seen > limit]
    if list(m._silent) != want_silent:
        problems.append(f"silent {list(m._silent)} != {want_silent}")
    if list(m._unsilent) != [i for i in ids if i not in set(want_silent)]:
        problems.append(f"unsilent {list(m._unsilent)} out of step")
    if [e.spec.id for e in entries if e.silent] != want_silent:
        problems.append("silent flags out of step")
    want_records = {e.spec.id: e.record(m.wall_offset) for e in entries}
    got_records = {r.spec.id: r for r in m.records()}
    if got_records != want_records:
        problems.append(f"records {got_records} != {want_records}")
    for model in {e.spec.model for e in entries}:
        got = {r.spec.id for r in m.records([model])}
        if got != {e.spec.id for e in entries if e.spec.model == model}:
            problems.append(f"records of {model} {got}")
    # next_deadline as the full scan computed it before.
    deadline = now + m.config.tick_period_s
    for e in entries:
        if e.suspect:
            deadline = min(deadline, e.last_seen + m._lag_s + m.timing.lease_s)
            continue
        deadline = min(deadline, e.last_seen + m._lag_s + m.timing.suspect_after_s)
        break
    if abs(m.next_deadline(now) - deadline) > 1e-9:
        problems.append(f"next_deadline {m.next_deadline(now)} != {deadline}")
    # _silent_at as the full scan computed it before, at moments back to a lease ago.
    for back in (0.0, 0.05, 0.5, 1.0, m.timing.lease_s):
        moment = t - back
        lim = moment - limit
        want = sum(1 for e in entries
                   if (e.last_seen if e.last_seen <= moment else e.seen_before) < lim)
        if m._silent_at(moment) != want:
            problems.append(f"_silent_at({moment}) {m._silent_at(moment)} != {want}")
    return problems


@given(histories)
def test_incremental_structures_equal_a_rebuild_after_any_history(sequence):
    m = fresh()
    now = 0.0
    for step, op in enumerate(sequence):
        now = run(m, op, now)
        m.tick(now)
        m.refresh_some_records(step % 3)  # the loop's slices before a snapshot
        assert rebuilt_problems(m, now) == [], op


@given(histories, st.integers(5, 40))
def test_a_growing_fleet_moves_the_silent_threshold_both_ways(sequence, extra):
    """With a tiny ingest budget the interval (and so every threshold) changes with each
    join and leave: the silent set must follow it in both directions."""
    config = DetectorConfig(heartbeat_interval_s=1.0, lease_s=3.0, tick_period_s=0.1,
                            max_ingest_per_s=4.0)
    m = Fleet(config)
    now = 0.0
    for i, op in enumerate(sequence):
        if i == extra % max(1, len(sequence)):
            for k in range(extra):  # the fleet grows at once: every threshold moves up
                m.join(spec(f"x{k}"), now=now)
        now = run(m, op, now)
        m.tick(now)
        assert rebuilt_problems(m, now) == [], op


@dataclass
class Churn:
    members: int
    changes_per_s: float
    seconds: float
    seed: int = 1


def churn(plan: Churn) -> tuple[Fleet, int, int, set[str]]:
    """Every member heartbeats each interval from its own phase; `changes_per_s` times a
    second one member (of those not already down) stops heartbeating: half of them pause
    for less than a lease (suspected, then alive again), half restart after their lease
    ran out (expired, then back with a new incarnation). The registry ticks every tick
    period.

    Returns the fleet, heartbeats answered OK, heartbeats sent, and the ids that were up
    all along (none of them may ever be suspected or expire)."""
    rng = random.Random(plan.seed)
    config = DetectorConfig(heartbeat_interval_s=1.0, lease_s=3.0, tick_period_s=0.1)
    m = Fleet(config, Limits(max_members=plan.members + 10))
    ids = [f"decode-{i}" for i in range(plan.members)]
    phase = {member_id: rng.random() for member_id in ids}
    incarnation = dict.fromkeys(ids, 1)
    for member_id in ids:
        m.join(spec(member_id), now=0.0)
    down: dict[str, tuple[float, bool]] = {}  # id -> (when it comes back, restarted)
    touched: set[str] = set()
    ok = sent = 0
    step = config.tick_period_s
    t = 0.0
    flips = 0.0
    while t < plan.seconds:
        start, t = t, t + step
        flips += plan.changes_per_s * step
        while flips >= 1:
            flips -= 1
            victim = rng.choice(ids)
            if victim not in down:
                restart = rng.random() < 0.5
                back = rng.uniform(3.5, 6.0) if restart else rng.uniform(0.5, 1.5)
                down[victim] = (t + back, restart)
                touched.add(victim)
        for member_id, (back_at, restart) in list(down.items()):
            if t >= back_at:
                del down[member_id]
                if restart:
                    incarnation[member_id] += 1
                    m.join(spec(member_id, incarnation[member_id]), now=t)
        for member_id in ids:
            if member_id in down:
                continue
            beat_at = int(start) + phase[member_id]
            if start < beat_at <= t or start < beat_at + 1 <= t:
                sent += 1
                outcome = m.beat(member_id, incarnation[member_id], READY,
                                 Load(running=rng.randrange(8)), now=t)
                ok += outcome.status.name == "OK"
        m.tick(t)
    return m, ok, sent, set(ids) - touched


def test_churn_keeps_every_live_member_and_answers_every_heartbeat():
    m, ok, sent, steady = churn(Churn(members=5_000, changes_per_s=50, seconds=12))
    events = m.take_events()
    wrongly_suspected = {e.member.spec.id for e in events
                         if isinstance(e, MemberUpdated) and e.member.suspect} & steady
    wrongly_expired = {e.id for e in events
                       if isinstance(e, MemberLeft) and e.reason is LeaveReason.EXPIRED} & steady
    assert sent > 5_000 * 10
    assert len(steady) > 4_000
    assert ok == sent  # every heartbeat from a live incarnation is answered OK
    assert wrongly_suspected == set()
    assert wrongly_expired == set()
    assert not m.self_preserving
    # And those that stopped past their lease were expired: churn is seen, not hidden.
    assert any(isinstance(e, MemberLeft) and e.reason is LeaveReason.EXPIRED for e in events)
    assert rebuilt_problems(m, 12.0) == []


# --- digests that carry news ---------------------------------------------------------------

BAND = Deadband(max_age_s=1.0)


@pytest.mark.parametrize(("sent", "new", "news"), [
    (Load(running=0), Load(running=1), True),  # small values: one request is news
    (Load(running=50), Load(running=54), False),  # inside a tenth
    (Load(running=50), Load(running=55), True),
    (Load(waiting=0), Load(waiting=1), True),  # a queue forming
    (Load(kv_usage=0.50), Load(kv_usage=0.51), False),
    (Load(kv_usage=0.50), Load(kv_usage=0.53), True),
    (Load(extra={"x": 10.0}), Load(extra={"x": 10.5}), False),
    (Load(extra={"x": 10.0}), Load(extra={"x": 11.0}), True),
    (Load(extra={"x": 0.0}), Load(extra={"x": 0.001}), True),  # from zero
    (Load(), Load(extra={"x": 1.0}), True),  # a new figure
])
def test_what_counts_as_news(sent, new, news):
    assert is_news(sent, new, BAND) is news
    assert is_news(sent, new, Deadband(max_age_s=0.0)) is (sent != new)  # off: any change


def test_a_change_inside_the_band_goes_out_at_its_max_age_and_a_big_one_at_once():
    m = Fleet()
    m.deadband = BAND
    m.join(spec("a"), load=Load(running=50), now=0.0)
    m.join(spec("b"), load=Load(running=50), now=0.0)
    m.beat("a", 1, load=Load(running=52), now=0.1)  # a wobble
    m.beat("b", 1, load=Load(running=80), now=0.1)  # news
    assert [e.id for e in m.take_load_digests(0.2)["m"]] == ["b"]
    m.beat("a", 1, load=Load(running=53), now=0.5)  # still within the band of 50
    assert m.take_load_digests(0.6) == {}
    late = m.take_load_digests(1.1)["m"]  # held since 0.1: its max age is up
    assert [(e.id, e.load.running) for e in late] == [("a", 53)]
    m.beat("a", 1, load=Load(running=56), now=1.2)  # within a tenth of 53, the value sent
    assert m.take_load_digests(1.3) == {}
    m.evict("a", 1.4)
    assert m.take_load_digests(5.0) == {}  # a member gone takes its held change with it
