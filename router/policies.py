"""Pairing math: which prefill and which decode serve a request. Pure and clock-free.

Everything here takes the time (`now`, the same clock as `LiveMember.load_at`), the
router's own in-flight counts and the local quarantine as arguments, so it is tested
with tables and Hypothesis, never with sleeps.

Vocabulary:
- `Candidate`: one member as the pairing math sees it (built once per membership change).
- `PairingTable`: per model, per protocol, the prefill and decode candidates, split into
  routable ones and ready-but-suspect ones (the fallback: detection alone never takes a
  role to zero).
- `Chooser`: one per-role selection rule (round robin, random, power of two, least
  loaded, prefix affinity).
- `Pairer`: picks a (P, D) pair from a table with a chooser per role.
"""

from __future__ import annotations

import hashlib
import math
import random
from bisect import bisect_left
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from registry.client import LiveMember
from registry.protocol import MemberState, Role

__all__ = [
    "POLICY_NAMES",
    "Candidate",
    "Chooser",
    "Pair",
    "Pairer",
    "PairingTable",
    "make_pairer",
    "prefix_key",
    "score",
]

# A member whose load report is older than this many heartbeat intervals is treated as
# saturated: we cannot see its queue, so we assume the worst and prefer anyone we can see.
STALE_LOAD_INTERVALS: Final = 3
DEFAULT_HEARTBEAT_INTERVAL_S: Final = 1.0
DEFAULT_STALE_LOAD_S: Final = STALE_LOAD_INTERVALS * DEFAULT_HEARTBEAT_INTERVAL_S
SATURATED_SCORE: Final = 1e9
# A full KV cache costs as much as this many queued requests: a member near 100% KV
# usage is about to preempt, so it should lose to a slightly longer queue elsewhere.
KV_FULL_PENALTY_REQS: Final = 16.0
# Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2016): a member
# takes a key only while its load stays under BOUND_FACTOR x the average.
AFFINITY_BOUND_FACTOR: Final = 1.25
AFFINITY_VNODES: Final = 64  # ring points per member; more = smoother split
AFFINITY_RING_CACHE: Final = 16  # rings kept (one per distinct eligible set)
PREFIX_BYTES: Final = 256  # how much of the prompt identifies a shared prefix


@dataclass(frozen=True, slots=True)
class Candidate:
    """A member as the pairing math sees it. `member` carries endpoints for the adapters."""

    id: str
    incarnation: int
    role: Role
    model: str
    protocol: str
    locality: str  # the value of the configured locality label, "" if none
    queue: int  # reported running + waiting
    kv_usage: float
    load_at: float  # monotonic time the load was measured
    http: str = ""  # base URL, no trailing slash
    member: LiveMember | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, member: LiveMember, locality_key: str = "") -> Candidate:
        spec = member.record.spec
        load = member.load
        return cls(
            id=spec.id, incarnation=spec.incarnation, role=spec.role, model=spec.model,
            protocol=spec.protocol,
            locality=spec.labels.get(locality_key, "") if locality_key else "",
            queue=load.running + load.waiting, kv_usage=load.kv_usage,
            load_at=member.load_at, http=spec.endpoints.http.rstrip("/"), member=member,
        )


def score(c: Candidate, in_flight: int, now: float, stale_after_s: float) -> float:
    """Lower is better: reported queue + the router's own in-flight + a KV-pressure term.

    A load older than `stale_after_s` counts as saturated (still ordered by in-flight, so
    when everyone is stale the router spreads its own work evenly).
    """
    if now - c.load_at > stale_after_s:
        return SATURATED_SCORE + in_flight
    return c.queue + in_flight + c.kv_usage * KV_FULL_PENALTY_REQS


LoadFn = Callable[[Candidate], float]


class Chooser(Protocol):
    """Picks one of `eligible` (never empty). `key` is the request's prefix hash."""

    def choose(self, eligible: Sequence[Candidate], load: LoadFn, key: int) -> Candidate: ...


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, eligible: Sequence[Candidate], load: LoadFn, key: int) -> Candidate:
        pick = eligible[self._next % len(eligible)]
        self._next += 1
        return pick


class RandomChoice:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, eligible: Sequence[Candidate], load: LoadFn, key: int) -> Candidate:
        return eligible[self._rng.randrange(len(eligible))]


