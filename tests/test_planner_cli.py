"""`pdreg planner` and `pdreg plan` as an operator runs them: a real registry, members
registered by real agents, a real HTTP server answering like a router, the planner as a
process that registers itself and calls its --exec hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from planner_helpers import FakeRouterMetrics

from engine_agent.agent import Agent
from pdreg import cli
from pdreg.testing import die_with_parent, stop_process, wait_until
from registry.security import ServerCurve, generate_keys
from registry.server import RegistryConfig, RegistryServer
from wire.protocol import Endpoints, Load, MemberSpec, MemberState, Role

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


def pdreg(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`pdreg ARGS` in this process (the planner under test is another process)."""
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


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
        registry: RegistryServer, fleet: FakeRouterMetrics, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
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
            return pdreg(capsys, "plan", "--registry", registry.control_address)[1]
        def tiny_rows() -> dict[str, list[str]]:
            return {line.split()[1]: line.split() for line in table().splitlines()
                    if line.startswith("tiny ")}
        # (while its view syncs, the table says "no prefill or decode is registered")
        assert wait_until(lambda: "prefill" in tiny_rows(), WAIT_S)
        rows = tiny_rows()
        assert rows["prefill"][2:4] == ["1", "3"]  # (4 + 4) / 4 = 2.0 vs 0.7: ceil(2.86)
        assert rows["decode"][2:4] == ["1", "1"]
        plan = json.loads(pdreg(capsys, "plan", "--registry", registry.control_address,
                                "--json")[1])
        prefill = next(d for d in plan["decisions"] if d["role"] == "prefill")
        assert prefill["reason"] == "utilization" and "waiting 4" in prefill["why"]
        assert wait_until(lambda: calls.exists() and calls.read_text(), WAIT_S)
        assert calls.read_text().splitlines() == ["tiny prefill 3"]
        direct = pdreg(capsys, "plan", "--planner", ready["url"])[1]
        assert "tiny" in direct and "NOW" in direct
    finally:
        code = stop_process(proc, 20.0)
    assert code == 0
    assert wait_until(lambda: planner_id not in registry.members(), WAIT_S)


def test_plan_without_a_planner_says_how_to_start_one(
        registry: RegistryServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = pdreg(capsys, "plan", "--registry", registry.control_address)
    assert code == 1
    assert "no planner is registered" in err and "pdreg planner" in err


def test_planner_refuses_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = pdreg(capsys, "planner", "--min-decode", "5", "--max-decode", "2",
                         "--no-register")
    assert code == 2 and "min" in err
    with pytest.raises(SystemExit) as exit_info:
        pdreg(capsys, "planner", "--ttft-slo", "-1")
    assert exit_info.value.code == 2 and "positive" in capsys.readouterr().err


# --- credentials --------------------------------------------------------------------------


@pytest.fixture
def secure_registry(tmp_path: Path) -> Iterator[tuple[RegistryServer, dict[str, str]]]:
    """A registry with CURVE (one allowed client key) and a fleet token; the environment
    a client's Secret would give it."""
    for name in ("registry", "client"):
        generate_keys(tmp_path, name)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "client.key").write_bytes((tmp_path / "client.key").read_bytes())
    server = RegistryServer(RegistryConfig(
        port=0, events_port=0, http_port=0, heartbeat_interval_s=0.2, lease_s=1.0,
        token="fleet-token",
        curve=ServerCurve.from_files(tmp_path / "registry.key_secret", allowed))).start()
    env = {**os.environ, "PDREG_TOKEN": "fleet-token",
           "PDREG_REGISTRY_PUBLIC_KEY": str(tmp_path / "registry.key"),
           "PDREG_CURVE_KEY": str(tmp_path / "client.key_secret")}
    try:
        yield server, env
    finally:
        server.close()


def start_planner(address: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], dict]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "--log-level", "WARNING", "planner", "--registry",
         address, "--port", "0", "--interval", "0.2"], stdout=subprocess.PIPE, text=True,
        env=env, preexec_fn=die_with_parent)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def test_planner_takes_the_fleet_token_and_curve_keys_like_every_client(
        secure_registry: tuple[RegistryServer, dict[str, str]],
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    registry, env = secure_registry
    proc, ready = start_planner(registry.control_address, env)
    try:
        assert wait_until(lambda: ready["id"] in registry.members(), WAIT_S)
        for name in ("PDREG_REGISTRY_PUBLIC_KEY", "PDREG_CURVE_KEY"):
            monkeypatch.setenv(name, env[name])
        code, out, err = pdreg(capsys, "plan", "--registry", registry.control_address,
                               "--json")
        assert code == 0, err
        assert json.loads(out)["decisions"] == []
        # Its HTTP face only reads: nothing a stranger sends changes a decision.
        for method in ("POST", "PUT", "DELETE"):
            assert httpx.request(method, f"{ready['url']}/v1/plan").status_code == 405
    finally:
        assert stop_process(proc, 20.0) == 0


def test_a_planner_without_the_fleet_token_is_not_registered(
        secure_registry: tuple[RegistryServer, dict[str, str]],
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    registry, env = secure_registry
    proc, ready = start_planner(registry.control_address, {**env, "PDREG_TOKEN": "wrong"})
    try:
        assert not wait_until(lambda: ready["id"] in registry.members(), 1.5)
        for name in ("PDREG_REGISTRY_PUBLIC_KEY", "PDREG_CURVE_KEY"):
            monkeypatch.setenv(name, env[name])
        code, _, err = pdreg(capsys, "plan", "--registry", registry.control_address)
        assert code == 1 and "no planner is registered" in err
    finally:
        stop_process(proc, 20.0)
