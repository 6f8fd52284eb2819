"""Limits on snapshot requests: a Sync costs the loop O(members), a heartbeat O(1).

Two token buckets, both pure (the clock is passed in):
- per peer (one ZeroMQ connection): PEER_BURST syncs, refilled at PEER_SYNCS_PER_S (a view
  syncs twice on start: once to learn the event port, once after subscribing);
- overall, in member records: peers that reconnect to get a new identity still cannot
  spend more than a share of the loop on snapshots.

A view that is refused keeps its last view and asks again after its sync timeout.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

PEER_BURST: Final = 4.0
PEER_SYNCS_PER_S: Final = 2.0
RECORDS_PER_S: Final = 200_000.0  # ~20 snapshots/s of 10,000 members
BURST_RECORDS: Final = 1_000_000.0  # 100 views resyncing at once at 10,000 members
MAX_PEERS_TRACKED: Final = 10_000


@dataclass(slots=True)
class TokenBucket:
    capacity: float
    rate_per_s: float
    tokens: float
    updated_at: float

    def take(self, cost: float, now: float) -> float:
        """0 after charging `cost`, else the seconds until it could be paid (nothing charged)."""
        elapsed = max(0.0, now - self.updated_at)
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate_per_s)
        self.updated_at = now
        cost = min(cost, self.capacity)  # a request bigger than the bucket waits for a full one
        if self.tokens < cost:
            return (cost - self.tokens) / self.rate_per_s
        self.tokens -= cost
        return 0.0


class SyncLimiter:
    def __init__(self, *, peer_burst: float = PEER_BURST,
                 peer_syncs_per_s: float = PEER_SYNCS_PER_S,
                 records_per_s: float = RECORDS_PER_S,
                 burst_records: float = BURST_RECORDS) -> None:
        self.peer_burst = peer_burst
        self.peer_syncs_per_s = peer_syncs_per_s
        self._records: TokenBucket | None = None
        self._records_rate = (burst_records, records_per_s)
        self._peers: OrderedDict[bytes, TokenBucket] = OrderedDict()  # least recent first

    def wait_s(self, peer: bytes, records: int, now: float) -> float:
        """0 if `peer` may have a snapshot of `records` members now (and charge it), else
        how long it should wait."""
        bucket = self._peers.get(peer)
        if bucket is None:
            bucket = TokenBucket(self.peer_burst, self.peer_syncs_per_s, self.peer_burst, now)
        wait = bucket.take(1.0, now)
        self._peers[peer] = bucket
        self._peers.move_to_end(peer)
        while len(self._peers) > MAX_PEERS_TRACKED:
            self._peers.popitem(last=False)
        if wait:
            return wait
        if self._records is None:
            capacity, rate = self._records_rate
            self._records = TokenBucket(capacity, rate, capacity, now)
        wait = self._records.take(float(max(1, records)), now)
        if wait:
            bucket.tokens += 1.0  # not served: the peer's own budget is not spent
        return wait
