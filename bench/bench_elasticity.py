"""Elasticity of pdreg, measured end to end on loopback.

    .venv/bin/python bench/bench_elasticity.py [--rounds 3] [--backend sim|torch]

A registry, a router and 2 prefill + 2 decode reference engines under steady streaming
traffic (the demo's cluster and load generator). Each round starts one more decode and
then kill -9s the oldest decode, measuring:

- join:  from the registry listing the new engine as routable to the router's first pick
         of it (router /metrics, sampled every SAMPLE_PERIOD_S);
- kill:  from SIGKILL to the router's last pick of the dead engine (a pick of a dead
         decode fails to connect and is retried on another pair), the client requests
         that failed, and the time until the registry expired it.

Prints one Markdown table (the figures bench/RESULTS.md quotes). Peer routers
(sglang-router, vllm-router) are not measured here yet.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from pdreg.demo.cluster import Cluster, ClusterConfig
from pdreg.demo.observer import Observer
from pdreg.demo.traffic import TrafficGenerator

SAMPLE_PERIOD_S = 0.02
WAIT_TIMEOUT_S = 90.0
SETTLE_S = 1.5  # traffic after each action before the next one
SIM_ARGS = ("--sim-prefill-delay", "0.002", "--sim-decode-delay", "0.01")


def wait(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def present(observer: Observer, member_id: str) -> bool:
    return any(m["id"] == member_id for m in observer.members() or [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=("sim", "torch"), default="sim")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--heartbeat-interval", type=float, default=0.5)
    parser.add_argument("--lease", type=float, default=2.0)
    args = parser.parse_args()

    cluster = Cluster(ClusterConfig(
        backend=args.backend, heartbeat_interval_s=args.heartbeat_interval,
        lease_s=args.lease, engine_args=SIM_ARGS if args.backend == "sim" else (),
        log_level="WARNING"))
    traffic: TrafficGenerator | None = None
    observer: Observer | None = None
    joins: list[float] = []
    last_picks: list[float] = []
    gones: list[float] = []
    failures: list[int] = []
    try:
        cluster.start_registry()
        cluster.start_router()
        observer = Observer(cluster.registry_url, cluster.router_url,
                            period_s=SAMPLE_PERIOD_S).start()
        cluster.start_engines(["prefill", "prefill", "decode", "decode"])
        traffic = TrafficGenerator(cluster.router_url, clients=args.clients).start()
        traffic.wait_ok(20, WAIT_TIMEOUT_S)
        for _ in range(args.rounds):
            (new_id,) = cluster.start_engines(["decode"])
            wait(lambda i=new_id: observer.timeline(i).first_pick_at is not None, "a pick")
            timeline = observer.timeline(new_id)
            assert timeline.routable_at is not None and timeline.first_pick_at is not None
            joins.append(max(0.0, timeline.first_pick_at - timeline.routable_at))
            time.sleep(SETTLE_S)

            victim = cluster.engine_ids("decode")[0]
            managed = cluster.retire(victim)
            kill_at = time.monotonic()
            managed.kill()
            wait(lambda v=victim: observer.members() is not None
                 and not present(observer, v), "expiry")
            gones.append((observer.timeline(victim).gone_at or time.monotonic()) - kill_at)
            time.sleep(SETTLE_S)
            last = observer.timeline(victim).last_pick_at
            last_picks.append(max(0.0, (last or kill_at) - kill_at))
            failures.append(sum(1 for r in traffic.records()
                                if not r.ok and r.finished >= kill_at))
        ok = traffic.ok_count
    finally:
        if traffic is not None:
            traffic.stop()
        if observer is not None:
            observer.stop()
        cluster.stop_all()
        cluster.remove_logs()

    def cell(values: list[float]) -> str:
        return (f"{statistics.median(values) * 1e3:.0f} ms (max {max(values) * 1e3:.0f})"
                if values else "-")
    print(f"backend {args.backend}, {args.clients} streaming clients, heartbeat "
          f"{args.heartbeat_interval} s, lease {args.lease} s, {args.rounds} rounds, "
          f"{ok} requests ok, sampling {SAMPLE_PERIOD_S * 1e3:.0f} ms\n")
    print("| router | ready → first routed request | kill -9 → last request sent to it "
          "| failed client requests per kill | kill -9 → out of the registry |")
    print("|---|---:|---:|---:|---:|")
    print(f"| pdreg | {cell(joins)} | {cell(last_picks)} | "
          f"{statistics.mean(failures) if failures else 0:.1f} (max "
          f"{max(failures, default=0)}) | {cell(gones)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
