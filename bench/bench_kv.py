"""KV-aware pairing side by side: pdreg `kv` against `prefix`, `peak_ewma`, round robin,
two peers and two oracles, on engines whose prefix caches really work.

Each router gets its own fresh cluster (same shape, same trace, same seed): a real
registry, 3 sim prefills (`--kv-events`, one prefill at a time, a cost per *uncached*
prompt token, a prefix cache of --cache-blocks blocks of 16 tokens, LRU) and 2 sim
decodes. A third of the way in a 4th prefill joins; two thirds in, prefill 1 restarts
(empty cache, same id): the caches change under the router.

Trace (seeded): 32 system prompts of 1-2k tokens with Zipf popularity, each request one
of: a system prompt + a fresh question; the next turn of one of 12 multi-turn sessions
(history grows each turn); a unique prompt. Open loop: Poisson arrivals (seeded) at
--utilisation of what the 3 first prefills compute with no cache hit at all, so the
prefills are busy but not permanently queued, and a router's hits show in its TTFT.

Reported per router: TTFT p50/p99 (first streamed token, client side), prefill tokens
computed per request and the hit rate (the engines' own counters), hit tokens against
the oracles', router CPU per request (its process tree), tokenization shown apart (the
router's own histogram), and for `kv` the hit rate it predicted at its picks. The
oracles replay the trace at its arrival times against LRU caches of the same size and
FIFO prefills of the same speed, knowing every cache and queue, each request to the
prefill holding most of it: one within the routers' load bound (`prefix`'s rule; the
fair ceiling for a router that must spread load, and the one "vs oracle" means), one
with load ignored (the ceiling of hits alone).

    .venv/bin/python bench/bench_kv.py [--requests 300] [--utilisation 0.7] [--routers kv,...]
    .venv/bin/python bench/bench_kv.py --routers kv --decisions   # log every kv pick
    .venv/bin/python bench/bench_kv.py --routers kv,kv+disagg=64   # conditional disagg.
    .venv/bin/python bench/bench_kv.py --scale   # the index alone at 1,000 members
    .venv/bin/python bench/bench_kv.py --routers kv,sglang-router:cache_aware

Writes bench/out/kv.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

import peers  # noqa: E402
from reference_helpers import EngineHandle, metrics, start_engine, start_engines  # noqa: E402

from engine_agent.reference.prefix_cache import PrefixCache  # noqa: E402
from engine_agent.reference.tokens import encode  # noqa: E402
from pdreg.testing import die_with_parent, free_low_port, stop_process, wait_until  # noqa: E402
from registry.client import MembershipView  # noqa: E402
from registry.server import RegistryConfig, RegistryServer  # noqa: E402
from router.choosers import AFFINITY_BOUND_FACTOR  # noqa: E402
from router.guard import LOOPBACK_ALLOW  # noqa: E402

OUT = REPO / "bench" / "out" / "kv.json"
# vLLM's and SGLang's GPU builds cache 16-token blocks (the CPU build: 128); the sim
# engines stand for GPU prefills, and 16 is also the costly case for the router (8x the
# blocks to key and index per prompt).
BLOCK = 16
PREFILLS = 3  # at the start; a 4th joins a third of the way in
# Per prefill: 32k tokens, a third of the trace's shared prefixes (system prompts and
# session histories, ~100k tokens): the fleet holds the popular ones when it partitions
# them, one prefill alone does not. (A GPU prefill holds 100k-1M tokens; the trace is
# scaled down with it.)
CACHE_BLOCKS = 2048
UTILISATION = 0.7
MAX_CONCURRENT = 64
PREFILL_S_PER_TOKEN = 0.0002  # 2k uncached tokens = 0.4 s; a cached block costs nothing
DECODE_S_PER_TOKEN = 0.002
MAX_TOKENS = 4
SYSTEM_PROMPTS = 32
SESSIONS = 12
ROUTERS = ("kv", "prefix", "peak_ewma", "round_robin")
READY_TIMEOUT_S = 60.0


# --- the trace ------------------------------------------------------------------------


def make_trace(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["cache", "block", "prefill", "decode", "router", "engine", "token", "prompt",
             "registry", "member", "latency", "queue", "session", "answer", "system",
             "policy", "index", "event", "replay"]

    def text(chars: int) -> str:
        out: list[str] = []
        size = 0
        while size < chars:
            w = rng.choice(words)
            out.append(w)
            size += len(w) + 1
        return " ".join(out)

    systems = [f"[system {i}] " + text(rng.randint(1000, 2000)) for i in range(SYSTEM_PROMPTS)]
    weights = [1 / (i + 1) ** 1.1 for i in range(SYSTEM_PROMPTS)]  # Zipf
    histories = [rng.choices(systems, weights)[0] for _ in range(SESSIONS)]
    trace = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.5:
            trace.append(rng.choices(systems, weights)[0] + "\nQ: " + text(rng.randint(40, 120)))
        elif kind < 0.85:
            s = rng.randrange(SESSIONS)
            histories[s] += "\nUser: " + text(rng.randint(40, 150)) + "\nAssistant: " + \
                text(rng.randint(60, 200))
            trace.append(histories[s])
        else:
            trace.append(f"[unique {rng.random()}] " + text(rng.randint(800, 1500)))
    return trace


def arrivals(trace: list[str], utilisation: float, seed: int) -> list[float]:
    """Poisson arrival times (s from the start) offering `utilisation` of what the first
    PREFILLS prefills compute with no cache at all: busy, not permanently queued."""
    work_s = sum(len(encode(p)) for p in trace) / len(trace) * PREFILL_S_PER_TOKEN
    rate = utilisation * PREFILLS / work_s
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in trace:
        t += rng.expovariate(rate)
        out.append(t)
    return out


@dataclass
class OracleResult:
    hit_rate: float
    prefill_ttft_p50_ms: float  # queue + uncached prefill time, modelled (no decode leg)


def oracle(trace: list[str], times: list[float], cache_blocks: int, joins_at: int,
           restarts_at: int, bounded: bool) -> OracleResult:
    """Replays the trace at its arrival times against LRU caches of the engines' size and
    FIFO prefills of the engines' speed (one prefill at a time), knowing every cache and
    queue. Each request goes to the prefill holding most of it (ties: the least loaded).
    `bounded`: only among the prefills within the routers' load bound (`prefix`'s
    consistent hashing with bounded loads: load + 1 <= ceil(1.25 (total + 1) / n), load
    = requests queued or in service), the ceiling a router that must spread load can
    reach; else load ignored, the ceiling of hits alone."""
    caches = [PrefixCache(BLOCK, cache_blocks) for _ in range(PREFILLS)]
    finishes: list[list[float]] = [[] for _ in range(PREFILLS)]  # per prefill, FIFO
    hit = total = 0
    ttfts: list[float] = []
    for i, (prompt, now) in enumerate(zip(trace, times, strict=True)):
        if i == joins_at:
            caches.append(PrefixCache(BLOCK, cache_blocks))
            finishes.append([])
        if i == restarts_at:
            caches[0] = PrefixCache(BLOCK, cache_blocks)
        ids = encode(prompt)
        keys = caches[0].keys_of(ids)[:max(0, (len(ids) - 1) // BLOCK)]
        loads = [sum(1 for f in fs if f > now) for fs in finishes]
        n = len(caches)
        candidates = range(n)
        if bounded:
            bound = math.ceil(AFFINITY_BOUND_FACTOR * (sum(loads) + 1) / n)
            candidates = [k for k in range(n) if loads[k] + 1 <= bound] or list(range(n))
        # Each prefill's cache already holds what its queued requests will store (FIFO:
        # they finish before this one starts), so the oracle sees "soon cached" too.
        best = max(candidates, key=lambda k: (caches[k].peek(keys), -loads[k], -k))
        hit_now = caches[best].lookup(ids)
        cached = hit_now.cached_blocks * BLOCK
        hit += cached
        total += len(ids)
        caches[best].store(ids, hit_now.keys, lambda _: None)
        start = max([now, *finishes[best][-1:]])
        done = start + (len(ids) - cached) * PREFILL_S_PER_TOKEN
        finishes[best] = [f for f in finishes[best] if f > now] + [done]
        ttfts.append(done - now)
    return OracleResult(hit / total, 1000 * statistics.median(ttfts))


# --- one run ---------------------------------------------------------------------------


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


KV_EVENTS = [True]  # --no-kv-events: engines cache but publish nothing (a fleet kv is blind to)


def engine_args(cache_blocks: int) -> list[str]:
    return ["--kv-events"] * KV_EVENTS[0] + [
        "--max-running", "1", "--prefix-cache-blocks", str(cache_blocks),
        "--block-size", str(BLOCK), "--sim-prefill-delay", str(PREFILL_S_PER_TOKEN)]


@contextmanager
def cluster(cache_blocks: int) -> Iterator[tuple[RegistryServer, list[EngineHandle], list]]:
    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0,
                                             heartbeat_interval_s=0.5, lease_s=3.0)).start()
    control = registry.control_address
    handles: list[EngineHandle] = []
    try:
        specs = [{"role": "prefill", "registry": control, "extra_args": [
            *engine_args(cache_blocks), "--port", str(free_low_port())]} for _ in range(3)]
        # Decodes cache and publish like prefills and compute a prompt at the same cost:
        # what a decode serving a request alone (conditional disaggregation) would do.
        # The sim does not slow a decode's other streams while it prefills one.
        specs += [{"role": "decode", "registry": control, "extra_args": [
            *engine_args(cache_blocks), "--max-running", "8",
            "--sim-decode-delay", str(DECODE_S_PER_TOKEN)]} for _ in range(2)]
        handles += start_engines(specs)
        yield registry, handles, specs
    finally:
        for h in handles:
            h.stop(timeout_s=10)
        registry.close()


@contextmanager
def router_process(registry: str, name: str, decisions: Path | None = None
                   ) -> Iterator[tuple[str, int]]:
    """`name`: a policy, or `kv+disagg=N` (kv with --disagg-min-uncached-tokens N).
    `decisions`: keep the router's DEBUG log there (the kv chooser logs every pick)."""
    policy, _, option = name.partition("+")
    extra = ["--disagg-min-uncached-tokens", option.split("=", 1)[1]] if option else []
    port = free_low_port()
    log = tempfile.NamedTemporaryFile(prefix="pdreg-bench-kv-router-", suffix=".log")  # noqa: SIM115
    level = "WARNING"
    if decisions is not None:
        level = "DEBUG"
        log = open(decisions, "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "--log-level", level, "router", "--registry",
         registry, "--port", str(port), "--policy", policy, "--no-register",
         "--drain-delay", "0", "--allow-upstream", LOOPBACK_ALLOW, *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent)
    try:
        assert proc.stdout is not None
        yield json.loads(proc.stdout.readline())["url"], proc.pid
    finally:
        stop_process(proc, 20)
        log.close()


