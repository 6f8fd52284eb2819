"""The on-demand hand-over between the registry's loop and its readers
(registry.on_demand), with real threads standing in for HTTP readers."""

from __future__ import annotations

import threading
import time

from pdreg.testing import wait_until
from registry.on_demand import OnDemand

WAIT_S = 10.0


def _held(value: int) -> OnDemand[int]:
    return OnDemand(value, max_age_s=60.0, min_gap_s=0.0, cost_factor=10.0, wait_s=WAIT_S)


def test_a_current_value_is_read_without_waking_the_loop():
    held = _held(1)
    wakes: list[int] = []
    assert held.read(lambda v: v == 1, lambda: wakes.append(1)) == 1
    assert wakes == [] and held.due_at() == float("inf")
    assert not held.wanted(time.monotonic())


def test_stale_readers_wake_the_loop_once_and_all_get_the_one_build():
    held = _held(1)
    wakes: list[int] = []
    got: list[int] = []
    readers = [threading.Thread(target=lambda: got.append(
        held.read(lambda v: v == 2, lambda: wakes.append(1)))) for _ in range(5)]
    for reader in readers:
        reader.start()
    # The loop side: it sees the request, builds once, and every reader gets that build.
    assert wait_until(lambda: held.wanted(time.monotonic()), WAIT_S)
    assert wait_until(lambda: held._requests.qsize() == 5, WAIT_S)
    held.built(2, time.monotonic())
    for reader in readers:
        reader.join(WAIT_S)
    assert got == [2] * 5
    assert wakes == [1]  # later readers rode on the first one's wake
    assert not held.wanted(time.monotonic())


def test_builds_are_spaced_by_their_cost():
    held = OnDemand(0, max_age_s=60.0, min_gap_s=0.02, cost_factor=10.0, wait_s=0.0)
    started = time.monotonic() - 0.5  # a build that took half a second
    held.built(1, started)
    held.read(lambda v: False, lambda: None)  # asks (and does not wait: wait_s=0)
    assert held.due_at() >= held.built_at + 5.0  # ten times its cost
    assert not held.wanted(held.built_at + 1.0)
    assert held.wanted(held.built_at + 5.1)


def test_readers_waiting_when_the_loop_stops_get_the_value_at_once():
    held = _held(1)
    got: list[int] = []
    waiting = threading.Thread(target=lambda: got.append(held.read(lambda v: v == 2,
                                                                   lambda: None)))
    waiting.start()
    assert wait_until(lambda: held._requests.qsize() == 1, WAIT_S)
    held.stop()  # no build will come: not a wait of WAIT_S
    waiting.join(WAIT_S / 2)
    assert got == [1]
    late = threading.Thread(target=lambda: got.append(held.read(lambda v: v == 2,
                                                                lambda: None)))
    late.start()
    late.join(WAIT_S / 2)
    assert got == [1, 1]
