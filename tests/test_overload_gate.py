"""Admission's gate and its budget shares (router/admission/gate.py, shares.py) on an
event loop, with a fixed set of candidates: admit, queue, pump, shed (429), deadline
(503), queue full, cancellation, the routers' split of a budget, and a Hypothesis
history of admissions, charges, retries and cancellations after which nothing is left
reserved or queued. Classes and the TTFT prediction have their tables here too."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from registry.client import LiveMember
from router.admission.classes import (
    DEFAULT_CLASS,
    ClassBook,
    TrafficClass,
    book_of,
    default_book,
    load_classes,
)
from router.admission.gate import Admission, Cost, Ticket, Who
from router.admission.metrics import AdmissionMetrics
from router.admission.options import AdmissionOptions
from router.admission.predict import TtftPredictor
from router.latency import LatencyTracker
from router.table import Candidate, Pair
from serving.http_messages import Response
from wire.protocol import (
    ROUTER_PROTOCOL,
    Endpoints,
    Load,
    MemberRecord,
    MemberSpec,
    MemberState,
    Role,
)

CRITICAL = TrafficClass("critical", priority=2, ttft_slo_ms=5000)
STANDARD = TrafficClass("standard", priority=1, ttft_slo_ms=5000)
BATCH = TrafficClass("batch", priority=0, ttft_slo_ms=100, sheddable=True)
BOOK = ClassBook({c.name: c for c in (CRITICAL, STANDARD, BATCH)}, "standard")


def live(member_id: str, role: Role, *, capacity: int = 0, kv: float = 0.0,
         protocol: str = "vllm-nixl") -> LiveMember:
    spec = MemberSpec(id=member_id, incarnation=1, role=role, model="m", protocol=protocol,
                      endpoints=Endpoints(http="http://127.0.0.1:1"), capacity=capacity)
    load = Load(kv_usage=kv)
    record = MemberRecord(spec=spec, state=MemberState.READY, load=load)
    return LiveMember(record=record, load=load, load_at=0.0, registry="r")


P1, P2, D1 = (Candidate.of(live("p1", Role.PREFILL)), Candidate.of(live("p2", Role.PREFILL)),
              Candidate.of(live("d1", Role.DECODE)))


@dataclass
class Fleet:
    prefills: Sequence[Candidate] = (P1,)
    decodes: Sequence[Candidate] = (D1,)

    def __call__(self, model: str) -> tuple[Sequence[Candidate], Sequence[Candidate]]:
        return self.prefills, self.decodes


def gate(fleet: Fleet | None = None, **options: object) -> Admission:
    opts = AdmissionOptions(**{"prefill_budget_tokens": 100, **options})  # type: ignore[arg-type]
    return Admission(opts, BOOK, fleet or Fleet(), LatencyTracker(),
                     AdmissionMetrics(CollectorRegistry()), asyncio.get_running_loop().time)


def who(klass: TrafficClass = STANDARD, tenant: str = "t") -> Who:
    return Who(klass, tenant, 1.0)


def counted(admission: Admission, outcome: str, klass: str = "standard") -> float:
    return admission.metrics.admission.labels("m", klass, outcome).value


def test_admits_while_a_pair_has_room_then_queues_until_a_release() -> None:
    async def run() -> None:
        admission = gate()
        first = await admission.admit("m", who(), Cost(60, 10), 100)
        assert isinstance(first, Ticket)
        second = asyncio.create_task(admission.admit("m", who(), Cost(60, 10), 100))
        await asyncio.sleep(0)
        assert not second.done() and admission.queued() == 1
        decode, prefill = admission.shares.charge(first, Pair(P1, D1))
        assert admission.shares.prefills.used("p1") == 60  # the reservation gave way to the pair's
        prefill.release()  # the prefill leg is done: room for the next
        ticket = await asyncio.wait_for(second, 5)
        assert isinstance(ticket, Ticket) and admission.queued() == 0
        decode.release()
        ticket.settle()
        assert admission.shares.prefills.used("p1") == admission.shares.decodes.used("d1") == 0
        assert counted(admission, "admitted") == counted(admission, "admitted_queued") == 1
    asyncio.run(run())


def test_a_queue_behind_a_full_prefill_is_not_tried_again_by_what_cannot_free_one() -> None:
    """Every try of the queue's head reads the candidates and each member's limit: a
    burst that queues half its requests paid for it on every grant given back. A
    decode's release, another arrival and a charge that keeps its reservation's room
    make no prefill room: none of them tries the head again; a prefill's release does,
    and the queue is served in order."""
    async def run() -> None:
        @dataclass
        class Counting(Fleet):
            reads: int = 0

            def __call__(self, model: str) -> tuple[Sequence[Candidate], Sequence[Candidate]]:
                self.reads += 1
                return super().__call__(model)

        one_slot = Candidate.of(live("p1", Role.PREFILL, capacity=1))
        fleet = Counting(prefills=(one_slot,))
        admission = gate(fleet)
        first = await admission.admit("m", who(), Cost(10, 10), 100)
        assert isinstance(first, Ticket)
        other = admission.shares.decodes.take("d1", 10)  # another request's decode, say
        waiting = [asyncio.create_task(admission.admit("m", who(), Cost(10, 10), 100))
                   for _ in range(3)]
        await asyncio.sleep(0)
        assert admission.queued() == 3
        reads = fleet.reads
        decode, prefill = admission.shares.charge(first, Pair(one_slot, D1))
        other.release()
        late = asyncio.create_task(admission.admit("m", who(), Cost(10, 10), 100))
        await asyncio.sleep(0)
        assert fleet.reads == reads + 1 and admission.queued() == 4  # the arrival's TTFT
        assert prefill is not None
        prefill.release()  # the prefill is free: the head is tried, and admitted
        ticket = await asyncio.wait_for(waiting[0], 5)
        assert isinstance(ticket, Ticket) and not any(t.done() for t in waiting[1:])
        decode.release()
        for task in [*waiting[1:], late]:
            ticket.settle()
            ticket = await asyncio.wait_for(task, 5)
            assert isinstance(ticket, Ticket)
        ticket.settle()
        assert admission.queued() == 0 and list(admission.shares.prefills.members()) == []
    asyncio.run(run())


def test_a_membership_change_seen_while_admitting_from_the_queue_admits_once() -> None:
    # Reading the candidates applies what changed in the view, and on_members pumps: the
    # queued request must get one reservation and the router no error.
    async def run() -> None:
        admission: Admission

        @dataclass
        class Changing(Fleet):
            armed: bool = False

            def __call__(self, model: str) -> tuple[Sequence[Candidate], Sequence[Candidate]]:
                if self.armed:
                    self.armed = False
                    admission.on_members({}, ())
                return super().__call__(model)

        fleet = Changing()
        admission = gate(fleet)
        first = await admission.admit("m", who(), Cost(60, 10), 100)
        assert isinstance(first, Ticket)
        second = asyncio.create_task(admission.admit("m", who(), Cost(60, 10), 100))
        await asyncio.sleep(0)
        assert admission.queued() == 1
        fleet.armed = True
        first.settle()  # room again: the pump reads the candidates, which changed
        ticket = await asyncio.wait_for(second, 5)
        assert isinstance(ticket, Ticket) and admission.queued() == 0
        assert admission.shares.prefills.used("p1") == 60  # one reservation, not two
        ticket.settle()
        assert admission.shares.prefills.used("p1") == 0
    asyncio.run(run())


def test_a_sheddable_request_that_would_miss_its_slo_gets_429_at_once() -> None:
    async def run() -> None:
        admission = gate()
        admission.predictor.observe("p1", 1.0, 100, 0.0)  # 10 ms a token
        held = await admission.admit("m", who(), Cost(100, 10), 100)
        assert isinstance(held, Ticket)
        answer = await admission.admit("m", who(BATCH), Cost(50, 10), 100)  # >= 1.5 s
        assert isinstance(answer, Response) and answer.status == 429
        assert answer.headers is not None and int(answer.headers["Retry-After"]) >= 1
        assert admission.queued() == 0 and counted(admission, "shed_slo", "batch") == 1
        held.settle()
    asyncio.run(run())


def test_a_request_that_waits_past_its_deadline_gets_503_with_retry_after() -> None:
    async def run() -> None:
        admission = gate()
        held = await admission.admit("m", who(), Cost(100, 10), 100)
        quick = TrafficClass("quick", priority=1, ttft_slo_ms=30)
        answer = await admission.admit("m", who(quick), Cost(10, 10), 100)
        assert isinstance(answer, Response) and answer.status == 503
        assert answer.headers is not None and "Retry-After" in answer.headers
        assert b"queue_deadline" in answer.body and admission.queued() == 0
        assert isinstance(held, Ticket)
        held.settle()
    asyncio.run(run())


def test_a_prompt_over_its_slo_by_its_own_service_still_waits_for_a_free_prefill() -> None:
    async def run() -> None:  # 10 ms a token: 600 tokens take 6 s, over the 5 s SLO
        admission = gate(prefill_budget_tokens=600)
        admission.predictor.observe("p1", 1.0, 100, 0.0)
        held = await admission.admit("m", who(), Cost(600, 10), 100)
        waiting = asyncio.create_task(admission.admit("m", who(), Cost(600, 10), 100))
        await asyncio.sleep(0.05)  # before: no allowance (the SLO less 6 s), 503 at once
        assert not waiting.done() and admission.queued() == 1 and isinstance(held, Ticket)
        held.settle()
        ticket = await asyncio.wait_for(waiting, 5)
        assert isinstance(ticket, Ticket)
        ticket.settle()
    asyncio.run(run())


def test_a_full_queue_answers_503_at_once() -> None:
    async def run() -> None:
        admission = gate(max_queue_requests=1)
        held = await admission.admit("m", who(), Cost(100, 10), 100)
        waiting = asyncio.create_task(admission.admit("m", who(), Cost(10, 10), 100))
        await asyncio.sleep(0)
        answer = await admission.admit("m", who(), Cost(10, 10), 100)
        assert isinstance(answer, Response) and answer.status == 503
        assert b"queue_full" in answer.body
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert admission.queued() == 0 and counted(admission, "cancelled") == 1
        assert isinstance(held, Ticket)
        held.settle()
        assert admission.shares.prefills.used("p1") == 0
    asyncio.run(run())


def test_a_client_that_leaves_just_as_it_is_admitted_gives_its_reservation_back() -> None:
    async def run() -> None:
        admission = gate()
        held = await admission.admit("m", who(), Cost(100, 10), 100)
        waiting = asyncio.create_task(admission.admit("m", who(), Cost(10, 10), 100))
        await asyncio.sleep(0)
        assert isinstance(held, Ticket)
        held.settle()  # the pump admits the waiter: its future has a ticket ...
        waiting.cancel()  # ... and its client leaves before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert admission.shares.prefills.used("p1") == admission.shares.decodes.used("d1") == 0
    asyncio.run(run())


def test_a_decodes_slot_is_taken_when_the_prefill_is_done_not_at_admission() -> None:
    """One decode with one slot, two prefills: a second request is admitted while the
    first is still in its prefill (the decode is idle until then); once a prefill part
    ends the decode's slot is taken, so a third waits for that decode to finish."""
    async def run() -> None:
        one_slot = Candidate.of(live("d1", Role.DECODE, capacity=1))
        admission = gate(Fleet(prefills=(P1, P2), decodes=(one_slot,)))
        first = await admission.admit("m", who(), Cost(60, 10), 100)
        assert isinstance(first, Ticket)
        decode, prefill = admission.shares.charge(first, Pair(P1, one_slot))
        second = await admission.admit("m", who(), Cost(60, 10), 100)
        assert isinstance(second, Ticket)  # not queued behind an idle decode
        assert prefill is not None
        prefill.release()  # the first moves on to the decode: its slot is taken
        assert admission.shares.decodes.requests("d1") == 1
        second.settle()
        third = asyncio.create_task(admission.admit("m", who(), Cost(60, 10), 100))
        await asyncio.sleep(0)
        assert not third.done() and admission.queued() == 1
        decode.release()  # the first's answer is done
        ticket = await asyncio.wait_for(third, 5)
        assert isinstance(ticket, Ticket)
        ticket.settle()
        shares = admission.shares
        assert list(shares.decodes.members()) == list(shares.prefills.members()) == []
        # A mixed member serves its request's decode from the start: counted at once.
        mixed = Candidate.of(live("m1", Role.MIXED, capacity=1))
        both, none = admission.shares.charge(Ticket(Cost(60, 10)), Pair(mixed, mixed))
        assert none is None and admission.shares.decodes.requests("m1") == 1
        both.release()
        assert admission.shares.decodes.requests("m1") == 0
    asyncio.run(run())


