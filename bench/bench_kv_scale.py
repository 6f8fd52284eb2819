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

The router side is this process: the router's own `KvFeed` (router/kv/feed.py, on an IO
thread of its own here, one SUB and one replay DEALER per member) and `KvIndex`, subscribed to every
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
    .venv/bin/python bench/bench_kv_scale.py --members 1000  # the scale RESULTS.md reports
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
from dataclasses import dataclass, field
from pathlib import Path

import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `bench` and pdreg

from bench.procs import rss_bytes, task_cpu_s  # noqa: E402
from bench.tables import percentiles, write_json  # noqa: E402
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
REPLAY_BUFFER = 64  # batches a publisher keeps for replays, as engines keep a bounded one
LIVE_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 30.0  # after publishing: the feed applies what is queued, up to this
SLOW_JOINER_S = 0.5  # SUB connections settle before the first batch
MEMBERS_PER_PUBLISHER = 250


# --- publishers (child processes) -------------------------------------------------------


class Publishers:
    """`count` members' sockets in one process: per member a PUB socket and a replay
    ROUTER socket (127.0.0.1, port 0) and the last REPLAY_BUFFER batches it published."""

    def __init__(self, count: int) -> None:
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 2 * count + 16)
        self.pubs, self.replays = [], []
        for _ in range(count):
            pub = self.ctx.socket(zmq.PUB)
            pub.set_hwm(100_000)
            pub.bind("tcp://127.0.0.1:0")
            rep = self.ctx.socket(zmq.ROUTER)
            rep.bind("tcp://127.0.0.1:0")
            self.pubs.append(pub)
            self.replays.append(rep)
        self.poller = zmq.Poller()
        self.member_of = {}
        for m, rep in enumerate(self.replays):
            self.poller.register(rep, zmq.POLLIN)
            self.member_of[rep] = m
        self.seqs = [0] * count
        self.history: list[list[tuple[int, bytes]]] = [[] for _ in range(count)]

    def endpoints(self) -> list[tuple[str, str]]:
        return [(p.getsockopt(zmq.LAST_ENDPOINT).decode(),
                 r.getsockopt(zmq.LAST_ENDPOINT).decode())
                for p, r in zip(self.pubs, self.replays, strict=True)]

    def answer_replays(self, timeout_ms: int) -> None:
        """vLLM's replay protocol: a start seq in, the batches from it and an end marker
        out."""
        for sock, _ in self.poller.poll(timeout_ms):
            client, _empty, start = sock.recv_multipart()
            member = self.member_of[sock]
            first = int.from_bytes(start, "big")
            for seq, payload in self.history[member]:
                if seq >= first:
                    sock.send_multipart([client, b"", TOPIC, encode_seq(seq), payload])
            sock.send_multipart([client, b"", b"", REPLAY_END, b""])

    def publish(self, m: int, payload: bytes) -> None:
        """vLLM's wire format: [topic, seq, msgpack KVEventBatch]."""
        self.pubs[m].send_multipart([TOPIC, encode_seq(self.seqs[m]), payload])
        self.history[m].append((self.seqs[m], payload))
        if len(self.history[m]) > REPLAY_BUFFER:
            self.history[m].pop(0)
        self.seqs[m] += 1

    def close(self) -> None:
        for sock in (*self.pubs, *self.replays):
            sock.close(linger=0)
        self.ctx.term()


def publish(count: int, rate: float, blocks: int, capacity: int, seconds: float,
            seed: int) -> None:
    """Child: bind `count` members' sockets, print their endpoints, wait for "go" on
    stdin, publish for `seconds`, answer replays all along, print what was sent."""
    out = Publishers(count)
    print(json.dumps(out.endpoints()), flush=True)
    rng = random.Random(seed)
    held: list[list[list[int]]] = [[] for _ in range(count)]  # per member: prompts' hashes
    go = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), go.set()), daemon=True).start()
    while not go.is_set():
        out.answer_replays(50)
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
            out.publish(m, encode_batch(KVEventBatch(time.time(), events, 0)))
            sent += 1
        out.answer_replays(max(0, int(1000 * (min(due) - time.monotonic()))))
    print(json.dumps({"sent": sent}), flush=True)
    sys.stdin.readline()  # stay until the parent has read everything
    out.close()


# --- the router side (this process) -----------------------------------------------------


@dataclass
class Measured:
    """What the publishing window gave on the router side."""

    sent: int = 0
    wall_s: float = 0.0
    feed_cpu_s: float = 0.0
    process_cpu_s: float = 0.0
    batches: int = 0
    events: int = 0
    rss_growth: int = 0
    lags: list[float] = field(default_factory=list)


