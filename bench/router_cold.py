"""bench_router.py's cold burst: COLD_REQUESTS at c=CONCURRENCY on fresh connections to a
router that has served one request (`cold_burst`; the steady scenario takes one before
its warm-up), and its `--cold-only --repeat N` mode (`run_cold`, `print_cold`).

A 64-request p99 moves more between runs than between routers on a small shared
machine, so `--cold-only --repeat N` measures the cold burst alone, N launches of every
router (mini_lb left out), each launch a freshly started router in front of engines
kept up for the whole run, the routers' order rotated every round; it reports each
router's median and range of the cold p99 and cold CPU per request, and writes
bench/out/router_cold.json. `--baseline-src` routers join the rotation, each in front of
its own tree's registry and engines.
"""

from __future__ import annotations

import json
import statistics
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field

from bench.load import completion, run_closed_loop
from bench.procs import tree_run_s
from bench.router_lineup import (
    BASELINE_SRC,
    BODY,
    CONCURRENCY,
    REPO,
    Target,
    baseline_engines,
    lineup,
    pd_engines,
    pdreg_router,
    serving,
)
from bench.tables import p99, print_table

COLD_REQUESTS = 64
OUT_PATH = REPO / "bench" / "out" / "router_cold.json"


@dataclass
class ColdBurst:
    """One cold burst's figures."""

    p99_ms: float
    cpu_us_per_req: float | None
    failed: int


@dataclass
class ColdRow:
    """One router's cold bursts over `--repeat` launches: medians and ranges."""

    router: str
    handshake: str
    p99_ms: list[float] = field(default_factory=list)
    cpu_us_per_req: list[float] = field(default_factory=list)
    failed: int = 0


def cold_burst(target: Target) -> ColdBurst:
    """COLD_REQUESTS at c=CONCURRENCY on fresh connections. CPU from the threads' run
    time (nanoseconds): a 64-request burst is a few 10 ms ticks."""
    send = completion(target.url, BODY)
    cpu_before = tree_run_s(target.pid) if target.pid else 0.0
    cold = run_closed_loop(send, COLD_REQUESTS, CONCURRENCY)
    cpu_us_per_req = None
    if target.pid:
        cpu_us_per_req = (tree_run_s(target.pid) - cpu_before) / COLD_REQUESTS * 1e6
    return ColdBurst(p99_ms=p99(cold.latencies) * 1e3 if cold.latencies else 0.0,
                     cpu_us_per_req=cpu_us_per_req, failed=cold.failed)


def measure_cold(target: Target, handshake: str) -> ColdBurst:
    """A freshly started router's cold burst alone (after the one request that says it
    serves, as in bench_router's `measure`)."""
    serving(target)
    burst = cold_burst(target)
    print(f"  {target.name:28s} {handshake:9s} cold c32 p99={burst.p99_ms:.1f}ms "
          f"cpu/req={burst.cpu_us_per_req or 0:.0f}us failed={burst.failed}", flush=True)
    return burst


def run_cold(repeat: int, policies: list[str], handshakes: list[str],
             peers_too: bool) -> list[ColdRow]:
    """`repeat` rounds per handshake; every round launches each router afresh, in an
    order rotated by one each round, and takes its cold burst. The engines stay up."""
    found: dict[tuple[str, str], ColdRow] = {}
    for handshake in handshakes:
        print(f"{handshake} handshake, cold bursts x{repeat}", flush=True)
        with ExitStack() as stack:
            registry, handles = stack.enter_context(pd_engines(handshake))
            factories = lineup(handshake, registry, policies, handles, peers_too,
                               mini_lb=False)
            for src in BASELINE_SRC:
                address = stack.enter_context(baseline_engines(src, handshake))
                factories.append(lambda src=src, address=address: pdreg_router(
                    address, policies[-1], f"pdreg {src.name} ({policies[-1]})", src))
            for round_ in range(repeat):
                shift = round_ % len(factories)
                for factory in factories[shift:] + factories[:shift]:
                    with factory() as target:
                        burst = measure_cold(target, handshake)
                    cold = found.setdefault((target.name, handshake),
                                            ColdRow(target.name, handshake))
                    cold.p99_ms.append(burst.p99_ms)
                    if burst.cpu_us_per_req is not None:
                        cold.cpu_us_per_req.append(burst.cpu_us_per_req)
                    cold.failed += burst.failed
    return list(found.values())


def print_cold(rows: list[ColdRow], repeat: int) -> None:
    def spread(values: list[float], unit: str, digits: int) -> str:
        if not values:
            return "-"
        return (f"{statistics.median(values):,.{digits}f} {unit} "
                f"({min(values):,.{digits}f}-{max(values):,.{digits}f})")
    print(f"\ncold bursts: {COLD_REQUESTS} requests at c={CONCURRENCY} on fresh connections "
          f"to a freshly started router, {repeat} launches each; median (min-max)\n")
    print_table(["router", "handshake", "cold c=32 p99", "cold CPU per request", "failed"],
                ([r.router, r.handshake, spread(r.p99_ms, "ms", 1),
                  spread(r.cpu_us_per_req, "µs", 0), str(r.failed)] for r in rows), "llrrr")
    OUT_PATH.parent.mkdir(exist_ok=True)
    OUT_PATH.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(f"\nfigures: {OUT_PATH}")
