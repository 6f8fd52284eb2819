"""A reference engine registers itself with a real registry, reports its real load, and
on SIGTERM drains (DRAINING while work is in flight), says bye and exits 0."""

from __future__ import annotations

import signal
import threading

import httpx
from reference_helpers import BodyFor, start_engine

from pdreg.testing import wait_until
from registry.server import RegistryServer
from wire.protocol import MemberState, Role


def test_engine_registers_reports_load_and_drains(registry: RegistryServer) -> None:
    engine = start_engine(role="prefill", backend="sim", protocol="sglang",
                          registry=registry.control_address,
                          extra_args=["--sim-decode-delay", "0.02", "--max-running", "4",
                                      "--label", "zone=a"])
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
        engine.url + "/v1/completions", json=BodyFor.slow(60), timeout=30)))
    try:
        assert wait_until(lambda: engine.id in registry.members() and registry.members()[
            engine.id].state is MemberState.READY, 15), engine.log()
        spec = registry.members()[engine.id].spec
        assert (spec.role, spec.model, spec.protocol) == (Role.PREFILL, "tiny", "sglang")
        assert spec.endpoints.http == engine.url
        assert (spec.endpoints.kv_host, spec.endpoints.kv_port,
                spec.endpoints.bootstrap_port) == ("127.0.0.1", engine.kv_port,
                                                   engine.bootstrap_port)
        assert spec.capacity == 4 and spec.labels == {"zone": "a"}

        thread.start()  # 60 tokens x 20 ms: in flight for about a second
        assert wait_until(lambda: registry.members()[engine.id].load.running == 1, 10)
        engine.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: engine.id not in registry.members() or registry.members()[
            engine.id].state is MemberState.DRAINING, 10)
        thread.join(30)
        assert engine.proc.wait(30) == 0
        assert wait_until(lambda: engine.id not in registry.members(), 10)
    finally:
        engine.stop()
    assert result["r"].status_code == 200
    assert len(result["r"].json()["choices"][0]["token_ids"]) == 60
