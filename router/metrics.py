"""Router metrics on a private CollectorRegistry (several routers may share a process)."""

from __future__ import annotations

from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

__all__ = ["LabelCache", "RouterMetrics"]

MAX_CACHED_CHILDREN: Final = 4096  # per metric; models come from clients, so bound it

# Seconds. TTFT spans a prefill; end-to-end spans a whole generation.
TTFT_BUCKETS_S: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
E2E_BUCKETS_S: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


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


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pdreg_router_requests", "Client requests by model and outcome "
            "(ok, client_error, no_capacity, upstream_error, failed_midstream, cancelled)",
            ("model", "outcome"), registry=r)
        self.ttft = Histogram("pdreg_router_ttft_seconds",
                              "Request arrival to the first byte of the decode's answer",
                              ("model",), buckets=TTFT_BUCKETS_S, registry=r)
        self.e2e = Histogram("pdreg_router_e2e_seconds", "Request arrival to the last byte",
                             ("model",), buckets=E2E_BUCKETS_S, registry=r)
        self.in_flight = Gauge("pdreg_router_in_flight", "Requests this router has open "
                               "on a member", ("member",), registry=r)
        self.retries = Counter("pdreg_router_retries", "Retries on a new pair, by reason",
                               ("reason",), registry=r)
        self.quarantines = Counter("pdreg_router_quarantines",
                                   "Members quarantined after a failure", ("member",),
                                   registry=r)
        # Per member and role rather than per (P, D) pair: P x D series do not scale.
        self.picks = Counter("pdreg_router_picks", "Times a member was chosen, by role",
                             ("member", "role"), registry=r)
        # The request path's children, cached.
        self.requests_of = LabelCache(self.requests)
        self.ttft_of = LabelCache(self.ttft)
        self.e2e_of = LabelCache(self.e2e)
        self.in_flight_of = LabelCache(self.in_flight)
        self.picks_of = LabelCache(self.picks)

    def render(self) -> bytes:
        return generate_latest(self.registry)