def test_a_prefills_speed_is_measured_without_the_requests_own_reservation() -> None:
    """A request alone on a prefill for 0.6 s with 60 uncached tokens: 0.01 s a token.
    Its own reservation, given back as its pair's grant is taken, is not work beside it
    (else 0.005, and its class's deadline would allow for half the service it takes)."""
    async def run() -> None:
        now = [0.0]
        admission = Admission(AdmissionOptions(prefill_budget_tokens=100), BOOK, Fleet(),
                              LatencyTracker(), AdmissionMetrics(CollectorRegistry()),
                              lambda: now[0])
        ticket = await admission.admit("m", who(), Cost(60, 10), 100)
        assert isinstance(ticket, Ticket) and ticket.reserved("p1") == 60
        decode, prefill = admission.shares.charge(ticket, Pair(P1, D1))
        now[0] += 0.6
        assert prefill is not None
        prefill.release()
        decode.release()
        assert admission.predictor.seconds_per_token(["p1"]) == pytest.approx(0.01)
    asyncio.run(run())


def test_higher_priority_goes_first_and_pairing_avoids_full_members() -> None:
    async def run() -> None:
        admission = gate(Fleet(prefills=(P1, P2)))
        a = await admission.admit("m", who(), Cost(100, 10), 100)
        b = await admission.admit("m", who(), Cost(100, 10), 100)  # on p2: most room
        assert isinstance(a, Ticket) and isinstance(b, Ticket)
        assert admission.shares.full("m") == {"p1", "p2"}
        # ... but the room each reserved is its own: its pair goes there, not to the other
        assert admission.shares.full("m", a) == {"p2"} and admission.shares.full("m", b) == {"p1"}
        low = asyncio.create_task(admission.admit("m", who(STANDARD), Cost(100, 1), 10))
        await asyncio.sleep(0)
        high = asyncio.create_task(admission.admit("m", who(CRITICAL), Cost(100, 1), 10))
        await asyncio.sleep(0)
        a.settle()
        await asyncio.wait_for(high, 5)
        assert not low.done()
        b.settle()
        await asyncio.wait_for(low, 5)
        for task in (high, low):
            result = task.result()
            assert isinstance(result, Ticket)
            result.settle()
    asyncio.run(run())