class PowerOfTwo:
    """Sample two distinct members, take the less loaded (ties: the first sampled)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, eligible: Sequence[Candidate], load: LoadFn, key: int) -> Candidate:
        n = len(eligible)
        if n == 1:
            return eligible[0]
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        j += j >= i  # distinct from i, uniform over the rest
        a, b = eligible[i], eligible[j]
        return b if load(b) < load(a) else a


class LeastLoaded:
    """The minimum load; ties broken at random so equal members share the work."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, eligible: Sequence[Candidate], load: LoadFn, key: int) -> Candidate:
        best: list[Candidate] = []
        best_load = math.inf
        for c in eligible:
            value = load(c)
            if value < best_load:
                best, best_load = [c], value
            elif value == best_load:
                best.append(c)
        return best[0] if len(best) == 1 else best[self._rng.randrange(len(best))]


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

    def choose(self, eligible: Sequence[Candidate], load: LoadFn, key: int) -> Candidate:
        n = len(eligible)
        if n == 1:
            return eligible[0]
        loads = [load(c) for c in eligible]
        fresh = [v for v in loads if v < SATURATED_SCORE]
        bound = math.ceil(self._bound_factor * (sum(fresh) + 1) / max(1, len(fresh)))
        ring = self._ring(eligible)
        start = bisect_left(ring.points, key)
        total = len(ring.points)
        for step in range(total):
            owner = ring.owners[(start + step) % total]
            if loads[owner] + 1 <= bound:
                return eligible[owner]
        # Everyone is over the bound (e.g. all loads stale): fall back to least loaded.
        return eligible[min(range(n), key=loads.__getitem__)]


@dataclass(frozen=True, slots=True)
class ProtocolPool:
    """The candidates of one (model, protocol): P and D must speak the same handshake."""

    protocol: str
    prefills: tuple[Candidate, ...]  # routable (ready, not suspect); mixed included
    prefills_suspect: tuple[Candidate, ...]  # ready but suspect: the fallback tier
    decodes: tuple[Candidate, ...]
    decodes_suspect: tuple[Candidate, ...]


_PREFILL_ROLES: Final = (Role.PREFILL, Role.MIXED)
_DECODE_ROLES: Final = (Role.DECODE, Role.MIXED)


@dataclass(frozen=True, slots=True)
class PairingTable:
    """Per model, the protocol pools. Immutable; rebuilt only when membership changes."""

    pools: Mapping[str, tuple[ProtocolPool, ...]]

    @classmethod
    def build(cls, members: Mapping[str, LiveMember], locality_key: str = "",
              protocols: Collection[str] | None = None) -> PairingTable:
        """`protocols`: the handshakes this router speaks; members of others are left out."""
        by_key: dict[tuple[str, str], dict[str, list[Candidate]]] = {}
        for member in members.values():
            record = member.record
            if record.state is not MemberState.READY:
                continue  # joining and draining members take no new requests
            spec = record.spec
            if spec.role is Role.API_SERVER:
                continue
            if protocols is not None and spec.protocol not in protocols:
                continue  # a pair we could not drive
            tiers = by_key.setdefault((spec.model, spec.protocol), {
                "p": [], "ps": [], "d": [], "ds": []})
            candidate = Candidate.of(member, locality_key)
            suffix = "s" if record.suspect else ""
            if spec.role in _PREFILL_ROLES:
                tiers["p" + suffix].append(candidate)
            if spec.role in _DECODE_ROLES:
                tiers["d" + suffix].append(candidate)
        pools: dict[str, list[ProtocolPool]] = {}
        for (model, protocol), t in sorted(by_key.items()):
            pools.setdefault(model, []).append(ProtocolPool(
                protocol=protocol,
                # Sorted by id: a stable order keeps round robin and rings deterministic.
                prefills=_sorted(t["p"]), prefills_suspect=_sorted(t["ps"]),
                decodes=_sorted(t["d"]), decodes_suspect=_sorted(t["ds"])))
        return cls({model: tuple(p) for model, p in pools.items()})

    def models(self, quarantined: Mapping[str, int] | None = None) -> list[str]:
        """Models that have an eligible P and D right now (for /v1/models)."""
        out = []
        for model, pools in self.pools.items():
            for pool in pools:
                if (_eligible(pool.prefills, pool.prefills_suspect, quarantined)
                        and _eligible(pool.decodes, pool.decodes_suspect, quarantined)):
                    out.append(model)
                    break
        return out


def _sorted(candidates: list[Candidate]) -> tuple[Candidate, ...]:
    return tuple(sorted(candidates, key=lambda c: c.id))


