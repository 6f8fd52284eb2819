"""The planner against real routers configured as the manifests configure them: `pdreg
router --metrics-port` (its /metrics on a port of its own, 404 on the API port) beside an
older-style router without it, and `pdreg planner`, all real processes around a real
registry. The planner reads what each router advertises; a router killed mid-run is left
out and the other decides; with none readable, nothing scales down."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from engine_agent.agent import Agent
from pdreg.testing import die_with_parent, stop_process, wait_until
from registry.server import RegistryServer
from wire.protocol import Endpoints, Load, MemberSpec, MemberState, Role

WAIT_S = 30.0
STALE_AFTER_S = 1.0


@dataclass
class Started:
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def pdreg(self, *args: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
        """`pdreg ARGS` as a process; returns it and its JSON 'ready' line."""
        proc = subprocess.Popen([sys.executable, "-m", "pdreg", "--log-level", "INFO", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                preexec_fn=die_with_parent)
        self.procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"pdreg {' '.join(args)} exited with {proc.wait()}"
        return proc, json.loads(line)


@pytest.fixture
def started() -> Iterator[Started]:
    every = Started()
    try:
        yield every
    finally:
        for proc in every.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in every.procs:
            stop_process(proc, 20.0)


@dataclass
class Busy:
    load: Load = field(default_factory=lambda: Load(running=4, waiting=4))


def engine(registry: RegistryServer, member_id: str, role: Role, busy: Busy) -> Agent:
    spec = MemberSpec(id=member_id, incarnation=time.time_ns(), role=role, model="tiny",
                      protocol="vllm-nixl", endpoints=Endpoints(http="http://127.0.0.1:9"),
                      capacity=4)
    return Agent(spec, registries=registry.control_address, load=lambda: busy.load,
                 state=MemberState.READY).start()


def planner_figures(url: str) -> tuple[dict[str, Any], str]:
    plan = httpx.get(f"{url}/v1/plan", timeout=5.0).json()
    return plan, httpx.get(f"{url}/metrics", timeout=5.0).text


def routers_standing(text: str) -> dict[str, float]:
    return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("pdreg_planner_routers{")}


def decided(url: str, prefill: int, *, holding: bool, read: int, left_out: int) -> bool:
    """The planner at URL asks for PREFILL prefills (holding or not), with READ routers
    read and LEFT_OUT left out."""
    plan, text = planner_figures(url)
    rows = {d["role"]: d for d in plan["decisions"]}
    standing = routers_standing(text)
    return ("prefill" in rows and rows["prefill"]["desired"] == prefill
            and rows["prefill"]["holding"] is holding
            and standing.get("read") == read and standing.get("left_out") == left_out)


def ticks(url: str) -> float:
    text = planner_figures(url)[1]
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("pdreg_planner_ticks_total")))


def check_advertised(registry: RegistryServer, split: dict[str, Any],
                     plain: dict[str, Any]) -> None:
    """The router with --metrics-port advertises where its page is, and its API port
    serves none; the other advertises nothing: its page is on its API port."""
    advertised = registry.members()[split["id"]].spec.endpoints.metrics
    assert advertised.startswith("http://127.0.0.1:") and advertised.endswith("/metrics")
    assert advertised != f"{split['url']}/metrics"
    assert httpx.get(f"{split['url']}/metrics", timeout=5.0).status_code == 404
    assert "pdreg_router_requests" in httpx.get(advertised, timeout=5.0).text
    assert registry.members()[plain["id"]].spec.endpoints.metrics == ""
    assert "pdreg_router_requests" in httpx.get(f"{plain['url']}/metrics", timeout=5.0).text


def test_planner_scrapes_what_routers_advertise_and_leaves_out_the_dead(
        registry_factory: Any, started: Started) -> None:
    # A long lease: a killed router stays a member (registered, unreadable), as one
    # behind a NetworkPolicy that drops the planner would.
    registry = registry_factory(lease_s=120.0)
    address = registry.control_address
    split, split_ready = started.pdreg("router", "--registry", address, "--port", "0",
                                       "--metrics-port", "0", "--drain-delay", "0")
    plain, plain_ready = started.pdreg("router", "--registry", address, "--port", "0",
                                       "--drain-delay", "0")
    busy = Busy()
    agents = [engine(registry, "prefill-a", Role.PREFILL, busy),
              engine(registry, "decode-a", Role.DECODE, Busy(Load()))]
    try:
        assert wait_until(lambda: {split_ready["id"], plain_ready["id"]}
                          <= set(registry.members()), WAIT_S)
        check_advertised(registry, split_ready, plain_ready)
        planner, planner_ready = started.pdreg(
            "planner", "--registry", address, "--port", "0", "--interval", "0.2",
            "--scale-down-window", "0", "--router-stale-after", str(STALE_AFTER_S))
        url = planner_ready["url"]
        # Both routers read, nothing held: (4 + 4) / 4 = 2.0 vs 0.7 -> 3 prefills.
        assert wait_until(lambda: decided(url, 3, holding=False, read=2, left_out=0),
                          WAIT_S), planner_figures(url)
        assert not planner_figures(url)[0]["problems"]

        # The router with the metrics port dies: left out past the bound; the other
        # decides, and the idle fleet scales down on its word.
        split.send_signal(signal.SIGKILL)
        busy.load = Load()
        assert wait_until(lambda: decided(url, 1, holding=False, read=1, left_out=1),
                          WAIT_S), planner_figures(url)
        problems = planner_figures(url)[0]["problems"]
        assert any(split_ready["id"] in p for p in problems), problems

        # Load again, then the last router dies: while busy the rule still asks for 3
        # (up is allowed); once idle, the count is held, round after round.
        busy.load = Load(running=4, waiting=4)
        assert wait_until(lambda: decided(url, 3, holding=False, read=1, left_out=1), WAIT_S)
        plain.send_signal(signal.SIGKILL)
        assert wait_until(lambda: decided(url, 3, holding=False, read=0, left_out=2), WAIT_S)
        busy.load = Load()
        assert wait_until(lambda: decided(url, 3, holding=True, read=0, left_out=2),
                          WAIT_S), json.dumps(planner_figures(url)[0]["decisions"])
        prefill = next(d for d in planner_figures(url)[0]["decisions"]
                       if d["role"] == "prefill")
        assert "no scale-down" in prefill["why"], prefill
        later = ticks(url) + 5
        assert wait_until(lambda: ticks(url) >= later, WAIT_S)
        assert decided(url, 3, holding=True, read=0, left_out=2)
        planner.send_signal(signal.SIGTERM)
        assert stop_process(planner, 20.0) == 0
    finally:
        for agent in agents:
            agent.stop()
