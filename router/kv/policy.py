"""The `kv` policy: pick the prefill that computes least, from what each engine caches.

Pure, like router/policies.py: the KV index (router/kv/index.py) is read, never written;
time, loads and in-flight counts come in as arguments.

A request's affinity input is a `KvAffinity`: the prompt's block keys per block size
(router/kv/keys.py), computed at admission from its exact token ids. Per prefill:

    cached(c)   = leading prompt blocks c holds x block size (0 unless its index is
                  LIVE or a lower bound: SYNCING/REPLAYING members claim nothing)
    uncached(c) = prompt tokens - cached(c)
    cost(c)     = uncached(c) + QUEUE_WEIGHT x queue(c) x W
    queue(c)    = own(c) + OTHERS_WEIGHT x max(0, reported(c) - own(c)) + KV pressure

in tokens of prefill work. own(c) is this router's in-flight count on c (exact, now);
reported(c) is c's last load report, which is up to a heartbeat old and still counts
requests of ours that have finished since, so the rest counts at OTHERS_WEIGHT (a stale
"1" must not outweigh a whole cached prompt). W is the work one queued request brings:
an EWMA of the uncached tokens of recent picks. So a member with a long queue loses its
cache advantage once its queue costs more than the tokens it saves. Loads too old to
trust (the usual score: saturated) rank last. A prompt cached nowhere is placed by the
`prefix` ring (bounded load), so requests sharing a new prefix meet on one prefill.
On top, the bounded-load rule of `prefix` (router/choosers.py) with a looser factor: only
members whose load is within KV_BOUND_FACTOR x the average (+1) compete, so a hot prefix
never piles onto one prefill. The decode is chosen as `peak_ewma` chooses it (power of
two over load x observed service time): every decode pulls the whole prompt's KV from its
prefill (no decode-side cache here), so that part of the cost is the same for all.

Conditional disaggregation (`disagg_min_uncached_tokens` > 0): when the chosen decode
would compute fewer prompt tokens than that itself (the prompt less what its own cache
holds, if it publishes KV events; else the whole prompt), the prefill leg is skipped and
the decode serves the request alone, as Dynamo and llm-d do.

The index is not ahead of the engine: a request's blocks count at its prefill only once
that prefill's events list them, not from the pick on. bench_kv.py measured counting the
blocks of requests in flight as "soon cached" too: no gain (71.2% hits with, 71.9%
without), and the hits the router predicted equalled what the engines found (71.2% /
71.2%), so the events were not lagging behind the next request sharing a prefix.

Where the match cannot be exact, the prefill is chosen as `peak_ewma` chooses it (power
of two over outstanding work x observed service time, router/policies.py), the default
policy's scoring, so a fleet that publishes nothing is routed as well as before `kv`:
- a request whose tokens are not known exactly (no tokenizer for the model, no block
  size, a request shape we do not tokenize) carries a plain `Affinity`;
- a `KvAffinity` request for which no eligible prefill has an index that can answer
  (none publishes KV events, or every publisher is SYNCING/REPLAYING or of another
  block size).
The mixed case, some prefills publishing and some not: while at least one eligible
prefill's index can answer, the choice is by cost, and a prefill without an index counts
as holding nothing (what the router can see; it still wins on a shorter queue, and a
prompt cached nowhere goes by the ring over all of them). A member is never assumed to
hold blocks it has not reported. Decodes are chosen as `peak_ewma` chooses them, always.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from router.choosers import (
    AFFINITY_BOUND_FACTOR,
    SATURATED_SCORE,
    Chooser,
    LoadFn,
    PowerOfTwo,
    PrefixAffinity,
)
from router.kv.index import KvIndex
from router.latency import LatencyTracker
from router.policies import DEFAULT_STALE_LOAD_S, PREFILL_ROLE, Affinity, Loads, Options, Pairer
from router.table import Candidate, Pair, PairingTable

__all__ = ["KvAffinity", "KvChooser", "KvPairer", "make_kv_pairer"]

logger = logging.getLogger(__name__)

WORK_EWMA_ALPHA: Final = 0.3  # weight of the newest pick in W (about the last 3 picks)
OTHERS_WEIGHT: Final = 0.5  # reported queue beyond our own in-flight (see the docstring)
# A queued request costs half its work: the one in service is half done on average, and
# a hit now keeps the prefix where the next requests sharing it will hit again.
QUEUE_WEIGHT: Final = 0.5
KV_PRESSURE_REQS: Final = 4.0  # a full KV cache costs as much as this many queued requests
# The hard load bound (as `prefix`'s, load + 1 <= ceil(factor x (total + 1) / n)), looser
# than `prefix`'s 1.25: the cost already weighs each member's queue against the tokens
# its cache saves, so the bound only has to stop a pile-up (stale loads, a hot prefix).
# bench_kv.py at 70% utilisation: 1.25 spilt ~9% of the prompt tokens off the prefill
# holding them (67% hits); 2.0 gave 72%, 3.0 75%, none 77%, each with a lower TTFT.
KV_BOUND_FACTOR: Final = 2.0


@dataclass(frozen=True, slots=True)
class KvAffinity(Affinity):
    """What the `kv` policy knows of a request's prompt. `key` (the `Affinity` every
    chooser sees) is the `prefix` ring key, for members it cannot match exactly."""

    prompt_tokens: int = 0
    keys: Mapping[int, Sequence[int]] = field(default_factory=dict)  # block size -> keys


@dataclass(slots=True)
class Scored:
    candidate: Candidate
    cached_tokens: int
    cost: float


class KvChooser:
    """Prefill chooser for the request `KvPairer` sets in `request` before each choice:
    by cost over a `KvAffinity`; by `PrefixAffinity`'s ring for a plain key."""

    def __init__(self, index: KvIndex, block_size_of: Mapping[str, int] | None = None,
                 bound_factor: float = KV_BOUND_FACTOR) -> None:
        self.index = index
        self.bound_factor = bound_factor
        self.work = 0.0  # W: EWMA of uncached tokens per pick (0 until the first)
        self.last: Scored | None = None  # the last pick, for metrics and disaggregation
        self.in_flight: Mapping[str, int] = {}  # this router's, set per choice by KvPairer
        self.request: KvAffinity | None = None  # the request's, set per choice by KvPairer
        # New prefixes go by `prefix`'s ring and its tighter bound: a miss costs the
        # whole prompt wherever it lands, so only a short queue is worth having there.
        self._ring = PrefixAffinity(AFFINITY_BOUND_FACTOR)

    def answers(self, eligible: Sequence[Candidate], affinity: KvAffinity) -> bool:
        """Some eligible member's index can say what it holds of this prompt (it publishes
        at one of the prompt's block sizes, or has stored nothing yet, and is LIVE or a
        lower bound): the choice can go by cost. Otherwise the caller falls back to
        `peak_ewma`."""
        get, keys = self.index.get, affinity.keys
        for c in eligible:
            member = get(c.id, c.incarnation)
            if (member is not None and member.answers
                    and (member.block_size in keys or not member.blocks)):
                return True
        return False

    def cached_tokens(self, c: Candidate, affinity: KvAffinity) -> int:
        member = self.index.get(c.id, c.incarnation)
        if member is None or not member.block_size:
            return 0
        keys = affinity.keys.get(member.block_size)
        if not keys:
            return 0
        return member.cached_blocks(keys) * member.block_size

    def choose(self, eligible: Sequence[Candidate], load: LoadFn, key: int) -> Candidate:
        """`load` is the plain score (queue + in-flight + KV pressure), not latency-
        weighted: the bound and the queue term count requests."""
        request = self.request
        assert request is not None, "KvPairer sets the request before each choice"
        return self._choose_by_cost(eligible, load, request)

    def _choose_by_cost(self, eligible: Sequence[Candidate], load: LoadFn,
                        key: KvAffinity) -> Candidate:
        loads = [load(c) for c in eligible]
        fresh = [v for v in loads if v < SATURATED_SCORE]
        bound = math.ceil(self.bound_factor * (sum(fresh) + 1) / max(1, len(fresh)))
        work = self.work or float(key.prompt_tokens)
        best: Scored | None = None
        scored: list[tuple[Candidate, float, int]] = []
        for c, c_load in zip(eligible, loads, strict=True):
            if c_load + 1 > bound and len(eligible) > 1:
                continue  # over the load bound: a hot prefix spills to the next best
            scored.append((c, c_load, self.cached_tokens(c, key)))
        if scored and not any(cached for _, _, cached in scored):
            # Cached nowhere: place it by the prefix ring (bounded load), so the requests
            # that will share this prefix meet on one prefill instead of each caching it
            # wherever the queue was shortest.
            pick = self._ring.choose([c for c, _, _ in scored], load, key.key)
            best = Scored(pick, 0, 0.0)
        for c, c_load, cached in scored if best is None else ():
            if c_load >= SATURATED_SCORE:
                cost = SATURATED_SCORE + c_load  # cannot see its queue: last resort
            else:
                own = self.in_flight.get(c.id, 0)
                queue = (own + OTHERS_WEIGHT * max(0, c.queue - own)
                         + c.kv_usage * KV_PRESSURE_REQS)
                cost = (key.prompt_tokens - cached) + QUEUE_WEIGHT * queue * work
            if best is None or cost < best.cost:
                best = Scored(c, cached, cost)
        if best is None:  # everyone over the bound (stale loads): least loaded
            i = min(range(len(eligible)), key=loads.__getitem__)
            best = Scored(eligible[i], self.cached_tokens(eligible[i], key), loads[i])
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("[kv] pick tokens=%d work=%.0f bound=%d ring=%s %s -> %s cached=%d",
                         key.prompt_tokens, work, bound, not any(c for _, _, c in scored),
                         " ".join(f"{c.id}:load={v:g}:cached={self.cached_tokens(c, key)}"
                                  f"{'' if any(c is s for s, _, _ in scored) else ':over'}"
                                  for c, v in zip(eligible, loads, strict=True)),
                         best.candidate.id, best.cached_tokens)
        uncached = key.prompt_tokens - best.cached_tokens
        self.work = uncached if not self.work else \
            (1 - WORK_EWMA_ALPHA) * self.work + WORK_EWMA_ALPHA * uncached
        self.last = best
        return best.candidate


