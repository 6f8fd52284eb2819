"""Self-preservation's guarantee: a fleet that falls silent at once loses nobody.

First as a property over heartbeat phases and lateness on the pure membership, then with
real member processes SIGSTOPped together against a real registry.
"""

from __future__ import annotations

import heapq
import math
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from membership_ops import Fleet, spec

from pdreg.testing import die_with_parent, stop_process, wait_until
from registry.detector import (
    SELF_PRESERVATION_MIN_SILENT,
    SELF_PRESERVATION_SHARE,
    DetectorConfig,
)
from registry.server import RegistryServer
from wire.protocol import LeaveReason, MemberLeft

INTERVAL_S = 0.5
LEASE_S = 1.5
TICK_S = 0.1
CONFIG = DetectorConfig(heartbeat_interval_s=INTERVAL_S, lease_s=LEASE_S, tick_period_s=TICK_S)
AGENT_SCRIPT = Path(__file__).with_name("agent_process.py")


def simulate(phases: list[float], lateness: list[float], silent: set[int], stop_at: float,
             silence_s: float, seed: int) -> tuple[Fleet, list[MemberLeft]]:
    """Members heartbeat every interval from their phase, each beat late by up to their
    `lateness`; those in `silent` send nothing during [stop_at, stop_at + silence_s) and
    beat at once when they wake. The registry ticks after each message and every tick."""
    rng = random.Random(seed)
    fleet = Fleet(CONFIG)
    ids = [f"decode-{i}" for i in range(len(phases))]
    for member_id in ids:
        fleet.join(spec(member_id), now=0.0)
    wake_at = stop_at + silence_s
    end = wake_at + 3 * INTERVAL_S
    queue = [(phase, i) for i, phase in enumerate(phases)]
    queue += [(k * TICK_S, -1) for k in range(1, int(end / TICK_S) + 1)]
    heapq.heapify(queue)
    while queue:
        now, who = heapq.heappop(queue)
        if now > end:
            break
        if who >= 0:
            if who in silent and stop_at <= now < wake_at:
                heapq.heappush(queue, (wake_at, who))  # stopped: the beat waits for SIGCONT
                continue
            fleet.beat(ids[who], 1, now=now)
            late = rng.uniform(0.0, lateness[who])
            heapq.heappush(queue, (now + INTERVAL_S + late, who))
        fleet.tick(now)
    return fleet, [e for e in fleet.take_events() if isinstance(e, MemberLeft)]


@st.composite
def mass_silences(draw: st.DrawFn) -> tuple:
    n = draw(st.integers(3, 16))
    phases = draw(st.lists(st.floats(0.0, INTERVAL_S, exclude_max=True), min_size=n,
                           max_size=n))
    # Each member's heartbeats arrive up to `lateness` after they are due (a round trip, a
    # busy host): the guarantee covers anything below one interval.
    lateness = draw(st.lists(st.floats(0.0, 0.95 * INTERVAL_S), min_size=n, max_size=n))
    least = max(SELF_PRESERVATION_MIN_SILENT, math.ceil(SELF_PRESERVATION_SHARE * n))
    silent = draw(st.sets(st.integers(0, n - 1), min_size=min(least, n), max_size=n))
    stop_at = draw(st.floats(2.0, 4.0))
    silence_s = draw(st.floats(LEASE_S, 20.0))
    return phases, lateness, silent, stop_at, silence_s, draw(st.integers(0, 2**32))


@given(mass_silences())
# Found by Hypothesis: the leases ran out between two ticks and one member woke before
# the next, so the decision at that tick saw 2 of 3 silent and expired them.
@example(([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], {0, 1, 2}, 2.5625, 1.5, 0))
def test_a_fleet_that_falls_silent_at_once_loses_nobody(case):
    phases, lateness, silent, stop_at, silence_s, seed = case
    fleet, left = simulate(phases, lateness, silent, stop_at, silence_s, seed)
    assert left == []
    assert len(fleet) == len(phases)
    assert not any(record.suspect for record in fleet.records())  # all back, all routable


@given(st.integers(4, 16), st.integers(0, 2**32))
def test_a_lone_death_is_still_expired(n, seed):
    """The guarantee does not blind the detector: one member going quiet is expired."""
    _, left = simulate([i * INTERVAL_S / n for i in range(n)], [0.2] * n, {0}, 2.0,
                           30.0, seed)
    assert [(e.id, e.reason) for e in left] == [("decode-0", LeaveReason.EXPIRED)]


# --- the same with real processes -------------------------------------------------------


@pytest.fixture
def registry(registry_factory: Callable[..., RegistryServer]) -> RegistryServer:
    return registry_factory(heartbeat_interval_s=INTERVAL_S, lease_s=LEASE_S)


def start_members(address: str, count: int) -> list[subprocess.Popen[str]]:
    procs = [subprocess.Popen([sys.executable, str(AGENT_SCRIPT), address, f"decode-{i}",
                               str(9100 + i)], stdout=subprocess.PIPE, text=True,
                              preexec_fn=die_with_parent) for i in range(count)]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return procs


def test_sigstopped_majority_survives_and_returns(registry: RegistryServer) -> None:
    """A majority stalls at once: 7 members, 4 of them SIGSTOPped at the same moment for 4 s
    (well past the 1.5 s lease). Nobody is expired; all are routable again after."""
    procs = start_members(registry.control_address, 7)
    try:
        assert wait_until(lambda: len(registry.members()) == 7, 10)
        stopped = procs[:4]
        for proc in stopped:
            proc.send_signal(signal.SIGSTOP)
        preserving_seen = wait_until(lambda: registry.published.self_preserving, 3)
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            assert len(registry.members()) == 7, "a member was expired"
            time.sleep(0.05)
        assert registry.stats.departures.get("expired", 0) == 0
        for proc in stopped:
            proc.send_signal(signal.SIGCONT)
        assert preserving_seen
        assert wait_until(lambda: all(r.routable for r in registry.members().values())
                          and len(registry.members()) == 7, 10)
        assert wait_until(lambda: not registry.published.self_preserving, 5)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
        for proc in procs:
            stop_process(proc, 10)
