"""Which routers the planner decides from (planner/freshness.py), and the rule's
no-scale-down when it can read none (planner/rule.py): pure, tables and Hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.freshness import RouterFreshness, Standing, can_scale_down, standing
from planner.rule import Bounds, Planner, Reason, RoleSignals, RuleConfig
from wire.protocol import Role

R, S, L = Standing.READ, Standing.STALE, Standing.LEFT_OUT
BOUND_S = 10.0


@pytest.mark.parametrize(("read_now", "last_read", "now", "expected"), [
    (True, None, 0.0, R),  # read this round: counts, whatever came before
    (True, 0.0, 100.0, R),
    (False, 95.0, 100.0, S),  # unread 5 s: its last figures still count
    (False, 90.0, 100.0, S),  # exactly the bound: still counts
    (False, 89.9, 100.0, L),  # past the bound: left out
    (False, None, 100.0, L),  # never read: nothing to count
])
def test_standing(read_now: bool, last_read: float | None, now: float,
                  expected: Standing) -> None:
    assert standing(read_now, last_read, now, BOUND_S) is expected


@pytest.mark.parametrize(("standings", "expected"), [
    ([], True),  # no router registered: nothing to miss, load alone decides
    ([R], True),
    ([L, R], True),  # one left out: the rest decide
    ([L, S], True),  # a stale router's last figures still count
    ([L], False),  # routers, none readable: latency unknown
    ([L, L, L], False),
])
def test_can_scale_down(standings: list[Standing], expected: bool) -> None:
    assert can_scale_down(standings) is expected


def test_a_router_goes_stale_then_left_out_and_each_change_is_reported_once() -> None:
    freshness = RouterFreshness(BOUND_S)
    key = ("router-a", 1)
    rounds = [(0.0, True), (2.0, False), (4.0, False), (12.0, False), (14.0, False),
              (16.0, True)]
    seen = []
    for now, ok in rounds:
        got, change = freshness.observe(key, ok, now)
        seen.append((got, None if change is None else (change.before, change.after)))
    assert seen == [(R, None), (S, (R, S)), (S, None), (L, (S, L)), (L, None), (R, (L, R))]
    assert freshness.counts() == {R: 1, S: 0, L: 0}


def test_a_router_never_read_is_left_out_at_once_and_forgotten_when_gone() -> None:
    freshness = RouterFreshness(BOUND_S)
    got, change = freshness.observe(("router-b", 1), False, 0.0)
    assert got is L and change is not None and change.unread_s is None
    freshness.forget_except([("router-b", 2)])  # a new incarnation is a new router
    assert freshness.counts() == {R: 0, S: 0, L: 0}


@given(st.lists(st.tuples(st.floats(0, 5), st.booleans()), max_size=30))
def test_standing_follows_the_last_good_scrape(steps: list[tuple[float, bool]]) -> None:
    """Against a recount: left out exactly when the last good scrape is older than the
    bound (or there was none), read exactly when this round's scrape was good."""
    freshness = RouterFreshness(BOUND_S)
    now, last_ok = 0.0, None
    for gap, ok in steps:
        now += gap
        last_ok = now if ok else last_ok
        got, _ = freshness.observe("r", ok, now)
        if ok:
            assert got is R
        elif last_ok is None or now - last_ok > BOUND_S:
            assert got is L
        else:
            assert got is S


# --- the rule when no router can be read ----------------------------------------------

RULE = RuleConfig(scale_up_window_s=0.0, scale_down_window_s=0.0, latency_window_s=0.0,
                  prefill=Bounds(1, 20), decode=Bounds(1, 20))


def _asked(planner: Planner, replicas: int, busy: float) -> int:
    """One decision on load alone (8 capacity per replica)."""
    signals = RoleSignals(replicas=replicas, running=busy, capacity=8 * replicas)
    return planner.decide("m", Role.PREFILL, signals, 0.0).desired


@pytest.mark.parametrize(("busy_before", "busy_now", "expected", "holding"), [
    (40, 0, 8, True),  # idle now, but latency is unknown: keep 8, say why
    (40, 80, 15, False),  # busier: load may still scale up (ceil(8 * 80/64 / 0.7))
    (40, 40, 8, False),  # steady: nothing to hold
])
def test_no_scale_down_holds_the_count_but_lets_load_scale_up(
        busy_before: float, busy_now: float, expected: int, holding: bool) -> None:
    planner = Planner(RULE)
    assert _asked(planner, 1, busy_before) == 8  # ceil(1 * 40/8 / 0.7)
    signals = RoleSignals(replicas=8, running=busy_now, capacity=64)
    decision = planner.decide("m", Role.PREFILL, signals, 1.0,
                              no_scale_down="no router read within 10 s")
    assert (decision.desired, decision.holding) == (expected, holding)
    if holding:
        assert decision.reason is Reason.HOLD
        assert "no router read" in decision.why and "rule says 1" in decision.why
    # The routers are back: the rule alone decides again.
    assert planner.decide("m", Role.PREFILL, signals, 2.0).desired == (
        1 if busy_now == 0 else expected)