def _eligible(routable: tuple[Candidate, ...], suspect: tuple[Candidate, ...],
              quarantined: Mapping[str, int] | None) -> Sequence[Candidate]:
    """Routable members not quarantined; if none, the suspect ones not quarantined.

    `quarantined` maps id -> the incarnation that failed: a restarted member (new
    incarnation) is a new peer and is not held to its predecessor's failure.
    """
    for tier in (routable, suspect):
        if not quarantined:
            if tier:
                return tier
            continue
        kept = [c for c in tier if quarantined.get(c.id) != c.incarnation]
        if kept:
            return kept
    return ()


@dataclass(frozen=True, slots=True)
class Pair:
    prefill: Candidate
    decode: Candidate

    @property
    def direct(self) -> bool:
        """One mixed member serves both phases: forward the request as is, no handshake."""
        return self.prefill is self.decode


class Pairer:
    """Chooses (P, D) for a request: P by the prefill chooser, then D among members of the
    same model and protocol, preferring P's locality.

    A mixed member chosen as P also serves as its own D: serving in place beats moving
    the KV cache. `now` and `in_flight` (router's own, per member id) are passed in.
    """

    def __init__(self, prefill: Chooser, decode: Chooser, *,
                 stale_after_s: float = DEFAULT_STALE_LOAD_S) -> None:
        self._prefill = prefill
        self._decode = decode
        self.stale_after_s = stale_after_s

    def choose(self, table: PairingTable, model: str, *, now: float,
               in_flight: Mapping[str, int], quarantined: Mapping[str, int] | None = None,
               key: int = 0, exclude: Collection[str] = ()) -> Pair | None:
        pools = table.pools.get(model)
        if not pools:
            return None
        stale_after_s = self.stale_after_s

        def load(c: Candidate) -> float:
            return score(c, in_flight.get(c.id, 0), now, stale_after_s)

        options: list[tuple[Sequence[Candidate], Sequence[Candidate]]] = []
        for pool in pools:
            decodes = _without(
                _eligible(pool.decodes, pool.decodes_suspect, quarantined), exclude)
            if not decodes:
                continue
            prefills = _without(
                _eligible(pool.prefills, pool.prefills_suspect, quarantined), exclude)
            if prefills:
                options.append((prefills, decodes))
        if not options:
            return None
        if len(options) == 1:
            prefills, decodes = options[0]
        else:  # several protocols serve this model: choose P across all, D in P's pool
            prefills = [c for ps, _ in options for c in ps]
        p = self._prefill.choose(prefills, load, key)
        if p.role is Role.MIXED:
            return Pair(p, p)
        if len(options) > 1:
            decodes = next(ds for ps, ds in options if ps and ps[0].protocol == p.protocol)
        if p.locality:
            near = [d for d in decodes if d.locality == p.locality and load(d) < SATURATED_SCORE]
            if near:
                decodes = near
        return Pair(p, self._decode.choose(decodes, load, key))


def _without(candidates: Sequence[Candidate], exclude: Collection[str]) -> Sequence[Candidate]:
    """Drop members already tried for this request, unless that leaves nobody."""
    if not exclude:
        return candidates
    kept = [c for c in candidates if c.id not in exclude]
    return kept or candidates


POLICY_NAMES: Final = ("power_of_two", "round_robin", "random", "least_loaded", "prefix",
                       "session")
DEFAULT_POLICY: Final = "power_of_two"


def make_chooser(name: str, rng: random.Random) -> Chooser:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(rng)
    if name == "power_of_two":
        return PowerOfTwo(rng)
    if name == "least_loaded":
        return LeastLoaded(rng)
    if name in ("prefix", "session"):
        return PrefixAffinity()  # the same bounded-load ring, keyed differently
    raise ValueError(f"unknown policy {name!r}; expected one of: {', '.join(POLICY_NAMES)}")


def make_pairer(name: str = DEFAULT_POLICY, *, rng: random.Random | None = None,
                stale_after_s: float = DEFAULT_STALE_LOAD_S) -> Pairer:
    """`prefix` applies to prefills (where the prefix cache lives); decodes then use
    power of two. `session` pins both roles (a conversation keeps its pair while that
    pair is not overloaded). Every other policy applies to both roles."""
    rng = rng or random.Random()
    prefill = make_chooser(name, rng)
    decode = make_chooser("power_of_two" if name == "prefix" else name, rng)
    return Pairer(prefill, decode, stale_after_s=stale_after_s)
