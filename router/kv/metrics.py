"""The KV feed's and index's figures as Prometheus metrics, read at scrape time.

The feed bumps plain counters and the index holds its own; this collector reads
them when /metrics is scraped, so the event path pays nothing for metrics.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.kv.feed import KvFeed
from router.kv.index import IndexState, KvIndex

__all__ = ["KvCollector"]


class KvCollector:
    def __init__(self, index: KvIndex, feed: KvFeed) -> None:
        self._index = index
        self._feed = feed

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        c = self._feed.counters
        snapshot = self._index.published  # the feed's, swapped by reference
        gaps, replays, losses = snapshot.totals()
        for name, doc, value in (
            ("pdreg_router_kv_batches", "KV event batches applied or held, all members",
             c.batches),
            ("pdreg_router_kv_events", "KV events received (stored, removed, cleared)",
             c.events),
            ("pdreg_router_kv_bad_batches", "KV event batches that failed to decode "
             "(dropped; recovered by replay like a lost one)", c.bad),
            ("pdreg_router_kv_refused_endpoints", "Members whose KV events endpoint the "
             "upstream policy refused", c.refused),
            ("pdreg_router_kv_gap_overflows", "Times a member's index was declared unknown "
             "because its batches held behind a gap passed --kv-gap-bytes", c.overflows),
            ("pdreg_router_kv_feed_restarts", "Times the KV feed loop failed and started "
             "again (every member resynced)", c.restarts),
            ("pdreg_router_kv_gaps", "Gaps in a member's KV event sequence", gaps),
            ("pdreg_router_kv_replays", "Replays asked of members' replay sockets", replays),
            ("pdreg_router_kv_unknown", "Times a member's index became unknown (history "
             "lost: a gap no replay could fill, no replay socket, a restart)", losses),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family
        members = list(snapshot.members.values())
        blocks = GaugeMetricFamily("pdreg_router_kv_blocks", "Blocks indexed, all members")
        blocks.add_metric([], sum(m.blocks for m in members))
        yield blocks
        states = Tally(m.state for m in members)
        by_state = GaugeMetricFamily("pdreg_router_kv_members", "Members indexed, by index "
                                     "state (syncing, live, replaying, unknown)",
                                     labels=("state",))
        for state in IndexState:
            by_state.add_metric([state.value], states.get(state, 0))
        yield by_state
