"""One router's KV feed and index against many engines publishing KV events, over real
ZeroMQ sockets: the events/s it absorbs on one core, the lag, memory per million blocks.

Publishers are child processes, each with many members: per member a PUB socket and a
replay ROUTER socket (bound on 127.0.0.1, port 0), vLLM's wire format ([topic, seq,
msgpack KVEventBatch]) and its replay protocol (a start seq in, the batches after it and
an end marker out). Each member publishes --rate batches/s (staggered; Poisson-free, so
the offered load is steady): a batch stores one new prompt's blocks (--blocks blocks of
16 random tokens, a new chain) and, once the member holds --capacity blocks, removes its
oldest prompt's blocks in the same batch (LRU-like churn), so the index grows to
members x capacity blocks and stays there.

The router side is this process: the router's own `KvFeed` (router/kv/feed.py: one IO
thread, one SUB and one replay DEALER per member) and `KvIndex`, subscribed to every
member; nothing else runs in it. Measured over the publishing window, after every
member's index is LIVE:
- batches/s and events/s applied, against what was offered;
- the feed thread's CPU (its /proc task stat): the share of one core it used; and the
  process's (the feed thread plus ZeroMQ's IO thread, which reads the sockets);
- lag: wall time from a batch's timestamp (set when published) to its application,
  sampled every 8th batch (p50/p99/max);
- memory: the process's RSS growth from the subscribed-but-empty state to the end,
  per million blocks indexed (sockets' buffers included).

    .venv/bin/python bench/bench_kv_scale.py                 # 50 members, 10 s
    .venv/bin/python bench/bench_kv_scale.py --members 1000  # the issue's scale
    .venv/bin/python bench/bench_kv_scale.py --members 1000 --rate 20   # find the limit

Writes bench/out/kv-scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import zmq  # noqa: E402

from pdreg.testing import die_with_parent  # noqa: E402
from router.kv.feed import FeedMember, KvFeed  # noqa: E402
from router.kv.index import IndexState, KvIndex  # noqa: E402
from wire.kv_events import (  # noqa: E402
    REPLAY_END,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    encode_seq,
)
from wire.protocol import KvEventsSpec  # noqa: E402

OUT = REPO / "bench" / "out" / "kv-scale.json"
BLOCK = 16
TOPIC = b"kv@bench"
LAG_SAMPLE_EVERY = 8
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# --- publishers (child processes) -------------------------------------------------------


def publish(count: int, rate: float, blocks: int, capacity: int, seconds: float,
            seed: int) -> None:
    """Child: bind `count` members' sockets, print their endpoints, wait for "go" on
    stdin, publish for `seconds`, answer replays all along, print what was sent."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * count + 16)
    pubs, replays = [], []
    for _ in range(count):
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(100_000)
        pub.bind("tcp://127.0.0.1:0")
        rep = ctx.socket(zmq.ROUTER)
        rep.bind("tcp://127.0.0.1:0")
        pubs.append(pub)
        replays.append(rep)
    endpoints = [(p.getsockopt(zmq.LAST_ENDPOINT).decode(),
                  r.getsockopt(zmq.LAST_ENDPOINT).decode())
                 for p, r in zip(pubs, replays, strict=True)]
    print(json.dumps(endpoints), flush=True)
    poller = zmq.Poller()
    member_of = {}
    for m, rep in enumerate(replays):
        poller.register(rep, zmq.POLLIN)
        member_of[rep] = m
    rng = random.Random(seed)
    seqs = [0] * count
    held: list[list[list[int]]] = [[] for _ in range(count)]  # per member: prompts' hashes
    history: list[list[tuple[int, bytes]]] = [[] for _ in range(count)]  # for replays
    go = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), go.set()), daemon=True).start()

    def answer_replays(timeout_ms: int) -> None:
        for sock, _ in poller.poll(timeout_ms):
            client, _empty, start = sock.recv_multipart()
            member = member_of[sock]
            first = int.from_bytes(start, "big")
            for seq, payload in history[member]:
                if seq >= first:
                    sock.send_multipart([client, b"", TOPIC, encode_seq(seq), payload])
            sock.send_multipart([client, b"", b"", REPLAY_END, b""])

    while not go.is_set():
        answer_replays(50)
    period = 1.0 / rate
    started = time.monotonic()
    due = [started + period * rng.random() for _ in range(count)]  # staggered
    sent = 0
    while time.monotonic() - started < seconds:
        now = time.monotonic()
        for m in range(count):
            if due[m] > now:
                continue
            due[m] += period
            hashes = [rng.getrandbits(63) for _ in range(blocks)]
            events: list = [BlockStored(hashes, None, list(os.urandom(blocks * BLOCK)),
                                        BLOCK, None, "GPU", None)]
            held[m].append(hashes)
            if len(held[m]) * blocks > capacity:
                events.append(BlockRemoved(held[m].pop(0), "GPU"))
            payload = encode_batch(KVEventBatch(time.time(), events, 0))
            pubs[m].send_multipart([TOPIC, encode_seq(seqs[m]), payload])
            history[m].append((seqs[m], payload))
            if len(history[m]) > 64:  # a bounded replay buffer, as engines keep
                history[m].pop(0)
            seqs[m] += 1
            sent += 1
        answer_replays(max(0, int(1000 * (min(due) - time.monotonic()))))
    print(json.dumps({"sent": sent}), flush=True)
    sys.stdin.readline()  # stay until the parent has read everything
    for sock in (*pubs, *replays):
        sock.close(linger=0)
    ctx.term()


