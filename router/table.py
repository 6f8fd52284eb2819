"""The pairing table: per model and handshake, the members pairing may choose from.

Built once per membership change, immutable after: per (model, protocol), the prefill
and decode candidates, split into routable ones and ready-but-suspect ones (the
fallback: detection alone never takes a role to zero). A load digest (up to 10 a
second) changes loads, not membership: `with_loads` replaces only the candidates whose
load changed.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from registry.client import LiveMember
from wire.protocol import MemberSpec, MemberState, Role

__all__ = ["Candidate", "Pair", "PairingTable", "ProtocolPool", "eligible", "served"]


def served(spec: MemberSpec) -> tuple[str, ...]:
    """The model names a member answers to: its base model, then its LoRA adapters (a
    request names an adapter in `model`, as vLLM's API does)."""
    return (spec.model, *spec.adapters) if spec.adapters else (spec.model,)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A member as the pairing math sees it. `member` carries endpoints for the handshakes."""

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

    def with_loads(self, changed: Mapping[str, LiveMember]) -> ProtocolPool:
        return ProtocolPool(self.protocol, _fresh(self.prefills, changed),
                            _fresh(self.prefills_suspect, changed),
                            _fresh(self.decodes, changed), _fresh(self.decodes_suspect, changed))


def _fresh(tier: tuple[Candidate, ...], changed: Mapping[str, LiveMember]
           ) -> tuple[Candidate, ...]:
    if not any(c.id in changed for c in tier):
        return tier
    return tuple(c.with_load(changed[c.id]) if c.id in changed else c for c in tier)


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
            candidate = Candidate.of(member, locality_key)
            suffix = "s" if record.suspect else ""
            for model in served(spec):  # the base model and its LoRA adapters
                tiers = by_key.setdefault((model, spec.protocol), {
                    "p": [], "ps": [], "d": [], "ds": []})
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

    def with_loads(self, changed: Mapping[str, LiveMember]) -> PairingTable:
        """The same pools with the loads of `changed` (members whose records are the
        ones this table was built from)."""
        if not changed:
            return self
        pools = dict(self.pools)
        for model in {name for m in changed.values() for name in served(m.record.spec)}:
            held = pools.get(model)
            if held:
                pools[model] = tuple(pool.with_loads(changed) for pool in held)
        return PairingTable(pools)

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


def _sorted(candidates: list[Candidate]) -> tuple[Candidate, ...]:
    return tuple(sorted(candidates, key=lambda c: c.id))


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
