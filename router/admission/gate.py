"""Admission in front of pairing: admit while an eligible pair has budget, else queue,
shed or refuse, so that past the fleet's capacity requests wait in the router, in order,
instead of in every engine's queue at once.

    admit   at once when nothing is queued for the model and some eligible prefill and
            decode have budget for the request (it reserves that budget until it is held
            on a pair). Otherwise its TTFT is predicted (router/admission/predict.py):
            a sheddable request that would miss its SLO gets 429 with Retry-After at
            once; any other waits in the model's fair queue (fair_queue.py), bounded in
            requests and bytes (503 with Retry-After when full), until budget frees up
            or its class deadline passes (503 with Retry-After; the deadline is its SLO
            less its own predicted service, unless the class sets one). Every request gets an
            answer; one whose client leaves is taken out of the queue.
    charge  when the request is held on a pair, the pair's own grants replace the
            reservation: the prefill's uncached prompt tokens (the `kv` policy's
            prediction on the pair), the decode's KV tokens (prompt + answer); they are
            released with the in-flight slots (router/inflight.py), so a retry or a
            migration is charged afresh and nothing leaks.
    pump    whenever a grant is released or membership changes, queued requests are
            admitted in the queue's order while the budget allows.

Budgets are split among routers: each router takes 1/N of a member's budget, N the
routers registered (they are members, role api_server), so no counts are shared.

One event loop owns all of it; no locks.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from registry.client import LiveMember
from router.admission.adaptive import AdaptiveLimit
from router.admission.budgets import Budgets, Grant, Limit, Releasable, ThenCount, Together
from router.admission.classes import ClassBook, TrafficClass
from router.admission.fair_queue import FairQueue, Waiter
from router.admission.metrics import AdmissionMetrics
from router.admission.options import KV_FULL, AdmissionOptions
from router.admission.predict import TtftPredictor
from router.latency import LatencyTracker
from router.table import Candidate, Pair
from serving.http_messages import Response, openai_error
from wire.protocol import ROUTER_PROTOCOL, Role

__all__ = ["Admission", "Cost", "Ticket", "Who"]

logger = logging.getLogger(__name__)

MAX_RETRY_AFTER_S: Final = 60
# The least wait in the queue, a share of the SLO: with only the SLO less its service, a
# prompt whose service alone is over the SLO got 503 whenever every prefill was busy
# (bench_kv.py, 8.5k tokens: 1.7 s a cold miss against 1 s; the cold start's 4th request).
MIN_WAIT_SLO_SHARE: Final = 0.5
PREFILL: Final = "prefill"
DECODE: Final = "decode"
_ARRIVAL: Final = "arrival"  # `Admission.pump`: a request joined a queue, no room changed


@dataclass(frozen=True, slots=True)
class Cost:
    """What a request will spend: its prompt tokens and the answer tokens it may ask."""

    prompt_tokens: int
    answer_tokens: int

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.answer_tokens


@dataclass(frozen=True, slots=True)
class Who:
    """A request's class and tenant, and the tenant's weight in the fair queue."""

    klass: TrafficClass
    tenant: str
    weight: float


class Ticket:
    """An admitted request: its cost and the budget reserved for it until it is held on
    a pair (`settle`, safe twice)."""

    __slots__ = ("_reserved", "cost")

    def __init__(self, cost: Cost, reserved: Sequence[Grant] = ()) -> None:
        self.cost = cost
        self._reserved = list(reserved)

    @property
    def reserved_on(self) -> frozenset[str]:
        """The members its reservation holds room on (none once settled)."""
        return frozenset(grant.member_id for grant in self._reserved if not grant.released)

    def reserved(self, member_id: str) -> int:
        """Units its reservation holds on `member_id`."""
        return sum(grant.units for grant in self._reserved
                   if grant.member_id == member_id and not grant.released)

    def settle(self) -> None:
        reserved, self._reserved = self._reserved, []
        for grant in reserved:
            grant.release()


# The eligible prefills and decodes of a model (routable, not quarantined):
# `Pairing.candidates`.
CandidatesOf = Callable[[str], tuple[Sequence[Candidate], Sequence[Candidate]]]


@dataclass(slots=True, eq=False)
class _Pending:
    future: asyncio.Future[Ticket]
    cost: Cost


class Admission:
    def __init__(self, options: AdmissionOptions, book: ClassBook, candidates: CandidatesOf,
                 decode_latency: LatencyTracker, metrics: AdmissionMetrics,
                 clock: Callable[[], float]) -> None:
        self.options = options
        self.book = book
        self.metrics = metrics
        self.predictor = TtftPredictor()
        self.prefills = Budgets(clock, self._prefill_released)
        self.decodes = Budgets(clock, self._decode_released)
        self.routers = 1
        self._routers: set[str] = set()  # ids of the routers registered
        self._candidates = candidates
        self._decode_latency = decode_latency
        self._clock = clock
        self._queues: dict[str, FairQueue] = {}
        self._pumping = self._pump_again = False
        self._shown_limits: dict[tuple[str, str], int] = {}  # what budget_limit says
        self._quiet = False  # releases do not pump (`charge` pumps once, if it must)
        # Per model, the queue's head when its last try found no room, and the role
        # (PREFILL, DECODE) that had none: a release in the other role does not try it.
        self._blocked: dict[str, tuple[Waiter, str]] = {}
        # The budgets protect the top class's SLO: each prefill's follows its legs.
        top = max(book.classes.values(), key=lambda c: c.priority)
        share = options.budget_slo_share
        self.adaptive = AdaptiveLimit(cap=options.prefill_budget_tokens,
                                      target_s=share * top.ttft_slo_s) if share > 0 else None

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
        protocol: not the planner), forget members gone, admit what fits."""
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
        self.predictor.retain(members.keys())
        if self.adaptive is not None:
            self.adaptive.retain(members.keys())
        if any(key[0] not in members for key in self._shown_limits):
            self._shown_limits = {k: v for k, v in self._shown_limits.items()
                                  if k[0] in members}
        self.pump()

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

    # --- admitting ----------------------------------------------------------------------

    async def admit(self, model: str, who: Who, cost: Cost, size: int) -> Ticket | Response:
        now = self._clock()
        queue = self._queues.get(model)
        if queue is None or not len(queue):
            ticket = self._reserve(model, cost)
            if ticket is not None:
                self._count(model, who, "admitted")
                return ticket
        prefills = [c.id for c in self._candidates(model)[0]]
        queue = self._queue(model)
        predicted = self.predictor.predict(
            ahead=queue.ahead(who.klass.priority) + self._in_flight(prefills),
            own=cost.prompt_tokens, prefills=prefills,
            decode_s=self._decode_latency.typical(DECODE))
        self.metrics.predicted_ttft.labels(model).observe(predicted)
        if who.klass.sheddable and predicted > who.klass.ttft_slo_s:
            self._count(model, who, "shed_slo")
            return _refusal(429, f"the request would miss its class's TTFT SLO "
                            f"({who.klass.ttft_slo_ms:.0f} ms; predicted "
                            f"{predicted * 1000:.0f} ms)", "slo_shed", predicted)
        pending = _Pending(asyncio.get_running_loop().create_future(), cost)
        waiter = Waiter(who.klass.name, who.klass.priority, who.tenant, who.weight,
                        cost.prompt_tokens, size, now,
                        now + self._deadline_s(who.klass, prefills, cost), pending)
        if not queue.push(waiter):
            self._count(model, who, "queue_full")
            return _refusal(503, "the router's queue is full", "queue_full", predicted)
        self._gauges(model, queue)
        self.pump(released=_ARRIVAL)
        return await self._wait(model, who, waiter, pending, predicted)

    def _deadline_s(self, klass: TrafficClass, prefills: Sequence[str], cost: Cost) -> float:
        """How long the request may wait: its class's `deadline_ms` when the file sets
        one; else its SLO less its own predicted service (its prefill alone, the first
        token), since a request admitted later would miss the SLO anyway: better a 503 the
        client can retry elsewhere than a late answer; at least MIN_WAIT_SLO_SHARE of it."""
        if klass.deadline_ms:
            return klass.deadline_s
        service = self.predictor.predict(ahead=0, own=cost.prompt_tokens,
                                         prefills=prefills[:1],
                                         decode_s=self._decode_latency.typical(DECODE))
        return max(MIN_WAIT_SLO_SHARE * klass.ttft_slo_s, klass.ttft_slo_s - service)

    async def _wait(self, model: str, who: Who, waiter: Waiter, pending: _Pending,
                    predicted: float) -> Ticket | Response:
        future = pending.future
        try:
            await asyncio.wait((future,), timeout=max(0.0, waiter.deadline - self._clock()))
        except BaseException:  # the client left: out of the queue, nothing reserved
            self._leave(model, waiter)
            if future.done() and not future.cancelled():
                future.result().settle()
            future.cancel()
            self._count(model, who, "cancelled")
            raise
        self._leave(model, waiter)
        waited = self._clock() - waiter.arrived
        self.metrics.queue_wait.labels(model, who.klass.name).observe(waited)
        if future.done():
            self._count(model, who, "admitted_queued")
            return future.result()
        future.cancel()
        self._count(model, who, "deadline")
        return _refusal(503, f"no capacity within the queue deadline "
                        f"({(waiter.deadline - waiter.arrived) * 1000:.0f} ms)", "queue_deadline",
                        max(predicted - waited, 1.0))

    def _leave(self, model: str, waiter: Waiter) -> None:
        queue = self._queues.get(model)
        if queue is not None and queue.remove(waiter):
            self._blocked.pop(model, None)  # the head may be another now
            self._gauges(model, queue)

    def pump(self, *, released: str = "") -> None:
        """Admit queued requests, in the queue's order, while the budget allows. Reading
        the candidates may apply a membership change, whose on_members pumps again: that
        inner call asks the running pump for another round rather than run beside it
        (two rounds would hand one waiter two reservations).

        `released`: what changed is only a grant given back in that role (PREFILL,
        DECODE), or a request that joined a queue (_ARRIVAL). A head whose last try
        found no room is then not tried again unless the release is in the role that
        had none: a release makes no room in the other role, an arrival none at all.
        That room comes back with a release in its role (a role without room has one
        of this router's grants on every eligible member: `Budgets.fits`) or a
        membership change, each of which tries the head again; or with what nothing
        here is told of (a quarantine's end, a decode's KV use falling), which the
        router's periodic pump sees. A burst at c=32 queues half its requests, and
        every try reads the candidates and every member's limit: 209 of 273 tries in a
        64-request burst were in vain before this.
        """
        if self._pumping:
            self._pump_again = True
            return
        self._pumping = True
        try:
            self._pump_again = True
            role = released
            while self._pump_again:
                self._pump_again = False
                self._pump_round(role)
                role = ""  # a round asked from within: anything may have changed
        finally:
            self._pumping = False

    def _pump_round(self, released: str = "") -> None:
        now = self._clock()
        for model, queue in list(self._queues.items()):
            length = len(queue)
            while len(queue):
                waiter = queue.peek(now)
                assert waiter is not None
                pending: _Pending = waiter.ticket
                if pending.future.done():  # its client left at this very moment
                    queue.remove(waiter)
                    continue
                if released:
                    blocked = self._blocked.get(model)
                    if blocked is not None and blocked[0] is waiter and blocked[1] != released:
                        break
                ticket = self._try_reserve(model, pending.cost)
                if not isinstance(ticket, Ticket):
                    self._blocked[model] = (waiter, ticket)
                    break
                self._blocked.pop(model, None)
                queue.pop(now)
                pending.future.set_result(ticket)
            if len(queue) != length:  # most rounds of a busy queue admit no one
                self._gauges(model, queue)
            if not len(queue):
                del self._queues[model]
                self._blocked.pop(model, None)

    def _reserve(self, model: str, cost: Cost) -> Ticket | None:
        """A ticket reserving budget on the eligible prefill and decode with the most
        room; None when no pair has room. A model with no eligible pair is admitted with
        nothing reserved: pairing answers it (503 no_capacity)."""
        ticket = self._try_reserve(model, cost)
        return ticket if isinstance(ticket, Ticket) else None

    def _try_reserve(self, model: str, cost: Cost) -> Ticket | str:
        """`_reserve`'s ticket, or the role (PREFILL, DECODE) where no member had room."""
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

    def _in_flight(self, prefills: Collection[str]) -> int:
        return sum(self.prefills.used(member_id) for member_id in prefills)

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
            self.pump()
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
            self.pump(released=PREFILL)

    def _decode_released(self, member_id: str, seconds: float, work: int) -> None:
        self.metrics.budget_used.labels(member_id, DECODE).set(self.decodes.used(member_id))
        if not self._quiet:
            self.pump(released=DECODE)

    # --- bookkeeping --------------------------------------------------------------------

    def _queue(self, model: str) -> FairQueue:
        queue = self._queues.get(model)
        if queue is None:
            options = self.options
            queue = self._queues[model] = FairQueue(
                max_requests=options.max_queue_requests, max_bytes=options.max_queue_bytes,
                starvation_s=options.starvation_s)
        return queue

    def _gauges(self, model: str, queue: FairQueue) -> None:
        for name in self.book.classes:
            self.metrics.queue_depth.labels(model, name).set(queue.depth(name))
        self.metrics.queue_bytes.labels(model).set(queue.bytes)

    def _count(self, model: str, who: Who, outcome: str) -> None:
        self.metrics.admission.labels(model, who.klass.name, outcome).inc()

    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def report(self) -> dict[str, Any]:
        """What `GET /v1/admission` answers (and `pdreg status --router` shows): the
        classes, the routers splitting each budget, per model the queue and the answers
        so far, per member the budget used and this router's share of it."""
        metrics = self.metrics
        models: dict[str, dict[str, Any]] = {}
        for (model, klass, outcome), value in metrics.admission.values():
            entry = models.setdefault(model, {"queued": {}, "bytes": 0, "outcomes": {}})
            entry["outcomes"].setdefault(klass, {})[outcome] = int(value)
        for (model, klass), value in metrics.queue_depth.values():
            models.setdefault(model, {"queued": {}, "bytes": 0, "outcomes": {}})
            models[model]["queued"][klass] = int(value)
        for (model,), value in metrics.queue_bytes.values():
            models.setdefault(model, {"queued": {}, "bytes": 0, "outcomes": {}})
            models[model]["bytes"] = int(value)
        limits = dict(metrics.budget_limit.values())
        budgets = {PREFILL: self.prefills, DECODE: self.decodes}
        members = [{"id": member_id, "role": role, "used": int(used),
                    "requests": budgets[role].requests(member_id),
                    "limit": int(limits.get((member_id, role), 0))}
                   for (member_id, role), used in sorted(metrics.budget_used.values())]
        return {
            "routers": self.routers,
            "seconds_per_token": self.predictor.seconds_per_token(),
            "classes": [{"name": c.name, "priority": c.priority, "ttft_slo_ms": c.ttft_slo_ms,
                         "sheddable": c.sheddable, "weight": c.weight,
                         "deadline_ms": c.deadline_s * 1000}
                        for c in self.book.classes.values()],
            "models": models, "members": members}


def _refusal(status: int, message: str, code: str, retry_after_s: float) -> Response:
    seconds = min(MAX_RETRY_AFTER_S, max(1, math.ceil(retry_after_s)))
    kind = "rate_limit_exceeded" if status == 429 else "service_unavailable"
    return openai_error(status, message, kind, code, {"Retry-After": str(seconds)})


def _is_router(member: LiveMember) -> bool:
    spec = member.record.spec
    return spec.role is Role.API_SERVER and spec.protocol == ROUTER_PROTOCOL
