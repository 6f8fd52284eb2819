"""KEDA and the HPA it creates, played for one ScaledObject: query, decide, fall back.

What KEDA does with a `prometheus` trigger (KEDA's scalers and pkg/fallback; the HPA's
replica calculator for an External metric with an AverageValue target):

- each poll, run the trigger's query on `serverAddress`; the first sample's value is the
  metric. No sample is an error when `ignoreNullValues` is "false".
- HPA, AverageValue: desired = ceil(value / threshold), unless value / (threshold x
  current) is within the 10% tolerance of 1 (then: current). Clamped to
  [minReplicaCount, maxReplicaCount]. The ScaledObjects set the HPA's own windows to 0.
- an error leaves the count where it is, until the failures in a row exceed
  `fallback.failureThreshold`; then the fallback count: `replicas` (behavior `static`,
  the default), the current count (`currentReplicas`), or the higher or lower of the
  two (`currentReplicasIfHigher` / `currentReplicasIfLower`).

Pure but for `query`, which the caller gives (an HTTP GET of Prometheus' API).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["HPA_TOLERANCE", "ScaledObject", "fallback_replicas", "hpa_replicas"]

HPA_TOLERANCE = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance


def hpa_replicas(value: float, threshold: float, current: int,
                 tolerance: float = HPA_TOLERANCE) -> int:
    if current > 0 and abs(value / (threshold * current) - 1.0) <= tolerance:
        return current
    return math.ceil(value / threshold)


def fallback_replicas(behavior: str, replicas: int, current: int) -> int:
    return {"static": replicas, "currentReplicas": current,
            "currentReplicasIfHigher": max(current, replicas),
            "currentReplicasIfLower": min(current, replicas)}[behavior]


@dataclass
class ScaledObject:
    name: str
    target: str  # the Deployment it scales
    polling_interval: float
    server: str  # the trigger's serverAddress
    query: str
    threshold: float
    ignore_null: bool
    min_replicas: int
    max_replicas: int
    failure_threshold: int | None  # None: no fallback
    fallback_count: int
    behavior: str
    failures: int = 0

    @classmethod
    def from_manifest(cls, obj: Mapping[str, Any]) -> ScaledObject:
        spec = obj["spec"]
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        meta = trigger["metadata"]
        fallback = spec.get("fallback")
        return cls(obj["metadata"]["name"], spec["scaleTargetRef"]["name"],
                   float(spec.get("pollingInterval", 30)), meta["serverAddress"],
                   meta["query"], float(meta["threshold"]),
                   meta.get("ignoreNullValues", "true") == "true",
                   int(spec.get("minReplicaCount", 0)), int(spec.get("maxReplicaCount", 100)),
                   None if fallback is None else int(fallback["failureThreshold"]),
                   0 if fallback is None else int(fallback["replicas"]),
                   "static" if fallback is None else fallback.get("behavior", "static"))

    def poll(self, current: int, query: Callable[[str, str], float | None]) -> tuple[int, str]:
        """One poll: the replica count to set, and what it came from (to print).
        QUERY(server, promql) is the first sample's value, None for no sample; it raises
        OSError when Prometheus cannot be reached."""
        try:
            value = query(self.server, self.query)
            if value is None and not self.ignore_null:
                raise LookupError("no data")
        except (OSError, LookupError) as exc:
            self.failures += 1
            if self.failure_threshold is not None and self.failures > self.failure_threshold:
                count = fallback_replicas(self.behavior, self.fallback_count, current)
                return self._clamp(count), f"fallback {self.behavior} ({exc})"
            return current, f"query failed {self.failures}x ({exc})"
        self.failures = 0
        value = value or 0.0  # None only when ignoreNullValues lets "no data" mean 0
        return self._clamp(hpa_replicas(value, self.threshold, current)), f"{value:g}"

    def _clamp(self, count: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, count))
