"""Parsing vLLM / SGLang /metrics into Load, and the probes against the stand-ins."""

from __future__ import annotations

import pytest

from engine_agent.probes import (
    SGLANG_GAUGES,
    VLLM_GAUGES,
    EngineKind,
    EngineProbe,
    Health,
    in_flight_from_metrics,
    load_from_metrics,
    load_from_sglang_loads,
)
from engine_agent.standins import StandinServer
from pdreg.testing import free_low_port
from wire.protocol import Load

VLLM_TWO_ENGINES = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
vllm:num_requests_running{engine="0",model_name="other"} 9.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.4
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 5.0
"""
VLLM_OLD_CACHE_NAME = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny"} 1.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="tiny"} 0.5
"""
SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 4.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 2.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m",tp_rank="0"} 1.5
"""
# Real SGLang 0.5.23 prefill (--enable-metrics) while 8 P/D requests ran, trimmed: the
# hand-off queues hold requests that are in neither running nor queue, and the open POSTs
# count live while the scheduler's gauges wait for the next batch to refresh.
PREFILL_LABELS = '{engine_type="prefill",model_name="tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"}'
SGLANG_PREFILL = """\
# HELP sglang:http_requests_active Number of currently active HTTP requests
# TYPE sglang:http_requests_active gauge
sglang:http_requests_active{endpoint="/v1/completions",method="POST"} 8.0
sglang:http_requests_active{endpoint="/metrics",method="GET"} 1.0
sglang:http_requests_active{endpoint="/health",method="GET"} 0.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{L} 1.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{L} 0.0
# TYPE sglang:token_usage gauge
sglang:token_usage{L} 0.02
# TYPE sglang:num_prefill_bootstrap_queue_reqs gauge
sglang:num_prefill_bootstrap_queue_reqs{L} 5.0
# TYPE sglang:num_prefill_inflight_queue_reqs gauge
sglang:num_prefill_inflight_queue_reqs{L} 1.0
# TYPE sglang:num_decode_prealloc_queue_reqs gauge
sglang:num_decode_prealloc_queue_reqs{L} 0.0
""".replace("{L}", PREFILL_LABELS)
# A scheduler that stopped (or has not reached a batch boundary yet): its gauges say 0,
# the HTTP server holds 3 generation requests open.
SGLANG_STUCK = """\
# TYPE sglang:http_requests_active gauge
sglang:http_requests_active{endpoint="/generate",method="POST"} 3.0
sglang:http_requests_active{endpoint="/metrics",method="GET"} 1.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{L} 0.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{L} 0.0
""".replace("{L}", PREFILL_LABELS)
# --enable-priority-scheduling: the total under priority="", a breakdown beside it.
SGLANG_PRIORITY = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",priority="",tp_rank="0"} 3.0
sglang:num_running_reqs{model_name="m",priority="0",tp_rank="0"} 1.0
sglang:num_running_reqs{model_name="m",priority="5",tp_rank="0"} 2.0
"""


@pytest.mark.parametrize(("text", "gauges", "model", "expected"), [
    (VLLM_TWO_ENGINES, VLLM_GAUGES, "tiny", Load(running=3, waiting=3, kv_usage=0.3)),
    (VLLM_TWO_ENGINES, VLLM_GAUGES, "", Load(running=12, waiting=3, kv_usage=0.3)),
    (VLLM_TWO_ENGINES, VLLM_GAUGES, "absent", Load()),
    (VLLM_OLD_CACHE_NAME, VLLM_GAUGES, "tiny", Load(running=1, kv_usage=0.5)),
    (SGLANG, SGLANG_GAUGES, "m", Load(running=4, waiting=2, kv_usage=1.0)),  # clamped
    # 8 open POSTs, 1 running: 7 wait somewhere (6 in the hand-off queues the gauges show)
    (SGLANG_PREFILL, SGLANG_GAUGES, "tiny", Load(running=1, waiting=7, kv_usage=0.02)),
    (SGLANG_PREFILL.replace("} 8.0", "} 2.0"), SGLANG_GAUGES, "tiny",
     Load(running=1, waiting=6, kv_usage=0.02)),  # gauges above the open POSTs: they stand
    (SGLANG_STUCK, SGLANG_GAUGES, "tiny", Load(waiting=3)),
    (SGLANG_PRIORITY, SGLANG_GAUGES, "m", Load(running=3)),
    ("", VLLM_GAUGES, "tiny", Load()),
])
def test_load_from_metrics(text: str, gauges: object, model: str, expected: Load) -> None:
    load = load_from_metrics(text, gauges, model)  # type: ignore[arg-type]
    assert (load.running, load.waiting) == (expected.running, expected.waiting)
    assert load.kv_usage == pytest.approx(expected.kv_usage)


