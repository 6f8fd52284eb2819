"""The demo's scenario end to end: real processes on loopback, real traffic, sim engines.

The test runs the same `Scenario` as `pdreg demo` and asserts on what it recorded: no
failed request through scale-up, drain, kill -9 of a decode mid-answer (at least one of
its streams migrates),
registry restart and scale-down; new members get traffic within 1 s of being ready; the
dead member leaves the registry within the lease. Then `pdreg demo` itself is
interrupted with Ctrl-C and must leave no process behind.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdreg.demo.cluster import ClusterConfig
from pdreg.demo.display import TerminalDisplay
from pdreg.demo.scenario import (
    LEASE_MARGIN_S,
    READY_TO_TRAFFIC_LIMIT_S,
    Scenario,
    ScenarioConfig,
    StepResult,
)
from pdreg.testing import die_with_parent

REPO_ROOT = Path(__file__).resolve().parent.parent
LEASE_S = 2.0
SIM_ARGS = ("--sim-prefill-delay", "0.002", "--sim-decode-delay", "0.01")
INTERRUPT_TIMEOUT_S = 60.0


@pytest.fixture
def played() -> Iterator[tuple[Scenario, str]]:
    out = io.StringIO()
    scenario = Scenario(ScenarioConfig(cluster=ClusterConfig(
        backend="sim", heartbeat_interval_s=0.5, lease_s=LEASE_S, engine_args=SIM_ARGS,
        log_level="WARNING")), TerminalDisplay(out))
    try:
        scenario.play()
        yield scenario, out.getvalue()
    finally:
        scenario.close()
        scenario.cluster.remove_logs()
    assert not [p.name for p in scenario.cluster.processes() if p.alive]


def _step(scenario: Scenario, name: str) -> StepResult:
    return next(r for r in scenario.results if r.name == name)


@pytest.mark.timeout(180)
def test_scenario_holds_every_expectation(played: tuple[Scenario, str]) -> None:
    scenario, printed = played
    assert scenario.ok, printed
    # The whole scenario ran with security on, and the demo says so.
    assert "CURVE on (1 allowed client key), fleet token, admin token" in printed
    assert [r.name for r in scenario.results] == [s.name for s in scenario.steps] + ["summary"]

    for name in ("start", "scale_up", "drain_prefill", "kill_decode", "restart_registry",
                 "scale_down"):
        traffic = _step(scenario, name).traffic
        assert traffic is not None and traffic.failed == 0 and traffic.ok > 0, (name, printed)

    scale_up = _step(scenario, "scale_up").measures
    for role in ("prefill", "decode"):
        assert scale_up[f"ready_to_first_request_{role}_s"] <= READY_TO_TRAFFIC_LIMIT_S

    kill = _step(scenario, "kill_decode")
    assert kill.measures["kill_to_gone_s"] <= LEASE_S + LEASE_MARGIN_S
    assert scenario.kill_at is not None
    records = scenario.traffic.records() if scenario.traffic else []
    assert [r for r in records if not r.ok] == []
    # The decode was killed mid-answer: its streams continued on another decode, and
    # every client got its whole answer.
    assert kill.measures["failed_count"] == 0, printed
    assert kill.measures["migrated_count"] >= 1, printed
    assert {c.name for c in kill.checks if c.ok} >= {
        "its streams migrated to another decode", "no client request failed"}, printed

    assert _step(scenario, "restart_registry").measures["rejoin_s"] <= 5.0
    assert len(records) > 50
    assert "routable: 1 api_server, 1 decode, 1 prefill" in _step(scenario, "scale_down").table


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_process() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "--log-level", "WARNING", "demo", "--backend", "sim"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True, preexec_fn=die_with_parent)
    children: set[int] = set()
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + INTERRUPT_TIMEOUT_S
        for line in proc.stdout:  # the cluster is up once the demo says where it is
            if "The cluster is up" in line or time.monotonic() > deadline:
                break
        children = _children(proc.pid)
        assert len(children) >= 6, children  # registry, router, 4 engines
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=INTERRUPT_TIMEOUT_S)
        assert proc.returncode == 1, rest
        assert "interrupted" in rest
        still = {pid for pid in children if _alive(pid)}
        assert not still, f"orphans left: {still}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
