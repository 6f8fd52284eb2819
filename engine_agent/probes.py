"""Read an external engine's /health, /metrics and metadata (vLLM, SGLang, generic).

Each probe is a small synchronous HTTP client with short timeouts: the sidecar calls it
from its own loop, never from the agent's heartbeat thread.

Contracts followed (see /work/shared/notes/engines-and-peers.md):
- vLLM: GET /health -> 200 (503 when the engine is dead); /metrics gauges
  `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
  (older name `vllm:gpu_cache_usage_perc`), labels `model_name`, `engine`;
  GET /v1/models -> {"data": [{"id": ...}]}.
- SGLang: GET /health -> 200 or 503; /metrics gauges `sglang:num_running_reqs`,
  `sglang:num_queue_reqs`, `sglang:token_usage`; GET /server_info -> JSON with
  `model_path`, `served_model_name`, `disaggregation_bootstrap_port`, `tp_size`, `dp_size`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from registry.protocol import Load

__all__ = [
    "SGLANG_GAUGES",
    "VLLM_GAUGES",
    "EngineKind",
    "EngineMetadata",
    "EngineProbe",
    "GaugeNames",
    "Health",
    "load_from_metrics",
    "make_probe",
    "parse_gauges",
]

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0  # one /health or /metrics call; a hung engine must not stall the loop
CONNECT_TIMEOUT_S = 1.0


class EngineKind(enum.Enum):
    VLLM = "vllm"
    SGLANG = "sglang"
    GENERIC = "generic"


class Health(enum.Enum):
    OK = "ok"  # 200
    FAILING = "failing"  # answered, but not 200 (or timed out)
    REFUSED = "refused"  # nothing listens: the engine is down (or not up yet)


@dataclass(frozen=True, slots=True)
class GaugeNames:
    running: tuple[str, ...]  # first name present wins (newer first, older after)
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]


VLLM_GAUGES = GaugeNames(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
)
SGLANG_GAUGES = GaugeNames(
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_usage=("sglang:token_usage",),
)


@dataclass(frozen=True, slots=True)
class EngineMetadata:
    """What an engine says about itself; empty / 0 where it says nothing."""

    model: str = ""
    bootstrap_port: int = 0
    tp_size: int = 1
    dp_size: int = 1


Sample = tuple[dict[str, str], float]  # (labels, value)


def parse_gauges(text: str, names: Iterable[str]) -> dict[str, list[Sample]]:
    """Samples of the wanted metric names from Prometheus text; others are skipped."""
    wanted = set(names)
    found: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found


def _pick(samples: dict[str, list[Sample]], names: tuple[str, ...],
          model: str) -> list[float]:
    for name in names:
        if name in samples:
            values = [value for labels, value in samples[name]
                      if not model or labels.get("model_name", model) == model]
            return [v for v in values if v == v]  # drop NaN
    return []


def load_from_metrics(text: str, gauges: GaugeNames, model: str = "") -> Load:
    """Load for `model` (all models when empty): counts summed over engines/ranks, cache
    usage averaged (a fraction per engine; a sum would exceed 1 with data parallelism)."""
    samples = parse_gauges(text, gauges.running + gauges.waiting + gauges.kv_usage)
    running = _pick(samples, gauges.running, model)
    waiting = _pick(samples, gauges.waiting, model)
    usage = _pick(samples, gauges.kv_usage, model)
    kv_usage = sum(usage) / len(usage) if usage else 0.0
    return Load(running=max(0, round(sum(running))), waiting=max(0, round(sum(waiting))),
                kv_usage=min(1.0, max(0.0, kv_usage)))


class EngineProbe:
    """HTTP probe of one engine at `base_url` (e.g. "http://127.0.0.1:8100")."""

    def __init__(self, kind: EngineKind, base_url: str, *, model: str = "") -> None:
        self.kind = kind
        self.base_url = base_url.rstrip("/")
        self.model = model  # filters /metrics by model_name once known
        self._client = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(PROBE_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            trust_env=False,  # loopback engines; never route through an HTTP proxy
        )

    def close(self) -> None:
        self._client.close()

    def health(self) -> Health:
        try:
            response = self._client.get("/health")
        except httpx.ConnectError:
            return Health.REFUSED
        except httpx.HTTPError as exc:
            logger.debug("[probe] %s/health: %s", self.base_url, exc)
            return Health.FAILING
        return Health.OK if response.status_code == 200 else Health.FAILING

    def load(self) -> Load | None:
        """The engine's load from /metrics; None for generic engines or on any error."""
        gauges = {EngineKind.VLLM: VLLM_GAUGES, EngineKind.SGLANG: SGLANG_GAUGES}.get(self.kind)
        if gauges is None:
            return None
        try:
            response = self._client.get("/metrics")
            response.raise_for_status()
            return load_from_metrics(response.text, gauges, self.model)
        except (httpx.HTTPError, ValueError) as exc:
            logger.debug("[probe] %s/metrics: %s", self.base_url, exc)
            return None

    def metadata(self) -> EngineMetadata | None:
        """What the engine reports about itself; None while it does not answer."""
        try:
            if self.kind is EngineKind.VLLM:
                return self._vllm_metadata()
            if self.kind is EngineKind.SGLANG:
                return self._sglang_metadata()
            return EngineMetadata()
        except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as exc:
            logger.debug("[probe] %s metadata: %s", self.base_url, exc)
            return None

    def _vllm_metadata(self) -> EngineMetadata:
        response = self._client.get("/v1/models")
        response.raise_for_status()
        models = response.json()["data"]
        return EngineMetadata(model=str(models[0]["id"]) if models else "")

    def _sglang_metadata(self) -> EngineMetadata:
        response = self._client.get("/server_info")
        response.raise_for_status()
        info = response.json()
        # The served name is what clients put in "model"; it defaults to model_path.
        model = info.get("served_model_name") or info.get("model_path") or ""
        return EngineMetadata(
            model=str(model),
            bootstrap_port=int(info.get("disaggregation_bootstrap_port") or 0),
            tp_size=max(1, int(info.get("tp_size") or 1)),
            dp_size=max(1, int(info.get("dp_size") or 1)),
        )


def make_probe(kind: EngineKind | str, base_url: str, *, model: str = "") -> EngineProbe:
    return EngineProbe(EngineKind(kind), base_url, model=model)
