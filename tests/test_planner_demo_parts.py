"""The pieces `pdreg demo --autoscale` and bench/bench_planner.py stand on: the hook the
planner runs really reaches the scaler, which really starts and drains engines and
counts their seconds; SLO attainment counts failures as misses."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Iterator

import pytest

from pdreg.demo.cluster import ClusterConfig
from pdreg.demo.open_loop import Outcome, Phase, attainment
from pdreg.demo.scaler import RoleArgsCluster, Scaler, hook_command
from pdreg.testing import wait_until

WAIT_S = 60.0


@pytest.fixture
def cluster() -> Iterator[RoleArgsCluster]:
    cluster = RoleArgsCluster(ClusterConfig(backend="sim", log_level="WARNING"),
                              {"decode": ("--max-running", "3")})
    try:
        cluster.start_registry()
        yield cluster
    finally:
        cluster.stop_all()
        cluster.remove_logs()


def test_the_hook_drives_the_scaler_which_starts_and_drains_engines(
        cluster: RoleArgsCluster) -> None:
    requests = cluster.log_dir / "scale-requests"
    requests.touch()
    scaler = Scaler(cluster, requests).start()
    try:
        # Exactly what the planner runs: CMD split like a shell would, then MODEL ROLE N.
        hook = [*shlex.split(hook_command(requests)), "tiny", "decode", "2"]
        assert subprocess.run(hook, timeout=10).returncode == 0
        assert wait_until(lambda: scaler.serving() == (0, 2), WAIT_S)
        decodes = cluster.engine_ids("decode")
        assert "--max-running" in " ".join(cluster.engines[decodes[0]].proc.args)
        subprocess.run([*hook[:-1], "1"], timeout=10, check=True)
        assert wait_until(lambda: scaler.serving() == (0, 1), WAIT_S)
        assert cluster.engine_ids("decode") == decodes[:1]  # the newest went
        assert wait_until(lambda: any(e.what == "exited" for e in scaler.events), WAIT_S)
        seconds = scaler.engine_seconds()
        assert seconds > 0
        assert scaler.engine_seconds(until=scaler.events[0].at) < seconds
    finally:
        scaler.close()
    whats = [e.what for e in scaler.events]
    assert whats.count("asked") == 2 and whats.count("ready") == 2 and "stopping" in whats


def test_attainment_counts_failures_as_misses() -> None:
    outcomes = [Outcome("p", 0, 1, 0.2, 0.02, True), Outcome("p", 0, 1, 2.0, 0.02, True),
                Outcome("p", 0, 1, 0.3, 0.09, True), Outcome("p", 0, 1, None, None, False)]
    result = attainment(outcomes, ttft_slo_s=1.0, itl_slo_s=0.05)
    assert (result.requests, result.failed) == (4, 1)
    assert (result.ttft, result.itl, result.both) == (0.5, 0.5, 0.25)
    assert attainment([], 1.0, 0.05).requests == 0


def test_phase_rates_ramp_linearly() -> None:
    ramp = Phase("up", 10.0, 1.0, 6.0)
    assert [ramp.rate_at(t) for t in (0, 5, 10, 20)] == [1.0, 3.5, 6.0, 6.0]
    assert ramp.rate_text == "1->6/s" and Phase("flat", 5, 2, 2).rate_text == "2/s"
