"""Loads on demand: a router's view applies the loads of the models it is asked about.

A router of every model in front of 100k members took ~20,000 load changes a second and
paid ~4 µs for each, whichever model it served. With loads on demand a model's digests
wait unapplied (registry/parked_loads.py) until a reader asks for it, then apply at once
and as they come. What a reader must never notice: a model it asks for has exactly the
loads an eager view would show; a model it does not ask for keeps loads as old as its
`loads_confirmed_at` says, never older ones passed off as current.
"""

from __future__ import annotations

import math
import time

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from membership_ops import Fleet, fresh, spec
from raw_member import RawMember, member_spec

from registry.client import MembershipView
from registry.merge import Merge
from registry.replica import Replica
from router.choice import NO_AFFINITY
from router.inflight import InFlight
from router.latency import LatencyTracker
from router.metrics import RouterMetrics
from router.pairing import Pairing
from router.policies import make_pairer
from router.quarantine import Quarantine
from wire.protocol import (
    Load,
    LoadDigest,
    LoadEntry,
    ReplyStatus,
    Role,
    Snapshot,
)

SOURCE = "127.0.0.1:7600"
WAIT_S = 10.0
IDS = ("a", "b", "c", "d")
MODELS = ("m", "n")


def snapshot_of(m: Fleet) -> Snapshot:
    return Snapshot(m.epoch, m.version, m.records(), m.timing.heartbeat_interval_s)


def digest(m: Fleet, model: str, *entries: LoadEntry) -> LoadDigest:
    return LoadDigest(m.epoch, m.version, model, list(entries), 1.0)


def replicas(m: Fleet) -> tuple[Replica, Replica]:
    """An eager replica and one with loads on demand, both synced to `m`."""
    eager, lazy = Replica(SOURCE), Replica(SOURCE, loads_on_demand=True)
    for replica in (eager, lazy):
        replica.apply_snapshot(snapshot_of(m), 0.0, 0.0)
    return eager, lazy


def joined(*members: tuple[str, str]) -> Fleet:
    m = fresh()
    for member_id, model in members:
        m.join(spec(member_id, 1, model), now=0.0)
    m.take_events()
    return m


def test_a_model_nobody_asked_for_keeps_its_loads_as_old_as_it_says() -> None:
    m = joined(("a", "m"), ("b", "n"))
    _, lazy = replicas(m)
    lazy.want({"m"})
    lazy.apply(digest(m, "m", LoadEntry("a", 1, Load(running=3), 0.0)), 5.0)
    lazy.apply(digest(m, "n", LoadEntry("b", 1, Load(running=7), 0.5)), 5.0)
    assert lazy.members["a"].load.running == 3 and lazy.loads_confirmed_at["m"] == 5.0
    # b's load is held back, and nothing says b's old load is current
    assert lazy.members["b"].load.running == 0 and lazy.members["b"].load_at == 0.0
    assert "n" not in lazy.loads_confirmed_at
    assert lazy.parked == 1


def test_asking_applies_the_newest_held_back_load_and_when_it_was_measured() -> None:
    m = joined(("b", "n"))
    _, lazy = replicas(m)
    lazy.apply(digest(m, "n", LoadEntry("b", 1, Load(running=7), 0.5)), 5.0)
    lazy.apply(digest(m, "n", LoadEntry("b", 1, Load(running=9), 0.25)), 6.0)
    lazy.apply(digest(m, "n"), 7.0)  # a pulse: the loads it does not list are unchanged
    assert lazy.want({"n"}) is True
    b = lazy.members["b"]
    assert (b.load.running, b.load_at) == (9, 5.75)
    assert lazy.loads_confirmed_at["n"] == 7.0
    assert lazy.take_loaded() == {"b": None} and lazy.parked == 0
    lazy.apply(digest(m, "n", LoadEntry("b", 1, Load(running=2), 0.0)), 8.0)
    assert lazy.members["b"].load.running == 2  # asked for: applied as it comes


