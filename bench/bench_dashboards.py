"""Open dashboards against the registry's propagation: N live pages against none, at 100k.

    .venv/bin/python bench/bench_dashboards.py [--members 100000] [--dashboards 0,20]
        [--measure 20] [--repeat 2] [--subscribers 100] [--baseline COMMIT]

Each run is bench_scale's (`run_one`: the registry as its own process with HTTP on, the
load generator heartbeating every member every --interval (default 5 s), subscribers
timing the probe's events, a view);
with N dashboards, a process holds N `/v1/stream` connections open to the registry from
before the fleet registers to the end, reading everything it is sent (bytes and messages
counted, nothing parsed, as a browser tab that keeps up would). Runs alternate (0, N, 0,
N...) so the machine's drift falls on both. Reported per run: propagation p50/p99 of the
probe's events to every subscriber, the registry's CPU, and per stream the bytes and
`state` messages it got (a stream that falls behind the change log gets the whole state
again). With --baseline, the same runs with that commit's registry beside this tree's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_scale

from registry.client import request_snapshot

_registry_process = bench_scale.registry_process
DASHBOARDS = [0]  # how many the next run opens (run_one knows nothing of them)
# The heartbeat interval from the start (5 s: what a registry picks at 100k members). On a
# shared 2-core machine a registry fell behind at 14k members (1 s) and 64k (5 s) while
# the fleet registered, and the generator stalled on lost replies: --interval 20 there.
INTERVAL = [5.0]
STREAMS: list[dict[str, float]] = []  # what the last run's streams got


def streams(url: str, count: int, ready: mp.Queue, stop: mp.Queue, out: mp.Queue) -> None:
    """`count` SSE streams to `url`, read until told to stop."""
    async def main() -> list[dict[str, float]]:
        figures = [{"bytes": 0, "states": 0} for _ in range(count)]
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async def one(k: int) -> None:
                async with session.get(url) as response:
                    # As little as a reader can do (the machine is the registry's too):
                    # bytes, and `state` messages (a marker split over two reads is
                    # missed: the count is a lower bound).
                    async for chunk in response.content.iter_any():
                        figures[k]["bytes"] += len(chunk)
                        figures[k]["states"] += chunk.count(b"event: state")
            tasks = [asyncio.create_task(one(k)) for k in range(count)]
            await asyncio.sleep(1.0)
            ready.put("open")
            while stop.empty():
                await asyncio.sleep(0.2)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return figures
    started = time.monotonic()
    figures = asyncio.run(main())
    elapsed = time.monotonic() - started
    out.put([{**f, "bytes_per_s": round(f["bytes"] / elapsed)} for f in figures])


@contextlib.contextmanager
def registry_with_dashboards(interval_s: float, lease_s: float, **kwargs: object
                             ) -> Iterator[tuple[str, int]]:
    """bench_scale's registry (at INTERVAL[0]), with DASHBOARDS[0] streams open to it."""
    with _registry_process(INTERVAL[0], 3 * INTERVAL[0], **kwargs) as (address, pid):
        if not DASHBOARDS[0]:
            yield address, pid
            return
        hello = request_snapshot(address, timeout_s=10)
        url = f"http://{address.rpartition(':')[0]}:{hello.http_port}/v1/stream"
        ready, stop, out = mp.Queue(), mp.Queue(), mp.Queue()
        proc = mp.Process(target=streams, args=(url, DASHBOARDS[0], ready, stop, out))
        proc.start()
        ready.get(timeout=60)
        try:
            yield address, pid
        finally:
            stop.put("stop")
            STREAMS[:] = out.get(timeout=60)
            proc.join(timeout=30)


bench_scale.registry_process = registry_with_dashboards  # run_one opens its registry so


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=100_000)
    parser.add_argument("--dashboards", default="0,20")
    parser.add_argument("--subscribers", type=int, default=100)
    parser.add_argument("--measure", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--baseline", default="", help="a commit to run beside this tree")
    parser.add_argument("--interval", type=float, default=INTERVAL[0], metavar="S",
                        help="the fleet's heartbeat interval")
    parser.add_argument("--profile", default="", metavar="DIR",
                        help="py-spy the registry over each window (bench_scale's --profile)")
    args = parser.parse_args()
    counts = [int(n) for n in args.dashboards.split(",")]
    INTERVAL[0] = args.interval
    trees = [("this", bench_scale.ROOT)]
    tmp = ""
    if args.baseline:
        tmp = bench_scale.baseline_tree(args.baseline)
        trees.insert(0, (args.baseline, tmp))
    rows = []
    try:
        for _ in range(args.repeat):
            for name, src in trees:
                for count in counts:
                    DASHBOARDS[0] = count
                    STREAMS.clear()
                    result = bench_scale.run_one(f"{name} {count} dashboards", src,
                                                 args.members, args.subscribers, 0.0,
                                                 args.measure, (), profile=args.profile)
                    row = {"tree": name, "dashboards": count, **asdict(result),
                           "streams": list(STREAMS)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n| tree | dashboards | propagation p50 / p99 | first subscriber p99 "
          "| registry CPU | loop turns > 25 ms | per stream: KB/s, whole states |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        per = r["streams"]
        stream = (f"{sum(s['bytes_per_s'] for s in per) / len(per) / 1e3:.0f} KB/s, "
                  f"{max(s['states'] for s in per):.0f}") if per else "-"
        print(f"| {r['tree']} | {r['dashboards']} | {r['propagation_p50_ms']} / "
              f"{r['propagation_p99_ms']} ms | {r['first_p99_ms']} ms | "
              f"{r['registry_core_pct']}% | {r['turns_over_25ms']} | {stream} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