class Router:
    """The router's own `KvFeed` (one IO thread, one SUB and one replay DEALER per member)
    and `KvIndex`, subscribed to every member; every LAG_SAMPLE_EVERY-th batch's lag
    (its timestamp, set when published, to its application) is sampled."""

    def __init__(self, endpoints: list[tuple[str, str]]) -> None:
        self.index = KvIndex()
        self.lags: list[float] = []
        original = KvFeed._on_batch
        count = [0]
        lags = self.lags

        def timed(feed: KvFeed, state, frames) -> None:  # type: ignore[no-untyped-def]
            original(feed, state, frames)
            count[0] += 1
            if count[0] % LAG_SAMPLE_EVERY == 0 and state.index.last_batch_ts:
                lags.append(time.time() - state.index.last_batch_ts)

        KvFeed._on_batch = timed  # type: ignore[method-assign]
        self.feed = KvFeed(self.index, replay_timeout_s=30.0)
        self.members = [FeedMember(f"p{i}", 1, KvEventsSpec(
            endpoint=pub, replay_endpoint=rep, topic=TOPIC.decode(), block_size=BLOCK))
            for i, (pub, rep) in enumerate(endpoints)]

    def subscribe(self) -> float:
        """Follow every member; seconds until each one's index is LIVE."""
        t0 = time.monotonic()
        self.feed.update(self.members)
        while sum(m.state is IndexState.LIVE for m in list(self.index.members.values())) \
                < len(self.members):
            if time.monotonic() - t0 > LIVE_TIMEOUT_S:
                raise SystemExit(f"members did not all become LIVE within {LIVE_TIMEOUT_S} s")
            time.sleep(0.1)
        subscribe_s = time.monotonic() - t0
        time.sleep(SLOW_JOINER_S)
        return subscribe_s

    def measure(self, procs: list[subprocess.Popen[str]]) -> Measured:
        """Say "go" to every publisher, wait for their totals, let the feed drain."""
        feed = self.feed
        assert feed.thread is not None and feed.thread.native_id is not None
        tid = feed.thread.native_id
        rss0, cpu0, proc0 = rss_bytes(), task_cpu_s(tid), time.process_time()
        batches0, events0 = feed.counters.batches, feed.counters.events
        self.lags.clear()
        started = time.monotonic()
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        sent = sum(json.loads(p.stdout.readline())["sent"] for p in procs)  # type: ignore[union-attr]
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while feed.counters.batches - batches0 < sent and time.monotonic() < deadline:
            time.sleep(0.05)
        return Measured(sent=sent, wall_s=time.monotonic() - started,
                        feed_cpu_s=task_cpu_s(tid) - cpu0,
                        process_cpu_s=time.process_time() - proc0,
                        batches=feed.counters.batches - batches0,
                        events=feed.counters.events - events0,
                        rss_growth=rss_bytes() - rss0, lags=sorted(self.lags))

    def summary(self) -> dict[str, object]:
        index = self.index
        gaps, replays, losses = index.published.totals()
        return {"blocks_indexed": index.total_blocks(),
                "index_states": {s.value: sum(m.state is s for m in index.members.values())
                                 for s in IndexState},
                "gaps": gaps, "replays": replays, "unknown": losses}


def _start_publishers(args: argparse.Namespace) -> list[subprocess.Popen[str]]:
    procs_n = args.processes or max(1, -(-args.members // MEMBERS_PER_PUBLISHER))
    shares = [args.members // procs_n + (i < args.members % procs_n) for i in range(procs_n)]
    return [subprocess.Popen(
        [sys.executable, __file__, "--publisher", str(n), str(args.rate), str(args.blocks),
         str(args.capacity), str(args.seconds), str(i)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
        for i, n in enumerate(shares)]


def _stop_publishers(procs: list[subprocess.Popen[str]]) -> None:
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


def _result(args: argparse.Namespace, publishers: int, subscribe_s: float, m: Measured,
            summary: dict[str, object]) -> dict[str, object]:
    wall, cpu, proc_cpu, lags = m.wall_s, m.feed_cpu_s, m.process_cpu_s, m.lags
    publish_s = min(wall, args.seconds)
    blocks = int(summary["blocks_indexed"])  # type: ignore[call-overload]
    return {
        "members": args.members, "rate_per_member": args.rate, "blocks_per_batch": args.blocks,
        "capacity_per_member": args.capacity, "publisher_processes": publishers,
        "subscribe_s": round(subscribe_s, 2),
        "offered_batches_per_s": round(m.sent / publish_s), "sent": m.sent,
        "applied": m.batches, "applied_batches_per_s": round(m.batches / wall),
        "applied_events_per_s": round(m.events / wall),
        "feed_cpu_share_of_core": round(cpu / wall, 3),
        # the feed thread + ZeroMQ's IO thread (which reads the TCP streams) + this
        # process's idle main thread: all the router would spend
        "process_cpu_share_of_core": round(proc_cpu / wall, 3),
        "batches_per_process_cpu_s": round(m.batches / proc_cpu) if proc_cpu else None,
        "batches_per_cpu_s": round(m.batches / cpu) if cpu else None,
        "events_per_cpu_s": round(m.events / cpu) if cpu else None,
        "lag_p50_ms": round(1000 * statistics.median(lags), 1) if lags else None,
        "lag_p99_ms": round(1000 * percentiles(lags)[98], 1),
        "lag_max_ms": round(1000 * lags[-1], 1) if lags else None,
        "blocks_indexed": blocks, "rss_growth_mb": round(m.rss_growth / 2**20, 1),
        "rss_bytes_per_block": round(m.rss_growth / blocks) if blocks else None,
        "index_states": summary["index_states"], "gaps": summary["gaps"],
        "replays": summary["replays"], "unknown": summary["unknown"],
    }


def _parser() -> argparse.ArgumentParser:
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
    return parser


def main() -> int:
    args = _parser().parse_args()
    if args.publisher:
        count, rate, blocks, capacity, seconds, seed = args.publisher
        publish(int(count), rate, int(blocks), int(capacity), seconds, int(seed))
        return 0
    procs = _start_publishers(args)
    try:
        endpoints = [e for p in procs for e in json.loads(p.stdout.readline())]  # type: ignore[union-attr]
        router = Router(endpoints)
        subscribe_s = router.subscribe()
        measured = router.measure(procs)
        summary = router.summary()
        router.feed.close()
    finally:
        _stop_publishers(procs)
    result = _result(args, len(procs), subscribe_s, measured, summary)
    print(json.dumps(result, indent=2))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
