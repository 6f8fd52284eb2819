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
`prefix` ring among the least loaded members, so requests sharing a new prefix meet on
one prefill whenever it is as free as any, and a miss never waits behind a queue.
On top, the bounded-load rule of `prefix` (router/choosers.py) with a looser factor: only
members whose load is within KV_BOUND_FACTOR x the average (+1) compete, so a hot prefix
never piles onto one prefill. The decode is chosen as `peak_ewma` chooses it (power of
two over load x observed service time): every decode pulls the whole prompt's KV from its
prefill, so that part of the cost is the same for all; except under conditional
disaggregation.

Conditional disaggregation (`disagg_min_uncached_tokens` > 0, by default
DEFAULT_DISAGG_MIN_UNCACHED_TOKENS): a decode keeps the KV it pulls and its KV events say
so, so the decode is the one holding most of the prompt (a chat's conversation so far)
unless its load is over `prefix`'s bound (AFFINITY_BOUND_FACTOR); and when that decode
holds part of the prompt and would compute fewer prompt tokens than the threshold
itself, the prefill leg is skipped and the decode serves the request alone, as Dynamo
and llm-d do. A prompt no decode holds keeps its prefill leg, placed as `peak_ewma`
places it.

The index is not ahead of the engine: a request's blocks count at its prefill only once
that prefill's events list them, not from the pick on. bench_kv.py measured counting the
blocks of requests in flight as "soon cached" too: no gain (71.2% hits with, 71.9%
without), and the hits the router predicted equalled what the engines found (71.2% /
71.2%), so the events were not lagging behind the next request sharing a prefix.

A member's events are claims, and an insider may lie: each pick's prediction travels
with its `Pair`, the engine reports the prompt tokens it found cached, and a member that
keeps finding much less than it claimed is scored as holding nothing for a while
(router/kv/trust.py). Ties in cost go at random, so equal claims split the work.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from router.choice import Affinity, Choice
from router.choosers import (
    AFFINITY_BOUND_FACTOR,
    SATURATED_SCORE,
    Chooser,
    LoadFn,
    PowerOfTwo,
    PrefixAffinity,
)
from router.kv.index import KvIndex
from router.kv.trust import CacheTrust
from router.latency import LatencyTracker
from router.policies import DEFAULT_STALE_LOAD_S, Loads, Pairer
from router.table import Candidate, Pair

__all__ = ["DEFAULT_DISAGG_MIN_UNCACHED_TOKENS", "KvAffinity", "KvChooser", "KvPairer",
           "make_kv_pairer"]

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
# A prompt cached nowhere goes by the ring among the members this close to the least
# loaded (in requests). bench_kv.py --decisions: with the ring's own bound, one miss in
# ten waited behind a busy prefill while another was idle (the tail's slowest requests).
LEAST_LOADED_SLACK: Final = 0.5
# Conditional disaggregation's threshold, in uncached prompt tokens on a decode that
# holds the rest. bench_kv.py --trace chat (bench/RESULTS.md), the decode holding the
# conversation and the answer it wrote: TTFT p50 0.49x of always disaggregating at 256,
# 0.51x at 512, 0.49x at 1,024, 0.78x at 128 (a new question is ~100-170 tokens). The
# smallest N on that plateau: the less a decode prefills, the less its other streams wait.
DEFAULT_DISAGG_MIN_UNCACHED_TOKENS: Final = 256


@dataclass(frozen=True, slots=True)
class KvAffinity(Affinity):
    """What the `kv` policy knows of a request's prompt. `key` (the `Affinity` every
    chooser sees) is the `prefix` ring key, for a prompt cached nowhere."""

    prompt_tokens: int = 0
    keys: Mapping[int, Sequence[int]] = field(default_factory=dict)  # block size -> keys


# A prefill within the load bound, its load (the plain score) and the prompt tokens it
# holds.
Within = list[tuple[Candidate, float, int]]


class KvChooser:
    """The prefill for a `KvAffinity`, in three steps: the load bound keeps who may
    compete, the ring places a prompt that none of them holds, and otherwise the
    cheapest by cost wins (the module docstring). Every answer is `exact`: it went by
    the index. The one thing it keeps between choices is W, the work a queued request
    brings."""

    def __init__(self, index: KvIndex, bound_factor: float = KV_BOUND_FACTOR, *,
                 trust: CacheTrust | None = None, rng: random.Random | None = None) -> None:
        """`trust`: whose claims to ignore (router/kv/trust.py); `rng` breaks ties."""
        self.index = index
        self.bound_factor = bound_factor
        self.trust = trust or CacheTrust()
        self.rng = rng or random.Random()
        self.work = 0.0  # W: EWMA of uncached tokens per pick (0 until the first)
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

    def cached_tokens(self, c: Candidate, affinity: KvAffinity, now: float) -> int:
        """The prompt tokens `c` is predicted to hold: what its events claim, or none
        while its own reports contradict its claims (`trust`)."""
        if self.trust.distrusts(c.id, now):
            return 0
        member = self.index.get(c.id, c.incarnation)
        if member is None or not member.block_size:
            return 0
        keys = affinity.keys.get(member.block_size)
        if not keys:
            return 0
        return member.cached_blocks(keys) * member.block_size

    def choose(self, eligible: Sequence[Candidate], load: LoadFn, affinity: KvAffinity,
               in_flight: Mapping[str, int], now: float) -> Choice:
        """`load` is the plain score (queue + in-flight + KV pressure), not latency-
        weighted: the bound and the queue term count requests. `in_flight`: this
        router's own requests per member id (own(c) in the cost)."""
        loads = [load(c) for c in eligible]
        bound = self._bound(loads)
        within = self._within(eligible, loads, bound, affinity, now)
        if not within:  # everyone over the bound (stale loads): the least loaded
            i = min(range(len(eligible)), key=loads.__getitem__)
            choice = Choice(eligible[i], self.cached_tokens(eligible[i], affinity, now),
                            exact=True)
        elif not any(cached for _, _, cached in within):
            # Cached nowhere: place it by the prefix ring among the least loaded, so the
            # requests that will share this prefix meet on one prefill while it is as
            # free as any; never behind a queue another prefill does not have (a miss
            # computes the whole prompt anywhere: waiting buys it nothing).
            choice = Choice(self._ring.choose(_least_loaded(within), load, affinity),
                            exact=True)
        else:
            choice = self._cheapest(within, affinity, in_flight)
        if logger.isEnabledFor(logging.DEBUG):
            self._log_pick(eligible, loads, bound, within, affinity, choice, now)
        self._learn(affinity.prompt_tokens - choice.cached_tokens)
        return choice

    def _bound(self, loads: Sequence[float]) -> int:
        """The hard load bound (`prefix`'s rule, KV_BOUND_FACTOR): load + 1 may not pass
        it. Loads too old to trust (saturated) do not count in the average."""
        fresh = [v for v in loads if v < SATURATED_SCORE]
        return math.ceil(self.bound_factor * (sum(fresh) + 1) / max(1, len(fresh)))

    def _within(self, eligible: Sequence[Candidate], loads: Sequence[float], bound: int,
                affinity: KvAffinity, now: float) -> Within:
        """The members within the bound, with what each holds of the prompt. A lone
        member is never over it."""
        alone = len(eligible) == 1
        return [(c, c_load, self.cached_tokens(c, affinity, now))
                for c, c_load in zip(eligible, loads, strict=True)
                if alone or c_load + 1 <= bound]  # over it: a hot prefix spills

    def _cheapest(self, within: Within, affinity: KvAffinity,
                  in_flight: Mapping[str, int]) -> Choice:
        """The least cost: uncached tokens + the queue's worth of work (the module
        docstring); a member whose load is too old to see ranks last. Ties at random: an
        order (the lower id, the lower KV use) would be a rule an insider could game."""
        work = self.work or float(affinity.prompt_tokens)
        best: list[Choice] = []
        best_cost = 0.0
        for c, c_load, cached in within:
            if c_load >= SATURATED_SCORE:
                cost = SATURATED_SCORE + c_load  # cannot see its queue: last resort
            else:
                own = in_flight.get(c.id, 0)
                queue = (own + OTHERS_WEIGHT * max(0, c.queue - own)
                         + c.kv_usage * KV_PRESSURE_REQS)
                cost = (affinity.prompt_tokens - cached) + QUEUE_WEIGHT * queue * work
            if not best or cost < best_cost:
                best, best_cost = [Choice(c, cached, exact=True)], cost
            elif cost == best_cost:
                best.append(Choice(c, cached, exact=True))
        assert best, "within the bound is never empty here"
        return best[0] if len(best) == 1 else self.rng.choice(best)

    def _learn(self, uncached: int) -> None:
        """W follows the uncached tokens of each pick (an EWMA; the first pick sets it)."""
        self.work = uncached if not self.work else \
            (1 - WORK_EWMA_ALPHA) * self.work + WORK_EWMA_ALPHA * uncached

    def _log_pick(self, eligible: Sequence[Candidate], loads: Sequence[float], bound: int,
                  within: Within, affinity: KvAffinity, choice: Choice, now: float) -> None:
        kept = {id(c) for c, _, _ in within}
        logger.debug("[kv] pick tokens=%d work=%.0f bound=%d ring=%s %s -> %s cached=%d",
                     affinity.prompt_tokens, self.work or affinity.prompt_tokens, bound,
                     not any(cached for _, _, cached in within),
                     " ".join(f"{c.id}:load={v:g}:cached={self.cached_tokens(c, affinity, now)}"
                              f"{'' if id(c) in kept else ':over'}"
                              for c, v in zip(eligible, loads, strict=True)),
                     choice.candidate.id, choice.cached_tokens)


def _least_loaded(within: Within) -> list[Candidate]:
    """The members within LEAST_LOADED_SLACK of the least load (a member's KV pressure
    adds a fraction of a request to its load: not a queue)."""
    least = min(c_load for _, c_load, _ in within)
    return [c for c, c_load, _ in within if c_load < least + LEAST_LOADED_SLACK]


class KvPairer(Pairer):
    """`Pairer` with the KV chooser for prefills where an index can answer, `peak_ewma`'s
    choice otherwise (and for decodes), and conditional disaggregation. The pair it
    answers carries the prefill choice's prediction (`Pair.cached_tokens`, `exact`)."""

    def __init__(self, chooser: KvChooser, decode: Chooser, fallback: Chooser, *,
                 latency: LatencyTracker,
                 stale_after_s: float = DEFAULT_STALE_LOAD_S,
                 disagg_min_uncached_tokens: int = 0) -> None:
        """`fallback`: `peak_ewma`'s prefill chooser, for requests the index cannot
        answer."""
        super().__init__(fallback, decode, stale_after_s=stale_after_s, latency=latency)
        self.kv = chooser
        self.disagg_min_uncached_tokens = disagg_min_uncached_tokens

    def _choose_prefill(self, prefills: Sequence[Candidate], loads: Loads,
                        affinity: Affinity) -> Choice:
        if isinstance(affinity, KvAffinity) and self.kv.answers(prefills, affinity):
            return self.kv.choose(prefills, loads.base, affinity, loads.in_flight, loads.now)
        return super()._choose_prefill(prefills, loads, affinity)

    def _choose_decode(self, decodes: Sequence[Candidate], loads: Loads,
                       affinity: Affinity) -> Candidate:
        """Under conditional disaggregation, the decode holding most of the prompt if it
        is within the load bound; otherwise (or none holds any) `peak_ewma`'s pick."""
        picked = super()._choose_decode(decodes, loads, affinity)
        if (not self.disagg_min_uncached_tokens or not isinstance(affinity, KvAffinity)
                or len(decodes) < 2):
            return picked
        holder, cached = max(((c, self.kv.cached_tokens(c, affinity, loads.now))
                              for c in decodes),
                             key=lambda held: held[1])
        if not cached or holder is picked:
            return picked
        held = [loads.base(c) for c in decodes]
        fresh = [v for v in held if v < SATURATED_SCORE]
        # `prefix`'s own bound (1.25): the load bound of the prefill's cost rule is
        # vacuous for two members, and a decode's queue is not weighed against its cache.
        bound = math.ceil(AFFINITY_BOUND_FACTOR * (sum(fresh) + 1) / max(1, len(fresh)))
        if held[decodes.index(holder)] + 1 <= bound:
            return holder
        return picked

    def _paired(self, pair: Pair, affinity: Affinity, now: float) -> Pair:
        """Conditional disaggregation: when the decode holds part of the prompt (its own
        KV events say so: it kept what it pulled, the conversation so far) and would
        compute fewer than `disagg_min_uncached_tokens` of it itself, the decode serves
        the request alone. A prompt the decode holds nothing of keeps its prefill leg,
        however short: only the conversation case was measured to win."""
        if not self.disagg_min_uncached_tokens or not isinstance(affinity, KvAffinity):
            return pair
        cached = self.kv.cached_tokens(pair.decode, affinity, now)
        if cached and affinity.prompt_tokens - cached < self.disagg_min_uncached_tokens:
            return Pair(pair.decode, pair.decode, cached, pair.exact)
        return pair


def make_kv_pairer(index: KvIndex, *, rng: random.Random | None = None,
                   stale_after_s: float = DEFAULT_STALE_LOAD_S,
                   latency: LatencyTracker | None = None,
                   disagg_min_uncached_tokens: int = 0,
                   trust: CacheTrust | None = None) -> KvPairer:
    """`latency`: the router's tracker (the one its outcomes feed), else one of its own;
    `trust`: the router's record of members whose reports contradict their events."""
    rng = rng or random.Random()
    return KvPairer(KvChooser(index, trust=trust, rng=rng), PowerOfTwo(rng), PowerOfTwo(rng),
                    latency=latency or LatencyTracker(), stale_after_s=stale_after_s,
                    disagg_min_uncached_tokens=disagg_min_uncached_tokens)
