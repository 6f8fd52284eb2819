"""The store's metrics: reachable or not, writes, watch events, reloads, the lease, and
what was refused. Counted into plain fields by the store's threads (and the HTTP side for
writes), turned into metric families at scrape time, like `registry.metrics.LoopStats`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["ADMIN_REFUSALS", "REFUSAL_REASONS", "StoreCollector", "StoreStats"]

REFUSAL_REASONS = ["oversized", "malformed", "invalid", "id", "cap"]  # BadRecord.reason
ADMIN_REFUSALS = ["id", "ban", "unknown", "unavailable"]  # admin requests refused, by why
RELOAD_REASONS = ["start", "reconnect", "compacted"]
INTENT_KINDS = ["drain", "evict", "cordon"]


@dataclass
class StoreStats:
    kind: str = "memory"
    up: bool = False
    reason: str = ""  # why it is down
    writes: Counter[str] = field(default_factory=Counter)  # ok | unavailable
    watch_events: int = 0
    reloads: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)  # store values refused
    admin_refused: Counter[str] = field(default_factory=Counter)
    lease_held: bool = False
    lease_renewals: int = 0
    lease_grants: int = 0
    lease_failures: int = 0
    applied_revision: int = 0
    intents: Counter[str] = field(default_factory=Counter)  # held now, by kind
    registries: int = 0  # in the replica set now
    swept: int = 0  # expired intents deleted from the store


class StoreCollector(Collector):
    def __init__(self, stats: StoreStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        up = GaugeMetricFamily("pdreg_store_up", "1 while the registry's store (--store) is "
                               "reachable; admin writes answer 503 while it is not.",
                               labels=["kind"])
        up.add_metric([s.kind], float(s.up))
        yield up
        yield _labelled("pdreg_store_writes", "Admin writes to the store, by result.",
                        "result", s.writes, ["ok", "unavailable"])
        yield CounterMetricFamily("pdreg_store_watch_events",
                                  "Changes the store's watch delivered.", value=s.watch_events)
        yield _labelled("pdreg_store_reloads", "Everything read from the store again, by "
                        "why (start, reconnect after an outage, compacted watch).", "reason",
                        s.reloads, RELOAD_REASONS)
        yield _labelled("pdreg_store_values_refused", "Keys or values in the store refused "
                        "(oversized, malformed, invalid, bad member id, over the cap "
                        "on intents); they change nothing.", "reason", s.refused, REFUSAL_REASONS)
        yield _labelled("pdreg_admin_requests_refused", "Admin requests refused, by why "
                        "(bad id or ban, no such member, store unavailable).", "reason",
                        s.admin_refused, ADMIN_REFUSALS)
        yield GaugeMetricFamily("pdreg_store_lease_held", "1 while this registry's entry "
                                "in the replica set is under a live lease (etcd).",
                                value=float(s.lease_held))
        yield CounterMetricFamily("pdreg_store_lease_renewals", "Lease keep-alives that "
                                  "etcd accepted.", value=s.lease_renewals)
        yield CounterMetricFamily("pdreg_store_lease_grants", "Leases granted (at start, "
                                  "and when etcd had lost the last one).", value=s.lease_grants)
        yield CounterMetricFamily("pdreg_store_lease_failures", "Lease calls that failed.",
                                  value=s.lease_failures)
        yield GaugeMetricFamily("pdreg_store_revision", "The store revision this registry "
                                "has applied.", value=s.applied_revision)
        yield _gauges("pdreg_store_intents", "Admin intents held, by kind.", "kind",
                      s.intents, INTENT_KINDS)
        yield GaugeMetricFamily("pdreg_store_registries", "Registries in the replica set.",
                                value=s.registries)
        yield CounterMetricFamily("pdreg_store_intents_swept", "Expired intents deleted "
                                  "from the store.", value=s.swept)


def _labelled(name: str, documentation: str, label: str, values: Counter[str],
              always: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key in sorted(set(values) | set(always)):
        family.add_metric([key], values.get(key, 0))
    return family


def _gauges(name: str, documentation: str, label: str, values: Counter[str],
            always: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=[label])
    for key in sorted(set(values) | set(always)):
        family.add_metric([key], values.get(key, 0))
    return family
