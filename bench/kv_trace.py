"""The trace `bench_kv.py` replays, and the oracles its routers are measured against.

Trace (seeded): SYSTEM_PROMPTS system prompts of 1-2k tokens with Zipf popularity, each
request one of: a system prompt + a fresh question; the next turn of one of SESSIONS
multi-turn sessions (history grows each turn); a unique prompt. Arrivals are Poisson
(seeded) at a share of what the first PREFILLS prefills compute with no cache hit.

The oracles replay the trace at its arrival times against LRU caches of the engines'
size and FIFO prefills of the engines' speed, knowing every cache and queue.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

from engine_agent.reference.prefix_cache import PrefixCache
from engine_agent.reference.sim import sim_answer
from engine_agent.reference.tokens import decode, encode
from router.choosers import AFFINITY_BOUND_FACTOR

# vLLM's and SGLang's GPU builds cache 16-token blocks (the CPU build: 128); the sim
# engines stand for GPU prefills, and 16 is also the costly case for the router (8x the
# blocks to key and index per prompt).
BLOCK = 16
PREFILLS = 3  # at the start; a 4th joins a third of the way in
PREFILL_S_PER_TOKEN = 0.0002  # 2k uncached tokens = 0.4 s; a cached block costs nothing
SYSTEM_PROMPTS = 32
SESSIONS = 12


def make_trace(n: int, seed: int, scale: float = 1.0) -> list[str]:
    """`scale`: every text's length times this (1: ~2k-token prompts on average; the
    CPU goals are set at ~1k and ~8k)."""
    rng = random.Random(seed)
    words = ["cache", "block", "prefill", "decode", "router", "engine", "token", "prompt",
             "registry", "member", "latency", "queue", "session", "answer", "system",
             "policy", "index", "event", "replay"]

    def text(chars: int) -> str:
        chars = round(chars * scale)
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


CHAT_SESSIONS = 16  # conversations open at once
CHAT_TURNS = 8  # turns per conversation; then a new one takes its place


@dataclass(frozen=True)
class ChatTrace:
    prompts: list[str]
    max_tokens: list[int]  # each turn's answer length: the next turn repeats the answer


def make_chat_trace(n: int, seed: int) -> ChatTrace:
    """Multi-turn chat only: CHAT_SESSIONS conversations at once, each on one of 4 system
    prompts; a turn sends the history plus a new question and asks for an answer of 60-200
    tokens, and the next turn repeats that answer (the sim's own, `sim_answer`: what a
    client sends back) before its question. After CHAT_TURNS turns a conversation ends
    and a new one starts. So a decode that kept the previous turn's prompt and the answer
    it generated lacks only the new question (`bench_kv.py --trace chat`: conditional
    disaggregation), where a prefill lacks the answer too."""
    rng = random.Random(seed)
    base = make_trace(4 * SESSIONS, seed)  # only for its vocabulary of system prompts

    def text(chars: int) -> str:
        return " ".join(rng.choice(base[0].split()) for _ in range(chars // 7))

    systems = [f"[system {i}] " + text(rng.randint(1000, 2000)) for i in range(4)]
    histories = [rng.choice(systems) for _ in range(CHAT_SESSIONS)]
    turns = [0] * CHAT_SESSIONS
    trace = ChatTrace([], [])
    for _ in range(n):
        s = rng.randrange(CHAT_SESSIONS)
        if turns[s] == CHAT_TURNS:
            histories[s], turns[s] = rng.choice(systems) + f" [chat {rng.random()}]", 0
        prompt = histories[s] + "\nUser: " + text(rng.randint(40, 150)) + "\nAssistant: "
        answer = rng.randint(60, 200)
        histories[s] = prompt + decode(sim_answer(encode(prompt), answer))
        turns[s] += 1
        trace.prompts.append(prompt)
        trace.max_tokens.append(answer)
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
