"""`pdreg planner` and `pdreg plan` as an operator runs them: a real registry, members
registered by real agents, a real HTTP server answering like a router, the planner as a
process that registers itself and calls its --exec hook."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from planner_helpers import FakeRouterMetrics

from engine_agent.agent import Agent
from pdreg.testing import die_with_parent, stop_process, wait_until
from registry.protocol import Endpoints, Load, MemberSpec, MemberState, Role
from registry.server import RegistryServer

READY_TIMEOUT_S = 60.0
WAIT_S = 20.0


def agent(registry: RegistryServer, member_id: str, role: Role, url: str, *,
          model: str = "tiny", protocol: str = "vllm-nixl", capacity: int = 0,
          load: Load | None = None) -> Agent:
    spec = MemberSpec(id=member_id, incarnation=time.time_ns(), role=role, model=model,
                      protocol=protocol, endpoints=Endpoints(http=url), capacity=capacity)
    figures = load or Load()
    return Agent(spec, registries=registry.control_address, load=lambda: figures,
                 state=MemberState.READY).start()


def pdreg(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdreg", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def fleet(registry: RegistryServer) -> Iterator[FakeRouterMetrics]:
    """One busy prefill, one idle decode, one router."""
    with FakeRouterMetrics() as router:
        agents = [
            agent(registry, "prefill-x", Role.PREFILL, "http://127.0.0.1:9001", capacity=4,
                  load=Load(running=4, waiting=4)),
            agent(registry, "decode-x", Role.DECODE, "http://127.0.0.1:9002", capacity=16),
            agent(registry, "router-x", Role.API_SERVER, router.url, model="",
                  protocol="openai"),
        ]
        try:
            yield router
        finally:
            for a in agents:
                a.stop()


def test_planner_registers_plans_calls_its_hook_and_leaves(
        registry: RegistryServer, fleet: FakeRouterMetrics, tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    hook = tmp_path / "hook.py"
    hook.write_text(f"import sys\nopen({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) "
                    "+ '\\n')\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "--log-level", "WARNING", "planner", "--registry",
         registry.control_address, "--port", "0", "--interval", "0.2",
         "--scale-down-window", "0", "--exec", f"{sys.executable} {hook}"],
        stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready"
        planner_id = ready["id"]
        assert wait_until(lambda: planner_id in registry.members(), WAIT_S)
        assert registry.members()[planner_id].spec.protocol == "pdreg-planner"

        # Found through the registry: the operator names only the registry.
        def table() -> str:
            return pdreg("plan", "--registry", registry.control_address).stdout
        assert wait_until(lambda: "prefill" in table(), WAIT_S)
        rows = {line.split()[1]: line.split() for line in table().splitlines()
                if line.startswith("tiny")}
        assert rows["prefill"][2:4] == ["1", "3"]  # (4 + 4) / 4 = 2.0 vs 0.7: ceil(2.86)
        assert rows["decode"][2:4] == ["1", "1"]
        plan = json.loads(pdreg("plan", "--registry", registry.control_address,
                                "--json").stdout)
        prefill = next(d for d in plan["decisions"] if d["role"] == "prefill")
        assert prefill["reason"] == "utilization" and "waiting 4" in prefill["why"]
        assert wait_until(lambda: calls.exists() and calls.read_text(), WAIT_S)
        assert calls.read_text().splitlines() == ["tiny prefill 3"]
        direct = pdreg("plan", "--planner", ready["url"]).stdout
        assert "tiny" in direct and "NOW" in direct
    finally:
        code = stop_process(proc, 20.0)
    assert code == 0
    assert wait_until(lambda: planner_id not in registry.members(), WAIT_S)


def test_plan_without_a_planner_says_how_to_start_one(registry: RegistryServer) -> None:
    result = pdreg("plan", "--registry", registry.control_address)
    assert result.returncode == 1
    assert "no planner is registered" in result.stderr and "pdreg planner" in result.stderr


def test_planner_refuses_bad_settings() -> None:
    result = pdreg("planner", "--min-decode", "5", "--max-decode", "2", "--no-register")
    assert result.returncode == 2 and "min" in result.stderr
    assert pdreg("planner", "--ttft-slo", "-1").returncode == 2