def first_token_s(client: httpx.Client, url: str, prompt: str) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True}
    started = time.monotonic()
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}")
        ttft = None
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                ttft = time.monotonic() - started
    if ttft is None:
        raise RuntimeError("no token")
    return ttft


def counters(handles: list[EngineHandle]) -> tuple[float, float]:
    prompt = hit = 0.0
    for h in handles:
        if h.returncode is None:
            m = metrics(h.url)
            prompt += m.get("pdreg:engine_prompt_tokens_total", 0.0)
            hit += m.get("pdreg:engine_prefix_cache_hit_tokens_total", 0.0)
    return prompt, hit


@contextmanager
def peer_router(name: str, handles: list[EngineHandle]) -> Iterator[tuple[str, int]]:
    """`sglang-router:POLICY` (SGLang's bootstrap handshake, which the reference engines
    answer too) or `vllm-router:POLICY`, given the first 3 prefills and the decodes as
    static URLs: a peer does not see the prefill that joins mid-run."""
    kind, _, policy = name.partition(":")
    prefills, decodes = handles[:3], handles[3:5]
    if kind == "sglang-router":
        router = peers.start_sglang_router([(h.url, h.bootstrap_port) for h in prefills],
                                           [h.url for h in decodes], policy=policy)
    else:
        router = peers.start_vllm_router([h.url for h in prefills], [h.url for h in decodes],
                                         policy=policy)
    try:
        yield router.url, router.proc.pid
    finally:
        router.stop()


