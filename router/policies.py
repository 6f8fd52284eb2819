"""Pairing policy: which prefill and which decode serve a request. Pure and clock-free.

Everything here takes the time (`now`, the same clock as `LiveMember.load_at`), the
router's own in-flight counts and the local quarantine as arguments, so it is tested
with tables and Hypothesis, never with sleeps.

A policy is a `Pairer`: a `Chooser` per role (router/choosers.py), the load function they
compare (reported queue + the router's own in-flight + KV pressure; times the member's
observed service time for `peak_ewma`), and the request's `Affinity` (router/choice.py:
what `prefix` and `session` hash; 0 for the others), computed once at admission. The
prefill step answers a `Choice`, whose prediction (prompt tokens cached) the `Pair`
carries on; nothing of a choice is left behind in the pairer.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from registry.detector import HEARTBEAT_INTERVAL_S
from router.choice import NO_AFFINITY, Affinity, Choice
from router.choosers import (
    SATURATED_SCORE,
    Chooser,
    LeastLoaded,
    PowerOfTwo,
    PrefixAffinity,
    RandomChoice,
    RoundRobin,
    prefix_key,
    session_key,
)
from router.latency import LatencyTracker
from router.table import Candidate, Pair, PairingTable, ProtocolPool, eligible
from wire.protocol import Role

__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_STALE_LOAD_S",
    "POLICY_NAMES",
    "AffinityKey",
    "Loads",
    "Pairer",
    "make_pairer",
    "score",
]

# A member whose load report is older than this many heartbeat intervals is treated as
# saturated: we cannot see its queue, so we assume the worst and prefer anyone we can see.
STALE_LOAD_INTERVALS: Final = 3
DEFAULT_STALE_LOAD_S: Final = STALE_LOAD_INTERVALS * HEARTBEAT_INTERVAL_S
# A full KV cache costs as much as this many queued requests: a member near 100% KV
# usage is about to preempt, so it should lose to a slightly longer queue elsewhere.
KV_FULL_PENALTY_REQS: Final = 16.0
PREFILL_ROLE: Final = "prefill"  # latency-tracker roles
DECODE_ROLE: Final = "decode"

# What a request's affinity key is made of: (the X-Session-Id header or "", the body).
AffinityKey = Callable[[str, Mapping[str, Any]], int]


def score(c: Candidate, in_flight: int, now: float, stale_after_s: float,
          confirmed_at: float = -math.inf) -> float:
    """Lower is better: reported queue + the router's own in-flight + a KV-pressure term.

    A load older than `stale_after_s` counts as saturated (still ordered by in-flight, so
    when everyone is stale the router spreads its own work evenly). Its age runs from
    when it was measured or, if later, `confirmed_at`: when the registry last said the
    loads of the member's model that it did not list are unchanged.
    """
    if now - max(c.load_at, confirmed_at) > stale_after_s:
        return SATURATED_SCORE + in_flight
    return c.queue + in_flight + c.kv_usage * KV_FULL_PENALTY_REQS


def outstanding(c: Candidate, in_flight: int, now: float, stale_after_s: float,
                confirmed_at: float = -math.inf) -> float:
    """The work a member has, for latency weighting: the larger of its reported queue and
    the router's own in-flight count (its report includes this router's requests, so the
    sum would count them twice, and a product magnifies that), plus KV pressure. Stale
    as in `score`."""
    if now - max(c.load_at, confirmed_at) > stale_after_s:
        return SATURATED_SCORE + in_flight
    return max(c.queue, in_flight) + c.kv_usage * KV_FULL_PENALTY_REQS


def no_key(session: str, body: Mapping[str, Any]) -> int:
    return 0


def prompt_key(session: str, body: Mapping[str, Any]) -> int:
    """The prompt's prefix (completions), else the messages' encoding (chat)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prefix_key(prompt.encode())
    source = prompt if prompt is not None else body.get("messages")
    return prefix_key(msgspec.json.encode(source))


def conversation_key(session: str, body: Mapping[str, Any]) -> int:
    """The session (the header, else OpenAI's `user`), else the prompt's prefix."""
    session = session or body.get("user") or ""
    if isinstance(session, str) and session:
        return session_key(session)
    return prompt_key("", body)


