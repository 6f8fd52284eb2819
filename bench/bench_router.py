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

A 64-request p99 moves more between runs than between routers on a small shared
machine, so `--cold-only --repeat N` measures the cold burst alone, N launches of every
router (mini_lb left out), each launch a freshly started router in front of engines
kept up for the whole run, the routers' order rotated every round; it reports each
router's median and range of the cold p99 and cold CPU per request, and writes
bench/out/router_cold.json. `--baseline-src` routers join the rotation, each in front of
its own tree's registry and engines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # `bench` and pdreg; the engine helpers

from reference_helpers import (  # noqa: E402
    EngineHandle,
    metrics,
    start_engine,
    start_engines,
    stop_all,
)

from bench import peers  # noqa: E402
from bench.load import completion, run_closed_loop, serves  # noqa: E402
from bench.procs import LOCAL_ROUTER_FLAGS, router_process, tree_run_s  # noqa: E402
from bench.tables import p99, print_table  # noqa: E402
from pdreg.demo.traffic import TrafficGenerator, figures  # noqa: E402
from pdreg.testing import die_with_parent, free_low_port, stop_process, wait_until  # noqa: E402
from registry.server import RegistryConfig, RegistryServer  # noqa: E402

BODY = {"model": "tiny", "prompt": "benchmark prompt", "max_tokens": 4, "ignore_eos": True}
OUT_DIR = REPO / "bench" / "out"
PLOT_PATH = REPO / "bench" / "plots" / "router.png"
PLOT_SCRIPT = REPO / "bench" / "plots" / "plot_router.py"
WARMUP_REQUESTS = 200
COLD_REQUESTS = 64
CONCURRENCY = 32
READY_TIMEOUT_S = 30.0
ROUTER_STOP_TIMEOUT_S = 20.0
# Slow-worker scenarios. Prefill per prompt token (a ~25-token prompt: fast ≈ 12 ms,
# slow ≈ 125 ms); decode per output token (8 tokens: fast ≈ 16 ms, slow ≈ 80 ms).
FAST_PREFILL_S_PER_TOKEN = 0.0005
SLOW_PREFILL_S_PER_TOKEN = 0.005
FAST_DECODE_S_PER_TOKEN = 0.002
SLOW_DECODE_S_PER_TOKEN = 0.010
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


@dataclass
class Target:
    name: str
    url: str
    cpu_s: Callable[[], float] | None = field(default=None)
    pid: int | None = None  # the router process (its tree's run time: the cold burst)


@dataclass
class ColdRow:
    """One router's cold bursts over `--repeat` launches: medians and ranges."""

    router: str
    handshake: str
    p99_ms: list[float] = field(default_factory=list)
    cpu_us_per_req: list[float] = field(default_factory=list)
    failed: int = 0


# --- measuring ---------------------------------------------------------------------------


def measure(target: Target, handshake: str, requests: int) -> Row:
    send = completion(target.url, BODY)
    if not wait_until(lambda: serves(send), READY_TIMEOUT_S, poll_s=0.2):
        raise RuntimeError(f"{target.name} does not serve requests at {target.url}")
    row = Row(router=target.name, handshake=handshake)
    cold_failed = cold_burst(target, row)
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
    row.failed = cold_failed + c1.failed + c32.failed
    print(f"  {target.name:24s} cpu/req={row.cpu_us_per_req or 0:.0f}us "
          f"cold c32 p99={row.cold_p99_ms:.1f}ms cpu/req={row.cold_cpu_us_per_req or 0:.0f}us "
          f"c1 p50/p99={row.p50_ms_c1:.2f}/{row.p99_ms_c1:.2f}ms "
          f"c32 p50/p99={row.p50_ms_c32:.1f}/{row.p99_ms_c32:.1f}ms "
          f"{row.req_per_s_c32:.0f} req/s failed={row.failed}", flush=True)
    return row


