"""The KV feed's CPU per batch when each batch is a wake of its own: what a router pays
per KV event batch at the event rates of bench_kv.py's trace (a few batches per
request, tens a second), where the feed sleeps between batches and every wake finds it
cold. This tree against a baseline commit, in turns (A B A B: the machine's load
drifts), each turn a child process following one publisher.

    .venv/bin/python bench/bench_kv_feed.py [--baseline COMMIT] [--batches 600] [--turns 3]

The publisher is the reference engine's (engine_agent/reference/kv_publisher.py), in a
process of its own, sending --rate batches a second of --blocks blocks stored (16 tokens
each) and as many removed. The feed is told its members from a uvloop event loop, as
the router tells it (a tree whose feed runs on that loop then runs it there, an older
one on a thread of its own), and it is charged the whole process's CPU (the loop, its
own thread if any, ZeroMQ's I/O thread; the main thread sleeps) and wakes (schedstat
timeslices, every thread's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCK = 16


def publish(port_file: str, rate: float, batches: int, blocks: int) -> None:
    """The publisher's process: `batches` batches at `rate` a second, then closes."""
    from engine_agent.reference.kv_publisher import KvEventPublisher
    from wire.kv_events import BlockRemoved, BlockStored

    publisher = KvEventPublisher()
    Path(port_file).write_text(f"{publisher.port} {publisher.replay_port}")
    time.sleep(2.0)  # the feed subscribes and syncs
    rng = random.Random(1)
    started = time.monotonic()
    for i in range(batches):
        first = 1 + i * blocks
        events: list = [BlockStored(list(range(first, first + blocks)), None,
                                    [rng.randrange(50_000) for _ in range(blocks * BLOCK)],
                                    BLOCK, None, None, None)]
        if i >= 8:  # an LRU cache at capacity: as many removed as stored
            events.append(BlockRemoved(list(range(first - 8 * blocks,
                                                  first - 7 * blocks)), None))
        publisher.publish(events)
        time.sleep(max(0.0, started + (i + 1) / rate - time.monotonic()))
    time.sleep(1.0)
    publisher.close()


def follow(port_file: str, batches: int, rate: float, blocks: int) -> dict[str, float]:
    """The measured process (its tree on sys.path): a KvFeed following the publisher."""
    import uvloop

    from router.kv.feed import FeedMember, KvFeed
    from router.kv.index import KvIndex
    from wire.protocol import KvEventsSpec

    publisher = subprocess.Popen([sys.executable, str(Path(__file__).resolve()),
                                  "--publish", port_file, "--batches", str(batches),
                                  "--rate", str(rate), "--blocks", str(blocks)], cwd=REPO)
    while not os.path.exists(port_file) or not Path(port_file).read_text():
        time.sleep(0.05)
    port, replay = Path(port_file).read_text().split()
    loop = uvloop.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, name="loop", daemon=True)
    loop_thread.start()
    feed = KvFeed(KvIndex())
    spec = KvEventsSpec(endpoint=f"tcp://127.0.0.1:{port}",
                        replay_endpoint=f"tcp://127.0.0.1:{replay}", block_size=BLOCK)

    async def follow_it() -> None:
        feed.update([FeedMember("p", 1, spec)])
    asyncio.run_coroutine_threadsafe(follow_it(), loop).result(10.0)
    time.sleep(1.0)

    def run_ns_slices() -> tuple[int, int]:
        """Every thread's run time (ns) and timeslices, summed."""
        run_ns = slices = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                fields = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()
            except OSError:
                continue
            run_ns, slices = run_ns + int(fields[0]), slices + int(fields[2])
        return run_ns, slices
    (cpu0, slices0), batches0 = run_ns_slices(), feed.counters.batches
    publisher.wait()
    (cpu1, slices1), got = run_ns_slices(), feed.counters.batches - batches0
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(10.0)
    feed.close()
    loop.call_soon_threadsafe(loop.stop)
    loop_thread.join(10.0)
    return {"us_per_batch": (cpu1 - cpu0) / 1e3 / max(1, got),
            "wakes_per_batch": (slices1 - slices0) / max(1, got), "batches": got}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="")
    parser.add_argument("--batches", type=int, default=600)
    parser.add_argument("--rate", type=float, default=100.0, help="batches a second")
    parser.add_argument("--blocks", default="1,40", help="blocks per batch, each a run")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--publish", default=None, help=argparse.SUPPRESS)  # internal
    parser.add_argument("--follow", default=None, help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.publish:
        sys.path.insert(0, str(REPO))
        publish(args.publish, args.rate, args.batches, int(args.blocks))
        return 0
    if args.follow:
        sys.path.insert(0, os.getcwd())  # the tree measured
        print(json.dumps(follow(args.follow, args.batches, args.rate, int(args.blocks))))
        return 0
    sys.path.insert(0, str(REPO))
    from bench.procs import remove_tree, source_tree

    baseline = source_tree(args.baseline) if args.baseline else None
    trees = ([(args.baseline, baseline)] if baseline else []) + [("this tree", str(REPO))]
    try:
        print("| tree | blocks per batch | process CPU per batch (median of turns) | "
              "wakes per batch | turns |\n|---|---:|---:|---:|---|")
        for blocks in args.blocks.split(","):
            got: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
            for turn in range(args.turns):
                for name, src in trees if turn % 2 == 0 else trees[::-1]:
                    port_file = os.path.join(tempfile.gettempdir(),
                                             f"pdreg-bench-kv-feed-{os.getpid()}")
                    child = [sys.executable, str(Path(__file__).resolve()), "--follow",
                             port_file, "--batches", str(args.batches), "--rate",
                             str(args.rate), "--blocks", blocks]
                    out = subprocess.run(child, cwd=src, capture_output=True, text=True,
                                         check=True).stdout
                    os.unlink(port_file)
                    got[name].append(json.loads(out.strip().splitlines()[-1]))
            for name, runs in got.items():
                us = [r["us_per_batch"] for r in runs]
                print(f"| {name} | {blocks} | {statistics.median(us):.0f} us | "
                      f"{statistics.median(r['wakes_per_batch'] for r in runs):.2f} | "
                      f"{', '.join(f'{u:.0f}' for u in us)} |", flush=True)
    finally:
        remove_tree(baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