@dataclass(frozen=True, slots=True)
class Loads:
    """What one choice knows of load: this router's own `in_flight` count per member id,
    `base` (the plain score: locality's saturation test, the `kv` policy's cost) and one
    load function per role for the choosers (the same as `base` unless latency-weighted)."""

    in_flight: Mapping[str, int]
    base: Callable[[Candidate], float]
    prefill: Callable[[Candidate], float]
    decode: Callable[[Candidate], float]
    now: float = 0.0  # the time of the choice (the `kv` policy's trust in members expires)


Options = list[tuple[Sequence[Candidate], Sequence[Candidate]]]


class Pairer:
    """Chooses (P, D) for a request: P by the prefill chooser, then D among members of the
    same model and protocol, preferring P's locality.

    A mixed member chosen as P also serves as its own D: serving in place beats moving
    the KV cache. `now` and `in_flight` (router's own, per member id) are passed in.
    With a `latency` tracker, a member's load is (outstanding + 1) x its estimated service
    time (peak-EWMA), so of two equally busy members the faster one wins, and a member
    twice as slow takes about half the work.
    """

    def __init__(self, prefill: Chooser, decode: Chooser, *,
                 stale_after_s: float = DEFAULT_STALE_LOAD_S,
                 affinity_key: AffinityKey = no_key,
                 latency: LatencyTracker | None = None) -> None:
        self._prefill = prefill
        self._decode = decode
        self.stale_after_s = stale_after_s
        self.affinity_key = affinity_key
        self.latency = latency

    def affinity(self, session: str, body: Mapping[str, Any]) -> Affinity:
        """The request's input to pairing, computed at admission (once per request)."""
        if self.affinity_key is no_key:
            return NO_AFFINITY
        return Affinity(self.affinity_key(session, body))

    def choose(self, table: PairingTable, model: str, *, now: float,
               in_flight: Mapping[str, int], quarantined: Mapping[str, int] | None = None,
               exclude: Collection[str] = (), loads_confirmed_at: float = -math.inf,
               affinity: Affinity = NO_AFFINITY) -> Pair | None:
        """A pair for a request with `affinity` (from `affinity()`), None if `model` has
        no eligible P and D. `loads_confirmed_at`: when the registry last confirmed
        `model`'s loads (see `score`)."""
        pools = table.pools.get(model)
        if not pools:
            return None
        options = _options(pools, quarantined, exclude)
        if not options:
            return None
        loads = self.loads(now, in_flight, loads_confirmed_at)
        # Several protocols serve this model: choose P across all, D in P's pool.
        prefills = options[0][0] if len(options) == 1 else [c for ps, _ in options
                                                             for c in ps]
        choice = self._choose_prefill(prefills, loads, affinity)
        p = choice.candidate
        self._note_probe(PREFILL_ROLE, p, now)
        if p.role is Role.MIXED:
            return Pair(p, p, choice.cached_tokens, choice.exact)
        d = self._choose_decode(_decodes_for(p, options, loads.base), loads, affinity)
        self._note_probe(DECODE_ROLE, d, now)
        return self._paired(Pair(p, d, choice.cached_tokens, choice.exact), affinity, now)

    def loads(self, now: float, in_flight: Mapping[str, int],
              confirmed_at: float) -> Loads:
        stale_after_s = self.stale_after_s

        def base(c: Candidate) -> float:
            return score(c, in_flight.get(c.id, 0), now, stale_after_s, confirmed_at)

        latency = self.latency
        if latency is None:
            return Loads(in_flight, base, base, base, now)

        def weighted(role: str) -> Callable[[Candidate], float]:
            def load(c: Candidate) -> float:
                s = outstanding(c, in_flight.get(c.id, 0), now, stale_after_s, confirmed_at)
                if s >= SATURATED_SCORE:
                    return s
                weight = latency.weight(role, c.id, c.incarnation, now)
                if weight < 0.0:
                    return -1.0  # due a probe: it wins when sampled, once
                return (s + 1.0) * weight
            return load
        return Loads(in_flight, base, weighted(PREFILL_ROLE), weighted(DECODE_ROLE), now)

    def _choose_prefill(self, prefills: Sequence[Candidate], loads: Loads,
                        affinity: Affinity) -> Choice:
        """The prefill, by the policy's chooser (which predicts nothing of its cache)."""
        return Choice(self._prefill.choose(prefills, loads.prefill, affinity))

    def _choose_decode(self, decodes: Sequence[Candidate], loads: Loads,
                       affinity: Affinity) -> Candidate:
        return self._decode.choose(decodes, loads.decode, affinity)

    def _paired(self, pair: Pair, affinity: Affinity, now: float) -> Pair:
        """The pair that serves the request: the one chosen (the `kv` policy may serve
        it on the decode alone instead)."""
        return pair

    def _note_probe(self, role: str, chosen: Candidate, now: float) -> None:
        latency = self.latency
        if latency is not None and latency.probe_due(role, chosen.id, chosen.incarnation,
                                                     now):
            latency.probing(role, chosen.id, now)


