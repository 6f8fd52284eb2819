"""The planner's Prometheus metrics, on a private CollectorRegistry.

`pdreg_planner_desired_replicas{model,role}` is the output KEDA or an HPA scales on;
the `pdreg_planner_input_*` gauges are the figures it was computed from, so a dashboard
shows why. Label sets are bounded: models by `inputs.MAX_MODELS`, roles by two, reasons
and error kinds by fixed enums.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from planner.freshness import Standing
from planner.rule import Decision, RoleSignals, RuleConfig

__all__ = ["PlannerMetrics"]


class PlannerMetrics:
    def __init__(self, config: RuleConfig, latency_quantile: float) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        mr = ("model", "role")
        self.desired = Gauge("pdreg_planner_desired_replicas",
                             "Replicas the planner wants for a model's role", mr, registry=r)
        self.current = Gauge("pdreg_planner_current_replicas",
                             "Members counted now (joining or ready)", mr, registry=r)
        self.recommended = Gauge("pdreg_planner_recommended_replicas",
                                 "The rule's recommendation before stabilization", mr,
                                 registry=r)
        self.holding = Gauge("pdreg_planner_holding", "1 while bad input holds the last "
                             "decision (see pdreg_planner_input_errors_total)", mr, registry=r)
        self.running = Gauge("pdreg_planner_input_running", "Running requests, summed", mr,
                             registry=r)
        self.waiting = Gauge("pdreg_planner_input_waiting", "Waiting requests, summed", mr,
                             registry=r)
        self.capacity = Gauge("pdreg_planner_input_capacity",
                              "Declared capacity, summed (0 = unknown)", mr, registry=r)
        self.kv_usage = Gauge("pdreg_planner_input_kv_usage", "Mean KV cache use, 0..1", mr,
                              registry=r)
        self.ttft = Gauge("pdreg_planner_input_ttft_seconds",
                          f"Routers' TTFT, quantile {latency_quantile:g} over the window",
                          ("model",), registry=r)
        self.itl = Gauge("pdreg_planner_input_itl_seconds",
                         "Routers' mean inter-token latency over the window", ("model",),
                         registry=r)
        self.queue_wait = Gauge("pdreg_planner_input_queue_wait_seconds",
                                f"Routers' admission queue wait, quantile "
                                f"{latency_quantile:g} over the window", ("model",),
                                registry=r)
        self.request_rate = Gauge("pdreg_planner_input_request_rate",
                                  "Requests per second reaching the routers",
                                  ("model",), registry=r)
        self.decisions = Counter("pdreg_planner_decisions",
                                 "Changes of the desired count, by direction and reason",
                                 (*mr, "direction", "reason"), registry=r)
        self.input_errors = Counter("pdreg_planner_input_errors",
                                    "Bad inputs by kind (router_unreachable, "
                                    "router_bad_metrics, no_router_readable, "
                                    "suspect_member, registry_away, refused_model)",
                                    ("kind",), registry=r)
        self.routers = Gauge("pdreg_planner_routers", "Routers by standing: read this "
                             "round, stale (unread, last figures still count) or left out "
                             "(unread past --router-stale-after)", ("standing",), registry=r)
        self.exec_runs = Counter("pdreg_planner_exec", "--exec hook runs by result "
                                 "(ok, failed, timeout)", ("result",), registry=r)
        self.ticks = Counter("pdreg_planner_ticks", "Planning rounds", registry=r)
        Gauge("pdreg_planner_ttft_slo_seconds", "--ttft-slo", registry=r).set(config.ttft_slo_s)
        Gauge("pdreg_planner_itl_slo_seconds", "--itl-slo", registry=r).set(config.itl_slo_s)
        self._models: set[str] = set()

    def publish(self, decision: Decision, signals: RoleSignals | None) -> None:
        labels = (decision.model, decision.role_name)
        self.desired.labels(*labels).set(decision.desired)
        self.current.labels(*labels).set(decision.current)
        self.recommended.labels(*labels).set(decision.recommended)
        self.holding.labels(*labels).set(1 if decision.holding else 0)
        self._models.add(decision.model)
        if signals is None:  # held: the inputs shown stay those the decision used
            return
        self.running.labels(*labels).set(signals.running)
        self.waiting.labels(*labels).set(signals.waiting)
        self.capacity.labels(*labels).set(signals.capacity)
        self.kv_usage.labels(*labels).set(signals.kv_usage)
        for gauge, value in ((self.ttft, signals.ttft_s), (self.itl, signals.itl_s),
                             (self.request_rate, signals.request_rate),
                             (self.queue_wait, signals.queue_wait_s)):
            if value is None:
                _remove(gauge, (decision.model,))
            else:
                gauge.labels(decision.model).set(value)

    def set_routers(self, counts: Mapping[Standing, int]) -> None:
        for standing, count in counts.items():
            self.routers.labels(standing.value).set(count)

    def forget_models(self, keep: Iterable[str]) -> None:
        """Remove the series of models no longer planned."""
        for model in self._models - set(keep):
            for gauge in (self.desired, self.current, self.recommended, self.holding,
                          self.running, self.waiting, self.capacity, self.kv_usage):
                for role in ("prefill", "decode"):
                    _remove(gauge, (model, role))
            for gauge in (self.ttft, self.itl, self.request_rate, self.queue_wait):
                _remove(gauge, (model,))
            self._models.discard(model)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _remove(gauge: Gauge, labels: tuple[str, ...]) -> None:
    with contextlib.suppress(KeyError):
        gauge.remove(*labels)
