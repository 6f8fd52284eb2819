"""Routers side by side: CPU per request, latency, req/s; and p99 TTFT with a slow prefill.

In front of the same 2 prefill + 2 decode sim engines (registered with a real registry
for pdreg, given as static URLs to the peers), the same aiohttp load generator (in this
process) drives:

- direct: one mixed sim engine, no router (one hop, no handshake);
- vLLM's two-stage NIXL handshake: `pdreg router` (engines registered as vllm-nixl) and
  vllm-router 0.1.17 (--policy round_robin);
- SGLang's bootstrap handshake: `pdreg router` (engines registered as sglang),
  sglang-router 0.3.2 (round_robin) and SGLang's Python mini_lb (random).

Router CPU is utime+stime of the router process and its children (/proc/PID/stat) over the
concurrency-32 burst. Then the same line-up in front of engines where one prefill is 10x
slower, under streaming clients: p50/p99 time to first token, and the share of requests
each router sent to the slow prefill (from the engines' own request counters).

    .venv/bin/python bench/bench_router.py [--requests 2000] [--policy power_of_two]

Writes bench/out/router.json and the plot bench/plots/router.png (matplotlib from
.venv-peers, which bench/peers.py installs on first use).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

import peers  # noqa: E402
from reference_helpers import (  # noqa: E402
    EngineHandle,
    metrics,
    start_engine,
    start_engines,
    stop_all,
)

from pdreg.demo.traffic import TrafficGenerator, figures  # noqa: E402
from pdreg.testing import die_with_parent, free_low_port, stop_process, wait_until  # noqa: E402
from registry.server import RegistryConfig, RegistryServer  # noqa: E402

BODY = {"model": "tiny", "prompt": "benchmark prompt", "max_tokens": 4, "ignore_eos": True}
OUT_DIR = REPO / "bench" / "out"
PLOT_PATH = REPO / "bench" / "plots" / "router.png"
PLOT_SCRIPT = REPO / "bench" / "plots" / "plot_router.py"
WARMUP_REQUESTS = 50
READY_TIMEOUT_S = 30.0
ROUTER_STOP_TIMEOUT_S = 20.0
# Slow-prefill scenario: per prompt token (a ~25-token prompt: fast ≈ 12 ms, slow ≈ 125 ms).
FAST_PREFILL_S_PER_TOKEN = 0.0005
SLOW_PREFILL_S_PER_TOKEN = 0.005
DECODE_S_PER_TOKEN = 0.002
STREAM_CLIENTS = 8
STREAM_SECONDS = 6.0
REQUESTS_REQUEST_COUNTER = "pdreg:engine_requests_total"


@dataclass
class Row:
    """One router's figures in the steady scenario."""

    router: str
    handshake: str
    cpu_us_per_req: float | None = None
    p50_ms_c1: float = 0.0
    p99_ms_c1: float = 0.0
    p50_ms_c32: float = 0.0
    p99_ms_c32: float = 0.0
    req_per_s_c32: float = 0.0
    failed: int = 0


@dataclass
class SlowRow:
    """One router's figures with one slow prefill."""

    router: str
    handshake: str
    ok: int = 0
    failed: int = 0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    slow_share: float = 0.0  # of prefill requests, the share the slow prefill served


@dataclass
class Target:
    name: str
    url: str
    cpu_s: Callable[[], float] | None = field(default=None)


# --- load ------------------------------------------------------------------------------


async def run_load(url: str, requests: int, concurrency: int
                   ) -> tuple[list[float], float, int]:
    """Latencies (s) of the successful POSTs, the wall time, and the failures."""
    latencies: list[float] = []
    failed = 0
    payload = json.dumps(BODY).encode()
    headers = {"Content-Type": "application/json"}
    left = requests
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        async def worker() -> None:
            nonlocal left, failed
            while left > 0:
                left -= 1
                started = time.perf_counter()
                try:
                    async with session.post(url + "/v1/completions", data=payload,
                                            headers=headers) as response:
                        await response.read()
                        ok = response.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - started)
                else:
                    failed += 1
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - started, failed


def serves(url: str) -> bool:
    _, _, failed = asyncio.run(run_load(url, 1, 1))
    return failed == 0


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


