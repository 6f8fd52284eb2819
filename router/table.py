"""The pairing table: per model and handshake, the members pairing may choose from.

Immutable: per (model, protocol), the prefill and decode candidates, split into
routable ones and ready-but-suspect ones (the fallback: detection alone never takes a
role to zero). `build` makes one from the members; a router keeps its own current from
the view's changes (router/table_updater.py): a load digest (up to 10 a second) swaps
in the candidates whose load changed (`ProtocolPool.with_candidates`), a membership
change makes the pools of that member's model again.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Final

import msgspec

from registry.client import LiveMember
from wire.protocol import MemberSpec, MemberState, Role

__all__ = ["Candidate", "Pair", "PairingTable", "ProtocolPool", "eligible", "model_pools",
           "served", "takes_requests"]


def served(spec: MemberSpec) -> tuple[str, ...]:
    """The model names a member answers to: its base model, then its LoRA adapters (a
    request names an adapter in `model`, as vLLM's API does)."""
    return (spec.model, *spec.adapters) if spec.adapters else (spec.model,)


class Candidate(msgspec.Struct, frozen=True, gc=False):
    """A member as the pairing math sees it. `member` carries endpoints for the handshakes.

    A Struct without the collector (`gc=False`), as `LiveMember` is: a router of every
    model at 100k members holds 100k of these, and as tracked objects they made each
    collection that reached them walk them all (young collections up to 213 ms). It holds
    only strings, numbers and `gc=False` Structs, so it cannot be part of a cycle."""

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
    member: LiveMember | None = None

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

    def with_load(self, member: LiveMember) -> Candidate:
        """This candidate with `member`'s load (the same record, a newer load)."""
        load = member.load
        return Candidate(self.id, self.incarnation, self.role, self.model, self.protocol,
                         self.locality, load.running + load.waiting, load.kv_usage,
                         member.load_at, self.http, member)


@dataclass(frozen=True, slots=True)
class ProtocolPool:
    """The candidates of one (model, protocol): P and D must speak the same handshake."""

    protocol: str
    prefills: tuple[Candidate, ...]  # routable (ready, not suspect); mixed included
    prefills_suspect: tuple[Candidate, ...]  # ready but suspect: the fallback tier
    decodes: tuple[Candidate, ...]
    decodes_suspect: tuple[Candidate, ...]

    def with_candidates(self, fresh: Mapping[str, Candidate]) -> ProtocolPool:
        """This pool with the candidates of `fresh` replaced (the same members, newer
        loads); members it does not hold are left out."""
        return ProtocolPool(self.protocol, _replaced(self.prefills, fresh),
                            _replaced(self.prefills_suspect, fresh),
                            _replaced(self.decodes, fresh), _replaced(self.decodes_suspect, fresh))


def _replaced(tier: tuple[Candidate, ...], fresh: Mapping[str, Candidate]
              ) -> tuple[Candidate, ...]:
    """`tier` with the candidates of `fresh` swapped in, found by bisection (a tier is
    sorted by id), so a digest costs its members, not the tier's (thousands, maybe)."""
    if not tier:
        return tier
    swapped: list[Candidate] | None = None
    size = len(tier)
    for member_id, candidate in fresh.items():
        at = bisect_left(tier, member_id, key=_ID)
        if at < size and tier[at].id == member_id:
            if swapped is None:
                swapped = list(tier)
            swapped[at] = candidate
    return tier if swapped is None else tuple(swapped)


_ID: Final = attrgetter("id")
_PREFILL_ROLES: Final = (Role.PREFILL, Role.MIXED)
_DECODE_ROLES: Final = (Role.DECODE, Role.MIXED)


@dataclass(frozen=True, slots=True)
class PairingTable:
    """Per model, the protocol pools. Immutable."""

    pools: Mapping[str, tuple[ProtocolPool, ...]]

    @classmethod
    def build(cls, members: Mapping[str, LiveMember], locality_key: str = "",
              protocols: Collection[str] | None = None) -> PairingTable:
        """`protocols`: the handshakes this router speaks; members of others are left out."""
        by_model: dict[str, list[Candidate]] = {}
        suspect: set[str] = set()
        for member in members.values():
            if takes_requests(member, protocols):
                candidate = Candidate.of(member, locality_key)
                if member.record.suspect:
                    suspect.add(candidate.id)
                for model in served(member.record.spec):  # its base model and adapters
                    by_model.setdefault(model, []).append(candidate)
        return cls({model: model_pools(by_model[model], suspect)
                    for model in sorted(by_model)})

    def models(self, quarantined: Mapping[str, int] | None = None) -> list[str]:
        """Models that have an eligible P and D right now (for /v1/models)."""
        out = []
        for model, pools in self.pools.items():
            for pool in pools:
                if (eligible(pool.prefills, pool.prefills_suspect, quarantined)
                        and eligible(pool.decodes, pool.decodes_suspect, quarantined)):
                    out.append(model)
                    break
        return out


def takes_requests(member: LiveMember, protocols: Collection[str] | None) -> bool:
    """Whether pairing may choose `member`: ready, an engine, of a handshake we speak."""
    record = member.record
    if record.state is not MemberState.READY:
        return False  # joining and draining members take no new requests
    spec = record.spec
    # An API server takes no traffic from a router; another protocol: a pair we could
    # not drive.
    return spec.role is not Role.API_SERVER and (protocols is None
                                                 or spec.protocol in protocols)


def model_pools(candidates: Iterable[Candidate], suspects: Container[str]
                ) -> tuple[ProtocolPool, ...]:
    """One model's pools, by protocol, from its candidates (`suspects`: the ids of those
    that are ready but suspect)."""
    by_protocol: dict[str, tuple[list[Candidate], ...]] = {}
    for candidate in candidates:
        p, ps, d, ds = by_protocol.setdefault(candidate.protocol, ([], [], [], []))
        suspect = candidate.id in suspects
        if candidate.role in _PREFILL_ROLES:
            (ps if suspect else p).append(candidate)
        if candidate.role in _DECODE_ROLES:
            (ds if suspect else d).append(candidate)
    return tuple(ProtocolPool(
        protocol=protocol,
        # Sorted by id: a stable order keeps round robin and rings deterministic (and
        # lets `with_loads` find a member by bisection).
        prefills=_sorted(p), prefills_suspect=_sorted(ps),
        decodes=_sorted(d), decodes_suspect=_sorted(ds))
        for protocol, (p, ps, d, ds) in sorted(by_protocol.items()))


def _sorted(candidates: list[Candidate]) -> tuple[Candidate, ...]:
    return tuple(sorted(candidates, key=_ID))


def eligible(routable: tuple[Candidate, ...], suspect: tuple[Candidate, ...],
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
    """The members that serve one request, with what the prefill choice predicted
    (router/choice.py `Choice`): `cached_tokens`, the prompt tokens the prefill is
    predicted to hold already (0: none, or nothing known), and `exact`, whether the
    choice went by the KV index. The request's metrics, conditional disaggregation and
    any budget over the members read the prediction here."""

    prefill: Candidate
    decode: Candidate
    cached_tokens: int = 0
    exact: bool = False

    @property
    def direct(self) -> bool:
        """One mixed member serves both phases: forward the request as is, no handshake."""
        return self.prefill is self.decode