def test_routers_split_each_members_budget_and_a_full_kv_takes_one_request() -> None:
    async def run() -> None:
        admission = gate(prefill_budget_tokens=1000, decode_budget_tokens=900)
        routers = {f"r{i}": live(f"r{i}", Role.API_SERVER, protocol=ROUTER_PROTOCOL)
                   for i in range(3)}
        planner = live("planner", Role.API_SERVER, protocol="pdreg-planner")  # not a router
        admission.on_members({"p1": live("p1", Role.PREFILL), "planner": planner, **routers})
        assert admission.shares.routers == 3
        assert admission.shares.limit(P1, "prefill").units == 333
        unsteered = gate(prefill_budget_tokens=1000, budget_slo_share=0.0)
        unsteered.on_members(routers)
        assert unsteered.shares.limit(P1, "prefill").units == 333
        assert admission.shares.limit(D1, "decode").units == 300
        small = Candidate.of(live("d2", Role.DECODE, capacity=7))
        assert admission.shares.limit(small, "decode").requests == 2
        full_kv = Candidate.of(live("d3", Role.DECODE, kv=0.97))
        assert admission.shares.limit(full_kv, "decode").requests == 1
    asyncio.run(run())


steps = st.lists(st.one_of(
    st.tuples(st.just("admit"), st.sampled_from([CRITICAL, STANDARD]), st.integers(1, 150)),
    st.tuples(st.just("charge"), st.integers(0, 99), st.booleans()),  # bool: retry first
    st.tuples(st.just("end"), st.integers(0, 99)),
    st.tuples(st.just("cancel"), st.integers(0, 99)),
), max_size=40)


