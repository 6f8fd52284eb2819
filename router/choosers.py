"""Per-role selection rules: which one of the eligible members takes a request.

Each `Chooser` gets the eligible candidates (never empty), a load function (lower is
better; see `router.policies`) and the request's `Affinity` (router/choice.py), and
returns one. Only `PrefixAffinity` reads the affinity (its `key`).
"""

from __future__ import annotations

import hashlib
import math
import random
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from router.choice import Affinity
from router.table import Candidate

__all__ = [
    "Chooser",
    "LeastLoaded",
    "LoadFn",
    "PowerOfTwo",
    "PrefixAffinity",
    "RandomChoice",
    "RoundRobin",
    "prefix_key",
    "session_key",
]

# A member whose load is at least this is saturated (its load report is stale).
SATURATED_SCORE: Final = 1e9
# Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2016): a member
# takes a key only while its load stays under BOUND_FACTOR x the average.
AFFINITY_BOUND_FACTOR: Final = 1.25
AFFINITY_VNODES: Final = 64  # ring points per member; more = smoother split
AFFINITY_RING_CACHE: Final = 16  # rings kept (one per distinct eligible set)
PREFIX_BYTES: Final = 256  # how much of the prompt identifies a shared prefix

LoadFn = Callable[[Candidate], float]


class Chooser(Protocol):
    """Picks one of `eligible` (never empty) for a request with `affinity`."""

    def choose(self, eligible: Sequence[Candidate], load: LoadFn,
               affinity: Affinity) -> Candidate: ...


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, eligible: Sequence[Candidate], load: LoadFn,
               affinity: Affinity) -> Candidate:
        pick = eligible[self._next % len(eligible)]
        self._next += 1
        return pick


class RandomChoice:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, eligible: Sequence[Candidate], load: LoadFn,
               affinity: Affinity) -> Candidate:
        return eligible[_below(self._rng, len(eligible))]


class PowerOfTwo:
    """Sample two distinct members, take the less loaded (ties: the first sampled)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, eligible: Sequence[Candidate], load: LoadFn,
               affinity: Affinity) -> Candidate:
        n = len(eligible)
        if n == 1:
            return eligible[0]
        i = _below(self._rng, n)
        j = _below(self._rng, n - 1)
        j += j >= i  # distinct from i, uniform over the rest
        a, b = eligible[i], eligible[j]
        return b if load(b) < load(a) else a


class LeastLoaded:
    """The minimum load; ties broken at random so equal members share the work."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, eligible: Sequence[Candidate], load: LoadFn,
               affinity: Affinity) -> Candidate:
        best: list[Candidate] = []
        best_load = math.inf
        for c in eligible:
            value = load(c)
            if value < best_load:
                best, best_load = [c], value
            elif value == best_load:
                best.append(c)
        return best[0] if len(best) == 1 else best[_below(self._rng, len(best))]


def _below(rng: random.Random, n: int) -> int:
    """A uniform integer in [0, n): `randrange` costs a microsecond in Python, this a
    tenth (n is a member count, far below where float rounding could bias it)."""
    return int(rng.random() * n)


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_key(prompt: bytes) -> int:
    """Hash of the first PREFIX_BYTES of a prompt: requests sharing it share a prefill."""
    return _hash64(prompt[:PREFIX_BYTES])


def session_key(session: str) -> int:
    """Hash of a session id: every turn of a conversation goes to the same pair."""
    return _hash64(session.encode())


@dataclass(frozen=True, slots=True)
class _Ring:
    points: list[int]  # sorted
    owners: list[int]  # owners[k] = index into the eligible list of points[k]


def _build_ring(ids: Sequence[str], vnodes: int) -> _Ring:
    pairs = sorted(
        (_hash64(f"{member_id}#{v}".encode()), index)
        for index, member_id in enumerate(ids)
        for v in range(vnodes)
    )
    return _Ring([p for p, _ in pairs], [o for _, o in pairs])


class PrefixAffinity:
    """Consistent hashing with bounded load on the prompt-prefix hash.

    A key goes to the first member clockwise on the ring whose load is under
    ceil(BOUND_FACTOR * (total + 1) / n); a shared prefix therefore lands on the same
    prefill (prefix-cache hits) until that prefill is overloaded, then spills to the next
    one on the ring, which is the same for every request with that prefix.
    """

    def __init__(self, bound_factor: float = AFFINITY_BOUND_FACTOR,
                 vnodes: int = AFFINITY_VNODES) -> None:
        self._bound_factor = bound_factor
        self._vnodes = vnodes
        self._rings: dict[tuple[str, ...], _Ring] = {}

    def _ring(self, eligible: Sequence[Candidate]) -> _Ring:
        ids = tuple(c.id for c in eligible)
        ring = self._rings.get(ids)
        if ring is None:
            if len(self._rings) >= AFFINITY_RING_CACHE:
                self._rings.pop(next(iter(self._rings)))  # oldest first (dict order)
            ring = self._rings[ids] = _build_ring(ids, self._vnodes)
        return ring

    def choose(self, eligible: Sequence[Candidate], load: LoadFn,
               affinity: Affinity) -> Candidate:
        n = len(eligible)
        if n == 1:
            return eligible[0]
        loads = [load(c) for c in eligible]
        fresh = [v for v in loads if v < SATURATED_SCORE]
        bound = math.ceil(self._bound_factor * (sum(fresh) + 1) / max(1, len(fresh)))
        ring = self._ring(eligible)
        start = bisect_left(ring.points, affinity.key)
        total = len(ring.points)
        for step in range(total):
            owner = ring.owners[(start + step) % total]
            if loads[owner] + 1 <= bound:
                return eligible[owner]
        # Everyone is over the bound (e.g. all loads stale): fall back to least loaded.
        return eligible[min(range(n), key=loads.__getitem__)]
