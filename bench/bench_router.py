"""Routers side by side: CPU per request, latency, req/s; and p99 TTFT with a slow worker.

In front of the same 2 prefill + 2 decode sim engines (registered with a real registry
for pdreg, given as static URLs to the peers), the same aiohttp load generator (in this
process) drives:

- direct: one mixed sim engine, no router (one hop, no handshake);
- vLLM's two-stage NIXL handshake: `pdreg router` (engines registered as vllm-nixl) and
  vllm-router 0.1.17 (--policy round_robin);
- SGLang's bootstrap handshake: `pdreg router` (engines registered as sglang),
  sglang-router 0.3.2 (round_robin) and SGLang's Python mini_lb (random).

pdreg runs once per policy in --policies (default: power_of_two and peak_ewma).

Steady: router CPU is utime+stime of the router process and its children
(/proc/PID/stat) over the concurrency-32 burst. Before its warm-up, each router also
takes a cold burst (64 requests at c=32 on fresh connections): its p99 is the start-of-run
cost a benchmark that warms up at low concurrency folds into its c=32 figures.

Slow worker: the same line-up in front of engines where one prefill is 10x slower, and
separately where one decode is 5x slower per token, under streaming clients: p50/p99
time to first token and end to end, and the share of requests each router sent to the
slow worker (from the engines' own request counters). "fast workers only" is pdreg in
front of the same cluster without the slow worker: the bar to be within 2x of.

    .venv/bin/python bench/bench_router.py [--requests 2000] [--policies a,b]
        [--scenarios steady,prefill,decode] [--handshakes vllm-nixl,sglang] [--no-peers]

Writes bench/out/router.json and the plot bench/plots/router.png (matplotlib from
.venv-peers, which bench/peers.py installs on first use).

`--cold-only --repeat N`: the cold burst alone, N fresh launches of every router, each
router's median and range (bench/router_cold.py says why and how). The routers and the
engines behind them: bench/router_lineup.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # `bench` and pdreg; the engine helpers

from reference_helpers import EngineHandle, metrics, start_engine  # noqa: E402

from bench import peers  # noqa: E402
from bench.load import run_closed_loop  # noqa: E402
from bench.router_cold import COLD_REQUESTS, cold_burst, print_cold, run_cold  # noqa: E402
from bench.router_lineup import (  # noqa: E402
    BASELINE_SRC,
    CONCURRENCY,
    FAST_DECODE_S_PER_TOKEN,
    FAST_PREFILL_S_PER_TOKEN,
    ROUTER_ARGS,
    SLOW_DECODE_S_PER_TOKEN,
    SLOW_PREFILL_S_PER_TOKEN,
    Target,
    baseline_engines,
    lineup,
    pd_engines,
    pdreg_router,
    serving,
)
from bench.tables import p99, print_table  # noqa: E402
from pdreg.demo.traffic import TrafficGenerator, figures  # noqa: E402

OUT_DIR = REPO / "bench" / "out"
PLOT_PATH = REPO / "bench" / "plots" / "router.png"
PLOT_SCRIPT = REPO / "bench" / "plots" / "plot_router.py"
WARMUP_REQUESTS = 200
STREAM_CLIENTS = 8
STREAM_SECONDS = 6.0
REQUESTS_REQUEST_COUNTER = "pdreg:engine_requests_total"
DEFAULT_POLICIES = ("power_of_two", "peak_ewma")
SLOW_ROLES = ("prefill", "decode")


@dataclass
class Row:
    """One router's figures in the steady scenario."""

    router: str
    handshake: str
    cpu_us_per_req: float | None = None
    cold_p99_ms: float = 0.0  # a c=32 burst on fresh connections, before the warm-up
    cold_cpu_us_per_req: float | None = None
    p50_ms_c1: float = 0.0
    p99_ms_c1: float = 0.0
    p50_ms_c32: float = 0.0
    p99_ms_c32: float = 0.0
    req_per_s_c32: float = 0.0
    failed: int = 0


@dataclass
class SlowRow:
    """One router's figures with one slow worker (`slow`: its role)."""

    router: str
    handshake: str
    slow: str
    ok: int = 0
    failed: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    e2e_p99_ms: float | None = None
    slow_share: float | None = None  # of that role's requests, the share the slow one served


# --- measuring ---------------------------------------------------------------------------