def cold_burst(target: Target, row: Row) -> int:
    """COLD_REQUESTS at c=CONCURRENCY on fresh connections into `row`; how many failed.
    CPU from the threads' run time (nanoseconds): a 64-request burst is a few 10 ms ticks."""
    send = completion(target.url, BODY)
    cpu_before = tree_run_s(target.pid) if target.pid else 0.0
    cold = run_closed_loop(send, COLD_REQUESTS, CONCURRENCY)
    if target.pid:
        row.cold_cpu_us_per_req = (tree_run_s(target.pid) - cpu_before) / COLD_REQUESTS * 1e6
    row.cold_p99_ms = p99(cold.latencies) * 1e3 if cold.latencies else 0.0
    return cold.failed


def measure_cold(target: Target, handshake: str) -> Row:
    """A freshly started router's cold burst alone (after the one request that says it
    serves, as in `measure`)."""
    send = completion(target.url, BODY)
    if not wait_until(lambda: serves(send), READY_TIMEOUT_S, poll_s=0.2):
        raise RuntimeError(f"{target.name} does not serve requests at {target.url}")
    row = Row(router=target.name, handshake=handshake)
    row.failed = cold_burst(target, row)
    print(f"  {target.name:28s} {handshake:9s} cold c32 p99={row.cold_p99_ms:.1f}ms "
          f"cpu/req={row.cold_cpu_us_per_req or 0:.0f}us failed={row.failed}", flush=True)
    return row


def measure_slow(target: Target, handshake: str, slow: str,
                 workers: list[EngineHandle]) -> SlowRow:
    """Streaming clients for STREAM_SECONDS: TTFT, end to end, and where `workers` (the
    slow role's engines, the slow one first; empty for a fast-only run) were used."""
    send = completion(target.url, BODY)
    if not wait_until(lambda: serves(send), READY_TIMEOUT_S, poll_s=0.2):
        raise RuntimeError(f"{target.name} does not serve requests at {target.url}")
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


# --- the processes ---------------------------------------------------------------------


@contextmanager
def pd_engines(handshake: str, slow: str = "", fast_only: bool = False
               ) -> Iterator[tuple[str, list[EngineHandle]]]:
    """A registry and 2P+2D sim engines registered with it as `handshake` members.

    `slow` "prefill": prefill 0 is 10x slower than prefill 1; "decode": decode 0 is 5x
    slower per token than decode 1 (both with timed prefill and decode); "": no delays.
    `fast_only`: the slow engine is left out (2 engines of the other role stay).
    Yields the registry's control address and the engines, prefills first.
    """
    def sim_args(role: str, slow_one: bool) -> list[str]:
        if not slow:
            return []
        prefill = SLOW_PREFILL_S_PER_TOKEN if slow_one and role == "prefill" else \
            FAST_PREFILL_S_PER_TOKEN
        decode = SLOW_DECODE_S_PER_TOKEN if slow_one and role == "decode" else \
            FAST_DECODE_S_PER_TOKEN
        return ["--sim-prefill-delay", str(prefill), "--sim-decode-delay", str(decode)]
    specs = []
    for role in ("prefill", "decode"):
        for index in range(2):
            slow_one = role == slow and index == 0
            if slow_one and fast_only:
                continue
            specs.append({"role": role, "extra_args": sim_args(role, slow_one)})
    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0))
    registry.start()
    handles: list[EngineHandle] = []
    try:
        handles = start_engines([{**s, "backend": "sim", "protocol": handshake,
                                  "registry": registry.control_address} for s in specs])
        yield registry.control_address, handles
    finally:
        stop_all(handles)
        registry.close()


ROUTER_ARGS: list[str] = []  # --router-args: extra `pdreg router` flags for every run
BASELINE_SRC: list[Path] = []  # --baseline-src: another pdreg source tree, run beside


