"""Router metrics on a private CollectorRegistry (several routers may share a process).

Every series the request path updates is owned by the router's event loop and updated
without locks (`LoopMetric`, `LoopHistogram`); /metrics collects them on that loop.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

__all__ = [
    "UNKNOWN_MODEL_LABEL",
    "LoopHistogram",
    "LoopMetric",
    "RequestRecorder",
    "RouterMetrics",
    "SeriesOf",
]

MAX_CACHED_CHILDREN: Final = 4096  # per metric; models come from clients, so bound it
UNKNOWN_MODEL_LABEL: Final = "unknown"  # the model label of models no member serves

# A metric's `labels`: label values -> the series (inc/dec, or observe).
SeriesOf = Callable[..., Any]

# Seconds. TTFT spans a prefill; end-to-end spans a whole generation.
TTFT_BUCKETS_S: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
E2E_BUCKETS_S: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Gaps between reads of a decode's stream: a token every few ms on a GPU, seconds when
# something is wrong (the idle timeout starts a migration).
ITL_BUCKETS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                        5, 10)


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


class _Value:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class LoopMetric:
    """A labelled counter or gauge owned by one event loop: `inc` is an add.

    prometheus_client takes a lock and validates on every update; the request path
    updates a dozen series per request, so they live here, lock-free, like
    `LoopHistogram`. Collected from the same loop (the /metrics handler)."""

    def __init__(self, kind: str, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self.family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _Value] = {}
        registry.register(self)

    def labels(self, *values: str) -> _Value:
        child = self._children.get(values)
        if child is None:
            child = _Value()
            if len(self._children) < MAX_CACHED_CHILDREN:
                self._children[values] = child
        return child

    def values(self) -> list[tuple[tuple[str, ...], float]]:
        """(label values, value) of every series, for a JSON report."""
        return [(labels, child.value) for labels, child in list(self._children.items())]

    def describe(self) -> list[Metric]:
        return [self.family(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = self.family(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        yield family


class RouterMetrics:
    """The router's series, in groups: the request path's, its members', the `kv`
    policy's."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._add_request_series()
        self._add_member_series()
        self._add_kv_series()
        # The request path's children.
        self.requests_of = self.requests.labels
        self.ttft_of = self.ttft.labels
        self.e2e_of = self.e2e.labels
        self.itl_of = self.itl.labels
        self.in_flight_of = self.in_flight.labels
        self.picks_of = self.picks.labels
        self.refused_of = self.refused.labels
        self.quarantines_of = self.quarantines.labels

    def _counter(self, name: str, documentation: str, *labels: str) -> LoopMetric:
        return LoopMetric("counter", name, documentation, labels, self.registry)

    def _add_request_series(self) -> None:
        r, counter = self.registry, self._counter
        self.requests = counter(
            "pdreg_router_requests", "Client requests by model and outcome "
            "(ok, client_error, no_capacity, upstream_error, failed_midstream, cancelled)",
            "model", "outcome")
        self.ttft = LoopHistogram(
            "pdreg_router_ttft_seconds", "Request arrival to the first token: the first "
            "streamed event of the decode's answer; for a non-streaming request, the end "
            "of the prefill leg (a mixed engine: its whole answer)",
            ("model",), buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = LoopHistogram(
            "pdreg_router_itl_seconds", "Gaps between reads of a decode's stream "
            "(inter-token latency as the router sees it)", ("model",),
            buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = LoopHistogram("pdreg_router_e2e_seconds", "Request arrival to the last "
                                 "byte", ("model",), buckets=E2E_BUCKETS_S, registry=r)
        self.retries = counter("pdreg_router_retries", "Retries on a new pair, by reason",
                               "reason")
        self.migrations = counter(
            "pdreg_router_migrations", "Requests continued on a new pair after their decode "
            "failed mid-answer, by reason (reset, eof, error_event, idle_timeout)", "reason")
        self.unmigratable = counter(
            "pdreg_router_unmigratable", "Mid-stream failures that could not be migrated, "
            "by why (no_token_ids, request_shape, budget, no_pair)", "why")
        self.refused = counter(
            "pdreg_router_refused", "Client requests refused before pairing, by reason "
            "(not_json, too_deep, no_model, loop, unauthorized, bad_class; from the HTTP server: "
            "malformed_http, head_too_large, body_too_large, body_timeout, header_timeout)",
            "reason")

    def _add_member_series(self) -> None:
        r, counter = self.registry, self._counter
        self.in_flight = LoopMetric("gauge", "pdreg_router_in_flight", "Requests this "
                                    "router has open on a member", ("member",), r)
        self.quarantines = counter("pdreg_router_quarantines",
                                   "Members quarantined after a failure", "member")
        # Per member and role rather than per (P, D) pair: P x D series do not scale.
        self.picks = counter("pdreg_router_picks", "Times a member was chosen, by role",
                             "member", "role")
        self.unroutable = LoopMetric(
            "gauge", "pdreg_router_unroutable_members", "Members whose HTTP or KV address "
            "is outside --allow-upstream: the router can never send them a request", (), r)

    def _add_kv_series(self) -> None:
        """KV-aware pairing (`--policy kv`, the default; router/kv/routing.py): updated on
        the loop (tokenizing runs off it, its timing is observed back on it)."""
        r, counter = self.registry, self._counter
        self.prompt_tokens = counter(
            "pdreg_router_prompt_tokens", "Prompt tokens routed with exact token ids "
            "(kv policy)", "model")
        self.prompt_tokens_cached = counter(
            "pdreg_router_prompt_tokens_cached", "Of those, tokens the KV index predicted "
            "cached at the chosen prefill", "model")
        self.kv_exact = LoopMetric(
            "gauge", "pdreg_router_kv_exact", "1 when the kv policy matches this model's "
            "prompts exactly (tokenizer and block size known), 0 when it pairs as peak_ewma "
            "(no KV events, no tokenizer...)", ("model",), r)
        self.kv_inexact_requests = counter(
            "pdreg_router_kv_inexact_requests", "Requests the kv policy paired as peak_ewma, "
            "by why (no_events, no_tokenizer, not_tokenized, no_block_size, no_index)",
            "model", "why")
        self.kv_cache_reports = counter(
            "pdreg_router_kv_cache_reports", "Engine reports of a request's cached prompt "
            "tokens checked against the kv policy's prediction, by verdict (kept: about "
            "what it claimed; short: much less)", "verdict")
        self.kv_distrusts = counter(
            "pdreg_router_kv_distrusts", "Times a member's KV events were distrusted (its "
            "reports kept falling short of its claims): scored as holding nothing for a "
            "while", "member")
        self.tokenize_seconds = LoopHistogram(
            "pdreg_router_tokenize_seconds", "Time to tokenize a prompt and key its blocks "
            "(kv policy), on or off the event loop", ("model",),
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 1), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestRecorder:
    """What one request records, through one object: the request path's only view of
    the metrics. `serves(model)`: whether a model gets a series of its own (clients name
    the model, so a typo or a scan cannot grow the metrics without bound)."""

    __slots__ = ("_metrics", "_serves")

    def __init__(self, metrics: RouterMetrics, serves: Callable[[str], bool]) -> None:
        self._metrics = metrics
        self._serves = serves

    def outcome(self, model: str, outcome: str) -> None:
        label = model if self._serves(model) else UNKNOWN_MODEL_LABEL
        self._metrics.requests_of(label, outcome).inc()

    def retry(self, reason: str) -> None:
        self._metrics.retries.labels(reason).inc()

    def migration(self, reason: str) -> None:
        self._metrics.migrations.labels(reason).inc()

    def unmigratable(self, why: str) -> None:
        self._metrics.unmigratable.labels(why).inc()

    def ttft(self, model: str, seconds: float) -> None:
        self._metrics.ttft_of(model).observe(seconds)

    def e2e(self, model: str, seconds: float) -> None:
        self._metrics.e2e_of(model).observe(seconds)

    def itl(self, model: str) -> Callable[[float], None]:
        """The observer of one stream's gaps between reads (called per read)."""
        return self._metrics.itl_of(model).observe