def test_a_new_record_a_leave_or_a_snapshot_supersede_what_was_held_back() -> None:
    m = joined(("a", "n"), ("b", "n"), ("c", "n"))
    _, lazy = replicas(m)
    lazy.apply(digest(m, "n", *(LoadEntry(i, 1, Load(running=5), 0.0) for i in "abc")), 1.0)
    m.join(spec("a", 2, "n"), now=10.0)  # a new incarnation, its own load
    m.leave("b", 1)
    for event in m.take_events():
        lazy.apply(event, 10.0)
    assert lazy.parked == 1  # c's alone
    lazy.apply_snapshot(snapshot_of(m), 3.0, 3.0)
    assert lazy.parked == 0
    lazy.want({"n"})
    assert lazy.members["a"].record.spec.incarnation == 2
    assert lazy.members["a"].load.running == 0 and lazy.members["c"].load.running == 0
    assert "b" not in lazy.members


def test_a_model_no_longer_asked_for_is_held_back_again() -> None:
    m = joined(("a", "m"))
    _, lazy = replicas(m)
    lazy.want({"m"})
    lazy.want(set())
    lazy.apply(digest(m, "m", LoadEntry("a", 1, Load(running=4), 0.0)), 1.0)
    assert lazy.members["a"].load.running == 0 and lazy.parked == 1


ops = st.one_of(
    st.tuples(st.just("join"), st.sampled_from(IDS), st.sampled_from(MODELS)),
    st.tuples(st.just("leave"), st.sampled_from(IDS)),
    st.tuples(st.just("digest"), st.sampled_from(MODELS),
              st.lists(st.tuples(st.sampled_from((*IDS, "ghost")), st.integers(0, 9),
                                 st.sampled_from(("current", "older", "newer")),
                                 st.floats(0.0, 2.0)), max_size=6)),
    st.tuples(st.just("want"), st.sets(st.sampled_from(MODELS))),
    st.tuples(st.just("resync")),
)


@given(st.lists(ops, max_size=40))
def test_a_model_asked_for_has_exactly_the_loads_an_eager_view_has(sequence) -> None:
    """Any history of joins, leaves, digests (with stale, future and unknown entries),
    resyncs and changes of what is asked for: the members of a model asked for are the
    eager view's, and once every model is asked for, the whole replica is."""
    m = fresh()
    eager, lazy = replicas(m)
    incarnations: dict[str, int] = {}
    wanted: set[str] = set()
    now = 0.0
    for op in sequence:
        now += 1.0
        events: list = []
        if op[0] == "join":
            incarnation = incarnations.get(op[1], 0) + 1
            if m.join(spec(op[1], incarnation, op[2]), now=now).status is ReplyStatus.OK:
                incarnations[op[1]] = incarnation
            events = m.take_events()
        elif op[0] == "leave" and op[1] in incarnations:
            m.leave(op[1], incarnations[op[1]])
            events = m.take_events()
        elif op[0] == "digest":
            shift = {"current": 0, "older": -1, "newer": 1}
            events = [digest(m, op[1], *(
                LoadEntry(i, incarnations.get(i, 1) + shift[which], Load(running=r), age)
                for i, r, which, age in op[2]))]
        elif op[0] == "want":
            wanted = set(op[1])
            lazy.want(wanted)
        elif op[0] == "resync":
            for replica in (eager, lazy):
                replica.apply_snapshot(snapshot_of(m), now, now)
        for event in events:
            eager.apply(event, now)
            lazy.apply(event, now)
        for member_id, member in eager.members.items():
            if member.model in wanted:
                assert lazy.members[member_id] == member
        for model in wanted:
            assert lazy.loads_confirmed_at.get(model) == eager.loads_confirmed_at.get(model)
    lazy.want(MODELS)
    assert lazy.members == eager.members
    assert lazy.loads_confirmed_at == eager.loads_confirmed_at
    assert lazy.parked == 0


def test_a_request_naming_an_adapter_reads_its_base_models_loads() -> None:
    m = fresh()
    for member_id, model, adapters in (("d0", "base", ("sql-lora",)),
                                       ("d1", "other", ("sql-lora",)), ("d2", "third", ())):
        m.join(msgspec.structs.replace(spec(member_id, 1, model, Role.DECODE),
                                       adapters=adapters), now=0.0)
    m.take_events()
    replica = Replica(SOURCE)
    merge = Merge([replica])
    replica.apply_snapshot(snapshot_of(m), 0.0, 0.0)
    merge.heard(0, 0.0)
    assert merge.update(0.0)
    assert merge.bases_of({"sql-lora"}) == {"sql-lora", "base", "other"}
    assert merge.bases_of({"third"}) == {"third"}
    m.leave("d1", 1)
    for event in m.take_events():
        replica.apply(event, 1.0)
    merge.heard(0, 1.0)
    assert merge.update(1.0)
    assert merge.bases_of({"sql-lora"}) == {"sql-lora", "base"}


