"""Real SGLang P/D through pdreg and through sglang-router 0.3.2, on the same two servers.

One real SGLang prefill and one real SGLang decode (CPU, the tiny model, KV over Mooncake
TCP; started as `make test-sglang` starts them, each under `pdreg agent`). In front of
them, in turn and alternating over rounds:

- direct: this process does SGLang's handshake itself (the same body to P and D at once
  with bootstrap_host/port/room): the floor, no router;
- `pdreg router` (--policy round_robin), fed by the registry the sidecars registered with;
- sglang-router 0.3.2 (--pd-disaggregation --policy round_robin), given the two URLs and
  the bootstrap port.

Each round sends non-streamed 8-token completions at concurrency 1 and then 8, and
reads the router's CPU around each burst: the nanosecond run time of every thread of its
process tree (/proc/PID/task/TID/schedstat; utime/stime tick at 10 ms, too coarse when
the engines, not the router, set the pace), less what the router spends idle over the
same wall time (heartbeats, health checks), measured just before.

    .venv/bin/python bench/bench_sglang.py [--rounds 3]

Needs .venv-sglang and the tiny model (`tests/sglang/setup.sh`) and .venv-peers (made by
bench/peers.py on first use). Writes bench/out/sglang.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "sglang")]

import harness  # noqa: E402  (tests/sglang: real SGLang servers under pdreg agent)
import peers  # noqa: E402

from pdreg.testing import die_with_parent, free_low_port, stop_process, wait_until  # noqa: E402
from registry.server import RegistryConfig, RegistryServer  # noqa: E402
from wire.protocol import MemberState  # noqa: E402

STARTUP_TIMEOUT_S = 300.0
SERVE_TIMEOUT_S = 60.0
C1_REQUESTS = 40
C8_REQUESTS = 96
IDLE_WINDOW_S = 3.0  # the router's own background CPU is measured over this long
BODY = {"model": harness.MODEL_NAME, "prompt": "The registry keeps the live membership",
        "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
OUT = REPO / "bench" / "out" / "sglang.json"


@dataclass
class Target:
    name: str
    url: str
    cpu_s: Callable[[], float] | None = None
    direct: tuple[str, str, int] | None = None  # prefill URL, decode URL, bootstrap port


@dataclass
class Sample:
    router: str
    cpu_us_per_req_c1: float | None
    cpu_us_per_req_c8: float | None
    p50_ms_c1: float
    p99_ms_c1: float
    p50_ms_c8: float
    p99_ms_c8: float
    req_per_s_c8: float
    failed: int


@dataclass
class Load:
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    failed: int = 0


async def _one(session: aiohttp.ClientSession, target: Target) -> bool:
    if target.direct is None:
        async with session.post(target.url + "/v1/completions", json=BODY) as response:
            await response.read()
            return response.status == 200
    prefill, decode, bootstrap_port = target.direct
    body = {**BODY, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.randrange(2**63)}

    async def post(url: str) -> int:
        async with session.post(url + "/v1/completions", json=body) as response:
            await response.read()
            return response.status

    statuses = await asyncio.gather(post(prefill), post(decode))
    return statuses == [200, 200]


async def run_load(target: Target, requests: int, concurrency: int) -> Load:
    load = Load()
    left = requests
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                started = time.perf_counter()
                try:
                    ok = await _one(session, target)
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                if ok:
                    load.latencies.append(time.perf_counter() - started)
                else:
                    load.failed += 1
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        load.wall_s = time.perf_counter() - started
    return load


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


def tree_cpu_s(pid: int) -> float:
    """Run time of every live thread of a process and its descendants, in seconds."""
    total_ns = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                total_ns += int((task / "schedstat").read_text().split()[0])
                pending += [int(child) for child in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue  # exited meanwhile
    return total_ns / 1e9


def measure(target: Target) -> Sample:
    def burst(requests: int, concurrency: int) -> tuple[Load, float | None]:
        idle_rate = 0.0
        if target.cpu_s:
            idle_before = target.cpu_s()
            time.sleep(IDLE_WINDOW_S)  # measuring idle CPU: nothing to wait for
            idle_rate = (target.cpu_s() - idle_before) / IDLE_WINDOW_S
        cpu_before = target.cpu_s() if target.cpu_s else 0.0
        load = asyncio.run(run_load(target, requests, concurrency))
        cpu = None
        if target.cpu_s:
            busy = target.cpu_s() - cpu_before - idle_rate * load.wall_s
            cpu = busy / requests * 1e6
        return load, cpu

    c1, cpu1 = burst(C1_REQUESTS, 1)
    c8, cpu8 = burst(C8_REQUESTS, 8)
    sample = Sample(
        router=target.name, cpu_us_per_req_c1=cpu1, cpu_us_per_req_c8=cpu8,
        p50_ms_c1=statistics.median(c1.latencies) * 1e3, p99_ms_c1=p99(c1.latencies) * 1e3,
        p50_ms_c8=statistics.median(c8.latencies) * 1e3, p99_ms_c8=p99(c8.latencies) * 1e3,
        req_per_s_c8=len(c8.latencies) / c8.wall_s, failed=c1.failed + c8.failed)
    print(f"  {target.name:14s} cpu/req c1={cpu1 or 0:.0f}us c8={cpu8 or 0:.0f}us "
          f"c1 p50/p99={sample.p50_ms_c1:.0f}/{sample.p99_ms_c1:.0f}ms "
          f"c8 p50/p99={sample.p50_ms_c8:.0f}/{sample.p99_ms_c8:.0f}ms "
          f"{sample.req_per_s_c8:.1f} req/s failed={sample.failed}", flush=True)
    return sample


def serves(target: Target) -> bool:
    return asyncio.run(run_load(target, 1, 1)).failed == 0


def median_of(samples: list[Sample]) -> Sample:
    def med(name: str) -> float | None:
        values = [getattr(s, name) for s in samples if getattr(s, name) is not None]
        return statistics.median(values) if values else None

    return Sample(router=samples[0].router, cpu_us_per_req_c1=med("cpu_us_per_req_c1"),
                  cpu_us_per_req_c8=med("cpu_us_per_req_c8"),
                  p50_ms_c1=med("p50_ms_c1") or 0.0, p99_ms_c1=med("p99_ms_c1") or 0.0,
                  p50_ms_c8=med("p50_ms_c8") or 0.0, p99_ms_c8=med("p99_ms_c8") or 0.0,
                  req_per_s_c8=med("req_per_s_c8") or 0.0,
                  failed=sum(s.failed for s in samples))


def start_pdreg_router(registry: str) -> tuple[subprocess.Popen[bytes], Target]:
    log = tempfile.NamedTemporaryFile(prefix="pdreg-bench-router-", suffix=".log",  # noqa: SIM115
                                      delete=False)
    proc = subprocess.Popen(
        [*harness.PDREG, "--log-level", "WARNING", "router", "--registry", registry,
         "--port", str(free_low_port()), "--policy", "round_robin", "--no-register",
         "--allow-upstream", "127.0.0.0/8,::1/128"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent)
    assert proc.stdout is not None
    url = json.loads(proc.stdout.readline())["url"]
    return proc, Target("pdreg", url, lambda: tree_cpu_s(proc.pid))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sglang-venv", type=Path, default=REPO / ".venv-sglang")
    parser.add_argument("--model-dir", type=Path,
                        default=REPO / ".cache" / "sglang-tiny-model")
    args = parser.parse_args()
    sglang_python = args.sglang_venv.resolve() / "bin" / "python"
    if not sglang_python.exists():
        print(f"no SGLang at {args.sglang_venv}: run tests/sglang/setup.sh first")
        return 2
    peers.ensure_peers_venv()
    registry = RegistryServer(RegistryConfig(host="127.0.0.1", port=0, events_port=0,
                                             http_port=-1, heartbeat_interval_s=0.5)).start()
    workdir = Path(tempfile.mkdtemp(prefix="pdreg-bench-sglang-"))
    prefill = harness.Engine("prefill", workdir / "prefill.log", role="prefill",
                             port=free_low_port(), bootstrap_port=free_low_port(),
                             omp_bind="0")
    decode = harness.Engine("decode", workdir / "decode.log", role="decode",
                            port=free_low_port(), omp_bind="1")
    router_proc: subprocess.Popen[bytes] | None = None
    sglang_router: peers.PeerRouter | None = None
    try:
        for engine in (prefill, decode):
            engine.launch(sglang_python, args.model_dir.resolve(), registry.control_address)
        members = registry.members
        if not wait_until(lambda: all(
                (m := members().get(e.member_id)) is not None and m.state is MemberState.READY
                for e in (prefill, decode)), STARTUP_TIMEOUT_S, 0.5):
            raise RuntimeError(f"SGLang servers not READY; logs in {workdir}")
        router_proc, pdreg_target = start_pdreg_router(registry.control_address)
        sglang_router = peers.start_sglang_router([(prefill.url, prefill.bootstrap_port)],
                                                  [decode.url], policy="round_robin")
        targets = [
            Target("direct", prefill.url, direct=(prefill.url, decode.url,
                                                  prefill.bootstrap_port)),
            pdreg_target,
            Target("sglang-router", sglang_router.url,
                   lambda: tree_cpu_s(sglang_router.proc.pid)),
        ]
        for target in targets:  # sglang-router answers 503 for a few seconds at first
            if not wait_until(lambda t=target: serves(t), SERVE_TIMEOUT_S, 0.5):
                raise RuntimeError(f"{target.name} does not serve at {target.url}")
            asyncio.run(run_load(target, 8, 4))  # warm connection pools
        samples: dict[str, list[Sample]] = {t.name: [] for t in targets}
        for round_number in range(args.rounds):
            print(f"round {round_number + 1}/{args.rounds}", flush=True)
            order = targets if round_number % 2 == 0 else list(reversed(targets))
            for target in order:
                samples[target.name].append(measure(target))
        results = [median_of(s) for s in samples.values()]
    finally:
        if sglang_router is not None:
            sglang_router.stop()
        if router_proc is not None:
            stop_process(router_proc, 10.0)
        for engine in (prefill, decode):
            engine.stop()
        registry.close()
    print_table(results, args.rounds)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


def print_table(results: list[Sample], rounds: int) -> None:
    print(f"\nmedian of {rounds} rounds; c=1: {C1_REQUESTS} requests, c=8: {C8_REQUESTS}")
    print("| path | router CPU per request c=1 / c=8 | latency p50 / p99 c=1 | "
          "latency p50 / p99 c=8 | req/s c=8 | failed |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        cpu = ("-" if r.cpu_us_per_req_c1 is None else
               f"{r.cpu_us_per_req_c1:,.0f} / {r.cpu_us_per_req_c8 or 0:,.0f} µs")
        print(f"| {r.router} | {cpu} | {r.p50_ms_c1:.0f} / {r.p99_ms_c1:.0f} ms | "
              f"{r.p50_ms_c8:.0f} / {r.p99_ms_c8:.0f} ms | {r.req_per_s_c8:.1f} | "
              f"{r.failed} |")


if __name__ == "__main__":
    sys.exit(main())
