"""Peak-EWMA latency estimates and the peak_ewma policy: tables and Hypothesis, no sleeps."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_policies import member, view

from router.latency import LatencyTracker, PeakEwma
from router.policies import DECODE_ROLE, PREFILL_ROLE, make_pairer
from router.table import PairingTable
from wire.protocol import Role

NOW = 1000.0
P, D = Role.PREFILL, Role.DECODE


# --- one estimate ---------------------------------------------------------------------------

@pytest.mark.parametrize(("samples", "expected"), [
    ([(0.0, 0.1)], 0.1),
    ([(0.0, 0.1), (0.0, 0.5)], 0.5),  # a higher sample is taken at once (the peak)
    ([(0.0, 0.5), (10.0, 0.1)], 0.5 * math.exp(-1) + 0.1 * (1 - math.exp(-1))),
    ([(0.0, 0.5), (0.0, 0.1)], 0.5),  # no time passed: a lower sample has no weight yet
    ([(0.0, 0.5), (1000.0, 0.1)], 0.1),  # long enough: the old estimate is forgotten
])
def test_peak_ewma_table(samples: list[tuple[float, float]], expected: float) -> None:
    estimate = PeakEwma(samples[0][1], samples[0][0])
    for at, sample in samples[1:]:
        estimate.observe(sample, at, decay_s=10.0)
    assert estimate.cost == pytest.approx(expected)


def test_an_avoided_member_is_due_one_probe_per_interval() -> None:
    tracker = LatencyTracker(probe_interval_s=30.0)
    tracker.observe(PREFILL_ROLE, "slow", 1, 1.0, 0.0)
    assert not tracker.probe_due(PREFILL_ROLE, "slow", 1, 29.0)
    assert tracker.probe_due(PREFILL_ROLE, "slow", 1, 30.0)
    tracker.probing(PREFILL_ROLE, "slow", 30.0)
    assert not tracker.probe_due(PREFILL_ROLE, "slow", 1, 31.0)  # one out, awaiting it
    assert tracker.probe_due(PREFILL_ROLE, "slow", 1, 60.0)  # its answer never came
    tracker.observe(PREFILL_ROLE, "slow", 1, 0.1, 32.0)  # it has recovered
    assert not tracker.probe_due(PREFILL_ROLE, "slow", 1, 33.0)
    # After a long gap a fast sample outweighs the old estimate almost entirely.
    assert tracker.cost(PREFILL_ROLE, "slow", 1) < 0.2
    assert not tracker.probe_due(PREFILL_ROLE, "never-seen", 1, 1e6)  # costed as typical


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 5)), min_size=1, max_size=40))
def test_an_estimate_stays_within_what_was_seen(samples: list[tuple[float, float]]) -> None:
    tracker = LatencyTracker(decay_s=10.0)
    now = 0.0
    for gap, sample in samples:
        now += gap
        tracker.observe(PREFILL_ROLE, "a", 1, sample, now)
    seen = [s for _, s in samples]
    cost = tracker.cost(PREFILL_ROLE, "a", 1)
    assert min(seen) - 1e-9 <= cost <= max(seen) + 1e-9
    assert min(seen) - 1e-9 <= tracker.typical(PREFILL_ROLE) <= max(seen) + 1e-9


def test_bad_samples_are_ignored_and_members_without_samples_cost_the_typical() -> None:
    tracker = LatencyTracker()
    for bad in (-1.0, math.nan, math.inf):
        tracker.observe(PREFILL_ROLE, "a", 1, bad, NOW)
    assert tracker.cost(PREFILL_ROLE, "a", 1) == 0.0
    tracker.observe(PREFILL_ROLE, "a", 1, 0.2, NOW)
    tracker.observe(PREFILL_ROLE, "b", 1, 0.4, NOW + 10)
    assert tracker.cost(PREFILL_ROLE, "new", 1) == tracker.typical(PREFILL_ROLE)
    assert 0.2 < tracker.typical(PREFILL_ROLE) < 0.4
    assert tracker.cost(DECODE_ROLE, "a", 1) == 0.0  # roles do not mix


def test_a_new_incarnation_starts_afresh_and_gone_members_are_forgotten() -> None:
    tracker = LatencyTracker()
    tracker.observe(PREFILL_ROLE, "a", 1, 5.0, NOW)
    tracker.observe(PREFILL_ROLE, "b", 1, 0.1, NOW)
    assert tracker.cost(PREFILL_ROLE, "a", 2) == tracker.typical(PREFILL_ROLE)
    tracker.observe(PREFILL_ROLE, "a", 2, 0.1, NOW)
    assert tracker.cost(PREFILL_ROLE, "a", 2) == pytest.approx(0.1)
    tracker.retain({"b"})
    assert set(tracker.estimates()) == {(PREFILL_ROLE, "b")}


# --- the peak_ewma policy -------------------------------------------------------------------

def table(*ids: str) -> PairingTable:
    return PairingTable.build(view(*(member(i, P) for i in ids), member("d", D)))


def test_the_faster_of_two_equally_busy_members_wins() -> None:
    tracker = LatencyTracker()
    pairer = make_pairer("peak_ewma", rng=random.Random(0), latency=tracker)
    tracker.observe(PREFILL_ROLE, "fast", 1, 0.01, NOW)
    tracker.observe(PREFILL_ROLE, "slow", 1, 0.10, NOW)
    t = table("fast", "slow")
    picks = Counter(pairer.choose(t, "m", now=NOW, in_flight={}).prefill.id  # type: ignore[union-attr]
                    for _ in range(50))
    assert picks == {"fast": 50}
    # Until the fast one has ten times the work: then the slow one is as good.
    busy = {"fast": 10}
    picks = Counter(pairer.choose(t, "m", now=NOW, in_flight=busy).prefill.id  # type: ignore[union-attr]
                    for _ in range(50))
    assert picks["slow"] > 0


def test_a_member_with_no_samples_gets_traffic() -> None:
    tracker = LatencyTracker()
    pairer = make_pairer("peak_ewma", rng=random.Random(1), latency=tracker)
    tracker.observe(PREFILL_ROLE, "a", 1, 0.01, NOW)
    tracker.observe(PREFILL_ROLE, "b", 1, 0.05, NOW)
    t = table("a", "b", "new")
    picks = Counter(pairer.choose(t, "m", now=NOW, in_flight={}).prefill.id  # type: ignore[union-attr]
                    for _ in range(300))
    assert picks["new"] > 30  # costed as typical: beats the slow one, loses to the fast


def test_a_slow_member_gets_its_probe_and_no_more() -> None:
    tracker = LatencyTracker(probe_interval_s=30.0)
    pairer = make_pairer("peak_ewma", rng=random.Random(3), latency=tracker,
                         stale_after_s=1e9)  # loads stay fresh over the test's minutes
    tracker.observe(PREFILL_ROLE, "fast", 1, 0.01, NOW)
    tracker.observe(PREFILL_ROLE, "slow", 1, 1.0, NOW)
    t = table("fast", "slow")

    def picks(at: float, n: int = 40) -> Counter[str]:
        out: Counter[str] = Counter()
        for _ in range(n):
            pair = pairer.choose(t, "m", now=at, in_flight={})
            assert pair is not None
            out[pair.prefill.id] += 1
            if pair.prefill.id == "fast":  # the fast one keeps answering: fresh samples
                tracker.observe(PREFILL_ROLE, "fast", 1, 0.01, at)
        return out

    assert picks(NOW + 10)["slow"] == 0
    assert picks(NOW + 31)["slow"] == 1  # due a probe: exactly one request
    assert picks(NOW + 45)["slow"] == 0  # its answer has not come: no second probe


def test_other_policies_ignore_latency() -> None:
    tracker = LatencyTracker()
    tracker.observe(PREFILL_ROLE, "fast", 1, 0.01, NOW)
    tracker.observe(PREFILL_ROLE, "slow", 1, 10.0, NOW)
    pairer = make_pairer("round_robin", latency=tracker)
    assert pairer.latency is None
    t = table("fast", "slow")
    assert [pairer.choose(t, "m", now=NOW, in_flight={}).prefill.id  # type: ignore[union-attr]
            for _ in range(4)] == ["fast", "slow", "fast", "slow"]


def test_a_slow_member_converges_to_a_small_share_in_a_simulation() -> None:
    """Two prefills, one 10x slower (each serves requests concurrently, like a batching
    engine), closed-loop clients: peak_ewma sends the slow one almost nothing; power of
    two on load alone sends it much more."""
    def slow_share(policy: str) -> float:
        tracker = LatencyTracker()
        pairer = make_pairer(policy, rng=random.Random(2), latency=tracker)
        t = table("fast", "slow")
        service = {"fast": 0.01, "slow": 0.1}
        clients = [0.0] * 8  # when each client's next request goes out
        busy_until: dict[str, list[float]] = {"fast": [], "slow": []}
        picks: Counter[str] = Counter()
        for _ in range(2000):
            i = min(range(len(clients)), key=clients.__getitem__)
            now = clients[i]
            in_flight = {k: sum(1 for end in v if end > now) for k, v in busy_until.items()}
            pair = pairer.choose(t, "m", now=now, in_flight=in_flight)
            assert pair is not None
            chosen = pair.prefill.id
            end = now + service[chosen]
            busy_until[chosen].append(end)
            tracker.observe(PREFILL_ROLE, chosen, 1, end - now, end)
            picks[chosen] += 1
            clients[i] = end
        return picks["slow"] / sum(picks.values())

    peak, load_only = slow_share("peak_ewma"), slow_share("power_of_two")
    assert peak < 0.01 and load_only > 0.05