def run_router(policy: str, trace: list[str], times: list[float], cache_blocks: int,
               decisions: Path | None = None) -> Row:
    with cluster(cache_blocks) as (registry, handles, specs):
        view = MembershipView(registry.control_address).start()
        try:
            assert view.wait_for(lambda m: len([x for x in m.values()
                                                if x.record.state.name == "READY"]) == 5,
                                 READY_TIMEOUT_S)
        finally:
            view.close()
        start = peer_router(policy, handles) if ":" in policy else \
            router_process(registry.control_address, policy, decisions)
        with start as (url, pid):
            if ":" not in policy:  # a peer listens already (peers._start waited)
                assert wait_until(lambda: httpx.get(url + "/v1/models").json()["data"], 30)
            joins_at, restarts_at = len(trace) // 3, 2 * len(trace) // 3
            lock = threading.Lock()
            ttfts: list[float] = []
            errors = [0]
            retired = [0.0, 0.0]  # counters of the restarted prefill's first life

            def mid_run(i: int) -> None:
                if i == joins_at:
                    handles.append(start_engine(role="prefill",
                                                registry=registry.control_address,
                                                extra_args=engine_args(cache_blocks)))
                elif i == restarts_at:
                    victim = handles[0]
                    p, h = counters([victim])
                    retired[0] += p
                    retired[1] += h
                    victim.stop(timeout_s=10)
                    handles[0] = start_engine(role="prefill",
                                              registry=registry.control_address,
                                              extra_args=specs[0]["extra_args"])

            local = threading.local()
            clients: list[httpx.Client] = []

            def one(i: int) -> None:
                client = getattr(local, "client", None)
                if client is None:
                    client = local.client = httpx.Client(timeout=120)
                    with lock:
                        clients.append(client)
                try:
                    t = first_token_s(client, url, trace[i])
                    with lock:
                        ttfts.append(t)
                except Exception as exc:
                    with lock:
                        errors[0] += 1
                        if errors[0] <= 3:
                            print(f"   request {i} failed: {exc!r}", flush=True)

            cpu_before = peers.process_tree_cpu_s(pid)
            # Open loop: each request at its arrival time, however the earlier ones fare
            # (a closed loop of a few clients keeps every prefill queued, whatever the
            # router does); the join and the restart run beside the arrivals.
            side: list[threading.Thread] = []
            with ThreadPoolExecutor(max_workers=MAX_CONCURRENT) as pool:
                started = time.monotonic()
                for i, at in enumerate(times):
                    if i in (joins_at, restarts_at):
                        side.append(threading.Thread(target=mid_run, args=(i,)))
                        side[-1].start()
                    delay = started + at - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    pool.submit(one, i)
            for t in side:
                t.join()
            for c in clients:
                c.close()
            cpu = peers.process_tree_cpu_s(pid) - cpu_before
            router_metrics = httpx.get(url + "/metrics").text
        decode_prompt, decode_hit = counters(handles[3:5])
        prompt, hit = counters(handles)
        prompt += retired[0]
        hit += retired[1]
    tok_sum = sum(float(line.rsplit(" ", 1)[1]) for line in router_metrics.splitlines()
                  if line.startswith("pdreg_router_tokenize_seconds_sum"))
    def metric(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in router_metrics.splitlines()
                   if line.startswith(name + "{"))

    picks = [line for line in router_metrics.splitlines()
             if line.startswith("pdreg_router_picks_total{")]
    skipped = sum(float(line.rsplit(" ", 1)[1]) * (1 if 'role="decode"' in line else -1)
                  for line in picks)
    routed = metric("pdreg_router_prompt_tokens_total")
    predicted = metric("pdreg_router_prompt_tokens_cached_total") / routed if routed else 0.0
    n = len(trace)
    q = statistics.quantiles(ttfts, n=100) if len(ttfts) > 2 else [0.0] * 99
    return Row(policy, n, errors[0], 1000 * statistics.median(ttfts), 1000 * q[98],
               (prompt - hit) / n, hit / prompt if prompt else 0.0,
               router_cpu_ms_per_request=1000 * cpu / n,
               tokenize_ms_per_request=1000 * tok_sum / n, predicted_hit_rate=predicted,
               skipped_prefill=round(skipped),
               decode_prefill_tokens_per_request=(decode_prompt - decode_hit) / n,
               ttfts=ttfts)