# --- the router side (this process) -----------------------------------------------------


def thread_cpu_s(native_id: int) -> float:
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=50)
    parser.add_argument("--rate", type=float, default=4.0, help="batches/s per member")
    parser.add_argument("--blocks", type=int, default=16,
                        help="blocks stored per batch (a 256-token prompt)")
    parser.add_argument("--capacity", type=int, default=1000,
                        help="blocks a member holds before it evicts (per member)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--processes", type=int, default=0,
                        help="publisher processes (default: one per 250 members)")
    parser.add_argument("--publisher", nargs=6, type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.publisher:
        count, rate, blocks, capacity, seconds, seed = args.publisher
        publish(int(count), rate, int(blocks), int(capacity), seconds, int(seed))
        return 0

    procs_n = args.processes or max(1, -(-args.members // 250))
    shares = [args.members // procs_n + (i < args.members % procs_n) for i in range(procs_n)]
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--publisher", str(n), str(args.rate), str(args.blocks),
         str(args.capacity), str(args.seconds), str(i)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
        for i, n in enumerate(shares)]
    try:
        endpoints = [e for p in procs for e in json.loads(p.stdout.readline())]  # type: ignore[union-attr]
        index = KvIndex()
        lags: list[float] = []
        original = KvFeed._on_batch
        count = [0]

        def timed(feed: KvFeed, state, frames) -> None:  # type: ignore[no-untyped-def]
            original(feed, state, frames)
            count[0] += 1
            if count[0] % LAG_SAMPLE_EVERY == 0 and state.index.last_batch_ts:
                lags.append(time.time() - state.index.last_batch_ts)

        KvFeed._on_batch = timed  # type: ignore[method-assign]
        feed = KvFeed(index, replay_timeout_s=30.0)
        members = [FeedMember(f"p{i}", 1, KvEventsSpec(endpoint=pub, replay_endpoint=rep,
                                                       topic=TOPIC.decode(), block_size=BLOCK))
                   for i, (pub, rep) in enumerate(endpoints)]
        t0 = time.monotonic()
        feed.update(members)
        while sum(m.state is IndexState.LIVE for m in list(index.members.values())) \
                < args.members:
            if time.monotonic() - t0 > 120:
                raise SystemExit("members did not all become LIVE within 120 s")
            time.sleep(0.1)
        subscribe_s = time.monotonic() - t0
        time.sleep(0.5)  # SUB connections settle before the first batch (slow joiner)
        assert feed._thread is not None and feed._thread.native_id is not None
        tid = feed._thread.native_id
        rss0, cpu0, proc0 = rss_bytes(), thread_cpu_s(tid), time.process_time()
        batches0, events0 = feed.counters.batches, feed.counters.events
        lags.clear()
        started = time.monotonic()
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        sent = sum(json.loads(p.stdout.readline())["sent"] for p in procs)  # type: ignore[union-attr]
        # Let the feed drain what is queued, up to 30 s more (the lag samples say how far
        # behind it was).
        deadline = time.monotonic() + 30.0
        while feed.counters.batches - batches0 < sent and time.monotonic() < deadline:
            time.sleep(0.05)
        wall = time.monotonic() - started
        publish_s = min(wall, args.seconds)
        cpu = thread_cpu_s(tid) - cpu0
        proc_cpu = time.process_time() - proc0
        batches = feed.counters.batches - batches0
        events = feed.counters.events - events0
        blocks = index.total_blocks()
        rss = rss_bytes() - rss0
        states = {s.value: sum(m.state is s for m in index.members.values())
                  for s in IndexState}
        gaps, replays, losses = index.totals()
        feed.close()
    finally:
        for p in procs:
            if p.poll() is None and p.stdin is not None:
                try:
                    p.stdin.write("\n")
                    p.stdin.flush()
                except OSError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    lags.sort()
    q = statistics.quantiles(lags, n=100) if len(lags) > 2 else [0.0] * 99
    result = {
        "members": args.members, "rate_per_member": args.rate, "blocks_per_batch": args.blocks,
        "capacity_per_member": args.capacity, "publisher_processes": procs_n,
        "subscribe_s": round(subscribe_s, 2),
        "offered_batches_per_s": round(sent / publish_s), "sent": sent, "applied": batches,
        "applied_batches_per_s": round(batches / wall),
        "applied_events_per_s": round(events / wall),
        "feed_cpu_share_of_core": round(cpu / wall, 3),
        # the feed thread + ZeroMQ's IO thread (which reads the TCP streams) + this
        # process's idle main thread: all the router would spend
        "process_cpu_share_of_core": round(proc_cpu / wall, 3),
        "batches_per_process_cpu_s": round(batches / proc_cpu) if proc_cpu else None,
        "batches_per_cpu_s": round(batches / cpu) if cpu else None,
        "events_per_cpu_s": round(events / cpu) if cpu else None,
        "lag_p50_ms": round(1000 * statistics.median(lags), 1) if lags else None,
        "lag_p99_ms": round(1000 * q[98], 1), "lag_max_ms": round(1000 * lags[-1], 1)
        if lags else None,
        "blocks_indexed": blocks,
        "rss_growth_mb": round(rss / 2**20, 1),
        "rss_bytes_per_block": round(rss / blocks) if blocks else None,
        "index_states": states, "gaps": gaps, "replays": replays, "unknown": losses,
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