@given(steps)
def test_no_history_leaves_budget_reserved_or_a_request_queued(history: list) -> None:
    """Admissions (some queued), pairs charged (some after a failed first pair: a
    retry), legs ended, clients gone: once every request has ended, every budget is
    zero, the queue is empty, and the counts never went negative on the way; an
    admitted request never finds the room reserved for it full."""
    async def run() -> None:
        admission = gate(Fleet(prefills=(P1, P2)))
        tasks: list[asyncio.Task[Ticket | Response]] = []
        held: list[tuple[Ticket, list]] = []

        def check() -> None:
            for budgets in (admission.shares.prefills, admission.shares.decodes):
                assert all(units >= 0 and n > 0 for _, units, n in budgets.members())
            # An admitted request not yet on a pair: the members it reserved room on
            # are never full for it (pairing sends it there), others as for anyone.
            for task in tasks:
                if task.done() and not task.cancelled() and isinstance(task.result(), Ticket):
                    ticket = task.result()
                    full = admission.shares.full("m", ticket)
                    assert not full & ticket.reserved_on
                    assert full == admission.shares.full("m") - ticket.reserved_on

        for step in history:
            if step[0] == "admit":
                tasks.append(asyncio.create_task(admission.admit(
                    "m", who(step[1]), Cost(step[2], 5), 10)))
            elif step[0] == "cancel" and tasks:
                tasks[step[1] % len(tasks)].cancel()
            elif step[0] == "charge" and tasks:
                task = tasks[step[1] % len(tasks)]
                if task.done() and not task.cancelled() and isinstance(task.result(), Ticket):
                    ticket = task.result()
                    grants = []
                    if step[2]:  # a first pair that failed: its grants go at once
                        for grant in admission.shares.charge(ticket, Pair(P2, D1)):
                            if grant is not None:
                                grant.release()
                    grants += [g for g in admission.shares.charge(ticket, Pair(P1, D1)) if g]
                    held.append((ticket, grants))
            elif step[0] == "end" and held:
                for grant in held.pop(step[1] % len(held))[1]:
                    grant.release()
            await asyncio.sleep(0)
            check()
        for _, grants in held:
            for grant in grants:
                grant.release()
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                result = await task
            except asyncio.CancelledError:
                continue
            if isinstance(result, Ticket):
                result.settle()
        check()
        assert admission.queued() == 0
        shares = admission.shares
        assert list(shares.prefills.members()) == list(shares.decodes.members()) == []
    asyncio.run(run())


