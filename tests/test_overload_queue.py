"""The admission queue and budgets (router/admission/fair_queue.py, budgets.py,
adaptive.py), pure:
Hypothesis histories checked against a recount, and the three promises: no class
starves, tenants' shares follow their weights within one request's cost, and a budget
is exactly what is in flight: never negative, nothing left after every release."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.admission.adaptive import GROWTH, AdaptiveLimit
from router.admission.budgets import Budgets, Limit
from router.admission.fair_queue import FairQueue, Waiter

CLASSES = {"critical": 2, "standard": 1, "batch": 0}
TENANTS = ("a", "b", "c")


def waiter(klass: str, tenant: str, cost: int, now: float, *, size: int = 10,
           weight: float = 1.0, deadline_s: float = 100.0) -> Waiter:
    return Waiter(klass, CLASSES[klass], tenant, weight, cost, size, now, now + deadline_s)


@dataclass
class Op:
    kind: str
    klass: str = "standard"
    tenant: str = "a"
    cost: int = 1
    dt: float = 0.0
    pick: int = 0


ops = st.one_of(
    st.builds(Op, st.just("push"), st.sampled_from(list(CLASSES)), st.sampled_from(TENANTS),
              st.integers(1, 500)),
    st.builds(Op, st.just("pop")),
    st.builds(Op, st.just("remove"), pick=st.integers(0, 50)),
    st.builds(Op, st.just("tick"), dt=st.floats(0.0, 3.0)),
    st.builds(Op, st.just("expire")),
)


@given(st.lists(ops, max_size=120), st.integers(1, 20), st.integers(50, 2000))
def test_queue_counts_match_a_recount_and_bounds_hold(history: list[Op], max_requests: int,
                                                      max_bytes: int) -> None:
    queue = FairQueue(max_requests=max_requests, max_bytes=max_bytes, starvation_s=2.0)
    queued: list[Waiter] = []  # the model: what should be in the queue
    now = 0.0
    for op in history:
        if op.kind == "push":
            w = waiter(op.klass, op.tenant, op.cost, now, size=op.cost, deadline_s=4.0)
            fits = len(queued) < max_requests and sum(q.size for q in queued) + w.size <= max_bytes
            assert queue.push(w) is fits
            if fits:
                queued.append(w)
        elif op.kind == "pop":
            w = queue.pop(now)
            assert (w is None) == (not queued)
            if w is not None:
                queued.remove(w)
        elif op.kind == "remove" and queued:
            w = queued.pop(op.pick % len(queued))
            assert queue.remove(w) and not queue.remove(w)  # safe twice
        elif op.kind == "tick":
            now += op.dt
        elif op.kind == "expire":
            late = queue.expired(now)
            assert all(w.deadline <= now for w in late)
            for w in late:
                queued.remove(w)
            assert all(w.deadline > now for w in queued)
        assert len(queue) == len(queued) <= max_requests
        assert queue.bytes == sum(w.size for w in queued) <= max_bytes
        assert set(map(id, queue.waiters())) == set(map(id, queued))
        for name in CLASSES:
            assert queue.depth(name) == sum(1 for w in queued if w.klass == name)


@given(st.lists(st.tuples(st.sampled_from(list(CLASSES)), st.sampled_from(TENANTS)),
                min_size=1, max_size=40))
def test_strict_priority_without_starved_waiters(pushes: list[tuple[str, str]]) -> None:
    queue = FairQueue(max_requests=100, max_bytes=10_000, starvation_s=1000.0)
    for klass, tenant in pushes:
        queue.push(waiter(klass, tenant, 10, 0.0))
    order = [queue.pop(1.0) for _ in pushes]
    priorities = [w.priority for w in order if w is not None]
    assert priorities == sorted(priorities, reverse=True)


@given(st.floats(0.5, 5.0), st.floats(0.01, 0.4), st.integers(1, 3))
def test_a_low_class_is_served_within_the_starvation_guard(
        guard_s: float, step_s: float, arrivals_per_step: int) -> None:
    """Critical traffic arrives faster than it is served, for ever; a batch request
    waiting since t=0 is still served once it has waited the guard (plus one step)."""
    queue = FairQueue(max_requests=100_000, max_bytes=1 << 30, starvation_s=guard_s)
    low = waiter("batch", "a", 10, 0.0)
    queue.push(low)
    now = 0.0
    while True:
        for _ in range(arrivals_per_step):
            queue.push(waiter("critical", "b", 10, now))
        now += step_s
        served = queue.pop(now)
        if served is low:
            break
        assert served is not None and served.klass == "critical"
        assert now < guard_s + step_s, "the batch request starved"
    assert now - low.arrived < guard_s + step_s


@given(st.lists(st.integers(1, 100), min_size=20, max_size=200),
       st.sampled_from([1.0, 2.0, 3.0]), st.sampled_from([1.0, 0.5, 4.0]))
def test_backlogged_tenants_share_by_weight_within_one_request(costs: list[int], wa: float,
                                                               wb: float) -> None:
    """Two tenants with work always queued: the tokens each is served, over its weight,
    differ by at most one request's cost over its weight (VTC's bound)."""
    queue = FairQueue(max_requests=1000, max_bytes=1 << 20, starvation_s=1e9)
    weights = {"a": wa, "b": wb}
    feed = iter(costs * 2)
    for tenant in ("a", "b", "a", "b"):  # two each: a tenant's line never empties
        queue.push(waiter("standard", tenant, next(feed), 0.0, weight=weights[tenant]))
    served = {"a": 0.0, "b": 0.0}
    bound = max(costs) / min(wa, wb)
    for _ in range(len(costs)):
        w = queue.pop(0.0)
        assert w is not None
        served[w.tenant] += w.cost
        queue.push(waiter("standard", w.tenant, next(feed), 0.0, weight=weights[w.tenant]))
        assert abs(served["a"] / wa - served["b"] / wb) <= bound + 1e-9


def test_a_tenant_back_from_idle_banks_no_credit() -> None:
    queue = FairQueue(max_requests=100, max_bytes=10_000, starvation_s=1e9)
    for _ in range(10):  # "a" alone: served 10 x 100 tokens
        queue.push(waiter("standard", "a", 100, 0.0))
        queue.pop(0.0)
    for _ in range(3):
        queue.push(waiter("standard", "a", 100, 0.0))
        queue.push(waiter("standard", "b", 100, 0.0))
    # "b" was idle, not owed: the two alternate instead of "b" taking all three first.
    assert [w.tenant for w in (queue.pop(0.0) for _ in range(6)) if w] == \
        ["a", "b", "a", "b", "a", "b"]


def test_a_push_past_a_bound_changes_nothing() -> None:
    queue = FairQueue(max_requests=2, max_bytes=25, starvation_s=1.0)
    assert queue.push(waiter("standard", "a", 1, 0.0, size=10))
    assert not queue.push(waiter("standard", "a", 1, 0.0, size=20))  # bytes
    assert queue.push(waiter("standard", "a", 1, 0.0, size=10))
    assert not queue.push(waiter("standard", "a", 1, 0.0, size=1))  # requests
    assert (len(queue), queue.bytes) == (2, 20)


budget_ops = st.lists(st.one_of(
    # bool: counted at once (a prefill's grant), or later (a decode's, after its prefill)
    st.tuples(st.just("take"), st.sampled_from(["p1", "p2", "d1"]), st.integers(0, 5000),
              st.booleans(), st.integers(0, 5000)),  # int: its reservation's units
    st.tuples(st.just("release"), st.integers(0, 100), st.booleans()),
    st.tuples(st.just("count"), st.integers(0, 100), st.booleans()),
), max_size=150)


@given(budget_ops)
def test_budgets_are_what_is_in_flight_never_negative_never_leaking(history: list) -> None:
    """Takes and releases in any order, releases twice (a cancellation racing the end of
    a leg), a retry's new grant before the old one goes, a decode's grant counted once
    its prefill is done (twice, or after it was released): the counts are the sum of the
    grants outstanding, and zero, with no entry left, once all are released."""
    now = [0.0]
    samples: list[tuple[str, float, int]] = []
    budgets = Budgets(lambda: now[0], lambda m, s, w: samples.append((m, s, w)))
    grants = []
    for op in history:
        now[0] += 0.1
        if op[0] == "take":
            before = budgets.used(op[1])
            grants.append(budgets.take(op[1], op[2], timed=True, counted=op[3],
                                       replaces=op[4]))
            # the work beside it: what was there, less its own reservation, never less
            # than itself
            assert grants[-1].work == op[2] + max(0, before - op[4])
        elif grants:
            grant = grants[op[1] % len(grants)]
            for _ in range(2 if op[2] else 1):
                grant.release() if op[0] == "release" else grant.count()
        for member in ("p1", "p2", "d1"):
            live = [g for g in grants if g.member_id == member and not g.released]
            assert budgets.used(member) == sum(g.units for g in live) >= 0
            assert budgets.requests(member) == sum(g.counted for g in live)
            assert (member in {m for m, _, _ in budgets.members()}) is bool(live)
    for grant in grants:
        grant.release()
    assert list(budgets.members()) == []
    assert len(samples) == len(grants)  # each release reported once
    assert all(seconds >= 0 for _, seconds, _ in samples)


@pytest.mark.parametrize(("in_flight", "units", "limit", "fits"), [
    ([], 10**6, Limit(units=100), True),  # alone, a prompt larger than the budget fits
    ([60], 40, Limit(units=100), True),
    ([60], 41, Limit(units=100), False),
    ([1, 1], 1, Limit(requests=2), False),
    ([1], 1, Limit(requests=2), True),
    ([10**6], 10**6, Limit(), True),  # no limit
])
def test_fits(in_flight: list[int], units: int, limit: Limit, fits: bool) -> None:
    budgets = Budgets(lambda: 0.0)
    for n in in_flight:
        budgets.take("m", n)
    assert budgets.fits("m", units, limit) is fits
    assert budgets.full("m", limit) is (bool(in_flight) and not budgets.fits("m", 0, limit))


def test_a_grant_takes_a_request_slot_only_once_counted() -> None:
    """A decode's slot is taken when its prefill is done, not at admission: a request
    still in its prefill leaves the decode's one slot free; its units count at once."""
    budgets = Budgets(lambda: 0.0)
    one_slot = Limit(requests=1)
    in_prefill = budgets.take("d", 30, counted=False)
    assert budgets.fits("d", 30, one_slot) and not budgets.full("d", one_slot)
    assert budgets.used("d") == 30
    in_prefill.count()
    assert not budgets.fits("d", 30, one_slot) and budgets.full("d", one_slot)
    assert not budgets.fits("d", 10, Limit(units=35))  # the units bound both alike
    in_prefill.release()
    in_prefill.count()  # a late count after the release changes nothing
    assert budgets.requests("d") == budgets.used("d") == 0 and not list(budgets.members())


