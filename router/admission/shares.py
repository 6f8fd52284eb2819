"""This router's share of each member's budget, and the grants it takes on them.

    limit    a member's budget in a role, split among routers: each router takes 1/N,
             N the routers registered (they are members, role api_server), so no counts
             are shared. A prefill's token budget also follows its legs (adaptive.py);
             a decode whose KV is full takes one request of ours at a time.
    reserve  the eligible prefill and decode with the most room: a `Ticket` holding
             that room until the request is held on a pair.
    charge   when the request is held on a pair, the pair's own grants replace the
             reservation: the prefill's uncached prompt tokens (the `kv` policy's
             prediction on the pair), the decode's KV tokens (prompt + answer); they are
             released with the in-flight slots (router/inflight.py), so a retry or a
             migration is charged afresh and nothing leaks.
    full     the members that can take nothing more now: pairing avoids them.

A prefill's timed grant, released, tells the TTFT predictor and the adaptive limit how
fast that member works; every release tells the gate (`on_room`) that room may have come
back, so that it admits what is queued. One event loop owns all of it; no locks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Final

from registry.client import LiveMember
from router.admission.adaptive import AdaptiveLimit
from router.admission.budgets import Budgets, Grant, Limit, Releasable, ThenCount, Together
from router.admission.metrics import AdmissionMetrics
from router.admission.options import KV_FULL, AdmissionOptions
from router.admission.predict import TtftPredictor
from router.admission.tickets import Cost, Ticket
from router.table import Candidate, Pair
from wire.protocol import ROUTER_PROTOCOL, Role

__all__ = ["DECODE", "PREFILL", "CandidatesOf", "OnRoom", "Shares"]

PREFILL: Final = "prefill"
DECODE: Final = "decode"

# The eligible prefills and decodes of a model (routable, not quarantined):
# `Pairing.candidates`.
CandidatesOf = Callable[[str], tuple[Sequence[Candidate], Sequence[Candidate]]]
# Room may have come back: in the role (PREFILL, DECODE) of the grant released, or
# anywhere ("").
OnRoom = Callable[[str], None]


class Shares:
    def __init__(self, options: AdmissionOptions, top_slo_s: float, candidates: CandidatesOf,
                 predictor: TtftPredictor, metrics: AdmissionMetrics,
                 clock: Callable[[], float], on_room: OnRoom) -> None:
        """`top_slo_s`: the TTFT SLO of the top class, which the budgets protect."""
        self.options = options
        self.metrics = metrics
        self.predictor = predictor
        self.prefills = Budgets(clock, self._prefill_released)
        self.decodes = Budgets(clock, self._decode_released)
        self.routers = 1
        self._routers: set[str] = set()  # ids of the routers registered
        self._candidates = candidates
        self._clock = clock
        self._on_room = on_room
        self._shown_limits: dict[tuple[str, str], int] = {}  # what budget_limit says
        self._quiet = False  # releases do not call on_room (`charge` calls it once, if it must)
        # Each prefill's budget follows its legs, to keep the top class within its SLO.
        share = options.budget_slo_share
        self.adaptive = AdaptiveLimit(cap=options.prefill_budget_tokens,
                                      target_s=share * top_slo_s) if share > 0 else None

    # --- limits -------------------------------------------------------------------------

    def limit(self, candidate: Candidate, role: str) -> Limit:
        """This router's share of a member's budget in `role`."""
        member = candidate.member
        capacity = member.record.spec.capacity if member is not None else 0
        requests = max(1, capacity // self.routers) if capacity else 0
        if role == PREFILL:
            return Limit(units=self._prefill_tokens(candidate.id), requests=requests)
        if candidate.kv_usage >= KV_FULL:
            return Limit(units=1, requests=1)  # full: one of ours at a time, at most
        tokens = self.options.decode_budget_tokens
        return Limit(units=max(1, tokens // self.routers) if tokens else 0, requests=requests)

    def _prefill_tokens(self, member_id: str) -> int:
        """The flag's budget, or what the member's legs allow (adaptive.py), if less;
        the flag's budget is split among the routers, the adaptive one is this
        router's own already (its legs, its work)."""
        cap = self.options.prefill_budget_tokens
        share = max(1, cap // self.routers) if cap else 0
        if self.adaptive is None:
            return share
        steered = self.adaptive.limit(member_id)
        return min(steered, share) if share else steered

    def on_members(self, members: Mapping[str, LiveMember],
                   moved: Collection[str] | None = None) -> None:
        """Membership changed (`moved`: the ids that joined, left or have a new record;
        None: all): count the routers (api_server members that speak the router
        protocol: not the planner), forget members gone."""
        if moved is None:
            self._routers = {i for i, m in members.items() if _is_router(m)}
        else:
            for member_id in moved:
                member = members.get(member_id)
                if member is not None and _is_router(member):
                    self._routers.add(member_id)
                else:
                    self._routers.discard(member_id)
        self.routers = max(1, len(self._routers))
        self.metrics.routers.labels().set(self.routers)
        if self.adaptive is not None:
            self.adaptive.retain(members.keys())
        if any(key[0] not in members for key in self._shown_limits):
            self._shown_limits = {k: v for k, v in self._shown_limits.items()
                                  if k[0] in members}

    def full(self, model: str, ticket: Ticket | None = None) -> frozenset[str]:
        """Members of `model` that can take nothing more now (pairing avoids them while
        another has room). Not those `ticket` reserved room on: that room is its own.
        Else a request whose reservation filled a prefill would see both prefills full
        and could be paired with the busy one, to wait in its engine behind another
        prompt while the prefill reserved for it stood idle."""
        prefills, decodes = self._candidates(model)
        full = frozenset(
            [c.id for c in prefills if self.prefills.full(c.id, self.limit(c, PREFILL))]
            + [c.id for c in decodes if self.decodes.full(c.id, self.limit(c, DECODE))])
        return full - ticket.reserved_on if ticket is not None else full

    def in_flight(self, prefills: Collection[str]) -> int:
        """Prompt tokens this router has in flight on `prefills`."""
        return sum(self.prefills.used(member_id) for member_id in prefills)

    # --- reserving ----------------------------------------------------------------------

    def reserve(self, model: str, cost: Cost) -> Ticket | None:
        """A ticket reserving budget on the eligible prefill and decode with the most
        room; None when no pair has room. A model with no eligible pair is admitted with
        nothing reserved: pairing answers it (503 no_capacity)."""
        ticket = self.try_reserve(model, cost)
        return ticket if isinstance(ticket, Ticket) else None

    def try_reserve(self, model: str, cost: Cost) -> Ticket | str:
        """`reserve`'s ticket, or the role (PREFILL, DECODE) where no member had room."""
        prefills, decodes = self._candidates(model)
        if not prefills or not decodes:
            return Ticket(cost)
        # The prefills first: in a queue's pump they are what is usually full, and then
        # the decodes need not be looked at.
        prefill = self._roomiest(prefills, self.prefills, PREFILL, cost.prompt_tokens)
        if prefill is None:
            return PREFILL
        decode = self._roomiest(decodes, self.decodes, DECODE, cost.kv_tokens)
        if decode is None:
            return DECODE
        # The decode's slot is not reserved: the request reaches it after its prefill.
        return Ticket(cost, (self._take(self.prefills, PREFILL, prefill.id, cost.prompt_tokens),
                             self._take(self.decodes, DECODE, decode.id, cost.kv_tokens,
                                        counted=False)))

    def _roomiest(self, candidates: Sequence[Candidate], budgets: Budgets, role: str,
                  units: int) -> Candidate | None:
        best: Candidate | None = None
        best_room = (-math.inf, 0)
        for candidate in candidates:
            limit = self.limit(candidate, role)
            if not budgets.fits(candidate.id, units, limit):
                continue
            room = (budgets.free(candidate.id, limit), -budgets.requests(candidate.id))
            if room > best_room:
                best, best_room = candidate, room
            self._show_limit(candidate.id, role, limit.units)
        return best

    def _show_limit(self, member_id: str, role: str, units: int) -> None:
        """The budget_limit gauge, set when it changes: a queue's pump looks at every
        candidate's limit on each release, and the gauge's update cost more than the
        look (a c=32 burst: ~20 updates a request)."""
        key = (member_id, role)
        if self._shown_limits.get(key) != units:
            self._shown_limits[key] = units
            self.metrics.budget_limit.labels(member_id, role).set(units)

    # --- charging the pair --------------------------------------------------------------

    def charge(self, ticket: Ticket, pair: Pair) -> tuple[Releasable, Releasable | None]:
        """The pair's grants for an admitted request: the decode's, and the prefill's
        unless one member serves both (then the decode's grant holds both). The pair's
        grants are taken before the reservation goes, so the room it frees cannot be
        given to a queued request in between. The decode's grant takes a request slot
        when the prefill's part ends (budgets.py), a mixed member's at once."""
        cost = ticket.cost
        uncached = max(0, cost.prompt_tokens - pair.cached_tokens)
        decode = self._take(self.decodes, DECODE, pair.decode.id, cost.kv_tokens,
                            counted=pair.direct)
        # Its own reservation there is no work beside it: counted, it would halve the
        # member's measured time per token and so the service a deadline allows for.
        reserved = ticket.reserved(pair.prefill.id)
        prefill = self._take(self.prefills, PREFILL, pair.prefill.id, uncached,
                             timed=not pair.direct, replaces=reserved)
        # The reservation goes without a pump per grant: on the pair it reserved, the
        # pair's grants hold the same room (less the prefill's cached tokens), so a
        # queued request can only fit now if some of it was left elsewhere or freed.
        # (A c=32 burst queues half its requests, and every pump of a busy queue tries
        # its head again: these two were a third of them, all in vain.)
        freed = bool(ticket.reserved_on - {pair.prefill.id, pair.decode.id}) \
            or uncached < reserved
        self._quiet = True
        try:
            ticket.settle()
        finally:
            self._quiet = False
        if freed:
            self._on_room("")
        if pair.direct:
            return Together(decode, prefill), None
        return decode, ThenCount(prefill, decode)

    def _take(self, budgets: Budgets, role: str, member_id: str, units: int, *,
              timed: bool = False, counted: bool = True, replaces: int = 0) -> Grant:
        grant = budgets.take(member_id, units, timed=timed, counted=counted,
                             replaces=replaces)
        self.metrics.budget_used.labels(member_id, role).set(budgets.used(member_id))
        return grant

    def _prefill_released(self, member_id: str, seconds: float, work: int) -> None:
        self.metrics.budget_used.labels(member_id, PREFILL).set(self.prefills.used(member_id))
        if seconds >= 0.0:
            self.predictor.observe(member_id, seconds, work, self._clock())
            if self.adaptive is not None:
                self.adaptive.observe(member_id, seconds, work)
        if not self._quiet:
            self._on_room(PREFILL)

    def _decode_released(self, member_id: str, seconds: float, work: int) -> None:
        self.metrics.budget_used.labels(member_id, DECODE).set(self.decodes.used(member_id))
        if not self._quiet:
            self._on_room(DECODE)


def _is_router(member: LiveMember) -> bool:
    spec = member.record.spec
    return spec.role is Role.API_SERVER and spec.protocol == ROUTER_PROTOCOL