def beating(view: MembershipView, loads: dict[RawMember, Load], predicate) -> bool:
    """Whether `predicate(view.members())` holds within WAIT_S, the members heartbeating
    their loads meanwhile as agents do (a member that stops would turn suspect)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for member, load in loads.items():
            member.heartbeat(load)
        if view.wait_for(predicate, 0.05):
            return True
    return False


def test_a_view_applies_a_models_loads_once_asked_over_real_sockets(registry) -> None:
    """A registry, two members of two models heartbeating new loads, a view with loads
    on demand: the model asked for follows its loads; the other's wait, held back, and
    show the moment it is asked for."""
    asked = RawMember(registry.control_address, spec=member_spec("decode-a", model="a"))
    other = RawMember(registry.control_address, spec=member_spec("decode-b", model="b"))
    try:
        with MembershipView(registry.control_address, loads_on_demand=True) as view:
            asked.register()
            other.register()
            assert view.wait_for(lambda m: {"decode-a", "decode-b"} <= m.keys(), WAIT_S)
            view.ask("a")
            loads = {asked: Load(running=5), other: Load(running=7)}
            assert beating(view, loads, lambda m: m["decode-a"].load.running == 5)
            assert beating(view, loads, lambda m: view.links()[0].held_back == 1)
            assert view.members()["decode-b"].load.running == 0
            assert view.loads_confirmed_at("b") == -math.inf
            view.ask("b")
            assert beating(view, loads, lambda m: m["decode-b"].load.running == 7)
            assert view.links()[0].held_back == 0
            assert view.loads_confirmed_at("b") > -math.inf
    finally:
        asked.close()
        other.close()


def test_an_eager_view_applies_every_models_loads(registry) -> None:
    other = RawMember(registry.control_address, spec=member_spec("decode-b", model="b"))
    try:
        with MembershipView(registry.control_address) as view:
            other.register()
            assert view.wait_for(lambda m: "decode-b" in m, WAIT_S)
            assert beating(view, {other: Load(running=7)},
                           lambda m: m["decode-b"].load.running == 7)
            assert view.links()[0].held_back == 0
    finally:
        other.close()


def pairing_over(view: MembershipView) -> Pairing:
    metrics = RouterMetrics()
    latency = LatencyTracker()
    return Pairing(view, make_pairer("least_loaded", latency=latency), locality_label="",
                   protocols={"reference"}, quarantine=Quarantine(5.0),
                   in_flight=InFlight(metrics.in_flight_of), picks_of=metrics.picks_of,
                   latency=latency, clock=time.monotonic)


def test_a_router_of_every_model_routes_by_the_loads_of_the_model_requested(
        registry) -> None:
    """Nothing asked for model b before its first request: the choice asks for it, and
    from then on the router steers around b's busy decode as an eager view would."""
    members = [RawMember(registry.control_address, spec=member_spec(member_id, role=role,
                                                                     model="b"))
               for member_id, role in (("prefill-b", Role.PREFILL), ("decode-busy", Role.DECODE),
                                       ("decode-idle", Role.DECODE))]
    loads = {members[0]: Load(), members[1]: Load(running=40, waiting=10),
             members[2]: Load()}
    try:
        with MembershipView(registry.control_address, loads_on_demand=True) as view:
            for member in members:
                member.register()
            pairing = pairing_over(view)
            assert beating(view, loads, lambda m: view.links()[0].held_back == 1)
            assert pairing.choose("b", NO_AFFINITY, ()) is not None  # the first request
            assert beating(view, loads, lambda m: m["decode-busy"].load.running == 40)
            picks = {pairing.choose("b", NO_AFFINITY, ()).decode.id for _ in range(30)}
            assert picks == {"decode-idle"}
    finally:
        for member in members:
            member.close()
