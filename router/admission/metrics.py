"""Admission's series, on the router's registry (router/metrics.py's loop-owned kinds)."""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry

from router.metrics import LoopHistogram, LoopMetric

__all__ = ["OUTCOMES", "AdmissionMetrics"]

# How admission answered: admitted at once or after queueing, or refused (and why).
OUTCOMES: Final = ("admitted", "admitted_queued", "shed_slo", "deadline", "queue_full",
                   "cancelled", "bad_class")
WAIT_BUCKETS_S: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_depth = LoopMetric(
            "gauge", "pdreg_router_queue_depth", "Requests waiting in the router's admission "
            "queue, by model and class", ("model", "class"), registry)
        self.queue_bytes = LoopMetric(
            "gauge", "pdreg_router_queue_bytes", "Bytes of request bodies waiting in the "
            "admission queue, by model", ("model",), registry)
        self.queue_wait = LoopHistogram(
            "pdreg_router_queue_wait_seconds", "Time a request waited in the admission queue "
            "(admitted or not), by model and class", ("model", "class"),
            buckets=WAIT_BUCKETS_S, registry=registry)
        self.admission = LoopMetric(
            "counter", "pdreg_router_admission", "Admission's answers by model, class and "
            "outcome (admitted, admitted_queued; shed_slo: 429; deadline, queue_full: 503; "
            "cancelled: the client left while queued; bad_class: 400/403)",
            ("model", "class", "outcome"), registry)
        self.budget_used = LoopMetric(
            "gauge", "pdreg_router_budget_used", "Units this router has in flight on a member "
            "(role prefill: uncached prompt tokens; decode: KV tokens)", ("member", "role"),
            registry)
        self.budget_limit = LoopMetric(
            "gauge", "pdreg_router_budget_limit", "This router's share of a member's budget "
            "(0: none of that kind)", ("member", "role"), registry)
        self.predicted_ttft = LoopHistogram(
            "pdreg_router_predicted_ttft_seconds", "TTFT admission predicted for requests that "
            "had to wait, by model", ("model",), buckets=WAIT_BUCKETS_S, registry=registry)
        self.routers = LoopMetric(
            "gauge", "pdreg_router_routers_seen", "Routers registered (this one included): "
            "each member's budget is split among them", (), registry)
