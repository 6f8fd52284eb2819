"""Read an external engine's /health, /metrics and metadata (vLLM, SGLang, generic).

Each probe is a small synchronous HTTP client with short timeouts: the sidecar calls it
from its own loop, never from the agent's heartbeat thread.

Contracts followed (docs/engines.md §1 and §3):
- vLLM: GET /health -> 200 (503 when the engine is dead); /metrics gauges
  `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
  (older name `vllm:gpu_cache_usage_perc`), labels `model_name`, `engine`;
  GET /v1/models -> {"data": [{"id": ...}]}.
- SGLang (measured on real 0.5.23, docs/engines.md §3):
  - GET /ready -> 200 once warm-up is done, 503 while starting, paused or shutting down:
    the readiness signal, and cheap. GET /health is not: it queues a one-token generation
    and sleeps a full second before answering (longer than a probe should wait), so it
    is used only where /ready is missing (older engines: 404).
  - /metrics exists only with `--enable-metrics` (404 otherwise; then GET /v1/loads, a
    live JSON view of the same counts). Gauges labelled `model_name`, `engine_type`,
    `tp_rank`, `pp_rank`, ...: `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
    `sglang:token_usage`, and in P/D the hand-off queues (`..._prefill_bootstrap_queue_
    reqs`, `..._prefill_inflight_queue_reqs` on a prefill, `..._decode_prealloc_queue_reqs`,
    `..._decode_transfer_queue_reqs` on a decode) whose requests are in flight but in
    neither of the first two. The scheduler refreshes these gauges only at batch
    boundaries, so they lag; `sglang:http_requests_active{method="POST"}` counts open
    generation requests live (from the HTTP server, even while the scheduler is stuck):
    what the gauges do not show of it counts as waiting, and a drain waits on it.
  - GET /server_info -> the server args: `model_path`, `served_model_name`,
    `disaggregation_mode`, `disaggregation_bootstrap_port`, `tp_size`, `dp_size`, `version`,
    and with `--kv-events-config` a `kv_events` object whose `block_size` is the page size
    its events carry (1 on CPU; docs/engines.md §9).
"""

from __future__ import annotations

import enum
import logging
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from wire.limits import MAX_ADAPTERS, MAX_NAME_CHARS
from wire.protocol import Load

__all__ = [
    "SGLANG_GAUGES",
    "VLLM_GAUGES",
    "EngineKind",
    "EngineMetadata",
    "EngineProbe",
    "GaugeNames",
    "Health",
    "in_flight_from_metrics",
    "load_from_metrics",
    "load_from_sglang_loads",
    "make_probe",
    "parse_gauges",
]

logger = logging.getLogger(__name__)

# Gauges beyond this (or not finite) are an engine bug or a hostile /metrics: skipped and
# counted, never rounded (round(inf) raises, and a count must fit Load's int32 fields).
MAX_GAUGE_VALUE = float(2**31 - 1)
# Samples skipped for a value that is not a finite number within MAX_GAUGE_VALUE, by name.
skipped_values: Counter[str] = Counter()
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
    queued: tuple[str, ...] = ()  # more queues counted as waiting: every one present adds
    http_active: str = ""  # open HTTP requests by `method` label: live, counted as load


VLLM_GAUGES = GaugeNames(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
)
SGLANG_GAUGES = GaugeNames(
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_usage=("sglang:token_usage",),
    queued=(
        "sglang:num_grammar_queue_reqs",
        "sglang:num_prefill_bootstrap_queue_reqs",  # prefill: waiting for its decode
        "sglang:num_prefill_inflight_queue_reqs",  # prefill: KV being sent
        "sglang:num_decode_prealloc_queue_reqs",  # decode: waiting for KV room
        "sglang:num_decode_transfer_queue_reqs",  # decode: KV arriving
        "sglang:num_decode_host_receive_queue_reqs",  # decode: KV arriving in host memory
        "sglang:num_retracted_reqs",  # decode: pushed out, to resume
        "sglang:num_paused_reqs",  # generation paused by the operator
    ),
    http_active="sglang:http_requests_active",
)
# /v1/loads (SGLang without --enable-metrics): per-rank counts and the P/D queues.
SGLANG_LOADS_QUEUES = (
    "prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs", "decode_transfer_queue_reqs", "decode_retracted_queue_reqs",
)


@dataclass(frozen=True, slots=True)
class EngineMetadata:
    """What an engine says about itself; empty / 0 where it says nothing."""

    model: str = ""
    bootstrap_port: int = 0
    tp_size: int = 1
    dp_size: int = 1
    kv_block_size: int = 0  # tokens per block of its KV events, where it says (SGLang)
    max_model_len: int = 0  # its context length in tokens, where it says (/v1/models)
    adapters: tuple[str, ...] = ()  # LoRA adapters served besides `model` (/v1/models)


