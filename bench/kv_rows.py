"""bench_kv's rows: one router's figures from a run (the client's TTFTs, the engines'
counters, the router's own metrics and CPU), and the table printed of them."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field

from bench.kv_open_loop import OpenLoop
from bench.kv_trace import BLOCK
from bench.tables import percentiles


@dataclass
class Row:
    router: str
    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    prefill_tokens_per_request: float
    hit_rate: float
    vs_oracle: float = 0.0  # against the bounded-load oracle
    vs_greedy_oracle: float = 0.0  # against the load-ignoring one
    router_cpu_ms_per_request: float = 0.0
    tokenize_ms_per_request: float = 0.0
    predicted_hit_rate: float = 0.0  # the router's own prediction at its picks (kv only)
    skipped_prefill: int = 0  # requests served by a decode alone (conditional disagg.)
    decode_prefill_tokens_per_request: float = 0.0  # prompt tokens decodes computed
    ttfts: list[float] = field(default_factory=list, repr=False)
    # The tail's requests: (index in the trace, TTFT ms), slowest first; the joining
    # prefill comes at requests/3, the restart at 2 x requests/3.
    slowest: list[tuple[int, float]] = field(default_factory=list)
    ttft_p99_warm_ms: float = 0.0  # requests from the join on (caches warm, 4 prefills)
    # The router's CPU per request by thread (the event loop, kv-feed, the view...)
    threads_ms_per_request: dict[str, float] = field(default_factory=dict)
    threads_wakes_per_request: dict[str, float] = field(default_factory=dict)  # timeslices
    # pdreg's admission answers by outcome (admitted, admitted_queued, deadline: a 503
    # queue_deadline...), from its own metrics: whose 503 an error was
    admission: dict[str, int] = field(default_factory=dict)


def make_row(policy: str, n: int, load: OpenLoop, cpu: float, router_metrics: str,
         served: tuple[float, float], decode: tuple[float, float]) -> Row:
    """The figures of one router's run: the client's TTFTs, the engines' counters, the
    router's own metrics (tokenization, its predicted hits, prefills it skipped)."""
    def metric(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in router_metrics.splitlines()
                   if line.startswith(name + "{"))

    tok_sum = sum(float(line.rsplit(" ", 1)[1]) for line in router_metrics.splitlines()
                  if line.startswith("pdreg_router_tokenize_seconds_sum"))
    picks = [line for line in router_metrics.splitlines()
             if line.startswith("pdreg_router_picks_total{")]
    skipped = sum(float(line.rsplit(" ", 1)[1]) * (1 if 'role="decode"' in line else -1)
                  for line in picks)
    routed = metric("pdreg_router_prompt_tokens_total")
    predicted = metric("pdreg_router_prompt_tokens_cached_total") / routed if routed else 0.0
    prompt, hit = served
    ttfts = load.ttfts
    admission: dict[str, int] = {}
    for line in router_metrics.splitlines():
        if line.startswith("pdreg_router_admission_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            admission[outcome] = admission.get(outcome, 0) + round(float(line.rsplit(" ", 1)[1]))
    return Row(policy, n, load.errors, 1000 * statistics.median(ttfts),
               1000 * percentiles(ttfts)[98], (prompt - hit) / n,
               hit / prompt if prompt else 0.0,
               router_cpu_ms_per_request=1000 * cpu / n,
               tokenize_ms_per_request=1000 * tok_sum / n, predicted_hit_rate=predicted,
               skipped_prefill=round(skipped),
               decode_prefill_tokens_per_request=(decode[0] - decode[1]) / n, ttfts=ttfts,
               slowest=[(i, round(1000 * t)) for i, t in sorted(
                   load.by_request.items(), key=lambda item: -item[1])[:max(3, n // 50)]],
               ttft_p99_warm_ms=1000 * percentiles(
                   [t for i, t in load.by_request.items() if i >= n // 3] or [0.0])[98],
               admission=admission)


def print_rows(rows: list[Row], fair: float, greedy: float, args: argparse.Namespace,
                rate: float) -> None:
    print(f"\noracle hit rate {fair:.1%} bounded load, {greedy:.1%} load "
          f"ignored ({args.requests} requests, {rate:.2f} req/s = "
          f"utilisation {args.utilisation}, {args.cache_blocks} blocks of {BLOCK} per "
          "prefill)")
    print(f"{'router':<28} {'TTFT p50':>9} {'p99':>8} {'prefill tok/req':>16} {'hit':>6} "
          f"{'vs oracle':>9} {'vs greedy':>9} {'CPU ms/req':>10} {'tokenize':>9} "
          f"{'errors':>6} {'predicted':>9} {'skipped P':>9} {'D tok/req':>9}")
    for r in rows:
        print(f"{r.router:<28} {r.ttft_p50_ms:>7.0f}ms {r.ttft_p99_ms:>6.0f}ms "
              f"{r.prefill_tokens_per_request:>16.0f} {r.hit_rate:>6.1%} {r.vs_oracle:>9.1%} "
              f"{r.vs_greedy_oracle:>9.1%} {r.router_cpu_ms_per_request:>10.2f} "
              f"{r.tokenize_ms_per_request:>7.3f}ms {r.errors:>6} {r.predicted_hit_rate:>9.1%} "
              f"{r.skipped_prefill:>9} {r.decode_prefill_tokens_per_request:>9.0f}")
    print("\nthe slowest 2% (request index, ms) and pdreg's admission answers:")
    for r in rows:
        print(f"{r.router:<28} {r.slowest} {r.admission or ''}")
    print("\nrouter CPU per request by thread (ms; wakes per request), threads over 0.01 ms:")
    for r in rows:
        busy = sorted(((t, ms) for t, ms in r.threads_ms_per_request.items() if ms > 0.01),
                      key=lambda item: -item[1])
        print(f"{r.router:<28} " + ", ".join(
            f"{t} {ms:.2f} ({r.threads_wakes_per_request.get(t, 0):.1f})" for t, ms in busy))
