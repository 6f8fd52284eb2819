"""Router overhead: CPU per request, latency at concurrency 1 and 32, req/s.

In front of 2 prefill + 2 decode sim engines (vllm-nixl handshake, registered with a real
registry), compare a request sent straight to a mixed sim engine with one through
`pdreg router` (a subprocess, so its CPU time can be read from /proc/PID/stat).

    .venv/bin/python bench/bench_router.py [--requests 2000] [--policy power_of_two]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from reference_helpers import EngineHandle, start_engine, start_engines  # noqa: E402

from pdreg.testing import die_with_parent, free_low_port  # noqa: E402
from registry.server import RegistryConfig, RegistryServer  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
BODY = {"model": "tiny", "prompt": "benchmark prompt", "max_tokens": 4, "ignore_eos": True}


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (psutil is not installed)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


async def run_load(url: str, requests: int, concurrency: int) -> tuple[list[float], float]:
    """Latencies (s) of `requests` POSTs with `concurrency` workers; and the wall time."""
    latencies: list[float] = []
    payload = json.dumps(BODY).encode()
    headers = {"Content-Type": "application/json"}
    left = requests
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                started = time.perf_counter()
                async with session.post(url + "/v1/completions", data=payload,
                                        headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}")
                latencies.append(time.perf_counter() - started)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - started


def wait_for_pairs(url: str, timeout_s: float = 30.0) -> None:
    """Until the router has learned a pair from the registry, it answers 503."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            asyncio.run(run_load(url, 1, 1))
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def measure(name: str, url: str, pid: int | None, requests: int) -> dict[str, float]:
    asyncio.run(run_load(url, 50, 4))  # warm the pools
    row: dict[str, float] = {}
    lat1, _ = asyncio.run(run_load(url, max(100, requests // 10), 1))
    row["p50_ms_c1"] = statistics.median(lat1) * 1e3
    row["p99_ms_c1"] = statistics.quantiles(lat1, n=100)[98] * 1e3
    cpu_before = cpu_seconds(pid) if pid else 0.0
    lat32, wall = asyncio.run(run_load(url, requests, 32))
    if pid:
        row["cpu_us_per_req"] = (cpu_seconds(pid) - cpu_before) / requests * 1e6
    row["p50_ms_c32"] = statistics.median(lat32) * 1e3
    row["p99_ms_c32"] = statistics.quantiles(lat32, n=100)[98] * 1e3
    row["req_per_s_c32"] = requests / wall
    print(f"{name:14s} " + "  ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--policy", default="power_of_two")
    args = parser.parse_args()
    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0))
    registry.start()
    handles: list[EngineHandle] = []
    router: subprocess.Popen[bytes] | None = None
    try:
        specs = [{"role": role, "backend": "sim", "registry": registry.control_address}
                 for role in ("prefill", "prefill", "decode", "decode")]
        handles = start_engines(specs)
        direct = start_engine(role="mixed", backend="sim")
        handles.append(direct)
        port = free_low_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "pdreg", "--log-level", "WARNING", "router", "--registry",
             registry.control_address, "--port", str(port), "--policy", args.policy,
             "--no-register"], cwd=REPO, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent)
        assert router.stdout is not None
        url = json.loads(router.stdout.readline())["url"]
        wait_for_pairs(url)
        results = {
            "direct (mixed)": measure("direct (mixed)", direct.url, None, args.requests),
            "pdreg router": measure("pdreg router", url, router.pid, args.requests),
        }
        print(json.dumps(results))
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            router.wait(20)
        for handle in handles:
            handle.stop(10)
        registry.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