@pytest.mark.parametrize(("text", "gauges", "expected"), [
    (SGLANG_PREFILL, SGLANG_GAUGES, 8),  # the open POSTs: more than the stale gauges say
    (SGLANG_PREFILL.replace("} 8.0", "} 2.0"), SGLANG_GAUGES, 7),  # gauges: 1 + 6 queued
    (VLLM_TWO_ENGINES, VLLM_GAUGES, 6),  # running + waiting of model "tiny"
])
def test_in_flight_from_metrics(text: str, gauges: object, expected: int) -> None:
    assert in_flight_from_metrics(text, gauges, "tiny") == expected  # type: ignore[arg-type]


def test_load_from_sglang_loads_sums_ranks_and_handoff_queues() -> None:
    body = {"loads": [
        {"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 1, "token_usage": 0.5,
         "disaggregation": {"mode": "decode", "decode_prealloc_queue_reqs": 3,
                            "decode_transfer_queue_reqs": 1}},
        {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": 0.1,
         "disaggregation": None},
    ]}
    load = load_from_sglang_loads(body)
    assert (load.running, load.waiting) == (3, 5)
    assert load.kv_usage == pytest.approx(0.3)


def test_sglang_probe_without_metrics_reads_v1_loads() -> None:
    with StandinServer("sglang", model="tiny", metrics=False,
                       disaggregation_mode="decode") as engine:
        engine.state.running, engine.state.queued, engine.state.kv_usage = 2, 3, 0.4
        probe = EngineProbe(EngineKind.SGLANG, engine.url, model="tiny")
        try:
            assert probe.load() == Load(running=2, waiting=3, kv_usage=0.4)
            assert probe.in_flight() == 5
        finally:
            probe.close()


def test_sglang_readiness_comes_from_ready_not_the_slow_health() -> None:
    """Real SGLang's /health holds every answer a second (it runs a generation); /ready
    answers at once and says 503 during warm-up just the same."""
    with StandinServer("sglang", model="tiny") as engine:
        probe = EngineProbe(EngineKind.SGLANG, engine.url, model="tiny")
        try:
            engine.state.healthy = False  # warming up
            assert probe.health() is Health.FAILING
            engine.state.healthy = True
            assert probe.health() is Health.OK
            assert (engine.hits["/ready"], engine.hits["/health"]) == (2, 0)
        finally:
            probe.close()


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_probe_reads_standin(kind: str) -> None:
    with StandinServer(kind, model="tiny", bootstrap_port=9000) as engine:
        probe = EngineProbe(EngineKind(kind), engine.url, model="tiny")
        try:
            engine.state.running, engine.state.waiting, engine.state.kv_usage = 5, 1, 0.75
            assert probe.health() is Health.OK
            assert probe.load() == Load(running=5, waiting=1, kv_usage=0.75)
            metadata = probe.metadata()
            assert metadata is not None and metadata.model == "tiny"
            if kind == "sglang":
                assert metadata.bootstrap_port == 9000
            engine.state.healthy = False
            assert probe.health() is Health.FAILING
        finally:
            probe.close()


@pytest.mark.parametrize(("kv_events", "expected"), [
    # As real SGLang 0.5.23 on CPU answers with --kv-events-config (docs/engines.md §9).
    ({"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 23983, "topic": "kv",
      "block_size": 1, "dp_size": 1, "replay_endpoint_port_base": 25249}, 1),
    ({"block_size": 64}, 64),
    (None, 0),  # events off: no kv_events block
    ({"block_size": True}, 0), ({"block_size": "16"}, 0), ({"block_size": 0}, 0),
    ({"block_size": -1}, 0), ({"block_size": 10**6}, 0), (["block_size", 1], 0),
])
def test_sglang_metadata_reads_the_kv_events_block_size(kv_events: object,
                                                        expected: int) -> None:
    """The page size SGLang's events carry, from /server_info; anything odd: not known."""
    with StandinServer("sglang", model="tiny") as engine:
        engine.kv_events = kv_events  # type: ignore[assignment]
        probe = EngineProbe(EngineKind.SGLANG, engine.url, model="tiny")
        try:
            metadata = probe.metadata()
            assert metadata is not None and metadata.kv_block_size == expected
        finally:
            probe.close()


def test_probe_refused_and_generic() -> None:
    probe = EngineProbe(EngineKind.GENERIC, f"http://127.0.0.1:{free_low_port()}")
    try:
        assert probe.health() is Health.REFUSED
        assert probe.load() is None
    finally:
        probe.close()