def scale(members: int = 1000, batches: int = 50, blocks_per_batch: int = 20) -> None:
    """The index alone, on one core: events/s it absorbs from `members` engines (decode
    included, as the feed thread does it), and memory per million blocks indexed."""
    import tracemalloc

    from router.kv.index import KvIndex
    from wire.kv_events import BlockRemoved, BlockStored, KVEventBatch, encode_batch

    index = KvIndex()
    payloads: list[tuple[str, int, bytes]] = []
    rng = random.Random(0)
    for m in range(members):
        mi = index.track(f"p{m}", 1)
        assert mi is not None
        mi.start_sync()
        mi.replay_done(complete=True)
        parent = None
        for seq in range(batches):
            hashes = [rng.getrandbits(63) for _ in range(blocks_per_batch)]
            events: list = [BlockStored(hashes, parent, [rng.randrange(50000)
                                                        for _ in range(BLOCK * len(hashes))],
                                        BLOCK, None, "GPU", None)]
            if seq % 5 == 4:  # evictions too: a realistic mix
                events.append(BlockRemoved(hashes[:2], "GPU"))
            else:
                parent = hashes[-1]
            payloads.append((f"p{m}", seq, encode_batch(KVEventBatch(0.0, events, 0))))
    from wire.kv_events import decode_batch

    def feed(index: KvIndex) -> tuple[int, float]:
        started = time.process_time()
        n = 0
        for member_id, seq, payload in payloads:
            batch = decode_batch(payload)
            n += len(batch.events)
            index.members[member_id].apply(seq, batch)
        return n, time.process_time() - started

    n_events, cpu = feed(index)
    fresh = KvIndex()
    for m in range(members):
        mi = fresh.track(f"p{m}", 1)
        assert mi is not None
        mi.start_sync()
        mi.replay_done(complete=True)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    feed(fresh)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    blocks = index.total_blocks()
    print(f"scale: {members} members, {len(payloads)} batches, {n_events} events, "
          f"{blocks} blocks indexed")
    print(f"  {len(payloads) / cpu:,.0f} batches/s = {n_events / cpu:,.0f} events/s = "
          f"{blocks / cpu:,.0f} blocks/s on one core (decode + apply)")
    print(f"  memory: {used / blocks:.0f} B per block = {used / blocks:.0f} MB per million "
          f"blocks")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--utilisation", type=float, default=UTILISATION,
                        help="offered load: this share of what the first 3 prefills "
                             "compute with no cache (Poisson arrivals)")
    parser.add_argument("--cache-blocks", type=int, default=CACHE_BLOCKS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--decisions", action="store_true",
                        help="keep each pdreg router's DEBUG log (every kv pick) in "
                             "bench/out/kv-decisions-ROUTER.log")
    parser.add_argument("--no-kv-events", action="store_true",
                        help="engines publish no KV events (what `kv` does blind)")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON results")
    parser.add_argument("--scale", action="store_true",
                        help="only the index at 1,000 members: events/s and memory")
    args = parser.parse_args()
    if args.scale:
        scale()
        return 0
    KV_EVENTS[0] = not args.no_kv_events
    trace = make_trace(args.requests, args.seed)
    times = arrivals(trace, args.utilisation, args.seed)
    joins_at, restarts_at = len(trace) // 3, 2 * len(trace) // 3
    fair = oracle(trace, times, args.cache_blocks, joins_at, restarts_at, bounded=True)
    greedy = oracle(trace, times, args.cache_blocks, joins_at, restarts_at, bounded=False)
    print(f"oracle (bounded load) {fair.hit_rate:.1%} hits, modelled prefill TTFT p50 "
          f"{fair.prefill_ttft_p50_ms:.0f} ms; oracle (load ignored) {greedy.hit_rate:.1%}, "
          f"{greedy.prefill_ttft_p50_ms:.0f} ms; {len(trace) / times[-1]:.2f} req/s",
          flush=True)
    OUT.parent.mkdir(exist_ok=True)
    rows = []
    for policy in args.routers.split(","):
        print(f"== {policy}", flush=True)
        decisions = OUT.parent / f"kv-decisions-{policy}.log" \
            if args.decisions and ":" not in policy else None
        row = run_router(policy, trace, times, args.cache_blocks, decisions)
        row.vs_oracle = row.hit_rate / fair.hit_rate if fair.hit_rate else 0.0
        row.vs_greedy_oracle = row.hit_rate / greedy.hit_rate if greedy.hit_rate else 0.0
        rows.append(row)
        print(f"   {row}", flush=True)
    print(f"\noracle hit rate {fair.hit_rate:.1%} bounded load, {greedy.hit_rate:.1%} load "
          f"ignored ({args.requests} requests, {len(trace) / times[-1]:.2f} req/s = "
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
    OUT.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({"oracle_hit_rate": fair.hit_rate,
                               "oracle_load_ignored_hit_rate": greedy.hit_rate,
                               "requests_per_s": len(trace) / times[-1],
                               "args": {k: str(v) for k, v in vars(args).items()},
                               "rows": [{k: v for k, v in asdict(r).items() if k != "ttfts"}
                                        for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
