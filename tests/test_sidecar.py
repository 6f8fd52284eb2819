"""The sidecar as a real subprocess (`python -m pdreg agent ...`) against stand-in engines
that follow vLLM's and SGLang's /health and /metrics contracts, and a real registry."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from engine_agent.standins import StandinServer
from pdreg.testing import (
    die_with_parent,
    free_low_port,
    kill_marked,
    marked_pids,
    stop_process,
    wait_until,
)
from registry.server import RegistryServer
from wire.protocol import MemberRecord, MemberState

INTERVAL_S = 0.2
TIMEOUT_S = 15.0  # generous: subprocess start on a loaded 2-core machine
EXIT_TIMEOUT_S = 15.0
KILL_GRACE_S = 3.0  # the sidecars' --kill-grace here
MARKER_ENV = "PDREG_TEST_SIDECAR_MARKER"  # finds a sidecar's whole process tree


@pytest.fixture
def registry(registry_factory: Callable[..., RegistryServer]) -> RegistryServer:
    return registry_factory(http_port=-1, heartbeat_interval_s=INTERVAL_S, lease_s=1.5)


class Sidecar:
    """One `pdreg agent` subprocess; `close()` makes sure it and its engine are gone."""

    def __init__(self, registry: RegistryServer, engine: str, engine_port: int,
                 args: list[str], command: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.engine_port = engine_port
        self.marker = uuid.uuid4().hex
        argv = [sys.executable, "-m", "pdreg", "agent", "--engine", engine,
                "--engine-url", f"http://127.0.0.1:{engine_port}",
                "--registry", registry.control_address, "--health-interval", "0.1",
                "--kill-grace", str(KILL_GRACE_S), *args]
        if command:
            argv += ["--", *command]
        self.process = subprocess.Popen(
            argv, env={**os.environ, **(env or {}), MARKER_ENV: self.marker},
            preexec_fn=die_with_parent)

    def tree(self) -> set[int]:
        """The sidecar's processes besides itself: engine, its children, the lifeline."""
        return set(marked_pids(MARKER_ENV, self.marker)) - {self.process.pid}

    def control(self, path: str, body: dict[str, object]) -> None:
        """Steer the stand-in engine (POST /standin/...)."""
        httpx.post(f"http://127.0.0.1:{self.engine_port}/standin/{path}", json=body,
                   timeout=5).raise_for_status()

    def close(self) -> None:
        stop_process(self.process, EXIT_TIMEOUT_S)  # drains, stops the engine, says bye
        kill_marked(MARKER_ENV, self.marker)  # anything a failed test left behind


@pytest.fixture
def sidecars() -> Iterator[list[Sidecar]]:
    started: list[Sidecar] = []
    try:
        yield started
    finally:
        for sidecar in started:
            sidecar.close()


def standin_command(kind: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "engine_agent.standins", "--kind", kind,
            "--port", str(port), "--model", "tiny", *extra]


def with_stubborn_helper(command: list[str]) -> list[str]:
    """The engine plus a helper process of its own that ignores SIGTERM (as an engine's
    worker might): `sleep` with SIGTERM ignored, then the engine exec'd in the shell."""
    return ["bash", "-c", "(trap '' TERM; exec sleep 600) & exec "
            + " ".join(shlex.quote(part) for part in command)]


def command_names(pids: set[int]) -> set[str]:
    names = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            names.add(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode())
    return {os.path.basename(name) for name in names}


def member(registry: RegistryServer, member_id: str) -> MemberRecord | None:
    return registry.members().get(member_id)