Sample = tuple[dict[str, str], float]  # (labels, value)


def usable(value: float) -> bool:
    """Whether a gauge value can be counted: finite and within MAX_GAUGE_VALUE."""
    return math.isfinite(value) and abs(value) <= MAX_GAUGE_VALUE


def parse_gauges(text: str, names: Iterable[str]) -> dict[str, list[Sample]]:
    """Samples of the wanted metric names from Prometheus text; others are skipped, and
    so are values that are not `usable` (counted in `skipped_values`)."""
    wanted = set(names)
    found: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                if not usable(sample.value):
                    _skip(sample.name, sample.value)
                    continue
                found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found


def _skip(name: str, value: object) -> None:
    if not skipped_values[name]:
        logger.warning("[probe] %s=%r is not a usable number; skipping it (and any like it, "
                       "counted in probes.skipped_values)", name, value)
    skipped_values[name] += 1


def _number(value: Any, name: str) -> float:
    """A JSON figure as a float; 0 (counted, skipped) when it is not a usable number."""
    number = float(value or 0)
    if not usable(number):
        _skip(name, value)
        return 0.0
    return number


def _pick(samples: dict[str, list[Sample]], names: tuple[str, ...],
          model: str) -> list[float]:
    for name in names:
        if name in samples:
            # SGLang with priority scheduling adds a per-priority breakdown beside the
            # total (priority=""): count the total only.
            values = [value for labels, value in samples[name]
                      if (not model or labels.get("model_name", model) == model)
                      and not labels.get("priority")]
            return values  # parse_gauges dropped NaN, infinities and absurd values
    return []


def _load(running: float, waiting: float, usage: list[float]) -> Load:
    kv_usage = sum(usage) / len(usage) if usage else 0.0
    # Sums of many usable values can still pass the int32 bound: clamp, never overflow.
    return Load(running=_count(running), waiting=_count(waiting),
                kv_usage=min(1.0, max(0.0, kv_usage)))


def _count(value: float) -> int:
    return int(min(MAX_GAUGE_VALUE, max(0.0, round(value))))


def load_from_metrics(text: str, gauges: GaugeNames, model: str = "") -> Load:
    """Load for `model` (all models when empty): counts summed over engines/ranks, cache
    usage averaged (a fraction per engine; a sum would exceed 1 with data parallelism).

    Where the engine counts its open POST requests (SGLang), those are live while its
    scheduler gauges lag (refreshed at batch boundaries only, and never while the scheduler
    is stuck): requests open beyond what the gauges show count as waiting."""
    wanted = gauges.running + gauges.waiting + gauges.kv_usage + gauges.queued
    samples = parse_gauges(text, (*wanted, gauges.http_active) if gauges.http_active
                           else wanted)
    running = sum(_pick(samples, gauges.running, model))
    waiting = sum(_pick(samples, gauges.waiting, model))
    waiting += sum(sum(_pick(samples, (name,), model)) for name in gauges.queued)
    if gauges.http_active:
        open_posts = sum(value for labels, value in samples.get(gauges.http_active, [])
                         if labels.get("method") == "POST")
        waiting = max(waiting, open_posts - running)
    return _load(running, waiting, _pick(samples, gauges.kv_usage, model))


def in_flight_from_metrics(text: str, gauges: GaugeNames, model: str = "") -> int:
    """Requests the engine still owes an answer: running + waiting (which, where the
    engine counts open POST requests, covers those too; see load_from_metrics)."""
    load = load_from_metrics(text, gauges, model)
    return load.running + load.waiting


