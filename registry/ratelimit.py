"""Limits on snapshot requests: a Sync costs the network O(members), a heartbeat O(1).

Two token buckets, both pure (the clock is passed in):
- per peer (one ZeroMQ connection): PEER_BURST syncs, refilled at PEER_SYNCS_PER_S;
- overall, in bytes sent: a snapshot is encoded once per version and the same bytes go to
  every requester, so what a sync costs is the bytes it puts on the wire (the loop only
  hands libzmq a reference). Peers that reconnect to get a new identity still cannot
  take more than BYTES_PER_S of the registry's bandwidth.

A view that is refused keeps its last view and asks again after its sync timeout.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

PEER_BURST: Final = 4.0
PEER_SYNCS_PER_S: Final = 2.0
# ~20 snapshots/s of 100k members (~25 MB each): 1,000 views starting together at 100k
# members are served in under a minute. Loopback and a 10 GbE link carry it.
BYTES_PER_S: Final = 512e6
BURST_BYTES: Final = 1e9
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
                 bytes_per_s: float = BYTES_PER_S,
                 burst_bytes: float = BURST_BYTES) -> None:
        self.peer_burst = peer_burst
        self.peer_syncs_per_s = peer_syncs_per_s
        self._bytes: TokenBucket | None = None
        self._bytes_rate = (burst_bytes, bytes_per_s)
        self._peers: OrderedDict[bytes, TokenBucket] = OrderedDict()  # least recent first

    def peer_wait_s(self, peer: bytes, now: float) -> float:
        """0 if `peer` may sync now (and charge it one sync), else how long to wait.

        Checked before a snapshot is encoded, so a flood from one peer costs no encoding.
        """
        bucket = self._peers.get(peer)
        if bucket is None:
            bucket = TokenBucket(self.peer_burst, self.peer_syncs_per_s, self.peer_burst, now)
        wait = bucket.take(1.0, now)
        self._peers[peer] = bucket
        self._peers.move_to_end(peer)
        while len(self._peers) > MAX_PEERS_TRACKED:
            self._peers.popitem(last=False)
        return wait

    def wait_s(self, peer: bytes, size: int, now: float) -> float:
        """Both checks in turn: 0 if `peer` may have `size` bytes now (and both are charged)."""
        return self.peer_wait_s(peer, now) or self.bytes_wait_s(peer, size, now)

    def bytes_wait_s(self, peer: bytes, size: int, now: float) -> float:
        """0 if a snapshot of `size` bytes may go to `peer` now (and charge it), else how
        long to wait; then the peer's sync is handed back (it was not served)."""
        if self._bytes is None:
            capacity, rate = self._bytes_rate
            self._bytes = TokenBucket(capacity, rate, capacity, now)
        wait = self._bytes.take(float(max(1, size)), now)
        if wait:
            bucket = self._peers.get(peer)
            if bucket is not None:
                bucket.tokens += 1.0
        return wait