def test_vllm_ready_gating_load_health_and_sigterm_drain(
        registry: RegistryServer, sidecars: list[Sidecar]) -> None:
    port = free_low_port()
    nixl_port = free_low_port()
    sidecar = Sidecar(
        registry, "vllm", port, ["--role", "prefill", "--label", "zone=a",
                                 "--drain-timeout", "20"],
        command=standin_command("vllm", port, "--unhealthy",
                                "--lora-modules", "sql=/loras/sql", "chat=/loras/chat"),
        env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
             "VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_port)})
    sidecars.append(sidecar)
    member_id = f"prefill-127.0.0.1-{port}"

    # Registered from /v1/models while /health says 503: JOINING, never READY.
    assert wait_until(lambda: member(registry, member_id) is not None, TIMEOUT_S)
    record = member(registry, member_id)
    assert record is not None
    assert record.state is MemberState.JOINING
    assert record.spec.model == "tiny" and record.spec.protocol == "vllm-nixl"
    assert record.spec.max_model_len == 512  # its context, as /v1/models says it
    assert record.spec.adapters == ("sql", "chat")  # its LoRA cards in /v1/models
    assert record.spec.endpoints.http == f"http://127.0.0.1:{port}"
    assert (record.spec.endpoints.kv_host, record.spec.endpoints.kv_port) == (
        "127.0.0.1", nixl_port)
    assert record.spec.labels == {"zone": "a"}
    assert not wait_until(
        lambda: member(registry, member_id).state is MemberState.READY, 0.5)

    # Healthy -> READY, and /metrics load reaches the registry.
    sidecar.control("state", {"healthy": True, "running": 2, "waiting": 1, "kv_usage": 0.25})
    assert wait_until(lambda: member(registry, member_id).state is MemberState.READY,
                      TIMEOUT_S)
    assert wait_until(lambda: (member(registry, member_id).load.running,
                               member(registry, member_id).load.waiting,
                               member(registry, member_id).load.kv_usage) == (2, 1, 0.25),
                      TIMEOUT_S)

    # /health failing -> no longer READY; healthy again -> READY again.
    sidecar.control("state", {"healthy": False})
    assert wait_until(lambda: member(registry, member_id).state is MemberState.JOINING,
                      TIMEOUT_S)
    sidecar.control("state", {"healthy": True})
    assert wait_until(lambda: member(registry, member_id).state is MemberState.READY,
                      TIMEOUT_S)

    # SIGTERM: DRAINING while requests run; gone once they reach zero; exit 0.
    sidecar.process.send_signal(signal.SIGTERM)
    assert wait_until(lambda: member(registry, member_id).state is MemberState.DRAINING,
                      TIMEOUT_S)
    assert not wait_until(lambda: member(registry, member_id) is None, 0.5)
    assert sidecar.process.poll() is None
    sidecar.control("state", {"running": 0, "waiting": 0})
    assert wait_until(lambda: member(registry, member_id) is None, TIMEOUT_S)
    assert sidecar.process.wait(EXIT_TIMEOUT_S) == 0
    with pytest.raises(httpx.ConnectError):  # the engine was stopped too
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


def test_child_crash_says_bye_at_once_and_exits_with_its_code(
        registry_factory: Callable[..., RegistryServer], sidecars: list[Sidecar]) -> None:
    # A lease far beyond the test's waits: the member can only leave by its bye.
    registry = registry_factory(http_port=-1, heartbeat_interval_s=INTERVAL_S,
                                lease_s=4 * TIMEOUT_S)
    port = free_low_port()
    sidecar = Sidecar(registry, "sglang", port, ["--role", "decode"],
                      command=with_stubborn_helper(standin_command("sglang", port)))
    sidecars.append(sidecar)
    member_id = f"decode-127.0.0.1-{port}"
    assert wait_until(lambda: (m := member(registry, member_id)) is not None
                      and m.state is MemberState.READY, TIMEOUT_S)
    record = member(registry, member_id)
    assert record is not None and record.spec.protocol == "sglang"
    assert record.spec.endpoints.bootstrap_port == 0  # decode servers run no bootstrap

    sidecar.control("exit", {"code": 3})
    assert wait_until(lambda: member(registry, member_id) is None, TIMEOUT_S)
    # It said bye CRASHED the moment its engine exited (no lease could have run out).
    assert wait_until(lambda: registry.stats.departures["crashed"] == 1, TIMEOUT_S)
    assert set(registry.stats.departures) == {"crashed"}
    assert sidecar.process.wait(EXIT_TIMEOUT_S) == 3
    # The engine's own helper (it ignores SIGTERM) did not outlive the engine: the
    # sidecar ended what was left of its process group before exiting.
    assert sidecar.tree() == set()


def test_kill_9_of_the_sidecar_ends_the_engine_and_its_children(
        registry: RegistryServer, sidecars: list[Sidecar]) -> None:
    port = free_low_port()
    sidecar = Sidecar(registry, "sglang", port, ["--role", "decode"],
                      command=with_stubborn_helper(standin_command("sglang", port)))
    sidecars.append(sidecar)
    member_id = f"decode-127.0.0.1-{port}"
    assert wait_until(lambda: (m := member(registry, member_id)) is not None
                      and m.state is MemberState.READY, TIMEOUT_S)
    tree = sidecar.tree()
    assert {"sleep", os.path.basename(sys.executable)} <= command_names(tree), tree
    assert len(tree) == 3, command_names(tree)  # engine, its helper, the lifeline

    sidecar.process.kill()  # no drain, no bye: the sidecar just vanishes
    sidecar.process.wait()
    # The engine hears of it at once; its SIGTERM-proof helper after the kill grace.
    assert wait_until(lambda: not sidecar.tree(), KILL_GRACE_S + TIMEOUT_S), (
        command_names(sidecar.tree()))
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    assert wait_until(lambda: member(registry, member_id) is None, TIMEOUT_S)  # expired


def test_attach_to_running_sglang_prefill_reads_server_info(
        registry: RegistryServer, sidecars: list[Sidecar]) -> None:
    with StandinServer("sglang", port=free_low_port(), model="tiny",
                       bootstrap_port=free_low_port(),
                       disaggregation_mode="prefill") as engine:
        engine.state.running = 4
        engine.lora_modules = {"sql": "/loras/sql"}  # --lora-paths sql=/loras/sql
        sidecar = Sidecar(registry, "sglang", engine.port,
                          ["--role", "prefill", "--advertise-host", "localhost"])
        sidecars.append(sidecar)
        member_id = f"prefill-localhost-{engine.port}"
        assert wait_until(lambda: (m := member(registry, member_id)) is not None
                          and m.state is MemberState.READY and m.load.running == 4,
                          TIMEOUT_S)
        record = member(registry, member_id)
        assert record is not None
        assert record.spec.model == "tiny"
        # Its context and adapters, from /v1/models as SGLang lists them.
        assert record.spec.max_model_len == 512 and record.spec.adapters == ("sql",)
        assert record.spec.endpoints.http == f"http://localhost:{engine.port}"
        assert record.spec.endpoints.bootstrap_port == engine.bootstrap_port
        assert record.spec.endpoints.kv_host == "localhost"

        # SIGINT drains like SIGTERM. The scheduler's gauges say idle, but one request is
        # still open on the HTTP side (on real SGLang the gauges lag): the drain waits.
        engine.state.running, engine.state.http_active = 0, 1
        sidecar.process.send_signal(signal.SIGINT)
        assert wait_until(lambda: member(registry, member_id).state is MemberState.DRAINING,
                          TIMEOUT_S)
        assert not wait_until(lambda: member(registry, member_id) is None, 1.5)
        engine.state.http_active = 0
        assert wait_until(lambda: member(registry, member_id) is None, TIMEOUT_S)
        # An attached engine is left running.
        assert sidecar.process.wait(EXIT_TIMEOUT_S) == 0
        assert httpx.get(f"{engine.url}/health", timeout=2).status_code == 200


def test_bad_flags_exit_2_with_a_clear_message() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdreg", "agent", "--engine", "generic",
         "--engine-url", "http://127.0.0.1:1", "--role", "decode", "--model", "m"],
        capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "--protocol is required" in result.stderr


def test_a_vllm_decode_registers_its_kv_events(
        registry: RegistryServer, sidecars: list[Sidecar]) -> None:
    """A decode's KV events are registered like a prefill's: conditional disaggregation
    follows what the decode holds (docs/kv-routing.md)."""
    port = free_low_port()
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
              '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}')
    # The stand-in takes no --kv-events-config; the sidecar reads it from the command
    # line, so it rides there as the shell's unused positional arguments.
    engine = " ".join(shlex.quote(part) for part in standin_command("vllm", port))
    sidecar = Sidecar(registry, "vllm", port, ["--role", "decode"],
                      command=["bash", "-c", f"exec {engine}", "vllm",
                               "--kv-events-config", config])
    sidecars.append(sidecar)
    member_id = f"decode-127.0.0.1-{port}"
    assert wait_until(lambda: member(registry, member_id) is not None, TIMEOUT_S)
    record = member(registry, member_id)
    assert record is not None and record.spec.kv_events is not None
    assert record.spec.kv_events.endpoint == "tcp://127.0.0.1:5557"
    assert record.spec.kv_events.replay_endpoint == "tcp://127.0.0.1:5558"
