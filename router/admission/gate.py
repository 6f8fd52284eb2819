"""Admission in front of pairing: admit while an eligible pair has budget, else queue,
shed or refuse, so that past the fleet's capacity requests wait in the router, in order,
instead of in every engine's queue at once.

    admit   at once when nothing is queued for the model and some eligible prefill and
            decode have budget for the request (it reserves that budget until it is held
            on a pair: shares.py). Otherwise its TTFT is predicted (predict.py):
            a sheddable request that would miss its SLO gets 429 with Retry-After at
            once; any other waits in the model's fair queue (fair_queue.py), bounded in
            requests and bytes (503 with Retry-After when full), until budget frees up
            or its class deadline passes (503 with Retry-After; the deadline is its SLO
            less its own predicted service, unless the class sets one). Every request gets an
            answer; one whose client leaves is taken out of the queue.
    pump    whenever a grant is released or membership changes, queued requests are
            admitted in the queue's order while the budget allows.
    report  what `GET /v1/admission` answers.

The budgets, this router's share of them and the pair's grants are shares.py's
(`Admission.shares`, pairing's `BudgetPort`); the request's values are tickets.py's.

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
from router.admission.classes import ClassBook, TrafficClass
from router.admission.fair_queue import FairQueue, Waiter
from router.admission.metrics import AdmissionMetrics
from router.admission.options import AdmissionOptions
from router.admission.predict import TtftPredictor
from router.admission.shares import DECODE, PREFILL, CandidatesOf, Shares
from router.admission.tickets import Cost, Ticket, Who
from router.latency import LatencyTracker
from serving.http_messages import Response, openai_error

# Cost, Ticket and Who are tickets.py's, named here too for the gate's callers.
__all__ = ["Admission", "Cost", "Ticket", "Who"]

logger = logging.getLogger(__name__)

MAX_RETRY_AFTER_S: Final = 60
# The least wait in the queue, a share of the SLO: with only the SLO less its service, a
# prompt whose service alone is over the SLO got 503 whenever every prefill was busy
# (bench_kv.py, 8.5k tokens: 1.7 s a cold miss against 1 s; the cold start's 4th request).
MIN_WAIT_SLO_SHARE: Final = 0.5
_ARRIVAL: Final = "arrival"  # `Admission.pump`: a request joined a queue, no room changed


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
        top = max(book.classes.values(), key=lambda c: c.priority)
        self.shares = Shares(options, top.ttft_slo_s, candidates, self.predictor, metrics,
                             clock, on_room=lambda role: self.pump(released=role))
        self._candidates = candidates
        self._decode_latency = decode_latency
        self._clock = clock
        self._queues: dict[str, FairQueue] = {}
        self._pumping = self._pump_again = False
        # Per model, the queue's head when its last try found no room, and the role
        # (PREFILL, DECODE) that had none: a release in the other role does not try it.
        self._blocked: dict[str, tuple[Waiter, str]] = {}

    def on_members(self, members: Mapping[str, LiveMember],
                   moved: Collection[str] | None = None) -> None:
        """Membership changed (`moved`: the ids that joined, left or have a new record;
        None: all): the shares count the routers and forget members gone, and so does
        the predictor; admit what fits."""
        self.shares.on_members(members, moved)
        self.predictor.retain(members.keys())
        self.pump()

    # --- admitting ----------------------------------------------------------------------

    async def admit(self, model: str, who: Who, cost: Cost, size: int) -> Ticket | Response:
        now = self._clock()
        queue = self._queues.get(model)
        if queue is None or not len(queue):
            ticket = self.shares.reserve(model, cost)
            if ticket is not None:
                self._count(model, who, "admitted")
                return ticket
        prefills = [c.id for c in self._candidates(model)[0]]
        queue = self._queue(model)
        predicted = self.predictor.predict(
            ahead=queue.ahead(who.klass.priority) + self.shares.in_flight(prefills),
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
                ticket = self.shares.try_reserve(model, pending.cost)
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
        budgets = {PREFILL: self.shares.prefills, DECODE: self.shares.decodes}
        members = [{"id": member_id, "role": role, "used": int(used),
                    "requests": budgets[role].requests(member_id),
                    "limit": int(limits.get((member_id, role), 0))}
                   for (member_id, role), used in sorted(metrics.budget_used.values())]
        return {
            "routers": self.shares.routers,
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
