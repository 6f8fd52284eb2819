"""`bench_kv.py --scale`: the router's KV index alone, on one core, without sockets.

Events/s it absorbs from many engines (decode included, as the feed thread does it), and
memory per million blocks indexed (tracemalloc over a second, fresh index). Over real
sockets, with the feed thread: `bench_kv_scale.py`.
"""

from __future__ import annotations

import random
import time
import tracemalloc

from router.kv.index import KvIndex
from wire.kv_events import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch

BLOCK = 16


def _live_index(members: int) -> KvIndex:
    """An index following `members` members, each synced (LIVE) and empty."""
    index = KvIndex()
    for m in range(members):
        mi = index.track(f"p{m}", 1)
        assert mi is not None
        mi.start_sync()
        mi.replay_done(complete=True)
    return index


def _batches(members: int, batches: int, blocks_per_batch: int) -> list[tuple[str, int, bytes]]:
    """Per member, `batches` encoded batches of a growing chain of new blocks; every fifth
    also removes two blocks (evictions too: a realistic mix)."""
    payloads: list[tuple[str, int, bytes]] = []
    rng = random.Random(0)
    for m in range(members):
        parent = None
        for seq in range(batches):
            hashes = [rng.getrandbits(63) for _ in range(blocks_per_batch)]
            events: list = [BlockStored(hashes, parent, [rng.randrange(50000)
                                                        for _ in range(BLOCK * len(hashes))],
                                        BLOCK, None, "GPU", None)]
            if seq % 5 == 4:
                events.append(BlockRemoved(hashes[:2], "GPU"))
            else:
                parent = hashes[-1]
            payloads.append((f"p{m}", seq, encode_batch(KVEventBatch(0.0, events, 0))))
    return payloads


def _feed(index: KvIndex, payloads: list[tuple[str, int, bytes]]) -> tuple[int, float]:
    """Decode and apply every batch; (events, CPU seconds)."""
    started = time.process_time()
    n = 0
    for member_id, seq, payload in payloads:
        batch = decode_batch(payload)
        n += len(batch.events)
        index.members[member_id].apply(seq, batch)
    return n, time.process_time() - started


def index_alone(members: int = 1000, batches: int = 50, blocks_per_batch: int = 20) -> None:
    """Print events/s on one core and bytes per block indexed."""
    payloads = _batches(members, batches, blocks_per_batch)
    index = _live_index(members)
    n_events, cpu = _feed(index, payloads)
    fresh = _live_index(members)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    _feed(fresh, payloads)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    blocks = index.total_blocks()
    print(f"scale: {members} members, {len(payloads)} batches, {n_events} events, "
          f"{blocks} blocks indexed")
    print(f"  {len(payloads) / cpu:,.0f} batches/s = {n_events / cpu:,.0f} events/s = "
          f"{blocks / cpu:,.0f} blocks/s on one core (decode + apply)")
    print(f"  memory: {used / blocks:.0f} B per block = {used / blocks:.0f} MB per million "
          f"blocks")
