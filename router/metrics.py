"""Router metrics on a private CollectorRegistry (several routers may share a process)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import HistogramMetricFamily, Metric

__all__ = ["LabelCache", "LoopHistogram", "RouterMetrics"]

MAX_CACHED_CHILDREN: Final = 4096  # per metric; models come from clients, so bound it

# Seconds. TTFT spans a prefill; end-to-end spans a whole generation.
TTFT_BUCKETS_S: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
E2E_BUCKETS_S: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Gaps between reads of a decode's stream: a token every few ms on a GPU, seconds when
# something is wrong (the idle timeout starts a migration).
ITL_BUCKETS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                        5, 10)


class LabelCache:
    """`metric.labels(*values)` looked up once per label values: `labels()` validates and
    takes a lock on every call, which the request path would pay several times."""

    def __init__(self, metric: MetricWrapperBase) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._metric.labels(*values)
            if len(self._children) < MAX_CACHED_CHILDREN:
                self._children[values] = child
        return child


class _HistogramChild:
    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


class LoopHistogram:
    """A labelled histogram owned by one event loop: `observe` is a bisect and two adds.

    prometheus_client's Histogram takes a lock per bucket update (about 0.8 µs an
    observation); the inter-token histogram is observed on every read of every stream,
    so it lives here, lock-free. Collected from the same loop (the /metrics handler).
    """

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._bounds = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], _HistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> _HistogramChild:
        child = self._children.get(values)
        if child is None:
            child = _HistogramChild(self._bounds)
            if len(self._children) < MAX_CACHED_CHILDREN:
                self._children[values] = child
        return child

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation,
                                      labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation,
                                       labels=self.labelnames)
        for values, child in list(self._children.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*self._bounds, float("inf")), list(child.counts),
                                    strict=True):
                cumulative += count
                buckets.append((_bound_text(bound), cumulative))
            family.add_metric(list(values), buckets, child.sum)
        yield family


def _bound_text(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pdreg_router_requests", "Client requests by model and outcome "
            "(ok, client_error, no_capacity, upstream_error, failed_midstream, cancelled)",
            ("model", "outcome"), registry=r)
        self.ttft = Histogram(
            "pdreg_router_ttft_seconds", "Request arrival to the first token: the first "
            "streamed event of the decode's answer; for a non-streaming request, the end "
            "of the prefill leg (a mixed engine: its whole answer)",
            ("model",), buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = LoopHistogram(
            "pdreg_router_itl_seconds", "Gaps between reads of a decode's stream "
            "(inter-token latency as the router sees it)", ("model",),
            buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("pdreg_router_e2e_seconds", "Request arrival to the last byte",
                             ("model",), buckets=E2E_BUCKETS_S, registry=r)
        self.in_flight = Gauge("pdreg_router_in_flight", "Requests this router has open "
                               "on a member", ("member",), registry=r)
        self.retries = Counter("pdreg_router_retries", "Retries on a new pair, by reason",
                               ("reason",), registry=r)
        self.migrations = Counter(
            "pdreg_router_migrations", "Requests continued on a new pair after their decode "
            "failed mid-answer, by reason (reset, eof, error_event, idle_timeout)",
            ("reason",), registry=r)
        self.unmigratable = Counter(
            "pdreg_router_unmigratable", "Mid-stream failures that could not be migrated, "
            "by why (no_token_ids, request_shape, budget, no_pair)", ("why",), registry=r)
        self.quarantines = Counter("pdreg_router_quarantines",
                                   "Members quarantined after a failure", ("member",),
                                   registry=r)
        # Per member and role rather than per (P, D) pair: P x D series do not scale.
        self.picks = Counter("pdreg_router_picks", "Times a member was chosen, by role",
                             ("member", "role"), registry=r)
        # KV-aware pairing (`--policy kv`; router/kv_policy.py, router/kv_feed.py).
        self.prompt_tokens = Counter(
            "pdreg_router_prompt_tokens", "Prompt tokens routed with exact token ids "
            "(kv policy)", ("model",), registry=r)
        self.prompt_tokens_cached = Counter(
            "pdreg_router_prompt_tokens_cached", "Of those, tokens the KV index predicted "
            "cached at the chosen prefill", ("model",), registry=r)
        self.kv_exact = Gauge(
            "pdreg_router_kv_exact", "1 when the kv policy matches this model's prompts "
            "exactly (tokenizer and block size known), 0 when it falls back to approximate "
            "prefix affinity", ("model",), registry=r)
        self.kv_inexact_requests = Counter(
            "pdreg_router_kv_inexact_requests", "Requests the kv policy routed by approximate "
            "prefix affinity, by why (no_tokenizer, not_tokenized, no_block_size)",
            ("model", "why"), registry=r)
        self.tokenize_seconds = Histogram(
            "pdreg_router_tokenize_seconds", "Time to tokenize a prompt and key its blocks "
            "(kv policy), on or off the event loop", ("model",),
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 1), registry=r)
        # The request path's children, cached.
        self.requests_of = LabelCache(self.requests)
        self.ttft_of = LabelCache(self.ttft)
        self.e2e_of = LabelCache(self.e2e)
        self.itl_of = self.itl.labels
        self.in_flight_of = LabelCache(self.in_flight)
        self.picks_of = LabelCache(self.picks)

    def render(self) -> bytes:
        return generate_latest(self.registry)