class KvPairer(Pairer):
    """`Pairer` with the KV chooser for prefills where an index can answer, `peak_ewma`'s
    choice otherwise (and for decodes), and conditional disaggregation.
    `on_pick(model, affinity, pair)`: called for a request's first choice (the prompt
    tokens it routed, and those predicted cached); `exact` says whether that choice went
    by the index."""

    def __init__(self, chooser: KvChooser, decode: Chooser, fallback: Chooser, *,
                 latency: LatencyTracker,
                 stale_after_s: float = DEFAULT_STALE_LOAD_S,
                 disagg_min_uncached_tokens: int = 0) -> None:
        super().__init__(chooser, decode, stale_after_s=stale_after_s, latency=latency)
        self.kv = chooser
        self._fallback = fallback  # peak_ewma's prefill chooser
        self.disagg_min_uncached_tokens = disagg_min_uncached_tokens
        self.on_pick: Callable[[str, KvAffinity, Pair], None] | None = None
        self.exact = False  # the last prefill choice went by the index

    def _choose_prefill(self, options: Options, loads: Loads, key: int,
                        now: float) -> Candidate:
        prefills = options[0][0] if len(options) == 1 else [c for ps, _ in options
                                                             for c in ps]
        request = self.kv.request
        self.exact = request is not None and self.kv.answers(prefills, request)
        if self.exact:
            p = self.kv.choose(prefills, loads.base, key)
        else:
            self.kv.last = None
            p = self._fallback.choose(prefills, loads.prefill, key)
        self._note_probe(PREFILL_ROLE, p, now)
        return p

    def choose(self, table: PairingTable, model: str, *, now: float,
               in_flight: Mapping[str, int], quarantined: Mapping[str, int] | None = None,
               key: int = 0, exclude: Collection[str] = (),
               loads_confirmed_at: float = -math.inf,
               affinity: Affinity | None = None) -> Pair | None:
        request = affinity if isinstance(affinity, KvAffinity) else None
        self.kv.in_flight, self.kv.request = in_flight, request
        pair = super().choose(table, model, now=now, in_flight=in_flight,
                              quarantined=quarantined, key=key, exclude=exclude,
                              loads_confirmed_at=loads_confirmed_at, affinity=affinity)
        if pair is None or request is None:
            return pair
        if self.disagg_min_uncached_tokens and not pair.direct:
            # What the decode would compute itself: the prompt less what *it* caches (a
            # decode that publishes KV events is indexed too; one that does not caches
            # nothing here).
            uncached = request.prompt_tokens - self.kv.cached_tokens(pair.decode, request)
            if uncached < self.disagg_min_uncached_tokens:
                pair = Pair(pair.decode, pair.decode)  # the decode prefills it locally
        if not exclude and self.on_pick is not None:
            self.on_pick(model, request, pair)
        return pair

    def cached_tokens_of(self, pair: Pair) -> int:
        """Prompt tokens predicted cached at the pair's prefill (the last choice)."""
        last = self.kv.last
        return last.cached_tokens if last is not None and last.candidate is pair.prefill else 0


def make_kv_pairer(index: KvIndex, *, rng: random.Random | None = None,
                   stale_after_s: float = DEFAULT_STALE_LOAD_S,
                   latency: LatencyTracker | None = None,
                   disagg_min_uncached_tokens: int = 0) -> KvPairer:
    """`latency`: the router's tracker (the one its outcomes feed), else one of its own."""
    rng = rng or random.Random()
    return KvPairer(KvChooser(index), PowerOfTwo(rng), PowerOfTwo(rng),
                    latency=latency or LatencyTracker(), stale_after_s=stale_after_s,
                    disagg_min_uncached_tokens=disagg_min_uncached_tokens)
