"""End to end: operators see each member's KV index in the registry.

Real processes: the registry (in-process, real sockets), reference engines publishing KV
events, and `pdreg router --policy kv`, which registers and reports its index per member
(router/kv/reporter.py) over its agent's control link. `/v1/members`, the dashboard's
state and stream, and plain `pdreg status` show the member live with its blocks; after the
engine restarts they show the new incarnation's index, never the old one's blocks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from reference_helpers import EngineHandle, start_engine, start_engines

from pdreg.testing import die_with_parent, free_low_port, stop_process, wait_until
from registry.server import RegistryServer
from router.guard import LOOPBACK_ALLOW

WAIT_S = 60.0  # engines and routers start under load on a shared machine
PROMPT = ("You are a careful assistant. Answer in one short sentence, cite nothing, and "
          "never apologise. ") * 8 + "What is 2+2?"  # ~47 blocks of 16 tokens


@pytest.fixture
def router_url(registry: RegistryServer) -> Iterator[str]:
    """`pdreg router --policy kv`, registered with `registry`."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdreg", "router", "--registry", registry.control_address,
             "--port", "0", "--policy", "kv", "--drain-delay", "0.1", "--drain-timeout", "2",
             "--allow-upstream", LOOPBACK_ALLOW],
            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert b'"ready"' in line, line
            yield json.loads(line)["url"]
        finally:
            stop_process(proc, 10)
            if proc.stdout is not None:
                proc.stdout.close()
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-3000:])  # shown on failure


def members(registry: RegistryServer) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(f"{registry.http_url}/v1/members").json()}


def kv_of(registry: RegistryServer, member_id: str) -> dict[str, Any] | None:
    member = members(registry).get(member_id)
    return member.get("kv_index") if member else None


def first_stream_state(registry: RegistryServer) -> dict[str, Any]:
    with httpx.stream("GET", f"{registry.http_url}/v1/stream", timeout=10) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                return json.loads(line.removeprefix("data: "))
    raise AssertionError("the stream ended without a state")


def test_the_registry_shows_each_members_kv_index_and_a_restart(
        registry: RegistryServer, router_url: str, handles: list[EngineHandle]) -> None:
    control = registry.control_address
    port = free_low_port()
    prefill, decode = start_engines([
        {"role": "prefill", "registry": control,
         "extra_args": ["--kv-events", "--port", str(port)]},
        {"role": "decode", "registry": control, "extra_args": ["--no-kv-events"]}])
    handles += [prefill, decode]
    # The router follows the prefill's events and says so: live, nothing cached yet.
    assert wait_until(lambda: (kv_of(registry, prefill.id) or {}).get("state") == "live",
                      WAIT_S)
    assert kv_of(registry, decode.id) is None  # started with --no-kv-events
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    response = httpx.post(router_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert wait_until(lambda: (kv_of(registry, prefill.id) or {}).get("blocks", 0) > 40,
                      WAIT_S)
    shown = kv_of(registry, prefill.id)
    assert shown is not None and shown["state"] == "live" and shown["routers"] == {"live": 1}
    blocks_before = shown["blocks"]

    # The dashboard's state and its stream carry it; plain `pdreg status` shows it.
    state = httpx.get(f"{registry.http_url}/v1/dashboard").json()
    card = next(m for m in state["members"] if m["id"] == prefill.id)
    assert card["kv_index"]["state"] == "live" and card["kv_index"]["blocks"] > 40
    streamed = next(m for m in first_stream_state(registry)["members"]
                    if m["id"] == prefill.id)
    assert streamed["kv_index"]["blocks"] > 40
    table = subprocess.run([sys.executable, "-m", "pdreg", "status", "--registry", control],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert "KV INDEX" in table.splitlines()[0]
    row = next(line for line in table.splitlines() if line.startswith(prefill.id))
    assert f"live {blocks_before} blocks" in row

    # The prefill restarts (same id, new incarnation, empty cache): what is shown is the
    # new incarnation's index, never the old one's blocks.
    old_incarnation = members(registry)[prefill.id]["incarnation"]
    prefill.stop(timeout_s=10)
    restarted = start_engine(role="prefill", registry=control,
                             extra_args=["--kv-events", "--port", str(port)])
    handles.append(restarted)
    assert restarted.id == prefill.id

    def new_index() -> dict[str, Any] | None:
        member = members(registry).get(prefill.id)
        if member is None or member["incarnation"] == old_incarnation:
            return None
        return member.get("kv_index")

    assert wait_until(lambda: new_index() is not None, WAIT_S)
    first = new_index()
    assert first is not None and first["blocks"] < blocks_before
    assert wait_until(lambda: (new_index() or {}).get("state") == "live", WAIT_S)
    assert new_index()["blocks"] < blocks_before
    metrics = httpx.get(f"{registry.http_url}/metrics").text
    assert 'pdreg_kv_index_reports_total{result="accepted"}' in metrics
