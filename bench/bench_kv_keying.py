"""The `kv` policy's own CPU per request, in-process: tokenizing and keying each prompt of
bench_kv.py's trace (`KvRouting.affinity`'s work, the reference engine's byte tokenizer)
and applying the event batch its prefill would publish (the feed's work: decode
and index the blocks it did not hold). This tree against a baseline commit, each in a
child process of its own, at prompt scales 0.5 (~1k tokens) and 4 (~7k tokens).

    .venv/bin/python bench/bench_kv_keying.py [--baseline COMMIT] [--requests 300]

Reports microseconds of CPU (time.process_time) per request, best of --repeat passes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCK = 16
SCALES = (0.5, 4.0)


def child(trace_path: str, repeat: int) -> dict[str, float]:
    """Runs inside the tree on sys.path: the router's own code, whatever its version."""
    from router.kv.index import KvIndex
    from router.kv.routing import KvRouting
    from router.metrics import RouterMetrics
    from wire.kv_events import BlockStored, KVEventBatch, decode_batch, encode_batch

    trace: list[str] = json.loads(Path(trace_path).read_text())
    requests = len(trace)
    best_affinity = best_events = float("inf")
    for _ in range(repeat):
        routing = KvRouting(RouterMetrics(), allows=lambda a: True)
        # One publisher, blocks of 16, bytes: where this tree keeps it (older: `_models`).
        publishers = getattr(routing, "publishers", None)
        if publishers is not None:
            publishers.models["tiny"] = _model_kv()
        else:
            routing._models = {"tiny": _model_kv()}
        index = KvIndex()
        member = index.track("p", 1)
        assert member is not None
        member.synced = True
        held: set[int] = set()
        batches = []
        affinity_s = 0.0

        async def affinities(routing=routing) -> list:  # one loop, as in the router
            nonlocal affinity_s
            out = []
            for prompt in trace:
                started = time.process_time()
                out.append(await routing.affinity({"model": "tiny", "prompt": prompt}, "tiny"))
                affinity_s += time.process_time() - started
            return out

        for prompt, affinity in zip(trace, asyncio.run(affinities()), strict=True):
            keys = affinity.keys[BLOCK]
            # What the prefill publishes: the blocks it did not hold, as vLLM does.
            first = next((i for i, k in enumerate(keys) if k not in held), len(keys))
            ids = [256, *prompt.encode()]  # the byte tokenizer's
            tokens = ids[first * BLOCK:len(keys) * BLOCK]
            if tokens:
                event = BlockStored(block_hashes=[f"h{k}".encode() for k in keys[first:]],
                                    parent_block_hash=f"h{keys[first - 1]}".encode()
                                    if first else None,
                                    token_ids=tokens, block_size=BLOCK, lora_id=None,
                                    medium=None, lora_name=None)
                batches.append(encode_batch(KVEventBatch(ts=0.0, events=[event])))
            held.update(keys)
        started = time.process_time()
        for seq, payload in enumerate(batches):
            member.apply(seq, decode_batch(payload))
        events_s = time.process_time() - started
        routing.close()
        best_affinity = min(best_affinity, affinity_s)
        best_events = min(best_events, events_s)
        assert member.state.value == "live"  # every batch applied
    return {"affinity_us": 1e6 * best_affinity / requests,
            "events_us": 1e6 * best_events / requests,
            "tokens": sum(map(len, trace)) / requests}


def _model_kv():
    from router.kv.routing import ModelKv

    return ModelKv(tokenizer_source="pdreg:bytes", block_sizes=(BLOCK,), members=("p",))


def run_tree(src: Path, trace_path: str, repeat: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                          trace_path, "--repeat", str(repeat)],
                         cwd=src, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a trace file
    args = parser.parse_args()
    if args.child is not None:
        sys.path.insert(0, os.environ["PYTHONPATH"])
        print(json.dumps(child(args.child, args.repeat)))
        return 0
    sys.path.insert(0, str(REPO))
    from bench.kv_trace import make_trace
    from bench.procs import remove_tree, source_tree

    baseline = source_tree(args.baseline) if args.baseline else None
    try:
        trees = ([(args.baseline, Path(baseline))] if baseline else []) + [("this tree", REPO)]
        print("| tree | prompt tokens | tokenize + key / request | events / request | "
              "both |\n|---|---:|---:|---:|---:|")
        for scale in SCALES:
            with tempfile.NamedTemporaryFile("w", suffix=".json") as trace:
                trace.write(json.dumps(make_trace(args.requests, 1, scale)))
                trace.flush()
                rows = [(name, run_tree(src, trace.name, args.repeat)) for name, src in trees]
            for name, r in rows:
                print(f"| {name} | {r['tokens']:,.0f} | {r['affinity_us']:.0f} us | "
                      f"{r['events_us']:.0f} us | "
                      f"{r['affinity_us'] + r['events_us']:.0f} us |", flush=True)
    finally:
        remove_tree(baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
