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
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "sglang")]

import harness  # noqa: E402  (tests/sglang: real SGLang servers under pdreg agent)

from bench import peers  # noqa: E402
from bench.load import Load, Send, completion, run_closed_loop, serves  # noqa: E402
from bench.procs import router_process, tree_run_s  # noqa: E402
from bench.tables import p99, print_table, write_json  # noqa: E402
from pdreg.testing import free_low_port, wait_until  # noqa: E402
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
LOAD_TIMEOUT_S = 120.0


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


def sender(target: Target) -> Send:
    """A request to `target`: through its router, or (direct) SGLang's handshake done
    here: the same body to P and D at once with bootstrap_host/port/room."""
    if target.direct is None:
        return completion(target.url, BODY)
    prefill, decode, bootstrap_port = target.direct

    async def send(session: aiohttp.ClientSession) -> bool:
        body = {**BODY, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
                "bootstrap_room": random.randrange(2**63)}

        async def post(url: str) -> int:
            async with session.post(url + "/v1/completions", json=body) as response:
                await response.read()
                return response.status

        return await asyncio.gather(post(prefill), post(decode)) == [200, 200]
    return send


def measure(target: Target) -> Sample:
    def burst(requests: int, concurrency: int) -> tuple[Load, float | None]:
        idle_rate = 0.0
        if target.cpu_s:
            idle_before = target.cpu_s()
            time.sleep(IDLE_WINDOW_S)  # measuring idle CPU: nothing to wait for
            idle_rate = (target.cpu_s() - idle_before) / IDLE_WINDOW_S
        cpu_before = target.cpu_s() if target.cpu_s else 0.0
        load = run_closed_loop(sender(target), requests, concurrency, LOAD_TIMEOUT_S)
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


@contextmanager
def sglang_pd(sglang_python: Path, model_dir: Path) -> Iterator[tuple[RegistryServer,
                                                                      harness.Engine,
                                                                      harness.Engine]]:
    """A registry, and one real SGLang prefill and decode registered with it (each under
    `pdreg agent`, as `make test-sglang` starts them), READY."""
    registry = RegistryServer(RegistryConfig(host="127.0.0.1", port=0, events_port=0,
                                             http_port=-1, heartbeat_interval_s=0.5)).start()
    workdir = Path(tempfile.mkdtemp(prefix="pdreg-bench-sglang-"))
    prefill = harness.Engine("prefill", workdir / "prefill.log", role="prefill",
                             port=free_low_port(), bootstrap_port=free_low_port(),
                             omp_bind="0")
    decode = harness.Engine("decode", workdir / "decode.log", role="decode",
                            port=free_low_port(), omp_bind="1")
    try:
        for engine in (prefill, decode):
            engine.launch(sglang_python, model_dir, registry.control_address)
        members = registry.members
        if not wait_until(lambda: all(
                (m := members().get(e.member_id)) is not None and m.state is MemberState.READY
                for e in (prefill, decode)), STARTUP_TIMEOUT_S, 0.5):
            raise RuntimeError(f"SGLang servers not READY; logs in {workdir}")
        yield registry, prefill, decode
    finally:
        for engine in (prefill, decode):
            engine.stop()
        registry.close()


def start_targets(stack: ExitStack, registry: str, prefill: harness.Engine,
                  decode: harness.Engine) -> list[Target]:
    """Direct, `pdreg router` and sglang-router in front of the pair, each serving and
    its connection pools warm (sglang-router answers 503 for a few seconds at first)."""
    router = stack.enter_context(router_process(
        registry, "round_robin", flags=("--allow-upstream", "127.0.0.0/8,::1/128")))
    sglang_router = peers.start_sglang_router([(prefill.url, prefill.bootstrap_port)],
                                              [decode.url], policy="round_robin")
    stack.callback(sglang_router.stop)
    targets = [
        Target("direct", prefill.url, direct=(prefill.url, decode.url,
                                              prefill.bootstrap_port)),
        Target("pdreg", router.url, lambda: tree_run_s(router.proc.pid)),
        Target("sglang-router", sglang_router.url,
               lambda: tree_run_s(sglang_router.proc.pid)),
    ]
    for target in targets:
        send = sender(target)
        if not wait_until(lambda send=send: serves(send), SERVE_TIMEOUT_S, 0.5):
            raise RuntimeError(f"{target.name} does not serve at {target.url}")
        run_closed_loop(send, 8, 4, LOAD_TIMEOUT_S)  # warm connection pools
    return targets


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
    with sglang_pd(sglang_python, args.model_dir.resolve()) as (registry, prefill, decode), \
            ExitStack() as stack:
        targets = start_targets(stack, registry.control_address, prefill, decode)
        samples: dict[str, list[Sample]] = {t.name: [] for t in targets}
        for round_number in range(args.rounds):  # alternating: the machine's load drifts
            print(f"round {round_number + 1}/{args.rounds}", flush=True)
            order = targets if round_number % 2 == 0 else list(reversed(targets))
            for target in order:
                samples[target.name].append(measure(target))
        results = [median_of(s) for s in samples.values()]
    print_results(results, args.rounds)
    write_json(OUT, [asdict(r) for r in results])
    return 0


def print_results(results: list[Sample], rounds: int) -> None:
    print(f"\nmedian of {rounds} rounds; c=1: {C1_REQUESTS} requests, c=8: {C8_REQUESTS}")

    def cells(r: Sample) -> list[str]:
        cpu = ("-" if r.cpu_us_per_req_c1 is None else
               f"{r.cpu_us_per_req_c1:,.0f} / {r.cpu_us_per_req_c8 or 0:,.0f} µs")
        return [r.router, cpu, f"{r.p50_ms_c1:.0f} / {r.p99_ms_c1:.0f} ms",
                f"{r.p50_ms_c8:.0f} / {r.p99_ms_c8:.0f} ms", f"{r.req_per_s_c8:.1f}",
                str(r.failed)]
    print_table(["path", "router CPU per request c=1 / c=8", "latency p50 / p99 c=1",
                 "latency p50 / p99 c=8", "req/s c=8", "failed"], map(cells, results),
                "lrrrrr")


if __name__ == "__main__":
    sys.exit(main())
