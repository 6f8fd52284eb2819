"""Prometheus metrics for the registry.

The loop counts into plain integers (`LoopStats`), with no locks on the hot path; a
custom collector turns them, and the membership's figures (`registry.fleet_stats`: counts
the loop keeps as members change, copied for the scrape), into metric families at scrape
time. A scrape costs O(roles x models), whatever the fleet's size.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from registry.fleet_stats import AGE_BUCKETS_S, SUSPECT, FleetFigures
from registry.outcome import Refusal
from wire.protocol import (
    LeaveReason,
    MemberLeft,
    MembershipEvent,
    MemberState,
    ReplyStatus,
    Role,
    role_name,
)

if TYPE_CHECKING:
    from registry.kv_reports import Applied
    from registry.outcome import Outcome


# Every reason a control message can be refused (pdreg_rejected_messages_total{reason}).
REJECTION_REASONS = [refusal.value for refusal in Refusal]


# Loop-turn and snapshot-build durations (seconds): a turn is ~0.1-5 ms; what delays every
# event behind it (a full GC, a big snapshot) shows in the upper buckets.
TURN_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass
class Durations:
    """A histogram the loop writes with one bisect (read racily at scrape)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(TURN_BUCKETS_S) + 1))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(TURN_BUCKETS_S, seconds)] += 1
        self.total_s += seconds

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, documentation)
        cumulative, total = [], 0
        for bound, count in zip([*map(_le, TURN_BUCKETS_S), "+Inf"], list(self.counts),
                                strict=True):
            total += count
            cumulative.append((bound, total))
        family.add_metric([], cumulative, self.total_s)
        return family


@dataclass
class LoopStats:
    """Counters written only by the loop thread; read (racily, harmlessly) at scrape."""

    heartbeats: int = 0
    heartbeat_results: Counter[str] = field(default_factory=Counter)
    registrations: Counter[str] = field(default_factory=Counter)
    departures: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    events: int = 0
    digests: int = 0
    syncs: int = 0
    sync_bytes: int = 0  # snapshot bytes sent (the same encoding goes to many views)
    snapshots_encoded: int = 0
    digest_entries: int = 0  # load entries published in digests
    reports: Counter[str] = field(default_factory=Counter)
    kv_reports: Counter[str] = field(default_factory=Counter)  # KvIndexReport, by result
    kv_entries: Counter[str] = field(default_factory=Counter)  # their entries, by result
    kv_entries_held: int = 0  # (router, member) entries the registry holds
    handshake_failures: int = 0
    replies_dropped: int = 0
    loop_errors: int = 0
    loop_lateness_s: float = 0.0
    lag_compensated_s: float = 0.0
    coalescing: bool = False  # registry.coalesce: the loop pauses between turns
    turns: Durations = field(default_factory=Durations)  # each turn's work, not its wait
    snapshot_builds: Durations = field(default_factory=Durations)

    def count_heartbeat_result(self, status: ReplyStatus) -> None:
        self.heartbeat_results[status.name.lower()] += 1

    def count_registration(self, outcome: Outcome) -> None:
        self.registrations[outcome.status.name.lower()] += 1

    def count_report(self, outcome: Outcome) -> None:
        """accepted, ignored (no such member incarnation), or why it was refused."""
        status = outcome.status
        result = outcome.kind if status is ReplyStatus.OK else status.name.lower()
        self.reports[result or "accepted"] += 1

    def count_kv_report(self, applied: Applied, held: int) -> None:
        self.kv_reports["accepted"] += 1
        entries = self.kv_entries
        entries["stored"] += applied.stored
        entries["unchanged"] += applied.unchanged
        entries["removed"] += applied.removed
        entries["ignored"] += applied.ignored
        self.kv_entries_held = held

    def count_rejection(self, reason: str) -> None:
        self.rejections[reason] += 1

    def count_event(self, event: MembershipEvent) -> None:
        self.events += 1
        if isinstance(event, MemberLeft):
            self.departures[event.reason.name.lower()] += 1


