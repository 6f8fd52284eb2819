"""The loop's coalescing rule (registry.coalesce), on a given clock."""

from __future__ import annotations

from registry.coalesce import Coalescer


def _run(coalescer: Coalescer, per_turn: int, turns_per_s: int, seconds: float,
         start: float = 0.0) -> list[float]:
    """Pauses after each turn of `per_turn` messages, `turns_per_s` turns a second."""
    return [coalescer.pause_after(per_turn, False, start + k / turns_per_s)
            for k in range(int(seconds * turns_per_s))]


def test_a_small_fleet_never_waits():
    coalescer = Coalescer(pause_s=0.001, above_per_s=2_000)
    assert set(_run(coalescer, per_turn=1, turns_per_s=1_000, seconds=5)) == {0.0}
    assert not coalescer.active


def test_a_busy_loop_pauses_from_the_first_full_window_on_and_stops_when_it_calms():
    coalescer = Coalescer(pause_s=0.001, above_per_s=2_000)
    busy = _run(coalescer, per_turn=3, turns_per_s=1_000, seconds=3)  # 3,000/s
    assert set(busy[:999]) == {0.0}  # the first window decides nothing
    assert set(busy[1_000:]) == {0.001}
    assert coalescer.active
    calm = _run(coalescer, per_turn=1, turns_per_s=500, seconds=3, start=3.0)  # 500/s
    assert calm[-1] == 0.0 and not coalescer.active


def test_no_pause_after_an_empty_turn_or_a_full_batch():
    coalescer = Coalescer(pause_s=0.001, above_per_s=2_000)
    _run(coalescer, per_turn=5, turns_per_s=1_000, seconds=2)
    assert coalescer.active
    assert coalescer.pause_after(0, False, 2.0) == 0.0  # a timer's turn: nothing arrived
    assert coalescer.pause_after(1024, True, 2.0) == 0.0  # more is waiting: go on
    assert coalescer.pause_after(7, False, 2.0) == 0.001


def test_a_pause_of_zero_turns_coalescing_off():
    coalescer = Coalescer(pause_s=0.0, above_per_s=2_000)
    assert set(_run(coalescer, per_turn=50, turns_per_s=1_000, seconds=3)) == {0.0}
