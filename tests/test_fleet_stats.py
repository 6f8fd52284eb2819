"""The counts /metrics reads (registry.fleet_stats) against a from-scratch count.

Membership keeps members by role, model and state, and their heartbeat times in slots,
as members change, so that a scrape never walks the fleet. After any sequence of
operations (Hypothesis), they must equal what a count over the members alone gives, and
the histogram a scrape shows must be the members' own ages, to a slot.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st
from membership_ops import IDS, READY, Fleet, Op, apply, fresh, ops, spec, ticks

from registry.fleet_stats import (
    AGE_BUCKETS_S,
    SLOT_S,
    SUSPECT,
    FleetFigures,
    micros,
    slot_of,
    state_key,
)
from registry.membership import Membership
from wire.protocol import MemberState, Role

# Beyond membership_ops' histories: members of other roles and models, stalls long enough
# for heartbeat ages past the largest bucket (time jumps, one tick: members are given the
# stall back and stay), and scrapes (a scrape folds the slots past the largest bucket).
others = st.builds(Op, st.just("join_other"), st.sampled_from(IDS), st.integers(1, 4),
                   st.sampled_from(list(MemberState)))
stalls = st.builds(Op, st.just("stall"),
                   dt=st.one_of(st.floats(0.25, 6.0), st.floats(100.0, 300.0)))
scrapes = st.builds(Op, st.just("scrape"))
histories = st.lists(st.one_of(ops, others, stalls, scrapes), max_size=80)
OTHER = {"a": (Role.DECODE, "m2"), "b": (Role.MIXED, "m"), "c": (Role.DECODE, "m"),
         "d": (Role.PREFILL, "m3")}


def run(m: Fleet, op: Op, now: float) -> float:
    if op.kind == "join_other":
        role, model = OTHER[op.member]
        m.join(spec(op.member, op.incarnation, model=model, role=role), op.state, now=now)
        m.tick(now)
        return now
    if op.kind == "stall":
        now += op.dt
        m.tick(now)
        return now
    if op.kind == "scrape":
        m.figures(now, 0)
        return now
    return apply(m, op, now)


def counted_problems(m: Membership) -> list[str]:
    """Where the running counts differ from a count over the member entries alone."""
    stats = m.fleet_stats
    members: Counter[tuple[Role, str]] = Counter()
    states: Counter[tuple[Role, str, int]] = Counter()
    slots: Counter[tuple[Role, str, int]] = Counter()
    older: Counter[tuple[Role, str]] = Counter()
    sums: Counter[tuple[Role, str]] = Counter()
    problems = []
    for e in m._members.values():
        key = (e.spec.role, e.spec.model)
        members[key] += 1
        states[(*key, state_key(e.shown_state, e.suspect))] += 1
        slot = slot_of(e.heartbeat_at)
        if slot < stats.folded_below:
            older[key] += 1
        else:
            slots[(*key, slot)] += 1
        sums[key] += micros(e.heartbeat_at)
        if (e.beat_us, e.counted) != (micros(e.heartbeat_at),
                                      state_key(e.shown_state, e.suspect)):
            problems.append(f"{e.spec.id} remembers {e.beat_us} us, key {e.counted}")
        if stats.groups.get(key) is not e.group:
            problems.append(f"{e.spec.id} counted in another group")
    if set(stats.groups) != set(members):
        problems.append(f"groups {set(stats.groups)} != {set(members)}")
    for key, group in stats.groups.items():
        got = (group.members, group.older, group.sum_us,
               {s: n for s, n in group.slots.items()}, list(group.states))
        want = (members[key], older[key], sums[key],
                {s: n for (*k, s), n in slots.items() if tuple(k) == key},
                [states[(*key, i)] for i in range(len(group.states))])
        if got != want:
            problems.append(f"group {key}: {got} != {want}")
    return problems


def shown_problems(m: Membership, now: float) -> list[str]:
    """Where what a scrape at `now` shows differs from the members' records."""
    figures = m.figures(now, 10)
    problems = []
    records = m.records()
    if figures.members != len(records) or figures.version != m.version:
        problems.append(f"figures of {figures.members} members v{figures.version}")
    want_states: Counter[tuple[Role, str, int]] = Counter(
        (r.spec.role, r.spec.model, SUSPECT if r.suspect else int(r.state)) for r in records)
    got_states = Counter({(g.role, g.model, key): n for g in figures.groups
                          for key, n in enumerate(g.states) if n})
    if got_states != want_states:
        problems.append(f"states {got_states} != {want_states}")
    for group in figures.groups:
        mine = [r for r in records if (r.spec.role, r.spec.model) == (group.role, group.model)]
        buckets, total_s = group.ages(now)
        ages = [now - (r.heartbeat_at - m.wall_offset) for r in mine]
        # Counted at their slot's middle; exactly so when not within a slot of a bound.
        at_middle = Counter(bisect_left(AGE_BUCKETS_S, now - (slot_of(
            r.heartbeat_at - m.wall_offset) + 0.5) * SLOT_S) for r in mine)
        if buckets != [at_middle[i] for i in range(len(buckets))]:
            problems.append(f"{group.role} {group.model} buckets {buckets} != {at_middle}")
        exact = Counter(bisect_left(AGE_BUCKETS_S, age) for age in ages)
        near = sum(1 for age in ages if min(abs(age - b) for b in AGE_BUCKETS_S) <= SLOT_S)
        if sum(abs(exact[i] - n) for i, n in enumerate(buckets)) > 2 * near:
            problems.append(f"buckets {buckets} far from the exact {exact}")
        if abs(total_s - sum(ages)) > 1e-6 * (len(ages) + 1):
            problems.append(f"sum of ages {total_s} != {sum(ages)}")
    return problems


@given(histories)
def test_counts_equal_a_count_over_the_members_after_any_history(history):
    m, now = fresh(), 0.0
    for op in history:
        now = run(m, op, now)
        problems = counted_problems(m)
        assert not problems, (op, problems)
    problems = shown_problems(m, now + 0.01)
    assert not problems, problems


def test_a_scrape_folds_old_slots_and_stays_exact():
    """Members past the largest bucket leave their slots for one count (+Inf), and a
    heartbeat from one of them takes it out again."""
    m = fresh()
    for i in range(5):
        m.join(spec(f"p{i}"), now=0.1 * i)
    m.tick(0.5)
    now = 500.0
    m.tick(now)  # a stall: members are given it back and stay
    figures: FleetFigures = m.figures(now, 0)
    (group,) = figures.groups
    assert (group.slots, group.older) == ((), 5)
    assert group.ages(now)[0][-1] == 5
    m.beat("p0", 1, READY, now=now)
    assert not counted_problems(m)
    assert not shown_problems(m, now + 0.2)
    (group,) = m.figures(now + 0.2, 0).groups
    assert group.older == 4 and group.ages(now + 0.2)[0][0] == 1  # p0 is 0.2 s old


def test_suspects_are_counted_apart_whatever_their_state():
    m = fresh()
    m.join(spec("p0"), MemberState.JOINING, now=0.0)
    ticks(m, 0.0, 2.5)  # past suspect_after (2 s), within the lease: suspect, joining
    (group,) = m.figures(2.5, 0).groups
    assert group.states[SUSPECT] == 1 and group.states[MemberState.JOINING] == 0
    m.beat("p0", 1, READY, now=2.5)
    (group,) = m.figures(2.5, 0).groups
    assert group.states[SUSPECT] == 0 and group.states[MemberState.READY] == 1
    m.leave("p0", 1)
    assert m.figures(2.5, 0).groups == ()
