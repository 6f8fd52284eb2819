"""Parsing vLLM / SGLang /metrics into Load, and the probes against the stand-ins."""

from __future__ import annotations

import pytest

from engine_agent.probes import (
    SGLANG_GAUGES,
    VLLM_GAUGES,
    EngineKind,
    EngineProbe,
    Health,
    load_from_metrics,
)
from engine_agent.standins import StandinServer
from pdreg.testing import free_low_port
from registry.protocol import Load

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


@pytest.mark.parametrize(("text", "gauges", "model", "expected"), [
    (VLLM_TWO_ENGINES, VLLM_GAUGES, "tiny", Load(running=3, waiting=3, kv_usage=0.3)),
    (VLLM_TWO_ENGINES, VLLM_GAUGES, "", Load(running=12, waiting=3, kv_usage=0.3)),
    (VLLM_TWO_ENGINES, VLLM_GAUGES, "absent", Load()),
    (VLLM_OLD_CACHE_NAME, VLLM_GAUGES, "tiny", Load(running=1, kv_usage=0.5)),
    (SGLANG, SGLANG_GAUGES, "m", Load(running=4, waiting=2, kv_usage=1.0)),  # clamped
    ("", VLLM_GAUGES, "tiny", Load()),
])
def test_load_from_metrics(text: str, gauges: object, model: str, expected: Load) -> None:
    load = load_from_metrics(text, gauges, model)  # type: ignore[arg-type]
    assert (load.running, load.waiting) == (expected.running, expected.waiting)
    assert load.kv_usage == pytest.approx(expected.kv_usage)


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


def test_probe_refused_and_generic() -> None:
    probe = EngineProbe(EngineKind.GENERIC, f"http://127.0.0.1:{free_low_port()}")
    try:
        assert probe.health() is Health.REFUSED
        assert probe.load() is None
    finally:
        probe.close()