def measure(target: Target, handshake: str, requests: int) -> Row:
    if not wait_until(lambda: serves(target.url), READY_TIMEOUT_S, poll_s=0.2):
        raise RuntimeError(f"{target.name} does not serve requests at {target.url}")
    asyncio.run(run_load(target.url, WARMUP_REQUESTS, 4))  # warm connection pools
    row = Row(router=target.name, handshake=handshake)
    lat1, _, failed1 = asyncio.run(run_load(target.url, max(100, requests // 10), 1))
    row.p50_ms_c1, row.p99_ms_c1 = statistics.median(lat1) * 1e3, p99(lat1) * 1e3
    cpu_before = target.cpu_s() if target.cpu_s else 0.0
    lat32, wall, failed32 = asyncio.run(run_load(target.url, requests, 32))
    if target.cpu_s:
        row.cpu_us_per_req = (target.cpu_s() - cpu_before) / requests * 1e6
    row.p50_ms_c32, row.p99_ms_c32 = statistics.median(lat32) * 1e3, p99(lat32) * 1e3
    row.req_per_s_c32 = len(lat32) / wall
    row.failed = failed1 + failed32
    print(f"  {target.name:24s} cpu/req={row.cpu_us_per_req or 0:.0f}us "
          f"c1 p50/p99={row.p50_ms_c1:.2f}/{row.p99_ms_c1:.2f}ms "
          f"c32 p50/p99={row.p50_ms_c32:.1f}/{row.p99_ms_c32:.1f}ms "
          f"{row.req_per_s_c32:.0f} req/s failed={row.failed}", flush=True)
    return row


def measure_slow(target: Target, handshake: str, prefills: list[EngineHandle]) -> SlowRow:
    """Streaming clients for STREAM_SECONDS; TTFT and where the prefills went."""
    if not wait_until(lambda: serves(target.url), READY_TIMEOUT_S, poll_s=0.2):
        raise RuntimeError(f"{target.name} does not serve requests at {target.url}")
    before = [metrics(p.url)[REQUESTS_REQUEST_COUNTER] for p in prefills]
    traffic = TrafficGenerator(target.url, clients=STREAM_CLIENTS).start()
    started = time.monotonic()
    try:
        time.sleep(STREAM_SECONDS)  # the measurement window itself, not a wait for a state
    finally:
        traffic.stop()
    after = [metrics(p.url)[REQUESTS_REQUEST_COUNTER] for p in prefills]
    served = [a - b for a, b in zip(after, before, strict=True)]
    result = figures(traffic.records(), started, time.monotonic())
    row = SlowRow(router=target.name, handshake=handshake, ok=result.ok, failed=result.failed,
                  slow_share=served[0] / max(1.0, sum(served)))
    if result.ttft_p50_s is not None and result.ttft_p99_s is not None:
        row.ttft_p50_ms, row.ttft_p99_ms = result.ttft_p50_s * 1e3, result.ttft_p99_s * 1e3
    print(f"  {target.name:24s} TTFT p50/p99={row.ttft_p50_ms or 0:.0f}/"
          f"{row.ttft_p99_ms or 0:.0f}ms slow-prefill share={row.slow_share:.0%} "
          f"ok={row.ok} failed={row.failed}", flush=True)
    return row


# --- the processes ---------------------------------------------------------------------


@contextmanager
def pd_engines(handshake: str, slow: bool) -> Iterator[tuple[str, list[EngineHandle]]]:
    """A registry and 2P+2D sim engines registered with it as `handshake` members.

    With `slow`, prefill 0 is 10x slower than prefill 1 (and decoding takes time too).
    Yields the registry's control address and the engines, prefills first.
    """
    def sim_args(prefill_s_per_token: float) -> list[str]:
        return ["--sim-prefill-delay", str(prefill_s_per_token),
                "--sim-decode-delay", str(DECODE_S_PER_TOKEN)] if slow else []
    specs = [
        {"role": "prefill", "extra_args": sim_args(SLOW_PREFILL_S_PER_TOKEN)},
        {"role": "prefill", "extra_args": sim_args(FAST_PREFILL_S_PER_TOKEN)},
        {"role": "decode", "extra_args": sim_args(0.0)},
        {"role": "decode", "extra_args": sim_args(0.0)},
    ]
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


@contextmanager
def pdreg_router(registry: str, policy: str) -> Iterator[Target]:
    port = free_low_port()
    # its log goes to a file: a client that hangs up after [DONE] makes aiohttp log a
    # traceback per request, which would drown the bench's own output
    log = tempfile.NamedTemporaryFile(prefix="pdreg-bench-router-", suffix=".log")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "--log-level", "WARNING", "router", "--registry",
         registry, "--port", str(port), "--policy", policy, "--no-register"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent)
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["url"]
        yield Target(f"pdreg ({policy})", url, lambda: peers.process_tree_cpu_s(proc.pid))
    finally:
        stop_process(proc, ROUTER_STOP_TIMEOUT_S)
        errors = Path(log.name).read_text(errors="replace").count(" ERROR ")
        if errors:
            print(f"  (pdreg router logged {errors} ERROR lines)", flush=True)
        log.close()


@contextmanager
def peer(router: peers.PeerRouter) -> Iterator[Target]:
    try:
        yield Target(router.name, router.url, router.cpu_s)
    finally:
        router.stop()


def lineup(handshake: str, registry: str, policy: str, handles: list[EngineHandle]
           ) -> list[Callable[[], AbstractContextManager[Target]]]:
    """Context-manager factories for every router that speaks `handshake`, pdreg first."""
    prefills, decodes = handles[:2], [h.url for h in handles[2:]]
    with_bootstrap = [(h.url, h.bootstrap_port) for h in prefills]
    factories: list[Callable[[], AbstractContextManager[Target]]] = [
        lambda: pdreg_router(registry, policy)]
    if handshake == "vllm-nixl":
        factories.append(lambda: peer(peers.start_vllm_router(
            [h.url for h in prefills], decodes)))
    else:
        factories.append(lambda: peer(peers.start_sglang_router(with_bootstrap, decodes)))
        factories.append(lambda: peer(peers.start_sglang_router(
            with_bootstrap, decodes, mini_lb=True)))
    return factories


def run_all(requests: int, policy: str) -> tuple[list[Row], list[SlowRow]]:
    rows: list[Row] = []
    slow_rows: list[SlowRow] = []
    with start_engine(role="mixed", backend="sim") as direct:
        print("direct (mixed engine)", flush=True)
        rows.append(measure(Target("direct (no router)", direct.url), "-", requests))
    for handshake in ("vllm-nixl", "sglang"):
        for slow in (False, True):
            print(f"{handshake} handshake, {'one slow prefill' if slow else 'steady'}",
                  flush=True)
            with pd_engines(handshake, slow) as (registry, handles):
                for factory in lineup(handshake, registry, policy, handles):
                    with factory() as target:
                        if slow:
                            slow_rows.append(measure_slow(target, handshake, handles[:2]))
                        else:
                            rows.append(measure(target, handshake, requests))
    return rows, slow_rows


# --- report ----------------------------------------------------------------------------


def print_tables(rows: list[Row], slow_rows: list[SlowRow], requests: int) -> None:
    print(f"\n{requests} requests at c=32, {max(100, requests // 10)} at c=1\n")
    print("| router | handshake | router CPU per request | p50 / p99 at c=1 "
          "| p50 / p99 at c=32 | req/s at c=32 | failed |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        cpu = f"{r.cpu_us_per_req:.0f} µs" if r.cpu_us_per_req is not None else "-"
        print(f"| {r.router} | {r.handshake} | {cpu} | {r.p50_ms_c1:.2f} / "
              f"{r.p99_ms_c1:.2f} ms | {r.p50_ms_c32:.1f} / {r.p99_ms_c32:.1f} ms | "
              f"{r.req_per_s_c32:,.0f} | {r.failed} |")
    print(f"\none slow prefill ({SLOW_PREFILL_S_PER_TOKEN * 1e3:g} ms/token vs "
          f"{FAST_PREFILL_S_PER_TOKEN * 1e3:g}), {STREAM_CLIENTS} streaming clients, "
          f"{STREAM_SECONDS:g} s each\n")
    print("| router | handshake | TTFT p50 | TTFT p99 | requests to the slow prefill "
          "| ok | failed |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for s in slow_rows:
        print(f"| {s.router} | {s.handshake} | {s.ttft_p50_ms or 0:.0f} ms | "
              f"{s.ttft_p99_ms or 0:.0f} ms | {s.slow_share:.0%} | {s.ok} | {s.failed} |")


def save_and_plot(rows: list[Row], slow_rows: list[SlowRow]) -> None:
    OUT_DIR.mkdir(exist_ok=True)
    data_path = OUT_DIR / "router.json"
    data_path.write_text(json.dumps({"steady": [asdict(r) for r in rows],
                                     "slow_prefill": [asdict(s) for s in slow_rows]},
                                    indent=1))
    python = peers.ensure_peers_venv() / "bin" / "python"
    done = subprocess.run([str(python), str(PLOT_SCRIPT), str(data_path), str(PLOT_PATH)],
                          check=False)
    print(f"\nfigures: {data_path}; plot: {PLOT_PATH if done.returncode == 0 else 'failed'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--policy", default="power_of_two")
    args = parser.parse_args()
    peers.ensure_peers_venv()
    rows, slow_rows = run_all(args.requests, args.policy)
    print_tables(rows, slow_rows, args.requests)
    save_and_plot(rows, slow_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