# --- classes ------------------------------------------------------------------------------

def test_classes_file_and_key_mapping(tmp_path: Path) -> None:
    path = tmp_path / "classes.toml"
    path.write_text('default = "standard"\n'
                    '[classes.critical]\npriority = 2\nttft_slo_ms = 500\n'
                    '[classes.standard]\npriority = 1\n'
                    '[classes.batch]\nttft_slo_ms = 10000\nsheddable = true\nweight = 0.5\n'
                    '[keys.team-a]\nkey_env = "TEAM_A"\nclass = "critical"\n'
                    'classes = ["standard"]\nweight = 3\n')
    book = load_classes(path, {"TEAM_A": "sk-a"})
    assert book.classes["batch"] == TrafficClass("batch", 0, 10000, True, 0.5)
    key = book.key_of(b"sk-a")
    assert key is not None and key.tenant == "team-a" and book.key_of(b"sk-b") is None
    assert book.resolve("", key) is book.classes["critical"]
    assert book.resolve("standard", key) is book.classes["standard"]
    assert book.resolve("batch", key) is None  # not among its classes
    assert book.resolve("", None) is book.classes["standard"]
    assert book.resolve("nope", None) is None
    assert book.weight_of(book.classes["batch"], key) == 3.0
    assert book.weight_of(book.classes["batch"], None) == 0.5


@pytest.mark.parametrize(("data", "error"), [
    ({}, "[classes.NAME]"),
    ({"classes": {"a": {"priority": "high"}}}, "priority"),
    ({"classes": {"a": {"ttft_slo_ms": -1}}}, "ttft_slo_ms"),
    ({"classes": {"a": {"ttft_slo_ms": math.inf}}}, "ttft_slo_ms"),
    ({"classes": {"a": {"shed": True}}}, "unknown fields"),
    ({"classes": {"a b": {}}}, "bad name"),
    ({"classes": {"a": {}}, "default": "b"}, "default class"),
    ({"classes": {"a": {}}, "keys": {"k": {"key_env": "UNSET"}}}, "key_env"),
    ({"classes": {"a": {}}, "keys": {"k": {"key_env": "K", "class": "z"}}}, "defined"),
])
def test_bad_classes_are_refused_with_the_place(data: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error.replace("[", r"\[")):
        book_of(data, {"K": "v"})


def test_without_a_file_one_class_with_the_slo_given() -> None:
    book = default_book(250)
    assert list(book.classes) == [DEFAULT_CLASS]
    assert book.classes[DEFAULT_CLASS].ttft_slo_s == 0.25
    assert not book.classes[DEFAULT_CLASS].sheddable


# --- prediction ---------------------------------------------------------------------------

@pytest.mark.parametrize(("samples", "ahead", "own", "prefills", "expected"), [
    ([], 10_000, 100, ["p1"], 0.02),  # nothing measured: the decode part alone
    ([("p1", 1.0, 100)], 900, 100, ["p1"], 10.02),  # 10 ms a token, 1000 tokens
    ([("p1", 1.0, 100)], 900, 100, ["p1", "p2"], 5.02),  # two prefills share the work
    ([("p1", 1.0, 100), ("p2", 3.0, 100)], 0, 100, ["p1", "p2"], 1.02),  # their mean
    ([("p1", 1.0, 0)], 900, 100, ["p1"], 0.02),  # no work: no sample
])
def test_ttft_prediction(samples: list, ahead: int, own: int, prefills: list[str],
                         expected: float) -> None:
    predictor = TtftPredictor()
    for member_id, seconds, work in samples:
        predictor.observe(member_id, seconds, work, 0.0)
    assert predictor.predict(ahead=ahead, own=own, prefills=prefills, decode_s=0.02) == \
        pytest.approx(expected)


