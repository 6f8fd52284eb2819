"""The sidecar reads an engine's KV events endpoints from its own command line."""

from __future__ import annotations

import json

import pytest

from engine_agent.kv_config import kv_events_from_command
from wire.protocol import KvEventsSpec

CONFIG = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                     "topic": "kv"})


@pytest.mark.parametrize(("command", "expected"), [
    (["vllm", "serve", "/models/tiny", "--block-size", "128", "--kv-events-config", CONFIG],
     KvEventsSpec("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv", 128, "vllm:sha256",
                  "/models/tiny")),
    (["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m",
      "--tokenizer", "/t", "--prefix-caching-hash-algo", "sha256_cbor",
      f"--kv-events-config={CONFIG}"],
     KvEventsSpec("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv", 0, "vllm:sha256_cbor",
                  "/t")),
    # vLLM's defaults: endpoint tcp://*:5557, no replay, topic "".
    (["vllm", "serve", "m", "--kv-events-config", '{"enable_kv_cache_events": true}'],
     KvEventsSpec("tcp://10.0.0.5:5557", "", "", 0, "vllm:sha256", "m")),
    (["vllm", "serve", "m"], None),
    (["vllm", "serve", "m", "--kv-events-config", '{"enable_kv_cache_events": false}'], None),
    (["vllm", "serve", "m", "--kv-events-config", "{not json"], None),
    # A publisher that connects out cannot be subscribed to.
    (["vllm", "serve", "m", "--kv-events-config",
      '{"enable_kv_cache_events": true, "endpoint": "tcp://collector:5557"}'], None),
    (["vllm", "serve", "m", "--kv-events-config",
      '{"enable_kv_cache_events": true, "publisher": "null"}'], None),
])
def test_vllm_command_lines(command, expected):
    assert kv_events_from_command(command, "10.0.0.5", "vllm") == expected


def test_sglang_command_line():
    command = ["python", "-m", "sglang.launch_server", "--model-path", "/models/x",
               "--page-size", "16", "--kv-events-config", CONFIG]
    spec = kv_events_from_command(command, "10.0.0.5", "sglang")
    assert spec == KvEventsSpec("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv", 16,
                                "sglang", "/models/x")
    # SGLang 0.5: no enable flag, the publisher says it ("null" by default); `bind` may
    # bind a concrete address.
    sglang_config = json.dumps({"publisher": "zmq", "endpoint": "tcp://10.0.0.7:6000",
                                "bind": True})
    spec = kv_events_from_command([*command[:-1], sglang_config], "10.0.0.5", "sglang")
    assert spec is not None and spec.endpoint == "tcp://10.0.0.7:6000"
    off = json.dumps({"endpoint": "tcp://*:6000"})
    assert kv_events_from_command([*command[:-1], off], "10.0.0.5", "sglang") is None


def test_the_block_size_an_engine_reports_wins_over_its_flags():
    """SGLang's /server_info says what its events carry (the page size it settled on,
    1 on CPU whatever the flags); without it, the flag; without either, 0 (learnt)."""
    command = ["python", "-m", "sglang.launch_server", "--model-path", "/models/x",
               "--kv-events-config", CONFIG]
    spec = kv_events_from_command(command, "10.0.0.5", "sglang", reported_block_size=1)
    assert spec is not None and spec.block_size == 1
    spec = kv_events_from_command([*command, "--page-size", "16"], "10.0.0.5", "sglang", 1)
    assert spec is not None and spec.block_size == 1
    spec = kv_events_from_command([*command, "--page-size", "16"], "10.0.0.5", "sglang")
    assert spec is not None and spec.block_size == 16
    spec = kv_events_from_command(command, "10.0.0.5", "sglang")
    assert spec is not None and spec.block_size == 0
