"""Reference engine benchmark: torch compute and KV transfer, and the sim's own overhead.

    .venv/bin/python bench/bench_engine.py [--quick]

1. torch backend (in-process, 1 thread): prefill tokens/s per prompt length, decode
   tokens/s after that prompt, and KV transfer time over ZeroMQ on loopback TCP
   (KvServer -> KvClient, bytes really copied through the kernel; pack, fetch, unpack).
2. sim backend (real engine processes, zero delays): engine CPU time per request, read
   from /proc/PID/stat around a burst of requests, for a mixed engine and for a P/D pair.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import aiohttp
import zmq.asyncio

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # `bench` and pdreg; the engine helpers

from reference_helpers import start_engines, stop_all  # noqa: E402

from bench.procs import cpu_s  # noqa: E402
from engine_agent.reference.backend import prompt_digest  # noqa: E402
from engine_agent.reference.kv_store import HeldKv, KvStore  # noqa: E402
from engine_agent.reference.kv_transfer import KvClient, KvServer  # noqa: E402
from engine_agent.reference.scheduler import Scheduler  # noqa: E402
from engine_agent.reference.torch_backend import TorchBackend  # noqa: E402

DECODE_TOKENS = 32


def _best(samples: list[float]) -> float:
    return min(samples)


async def bench_torch(lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    backend = TorchBackend("tiny", threads=1)
    ctx = zmq.asyncio.Context()
    store = KvStore(Scheduler(1, 1 << 30), lease_s=60.0)
    server = KvServer(ctx, store, "bench", "127.0.0.1", 0)
    serving = asyncio.create_task(server.serve())
    client = KvClient(ctx)
    rows = []
    try:
        await backend.prefill([1, 2, 3])  # warm
        for n in lengths:
            prompt = [(i * 7) % 256 for i in range(n)]
            prefill_s, decode_s, transfer_s = [], [], []
            for r in range(repeats):
                t0 = time.perf_counter()
                prefilled = await backend.prefill(prompt)
                prefill_s.append(time.perf_counter() - t0)
                seq = backend.start_sequence(prefilled, DECODE_TOKENS)
                token = int(prefilled.logits.argmax())
                t0 = time.perf_counter()
                for _ in range(DECODE_TOKENS):
                    token = int((await backend.step(seq, token)).argmax())
                decode_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                metas, buffers = backend.pack(prefilled)
                store.put(f"h:{n}-{r}", HeldKv(prompt_digest(prompt), n, metas, buffers))
                got = await client.fetch("127.0.0.1", server.port, key=f"h:{n}-{r}",
                                         engine_id="bench", prompt_digest=prompt_digest(prompt),
                                         num_tokens=n, wait_s=0)
                backend.unpack(n, *got)
                transfer_s.append(time.perf_counter() - t0)
            rows.append({"prompt_tokens": n, "kv_bytes": n * backend.kv_bytes_per_token,
                         "prefill_tok_s": n / _best(prefill_s),
                         "prefill_ms": 1e3 * _best(prefill_s),
                         "decode_tok_s": DECODE_TOKENS / _best(decode_s),
                         "transfer_ms": 1e3 * _best(transfer_s)})
    finally:
        serving.cancel()
        client.close()
        server.close()
        ctx.term()
        backend.close()
    return rows


async def _burst(requests: int, concurrency: int, send: Any) -> float:
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with limit:
            await send(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    return time.perf_counter() - t0


async def bench_sim(requests: int, concurrency: int) -> dict[str, float]:
    mixed, prefill, decode = start_engines([
        {"role": "mixed"}, {"role": "prefill"}, {"role": "decode"}])
    body = {"prompt": "x" * 100, "max_tokens": 8, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession() as session:

            async def post(url: str, payload: dict[str, Any]) -> dict[str, Any]:
                async with session.post(url + "/v1/completions", json=payload) as response:
                    assert response.status == 200, await response.text()
                    return await response.json()

            async def plain(_: int) -> None:
                await post(mixed.url, body)

            async def vllm_pd(_: int) -> None:
                first = await post(prefill.url, {**body, "max_tokens": 1,
                                                 "kv_transfer_params": {"do_remote_decode": True}})
                await post(decode.url, {**body, "kv_transfer_params": first["kv_transfer_params"]})

            await _burst(200, concurrency, plain)  # warm
            await _burst(100, concurrency, vllm_pd)
            c0 = cpu_s(mixed.proc.pid)
            wall = await _burst(requests, concurrency, plain)
            mixed_us = 1e6 * (cpu_s(mixed.proc.pid) - c0) / requests
            p0, d0 = cpu_s(prefill.proc.pid), cpu_s(decode.proc.pid)
            pd_wall = await _burst(requests, concurrency, vllm_pd)
            prefill_us = 1e6 * (cpu_s(prefill.proc.pid) - p0) / requests
            decode_us = 1e6 * (cpu_s(decode.proc.pid) - d0) / requests
    finally:
        stop_all([mixed, prefill, decode])
    return {"requests": requests, "concurrency": concurrency,
            "mixed_cpu_us_per_req": mixed_us, "mixed_req_s": requests / wall,
            "prefill_cpu_us_per_req": prefill_us, "decode_cpu_us_per_req": decode_us,
            "pd_req_s": requests / pd_wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer lengths and requests")
    args = parser.parse_args()
    lengths = [16, 128, 512] if args.quick else [16, 64, 128, 256, 512, 1024]
    rows = asyncio.run(bench_torch(lengths, repeats=2 if args.quick else 3))
    print("torch backend (1 thread; best of repeats)")
    print(f"{'prompt':>7} {'KV bytes':>10} {'prefill ms':>10} {'prefill tok/s':>13} "
          f"{'decode tok/s':>12} {'KV transfer ms':>14}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['kv_bytes']:>10} {r['prefill_ms']:>10.1f} "
              f"{r['prefill_tok_s']:>13.0f} {r['decode_tok_s']:>12.0f} "
              f"{r['transfer_ms']:>14.2f}")
    sim = asyncio.run(bench_sim(500 if args.quick else 2000, concurrency=8))
    print(f"\nsim backend (zero delays, {sim['requests']} requests, concurrency "
          f"{sim['concurrency']}, 100-token prompt, 8 tokens out)")
    print(f"mixed engine CPU per request: {sim['mixed_cpu_us_per_req']:.0f} us "
          f"({sim['mixed_req_s']:.0f} req/s whole machine)")
    print(f"P/D (vLLM handshake) CPU per request: prefill {sim['prefill_cpu_us_per_req']:.0f} us,"
          f" decode {sim['decode_cpu_us_per_req']:.0f} us ({sim['pd_req_s']:.0f} req/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