def _options(pools: Sequence[ProtocolPool], quarantined: Mapping[str, int] | None,
             exclude: Collection[str]) -> Options:
    """Per protocol pool, its eligible prefills and decodes, where both exist."""
    options: Options = []
    for pool in pools:
        decodes = _without(eligible(pool.decodes, pool.decodes_suspect, quarantined), exclude)
        if not decodes:
            continue
        prefills = _without(eligible(pool.prefills, pool.prefills_suspect, quarantined),
                            exclude)
        if prefills:
            options.append((prefills, decodes))
    return options


def _decodes_for(p: Candidate, options: Options,
                 base: Callable[[Candidate], float]) -> Sequence[Candidate]:
    """The decodes that can pair with `p`: its pool's, those near it if any is not
    saturated."""
    decodes = options[0][1] if len(options) == 1 else next(
        ds for ps, ds in options if ps and ps[0].protocol == p.protocol)
    if p.locality:
        near = [d for d in decodes if d.locality == p.locality and base(d) < SATURATED_SCORE]
        if near:
            return near
    return decodes


def _without(candidates: Sequence[Candidate], exclude: Collection[str]) -> Sequence[Candidate]:
    """Drop members already tried for this request, unless that leaves nobody."""
    if not exclude:
        return candidates
    kept = [c for c in candidates if c.id not in exclude]
    return kept or candidates


POLICY_NAMES: Final = ("peak_ewma", "power_of_two", "round_robin", "random", "least_loaded",
                       "prefix", "session", "kv")
# `kv` (router/kv/policy.py) is built by the router with its KV index; made here it is
# its own fallback: `peak_ewma`, for models it cannot match exactly.
# peak_ewma won bench/bench_router.py against power_of_two: one prefill 10x slower got
# 0-2% of prefills instead of 13-14%, one decode 5x slower 4-10% instead of 24-25%, at
# the same CPU per request within the machine's noise (bench/RESULTS.md).
# kv is peak_ewma wherever no engine publishes KV events (and for decodes always), and
# where they do it won bench/bench_kv.py: TTFT p50 62 ms against 239 for peak_ewma, 287
# for round robin and 216-343 for the peer routers' cache_aware (bench/RESULTS.md).
DEFAULT_POLICY: Final = "kv"


def make_chooser(name: str, rng: random.Random) -> Chooser:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(rng)
    if name in ("power_of_two", "peak_ewma"):
        return PowerOfTwo(rng)
    if name == "least_loaded":
        return LeastLoaded(rng)
    if name == "kv":  # without its index (router/kv/policy.py): its fallback
        return PowerOfTwo(rng)
    if name in ("prefix", "session"):
        return PrefixAffinity()  # the same bounded-load ring, keyed differently
    raise ValueError(f"unknown policy {name!r}; expected one of: {', '.join(POLICY_NAMES)}")


def make_pairer(name: str = DEFAULT_POLICY, *, rng: random.Random | None = None,
                stale_after_s: float = DEFAULT_STALE_LOAD_S,
                latency: LatencyTracker | None = None) -> Pairer:
    """`prefix` applies to prefills (where the prefix cache lives); decodes then use
    power of two. `session` pins both roles (a conversation keeps its pair while that
    pair is not overloaded). `peak_ewma` is power of two over load x observed latency
    (it uses `latency`, or a tracker of its own). Every other policy applies to both
    roles and ignores latency."""
    rng = rng or random.Random()
    prefill = make_chooser(name, rng)
    decode = make_chooser("power_of_two" if name == "prefix" else name, rng)
    key = {"prefix": prompt_key, "session": conversation_key}.get(name, no_key)
    latency = (latency or LatencyTracker()) if name in ("peak_ewma", "kv") else None
    return Pairer(prefill, decode, stale_after_s=stale_after_s, affinity_key=key,
                  latency=latency)