@contextmanager
def baseline_engines(src: Path, handshake: str) -> Iterator[str]:
    """Another pdreg version's registry and 2P+2D sim engines (their wire protocol may
    differ from this tree's); yields the registry's control address."""
    ports = [free_low_port()]
    ports += [free_low_port(avoid=set(ports)) for _ in range(2)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "--log-level", "WARNING", "registry", "--port",
         str(ports[0]), "--events-port", str(ports[1]), "--http-port", str(ports[2])],
        cwd=src, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    handles: list[EngineHandle] = []
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # "pdreg registry: control ..." once its sockets are bound
        address = f"127.0.0.1:{ports[0]}"
        handles = start_engines([{"role": role, "backend": "sim", "protocol": handshake,
                                  "registry": address, "src": src}
                                 for role in ("prefill", "prefill", "decode", "decode")])
        yield address
    finally:
        stop_all(handles)
        stop_process(proc, ROUTER_STOP_TIMEOUT_S)


def _flags_known(src: Path) -> list[str]:
    """LOCAL_ROUTER_FLAGS that another version's `pdreg router` has (an older one may lack
    --allow-upstream, and then sends to loopback anyway)."""
    text = (src / "pdreg" / "cmd_router.py").read_text()
    pairs = zip(LOCAL_ROUTER_FLAGS[::2], LOCAL_ROUTER_FLAGS[1::2], strict=True)
    return [part for flag, value in pairs if f'"{flag}"' in text for part in (flag, value)]


@contextmanager
def pdreg_router(registry: str, policy: str, label: str = "", src: Path | None = None
                 ) -> Iterator[Target]:
    """`src`: run the router of another pdreg source tree (e.g. an export of main), with
    only the flags every version has."""
    flags = _flags_known(src) if src else [*LOCAL_ROUTER_FLAGS, *ROUTER_ARGS]
    with router_process(registry, policy, flags=flags, src=src or REPO) as router:
        try:
            yield Target(label or f"pdreg ({policy})", router.url, router.cpu_s,
                         router.proc.pid)
        finally:
            errors = router.error_lines()
            if errors:
                print(f"  (pdreg router logged {errors} ERROR lines)", flush=True)


@contextmanager
def peer(router: peers.PeerRouter) -> Iterator[Target]:
    try:
        yield Target(router.name, router.url, router.cpu_s, router.proc.pid)
    finally:
        router.stop()


def lineup(handshake: str, registry: str, policies: list[str], handles: list[EngineHandle],
           peers_too: bool = True, mini_lb: bool = True
           ) -> list[Callable[[], AbstractContextManager[Target]]]:
    """Context-manager factories for every router that speaks `handshake`, pdreg first."""
    prefills = [h for h in handles if h.id.startswith("prefill")]
    decodes = [h.url for h in handles if h.id.startswith("decode")]
    with_bootstrap = [(h.url, h.bootstrap_port) for h in prefills]
    factories: list[Callable[[], AbstractContextManager[Target]]] = [
        lambda policy=policy: pdreg_router(registry, policy) for policy in policies]
    if not peers_too:
        return factories
    if handshake == "vllm-nixl":
        factories.append(lambda: peer(peers.start_vllm_router(
            [h.url for h in prefills], decodes)))
    else:
        factories.append(lambda: peer(peers.start_sglang_router(with_bootstrap, decodes)))
        if mini_lb:
            factories.append(lambda: peer(peers.start_sglang_router(
                with_bootstrap, decodes, mini_lb=True)))
    return factories


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
                        row = measure_cold(target, handshake)
                    cold = found.setdefault((row.router, handshake),
                                            ColdRow(row.router, handshake))
                    cold.p99_ms.append(row.cold_p99_ms)
                    if row.cold_cpu_us_per_req is not None:
                        cold.cpu_us_per_req.append(row.cold_cpu_us_per_req)
                    cold.failed += row.failed
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
    OUT_DIR.mkdir(exist_ok=True)
    path = OUT_DIR / "router_cold.json"
    path.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(f"\nfigures: {path}")


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