# Per-member heartbeat-age series only up to this many members: beyond it a scrape would
# grow with the fleet (~100 bytes a member: 10 MB at 100k), and rendering it holds the GIL
# the loop needs. The histogram below carries the same news at any size.
PER_MEMBER_SERIES_MAX = 1_000
__all__ = ["AGE_BUCKETS_S", "PER_MEMBER_SERIES_MAX", "LoopStats", "RegistryCollector",
           "make_metrics_registry"]


class RegistryCollector(Collector):
    """`figures` gives the membership as of the scrape (the loop copies it on demand);
    `clock` is the clock its heartbeat times run on (the loop's monotonic one)."""

    def __init__(self, stats: LoopStats, figures: Callable[[], FleetFigures],
                 per_member_max: int = PER_MEMBER_SERIES_MAX,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stats = stats
        self._figures = figures
        self._per_member_max = per_member_max
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        figures = self._figures()
        yield from self._membership_families(figures, self._clock())
        yield from self._message_families(stats)
        yield from self._loop_families(stats, figures)

    def _message_families(self, stats: LoopStats) -> Iterator[Metric]:
        """What the control and events sockets carried: counters only."""
        yield _counter("pdreg_heartbeats", "Heartbeats received.", stats.heartbeats)
        yield _labelled_counter("pdreg_heartbeat_results",
                                "Heartbeats not answered OK, by reply.", "result",
                                stats.heartbeat_results, ["unknown", "stale"])
        yield _labelled_counter("pdreg_registrations", "Registration attempts by result.",
                                "result", stats.registrations, ["ok", "stale", "rejected"])
        yield _labelled_counter("pdreg_departures", "Members that left, by reason.", "reason",
                                stats.departures, [r.name.lower() for r in LeaveReason])
        yield _labelled_counter("pdreg_rejected_messages",
                                "Control messages refused, by reason.", "reason",
                                stats.rejections, REJECTION_REASONS)
        yield _counter("pdreg_events_published", "Membership events published.", stats.events)
        yield _counter("pdreg_load_digests_published", "Load digests published.",
                       stats.digests)
        yield _counter("pdreg_syncs", "Snapshots served to views.", stats.syncs)
        yield _counter("pdreg_load_digest_entries",
                       "Member loads published in digests (changes past the deadband).",
                       stats.digest_entries)
        yield _counter("pdreg_sync_bytes", "Snapshot bytes sent to views.", stats.sync_bytes)
        yield _counter("pdreg_snapshots_encoded",
                       "Snapshots encoded (each is sent to every view asking meanwhile).",
                       stats.snapshots_encoded)
        yield _labelled_counter("pdreg_failure_reports",
                                "Failure reports from routers, by result.", "result",
                                stats.reports, ["accepted", "ignored", "rejected", "unknown",
                                                "stale"])
        yield _labelled_counter("pdreg_kv_index_reports",
                                "Routers' KV index reports, by result (limited: over the "
                                "rate; proof, replay, reporter...: refused).", "result",
                                stats.kv_reports, ["accepted", "limited"])
        yield _labelled_counter("pdreg_kv_index_report_entries",
                                "Entries of accepted KV index reports, by result (ignored: "
                                "no such member incarnation publishing KV events).", "result",
                                stats.kv_entries, ["stored", "unchanged", "removed", "ignored"])
        yield _gauge("pdreg_kv_index_entries",
                     "(router, member) KV index entries the registry holds.",
                     stats.kv_entries_held)
        yield _counter("pdreg_curve_handshake_failures",
                       "Connections refused by CURVE (no key, or a key not allowed).",
                       stats.handshake_failures)
        yield _counter("pdreg_replies_dropped", "Replies dropped (peer not reading).",
                       stats.replies_dropped)

    def _loop_families(self, stats: LoopStats, figures: FleetFigures) -> Iterator[Metric]:
        """The loop's own health: errors, lag, coalescing, turn and snapshot times."""
        yield _counter("pdreg_loop_errors", "Loop steps that raised (bugs).", stats.loop_errors)
        yield _gauge("pdreg_membership_version", "Current membership version.",
                     figures.version)
        yield _gauge("pdreg_self_preservation",
                     "1 while expiry is paused because many members went silent at once.",
                     float(figures.self_preserving))
        yield _gauge("pdreg_loop_lag_seconds",
                     "How late the loop woke for its last deadline.", stats.loop_lateness_s)
        yield _gauge("pdreg_loop_lag_compensated_seconds",
                     "The last stall the detector gave back to members (deadlines moved).",
                     stats.lag_compensated_s)
        yield _gauge("pdreg_loop_coalescing",
                     "1 while the message rate is high enough that the loop pauses briefly "
                     "between turns to handle messages in batches.", float(stats.coalescing))
        yield stats.turns.family(
            "pdreg_loop_turn_seconds",
            "Time the loop spent on each turn, not counting its wait: every message and "
            "event waits behind the turn in progress.")
        yield stats.snapshot_builds.family(
            "pdreg_snapshot_build_seconds",
            "Time the loop spent building each HTTP snapshot (O(members), rate-limited).")
        yield _gauge("pdreg_heartbeat_interval_seconds",
                     "Heartbeat interval the registry dictates.", figures.heartbeat_interval_s)

    def _membership_families(self, figures: FleetFigures, now: float) -> Iterator[Metric]:
        """Members by role/model/state and heartbeat ages: O(roles x models x heartbeat
        slots), from counts the loop keeps; a series per member only for fleets up to
        `per_member_max`."""
        groups = {(g.role, g.model): g for g in figures.groups}
        models = sorted({model for _, model in groups} or {""})
        states = [(s.name.lower(), int(s)) for s in MemberState] + [("suspect", SUSPECT)]
        family = GaugeMetricFamily("pdreg_members", "Members by role, model and state.",
                                   labels=["role", "model", "state"])
        histogram = HistogramMetricFamily(
            "pdreg_heartbeat_age_seconds",
            "Seconds since each member's last heartbeat, by role and model.",
            labels=["role", "model"])
        bounds = [*map(_le, AGE_BUCKETS_S), "+Inf"]
        for role in sorted(Role, key=role_name):
            name = role_name(role)
            for model in models:
                group = groups.get((role, model))
                for state, key in states:
                    family.add_metric([name, model, state], group.states[key] if group else 0)
                per_bucket, total_s = group.ages(now) if group else ([0] * len(bounds), 0.0)
                cumulative, total = [], 0
                for bound, count in zip(bounds, per_bucket, strict=True):
                    total += count
                    cumulative.append((bound, total))
                histogram.add_metric([name, model], cumulative, total_s)
        age = GaugeMetricFamily(
            "pdreg_member_heartbeat_age_seconds",
            "Seconds since each member's last heartbeat (only while the registry has at "
            f"most {self._per_member_max} members; see pdreg_heartbeat_age_seconds).",
            labels=["id", "role", "model"])
        if figures.per_member is not None and figures.members <= self._per_member_max:
            for member_id, role, model, heartbeat_at in figures.per_member:
                age.add_metric([member_id, role_name(role), model], max(0.0, now - heartbeat_at))
        yield family
        yield histogram
        yield age


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _le(bound: float) -> str:
    return repr(float(bound))


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _labelled_counter(name: str, documentation: str, label: str, values: Counter[str],
                      always: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key in sorted(set(values) | set(always)):
        family.add_metric([key], values.get(key, 0))
    return family


def make_metrics_registry(stats: LoopStats, figures: Callable[[], FleetFigures],
                          clock: Callable[[], float] = time.monotonic) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RegistryCollector(stats, figures, clock=clock))
    return registry