def measure(target: Target, handshake: str, requests: int) -> Row:
    send = serving(target)
    row = Row(router=target.name, handshake=handshake)
    cold = cold_burst(target)
    row.cold_p99_ms, row.cold_cpu_us_per_req = cold.p99_ms, cold.cpu_us_per_req
    # Warm every connection pool at the concurrency measured: a pool warmed at c=4 still
    # opens 28 connections per engine at the start of a c=32 run.
    run_closed_loop(send, WARMUP_REQUESTS, CONCURRENCY)
    c1 = run_closed_loop(send, max(100, requests // 10), 1)
    row.p50_ms_c1, row.p99_ms_c1 = statistics.median(c1.latencies) * 1e3, p99(c1.latencies) * 1e3
    cpu_before = target.cpu_s() if target.cpu_s else 0.0
    c32 = run_closed_loop(send, requests, CONCURRENCY)
    if target.cpu_s:
        row.cpu_us_per_req = (target.cpu_s() - cpu_before) / requests * 1e6
    row.p50_ms_c32 = statistics.median(c32.latencies) * 1e3
    row.p99_ms_c32 = p99(c32.latencies) * 1e3
    row.req_per_s_c32 = len(c32.latencies) / c32.wall_s
    row.failed = cold.failed + c1.failed + c32.failed
    print(f"  {target.name:24s} cpu/req={row.cpu_us_per_req or 0:.0f}us "
          f"cold c32 p99={row.cold_p99_ms:.1f}ms cpu/req={row.cold_cpu_us_per_req or 0:.0f}us "
          f"c1 p50/p99={row.p50_ms_c1:.2f}/{row.p99_ms_c1:.2f}ms "
          f"c32 p50/p99={row.p50_ms_c32:.1f}/{row.p99_ms_c32:.1f}ms "
          f"{row.req_per_s_c32:.0f} req/s failed={row.failed}", flush=True)
    return row


def measure_slow(target: Target, handshake: str, slow: str,
                 workers: list[EngineHandle]) -> SlowRow:
    """Streaming clients for STREAM_SECONDS: TTFT, end to end, and where `workers` (the
    slow role's engines, the slow one first; empty for a fast-only run) were used."""
    send = serving(target)
    run_closed_loop(send, WARMUP_REQUESTS // 4, STREAM_CLIENTS)
    before = [metrics(w.url)[REQUESTS_REQUEST_COUNTER] for w in workers]
    traffic = TrafficGenerator(target.url, clients=STREAM_CLIENTS).start()
    started = time.monotonic()
    try:
        time.sleep(STREAM_SECONDS)  # the measurement window itself, not a wait for a state
    finally:
        traffic.stop()
    after = [metrics(w.url)[REQUESTS_REQUEST_COUNTER] for w in workers]
    served = [a - b for a, b in zip(after, before, strict=True)]
    records = [r for r in traffic.records() if started <= r.finished]
    result = figures(records, started, time.monotonic())
    row = SlowRow(router=target.name, handshake=handshake, slow=slow, ok=result.ok,
                  failed=result.failed,
                  slow_share=served[0] / max(1.0, sum(served)) if served else None)
    if result.ttft_p50_s is not None and result.ttft_p99_s is not None:
        row.ttft_p50_ms, row.ttft_p99_ms = result.ttft_p50_s * 1e3, result.ttft_p99_s * 1e3
    e2e = [r.finished - r.started for r in records if r.ok]
    if e2e:
        row.e2e_p50_ms, row.e2e_p99_ms = statistics.median(e2e) * 1e3, p99(e2e) * 1e3
    share = "-" if row.slow_share is None else f"{row.slow_share:.0%}"
    print(f"  {target.name:28s} TTFT p50/p99={row.ttft_p50_ms or 0:.0f}/"
          f"{row.ttft_p99_ms or 0:.0f}ms e2e p50/p99={row.e2e_p50_ms or 0:.0f}/"
          f"{row.e2e_p99_ms or 0:.0f}ms slow-{slow} share={share} "
          f"ok={row.ok} failed={row.failed}", flush=True)
    return row


# --- the scenarios -----------------------------------------------------------------------


def run_all(requests: int, policies: list[str], scenarios: list[str], handshakes: list[str],
            peers_too: bool) -> tuple[list[Row], list[SlowRow]]:
    rows: list[Row] = []
    slow_rows: list[SlowRow] = []
    if "steady" in scenarios:
        with start_engine(role="mixed", backend="sim") as direct:
            print("direct (mixed engine)", flush=True)
            rows.append(measure(Target("direct (no router)", direct.url), "-", requests))
    for handshake in handshakes:
        if "steady" in scenarios:
            print(f"{handshake} handshake, steady", flush=True)
            with pd_engines(handshake) as (registry, handles):
                for factory in lineup(handshake, registry, policies, handles, peers_too):
                    with factory() as target:
                        rows.append(measure(target, handshake, requests))
            for src in BASELINE_SRC:  # another version's registry, engines and router
                with baseline_engines(src, handshake) as registry, \
                        pdreg_router(registry, policies[-1],
                                     f"pdreg {src.name} ({policies[-1]})", src) as target:
                    rows.append(measure(target, handshake, requests))
        for slow in (r for r in SLOW_ROLES if r in scenarios):
            print(f"{handshake} handshake, one slow {slow}", flush=True)
            with pd_engines(handshake, slow, fast_only=True) as (registry, _), \
                    pdreg_router(registry, policies[-1], "fast workers only") as target:
                slow_rows.append(measure_slow(target, handshake, slow, []))
            with pd_engines(handshake, slow) as (registry, handles):
                workers = [h for h in handles if h.id.startswith(slow)]
                for factory in lineup(handshake, registry, policies, handles, peers_too):
                    with factory() as target:
                        slow_rows.append(measure_slow(target, handshake, slow, workers))
    return rows, slow_rows


# --- report ----------------------------------------------------------------------------


def _steady_cells(r: Row) -> list[str]:
    def us(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f} µs"
    return [r.router, r.handshake, us(r.cpu_us_per_req),
            f"{r.p50_ms_c1:.2f} / {r.p99_ms_c1:.2f} ms",
            f"{r.p50_ms_c32:.1f} / {r.p99_ms_c32:.1f} ms", f"{r.req_per_s_c32:,.0f}",
            f"{r.cold_p99_ms:.1f} ms", us(r.cold_cpu_us_per_req), str(r.failed)]


def _slow_cells(s: SlowRow) -> list[str]:
    share = "-" if s.slow_share is None else f"{s.slow_share:.0%}"
    return [s.router, s.handshake, f"{s.ttft_p50_ms or 0:.0f} ms",
            f"{s.ttft_p99_ms or 0:.0f} ms", f"{s.e2e_p50_ms or 0:.0f} ms",
            f"{s.e2e_p99_ms or 0:.0f} ms", share, str(s.ok), str(s.failed)]


def print_tables(rows: list[Row], slow_rows: list[SlowRow], requests: int) -> None:
    print(f"\n{requests} requests at c={CONCURRENCY}, {max(100, requests // 10)} at c=1, "
          f"after a warm-up at c={CONCURRENCY}; cold: {COLD_REQUESTS} requests at "
          f"c={CONCURRENCY} before any warm-up\n")
    print_table(["router", "handshake", "router CPU per request", "p50 / p99 at c=1",
                 "p50 / p99 at c=32", "req/s at c=32", "cold c=32 p99",
                 "cold CPU per request", "failed"], map(_steady_cells, rows), "llrrrrrrr")
    for slow, what in (("prefill", f"one prefill {SLOW_PREFILL_S_PER_TOKEN * 1e3:g} ms per "
                        f"prompt token vs {FAST_PREFILL_S_PER_TOKEN * 1e3:g}"),
                       ("decode", f"one decode {SLOW_DECODE_S_PER_TOKEN * 1e3:g} ms per "
                        f"output token vs {FAST_DECODE_S_PER_TOKEN * 1e3:g}")):
        print(f"\n{what}; {STREAM_CLIENTS} streaming clients, {STREAM_SECONDS:g} s each\n")
        print_table(["router", "handshake", "TTFT p50", "TTFT p99", "e2e p50", "e2e p99",
                     f"requests to the slow {slow}", "ok", "failed"],
                    (_slow_cells(r) for r in slow_rows if r.slow == slow), "llrrrrrrr")


def save_and_plot(rows: list[Row], slow_rows: list[SlowRow]) -> None:
    OUT_DIR.mkdir(exist_ok=True)
    data_path = OUT_DIR / "router.json"
    data_path.write_text(json.dumps({"steady": [asdict(r) for r in rows],
                                     "slow": [asdict(s) for s in slow_rows]}, indent=1))
    python = peers.ensure_peers_venv() / "bin" / "python"
    done = subprocess.run([str(python), str(PLOT_SCRIPT), str(data_path), str(PLOT_PATH)],
                          check=False)
    print(f"\nfigures: {data_path}; plot: {PLOT_PATH if done.returncode == 0 else 'failed'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help="pdreg policies to run, comma-separated")
    parser.add_argument("--scenarios", default="steady,prefill,decode",
                        help="steady, prefill (one slow prefill), decode (one slow decode)")
    parser.add_argument("--handshakes", default="vllm-nixl,sglang")
    parser.add_argument("--no-peers", action="store_true", help="pdreg only")
    parser.add_argument("--router-args", default="", help="extra `pdreg router` flags")
    parser.add_argument("--baseline-src", type=Path, action="append", default=[],
                        help="steady: also run this pdreg source tree's registry, engines "
                             "and router (e.g. `git archive main` unpacked), for CPU per "
                             "request side by side with another version")
    parser.add_argument("--cold-only", action="store_true",
                        help="only the cold burst, --repeat launches of every router")
    parser.add_argument("--repeat", type=int, default=8,
                        help="--cold-only: launches of each router")
    args = parser.parse_args()
    ROUTER_ARGS.extend(args.router_args.split())
    BASELINE_SRC.extend(p.resolve() for p in args.baseline_src)
    if not args.no_peers:
        peers.ensure_peers_venv()

    def items(text: str) -> list[str]:
        return [x for x in text.split(",") if x]
    if args.cold_only:
        print_cold(run_cold(args.repeat, items(args.policies), items(args.handshakes),
                            not args.no_peers), args.repeat)
        return 0
    rows, slow_rows = run_all(args.requests, items(args.policies), items(args.scenarios),
                              items(args.handshakes), not args.no_peers)
    print_tables(rows, slow_rows, args.requests)
    save_and_plot(rows, slow_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
