"""Detector math: pure functions, table tests."""

from __future__ import annotations

import pytest

from registry.detector import DetectorConfig, is_self_preserving, loop_lag, timing_for

BASE = DetectorConfig(heartbeat_interval_s=1.0, lease_s=3.0, max_ingest_per_s=20_000)


@pytest.mark.parametrize(("members", "interval", "suspect", "lease"), [
    (0, 1.0, 2.0, 3.0),
    (12_500, 1.0, 2.0, 3.0),      # 100k GPUs at TP 8: still one second
    (40_000, 2.0, 4.0, 6.0),      # past the ingest budget the interval grows
])
def test_timing_for_fleet_size(members, interval, suspect, lease):
    timing = timing_for(BASE, members)
    assert (timing.heartbeat_interval_s, timing.suspect_after_s, timing.lease_s) == \
        pytest.approx((interval, suspect, lease))


@pytest.mark.parametrize(("lease_s", "expected"), [(1.0, 3.0), (3.0, 3.0), (10.0, 10.0)])
def test_lease_is_never_below_three_intervals(lease_s, expected):
    timing = timing_for(DetectorConfig(heartbeat_interval_s=1.0, lease_s=lease_s), 1)
    assert timing.lease_s == expected
    assert timing.suspect_after_s <= timing.lease_s


@pytest.mark.parametrize(("previous", "now", "lag"), [
    (0.0, 0.1, 0.0),
    (0.0, 0.2, 0.0),    # within the two-period allowance
    (0.0, 1.2, 1.0),
])
def test_loop_lag(previous, now, lag):
    assert loop_lag(previous, now, 0.1) == pytest.approx(lag)


@pytest.mark.parametrize(("silent", "total", "expected"), [
    (0, 0, False),
    (1, 1, False),    # a lone death is just a death
    (2, 2, False),
    (3, 4, True),
    (3, 6, True),     # half the fleet at once
    (3, 7, False),
    (50, 100, True),
    (49, 100, False),
])
def test_self_preservation_threshold(silent, total, expected):
    assert is_self_preserving(silent, total, DetectorConfig()) is expected


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        DetectorConfig(heartbeat_interval_s=0)
    with pytest.raises(ValueError, match="share"):
        DetectorConfig(self_preservation_share=1.5)


@pytest.mark.parametrize(("interval", "lease", "silent_after"), [
    (1.0, 3.0, 1.0),    # the default lease: silent past one interval, when someone is due
    (0.5, 1.5, 0.5),
    (1.0, 10.0, 8.0),   # a long lease: two intervals before it
])
def test_silence_counts_two_intervals_before_the_lease(interval, lease, silent_after):
    timing = timing_for(DetectorConfig(heartbeat_interval_s=interval, lease_s=lease), 1)
    assert timing.silent_after_s == pytest.approx(silent_after)