# --- a prefill's budget, steered by its legs (router/admission/adaptive.py) ---------------


@pytest.mark.parametrize(("start", "seconds", "work", "expected"), [
    (1000, 2.0, 800, 400),  # slower than the 1 s target: what it does in 1 s
    (1000, 0.5, 800, 1250),  # within target, near the budget: up a quarter
    (1000, 0.5, 100, 1000),  # within target but far from the budget: says nothing
    (4000, 0.5, 3900, 4000),  # never above the cap
    (1000, 100.0, 1, 1),  # never below one unit
])
def test_adaptive_limit_table(start: int, seconds: float, work: int, expected: int) -> None:
    limits = AdaptiveLimit(cap=4000, target_s=1.0)
    limits._limits["p"] = start
    limits.observe("p", seconds, work)
    assert limits.limit("p") == expected


@given(st.floats(0.0001, 0.01), st.integers(1, 8), st.floats(0.1, 2.0))
def test_adaptive_limit_finds_a_serial_engines_budget_and_a_batching_engines_cap(
        seconds_per_unit: float, parallel: int, target_s: float) -> None:
    """A serial engine (a leg takes work x speed) settles where its legs take about the
    target; an engine that does any work in the same time is given the cap."""
    serial = AdaptiveLimit(cap=100_000, target_s=target_s)
    batching = AdaptiveLimit(cap=100_000, target_s=target_s)
    for _ in range(200):
        work = serial.limit("p")
        serial.observe("p", work * seconds_per_unit / parallel, work)
        batching.observe("p", target_s / 2, batching.limit("p"))
        assert 1 <= serial.limit("p") <= 100_000
    settled = serial.limit("p") * seconds_per_unit / parallel
    assert settled <= target_s * GROWTH + seconds_per_unit or serial.limit("p") == 1
    assert serial.limit("p") == 100_000 or settled >= target_s / GROWTH - seconds_per_unit
    assert batching.limit("p") == 100_000