def load_from_sglang_loads(body: Any) -> Load:
    """Load from SGLang's GET /v1/loads JSON: {"loads": [{"num_running_reqs",
    "num_waiting_reqs", "token_usage", "disaggregation": {queues}}, ...]} per DP rank."""
    ranks = body["loads"]
    running = sum(_number(rank.get("num_running_reqs"), "num_running_reqs") for rank in ranks)
    waiting = 0.0
    for rank in ranks:
        disaggregation = rank.get("disaggregation") or {}
        waiting += _number(rank.get("num_waiting_reqs"), "num_waiting_reqs")
        waiting += sum(_number(disaggregation.get(key), key) for key in SGLANG_LOADS_QUEUES)
    usage = [_number(rank["token_usage"], "token_usage") for rank in ranks
             if rank.get("token_usage") is not None]
    return _load(running, waiting, usage)


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
        self._gauges = {EngineKind.VLLM: VLLM_GAUGES,
                        EngineKind.SGLANG: SGLANG_GAUGES}.get(kind)
        # SGLang: /ready where the engine has it (see the module doc), else /health.
        self._health_path = "/ready" if kind is EngineKind.SGLANG else "/health"
        self._metrics_missing = False  # SGLang without --enable-metrics: use /v1/loads

    def close(self) -> None:
        self._client.close()

    def health(self) -> Health:
        try:
            response = self._client.get(self._health_path)
            if response.status_code == 404 and self._health_path == "/ready":
                logger.info("[probe] %s has no /ready; gating on /health", self.base_url)
                self._health_path = "/health"
                response = self._client.get(self._health_path)
        except httpx.ConnectError:
            return Health.REFUSED
        except httpx.HTTPError as exc:
            logger.debug("[probe] %s%s: %s", self.base_url, self._health_path, exc)
            return Health.FAILING
        return Health.OK if response.status_code == 200 else Health.FAILING

    def load(self) -> Load | None:
        """The engine's load from /metrics; None for generic engines or on any error."""
        if self._gauges is None:
            return None
        try:
            if self._metrics_missing:
                return self._sglang_loads()
            text = self._metrics_text()
            if text is None:
                return self._sglang_loads()
            return load_from_metrics(text, self._gauges, self.model)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, OverflowError) as exc:
            logger.debug("[probe] %s load: %s", self.base_url, exc)
            return None

    def in_flight(self) -> int | None:
        """Requests the engine still holds (see in_flight_from_metrics); None if unknown."""
        if self._gauges is None:
            return None
        try:
            text = None if self._metrics_missing else self._metrics_text()
            if text is None:
                load = self._sglang_loads()
                return load.running + load.waiting
            return in_flight_from_metrics(text, self._gauges, self.model)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, OverflowError) as exc:
            logger.debug("[probe] %s in-flight: %s", self.base_url, exc)
            return None

    def _metrics_text(self) -> str | None:
        """/metrics, or None when an SGLang engine serves none (no --enable-metrics)."""
        response = self._client.get("/metrics")
        if response.status_code == 404 and self.kind is EngineKind.SGLANG:
            logger.warning("[probe] %s/metrics is 404 (SGLang without --enable-metrics): "
                           "reading load from /v1/loads", self.base_url)
            self._metrics_missing = True
            return None
        response.raise_for_status()
        return response.text

    def _sglang_loads(self) -> Load:
        response = self._client.get("/v1/loads")
        response.raise_for_status()
        return load_from_sglang_loads(response.json())

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
        base, max_model_len, adapters = self._model_cards()
        return EngineMetadata(model=base, max_model_len=max_model_len, adapters=adapters)

    def _model_cards(self) -> tuple[str, int, tuple[str, ...]]:
        """/v1/models as vLLM and SGLang both list it: the base model first, with its
        context length (`max_model_len`), then a card per LoRA adapter (vLLM's
        --lora-modules, SGLang's --lora-paths, or loaded later) whose "parent" is the
        base model. ("", 0, ()) when it lists nothing."""
        response = self._client.get("/v1/models")
        response.raise_for_status()
        models = response.json()["data"]
        if not models:
            return "", 0, ()
        base = str(models[0]["id"])
        length = models[0].get("max_model_len")
        adapters = [str(m["id"]) for m in models[1:] if m.get("parent") == base]
        return (base, length if type(length) is int and 0 < length < 2**31 else 0,
                tuple(a for a in adapters if 0 < len(a) <= MAX_NAME_CHARS)[:MAX_ADAPTERS])

    def _sglang_metadata(self) -> EngineMetadata:
        response = self._client.get("/server_info")
        response.raise_for_status()
        info = response.json()
        # The served name is what clients put in "model"; it defaults to model_path.
        model = info.get("served_model_name") or info.get("model_path") or ""
        kv_events = info.get("kv_events")
        block = kv_events.get("block_size") if isinstance(kv_events, dict) else None
        base, max_model_len, adapters = self._model_cards()
        return EngineMetadata(
            model=str(model),
            max_model_len=max_model_len if base == model else 0,
            adapters=adapters if base == model else (),
            bootstrap_port=int(info.get("disaggregation_bootstrap_port") or 0),
            tp_size=max(1, int(info.get("tp_size") or 1)),
            dp_size=max(1, int(info.get("dp_size") or 1)),
            # What its events carry, which the flags may not say (the page size is
            # chosen per device and attention backend): the router needs it exact.
            kv_block_size=block if type(block) is int and 0 < block <= 65536 else 0,
        )


def make_probe(kind: EngineKind | str, base_url: str, *, model: str = "") -> EngineProbe:
    return EngineProbe(EngineKind(kind), base_url, model=model)
