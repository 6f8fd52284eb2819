"""Loads on demand: a router's view follows the loads of the models it is asked about.

A router of every model in front of 100k members took ~20,000 load changes a second and
paid ~4 µs for each, whichever model it served. With loads on demand the digests of a
model nobody asks for are passed over, decoded no further than their versions; when a
request asks for that model, the view fetches its current loads from the registry and
follows them from then on. What a reader must never notice: a model it follows has the
loads an eager view would show, and a model it does not keeps loads as old as its
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
from router.policies import DEFAULT_STALE_LOAD_S, make_pairer
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


def current(m: Fleet, model: str, now: float) -> LoadDigest:
    """A digest listing every member of `model` with the load the registry holds."""
    return digest(m, model, *(LoadEntry(r.spec.id, r.spec.incarnation, r.load,
                                        now - r.heartbeat_at) for r in m.records([model])))


def test_a_model_nobody_asked_for_keeps_its_loads_as_old_as_they_are() -> None:
    m = joined(("a", "m"), ("b", "n"))
    _, lazy = replicas(m)
    lazy.want({"m"})
    lazy.apply(digest(m, "m", LoadEntry("a", 1, Load(running=3), 0.0)), 5.0)
    lazy.apply(digest(m, "n", LoadEntry("b", 1, Load(running=7), 0.5)), 5.0)
    assert lazy.members["a"].load.running == 3 and lazy.loads_confirmed_at["m"] == 5.0
    # b's digest is passed over, and nothing says b's old load is current
    assert lazy.members["b"].load.running == 0 and lazy.members["b"].load_at == 0.0
    assert "n" not in lazy.loads_confirmed_at
    assert lazy.missed == {"n"} and lazy.take_to_fetch() == set()


def test_asking_for_a_missed_model_fetches_its_loads_and_confirms_them_then() -> None:
    m = joined(("b", "n"), ("c", "n"))
    _, lazy = replicas(m)
    lazy.apply(digest(m, "n", LoadEntry("b", 1, Load(running=7), 0.5)), 5.0)
    lazy.want({"n"})
    assert lazy.take_to_fetch() == {"n"} and lazy.take_to_fetch() == set()
    # Followed, not yet fetched: a digest applies what it lists, confirms nothing else
    lazy.apply(digest(m, "n", LoadEntry("c", 1, Load(running=2), 0.0)), 6.0)
    assert lazy.members["c"].load.running == 2 and "n" not in lazy.loads_confirmed_at
    m.beat("b", 1, load=Load(running=9), now=6.5)
    assert lazy.apply_loads(snapshot_of(m), {"n"}, 7.0, 7.0) is True
    b, c = lazy.members["b"], lazy.members["c"]
    assert (b.load.running, b.load_at) == (9, 6.5)
    assert (c.load.running, c.load_at) == (2, 6.0)  # the registry's was older: kept
    assert lazy.loads_confirmed_at["n"] == 7.0 and not lazy.missed
    assert lazy.take_loaded() == {"b": None, "c": None}


def test_fetched_loads_take_nothing_but_loads() -> None:
    """The answer to a loads' fetch: members of other models, other incarnations, or
    another epoch (a registry that restarted: its resync gives every load) change
    nothing, and no membership comes from it (events say that)."""
    m = joined(("a", "m"), ("b", "n"))
    _, lazy = replicas(m)
    m.join(spec("z", 1, "n"), now=1.0)
    m.beat("a", 1, load=Load(running=4), now=1.0)
    m.beat("b", 1, load=Load(running=5), now=1.0)
    before = dict(lazy.members)
    other_epoch = Snapshot(m.epoch + 1, 1, m.records(), 1.0)
    assert lazy.apply_loads(other_epoch, {"m", "n"}, 2.0, 2.0) is False
    assert lazy.apply_loads(snapshot_of(m), {"n"}, 2.0, 2.0) is True
    assert lazy.members["a"] is before["a"] and "z" not in lazy.members
    assert lazy.members["b"].load.running == 5
    assert lazy.members["b"].record is before["b"].record


def test_a_snapshot_gives_every_load_and_a_model_no_longer_asked_for_is_missed_again(
        ) -> None:
    m = joined(("a", "m"))
    _, lazy = replicas(m)
    lazy.apply(digest(m, "m", LoadEntry("a", 1, Load(running=4), 0.0)), 1.0)
    assert lazy.missed == {"m"}
    lazy.apply_snapshot(snapshot_of(m), 2.0, 2.0)
    assert not lazy.missed
    lazy.want({"m"})
    assert lazy.take_to_fetch() == set()  # nothing missed since the snapshot
    lazy.want(set())
    lazy.apply(digest(m, "m", LoadEntry("a", 1, Load(running=4), 0.0)), 3.0)
    assert lazy.members["a"].load.running == 0 and lazy.missed == {"m"}


ops = st.one_of(
    st.tuples(st.just("join"), st.sampled_from(IDS), st.sampled_from(MODELS)),
    st.tuples(st.just("leave"), st.sampled_from(IDS)),
    st.tuples(st.just("beat"), st.sampled_from(IDS), st.integers(0, 9)),
    st.tuples(st.just("digest"), st.sampled_from(MODELS), st.booleans()),
    st.tuples(st.just("want"), st.sets(st.sampled_from(MODELS))),
    st.tuples(st.just("fetch")),
    st.tuples(st.just("resync")),
)


@given(st.lists(ops, max_size=40))
def test_a_model_followed_has_the_loads_an_eager_view_has(sequence) -> None:
    """Any history of joins, leaves, heartbeats, digests (some with stale and unknown
    entries besides), resyncs, fetches and changes of what is asked for: a model the
    lazy view follows and has fetched is never behind the eager view, a model it does
    not follow never claims newer loads than it has; once every model is asked for and
    fetched, and a digest came, the two views are the same."""
    m = fresh()
    eager, lazy = replicas(m)
    incarnations: dict[str, int] = {}
    confirmed_when_missed: dict[str, float] = {}
    now = 0.0

    def deliver(*events) -> None:
        for event in events:
            eager.apply(event, now)
            lazy.apply(event, now)

    for op in sequence:
        now += 1.0
        if op[0] == "join":
            incarnation = incarnations.get(op[1], 0) + 1
            if m.join(spec(op[1], incarnation, op[2]), now=now).status is ReplyStatus.OK:
                incarnations[op[1]] = incarnation
            deliver(*m.take_events())
        elif op[0] == "leave" and op[1] in incarnations:
            m.leave(op[1], incarnations[op[1]])
            deliver(*m.take_events())
        elif op[0] == "beat" and op[1] in incarnations:
            m.beat(op[1], incarnations[op[1]], load=Load(running=op[2]), now=now)
        elif op[0] == "digest":
            listed = current(m, op[1], now)
            if op[2]:  # entries no view may apply: an older incarnation, a stranger
                listed = digest(m, op[1], *listed.loads, LoadEntry("ghost", 1, Load(), 0.0),
                                *(LoadEntry(e.id, e.incarnation - 1, Load(running=99), 0.0)
                                  for e in listed.loads))
            deliver(listed)
        elif op[0] == "want":
            lazy.want(op[1])
        elif op[0] == "fetch":
            lazy.apply_loads(snapshot_of(m), lazy.take_to_fetch(), now, now)
        elif op[0] == "resync":
            for replica in (eager, lazy):
                replica.apply_snapshot(snapshot_of(m), now, now)
        assert lazy.members.keys() == eager.members.keys()
        for member_id, member in lazy.members.items():
            assert member.record == eager.members[member_id].record
        for member in lazy.members.values():
            # a model whose loads it confirms, it is not behind the eager view on
            if member.model in lazy.loads_confirmed_at and member.model not in lazy.missed:
                assert member.load_at >= eager.members[member.id].load_at
        for model in MODELS:  # while a model is missed, nothing confirms its loads
            if model in lazy.missed:
                confirmed = lazy.loads_confirmed_at.get(model, -math.inf)
                assert confirmed_when_missed.setdefault(model, confirmed) == confirmed
            else:
                confirmed_when_missed.pop(model, None)
    lazy.want(MODELS)
    now += 1.0
    lazy.apply_loads(snapshot_of(m), lazy.take_to_fetch(), now, now)
    now += 1.0
    deliver(*(current(m, model, now) for model in MODELS))
    assert lazy.members == eager.members
    assert lazy.loads_confirmed_at == eager.loads_confirmed_at
    assert not lazy.missed


def merged(*members: tuple[str, str, tuple[str, ...]]) -> tuple[Fleet, Replica, Merge]:
    """A registry's decodes (id, base model, adapters) and a view's merge of it, synced."""
    m = fresh()
    for member_id, model, adapters in members:
        m.join(msgspec.structs.replace(spec(member_id, 1, model, Role.DECODE),
                                       adapters=adapters), now=0.0)
    m.take_events()
    replica = Replica(SOURCE)
    merge = Merge([replica])
    replica.apply_snapshot(snapshot_of(m), 0.0, 0.0)
    merge.heard(0, 0.0)
    assert merge.update(0.0)
    return m, replica, merge


def test_a_request_naming_an_adapter_reads_its_base_models_loads() -> None:
    m, replica, merge = merged(("d0", "base", ("sql-lora",)), ("d1", "other", ("sql-lora",)),
                               ("d2", "third", ()))
    assert merge.bases_of({"sql-lora"}) == {"sql-lora", "base", "other"}
    assert merge.bases_of({"third"}) == {"third"}
    m.leave("d1", 1)
    for event in m.take_events():
        replica.apply(event, 1.0)
    merge.heard(0, 1.0)
    assert merge.update(1.0)
    assert merge.bases_of({"sql-lora"}) == {"sql-lora", "base"}


def test_an_adapters_loads_are_confirmed_when_its_base_models_are() -> None:
    """A request naming an adapter reads loads its base models' digests carry: their
    confirmations are its own (before, an adapter had none, so every member serving it
    looked stale once its load had not changed for a few heartbeats)."""
    m, replica, merge = merged(("d0", "base", ("sql-lora",)), ("d1", "other", ("sql-lora",)))
    replica.apply(current(m, "base", 5.0), 5.0)
    assert merge.loads_confirmed_at("sql-lora") == -math.inf  # "other": never confirmed
    replica.apply(current(m, "other", 6.0), 6.0)
    assert merge.loads_confirmed_at("sql-lora") == 5.0  # the oldest of its bases'
    assert merge.loads_confirmed_at("base") == 5.0
    m.leave("d0", 1)
    for event in m.take_events():
        replica.apply(event, 7.0)
    merge.heard(0, 7.0)
    assert merge.update(7.0)
    assert merge.loads_confirmed_at("sql-lora") == 6.0  # "other" alone serves it now
    m.leave("d1", 1)
    for event in m.take_events():
        replica.apply(event, 8.0)
    merge.heard(0, 8.0)
    assert merge.update(8.0)
    assert merge.loads_confirmed_at("sql-lora") == -math.inf  # nobody serves it


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
            assert beating(view, loads, lambda m: view.links()[0].loads_missed == 1)
            assert view.members()["decode-b"].load.running == 0
            assert view.loads_confirmed_at("b") == -math.inf
            view.ask("b")
            assert beating(view, loads, lambda m: m["decode-b"].load.running == 7)
            assert view.links()[0].loads_missed == 0
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
            assert view.links()[0].loads_missed == 0
    finally:
        other.close()


def pairing_over(view: MembershipView, stale_after_s: float = DEFAULT_STALE_LOAD_S
                 ) -> Pairing:
    metrics = RouterMetrics()
    latency = LatencyTracker()
    return Pairing(view, make_pairer("least_loaded", latency=latency,
                                     stale_after_s=stale_after_s), locality_label="",
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
            assert beating(view, loads, lambda m: view.links()[0].loads_missed == 1)
            assert pairing.choose("b", NO_AFFINITY, ()) is not None  # the first request
            assert beating(view, loads, lambda m: m["decode-busy"].load.running == 40)
            picks = {pairing.choose("b", NO_AFFINITY, ()).decode.id for _ in range(30)}
            assert picks == {"decode-idle"}
    finally:
        for member in members:
            member.close()


def test_requests_naming_an_adapter_steer_by_loads_an_idle_member_has_not_changed(
        registry) -> None:
    """An idle decode's load stays what it was: only its base model's confirmations keep
    it current. A request naming the adapter both serve goes to it, not to the busy one
    (before, the idle one looked saturated to such requests and the busy one took all)."""
    stale_after_s = 1.0  # five of the registry's heartbeat intervals
    members = [RawMember(registry.control_address, spec=msgspec.structs.replace(
                   member_spec(member_id, role=role, model="b"), adapters=("sql-lora",)))
               for member_id, role in (("prefill-b", Role.PREFILL), ("decode-busy", Role.DECODE),
                                       ("decode-idle", Role.DECODE))]
    busy = members[1]
    loads = {members[0]: Load(), busy: Load(running=40), members[2]: Load()}
    try:
        with MembershipView(registry.control_address, loads_on_demand=True) as view:
            for member in members:
                member.register()
            pairing = pairing_over(view, stale_after_s)
            assert beating(view, loads, lambda m: len(m) == len(members))
            assert pairing.choose("sql-lora", NO_AFFINITY, ()) is not None  # asks for it
            assert beating(view, loads, lambda m: m["decode-busy"].load.running == 40)
            idle_since = view.members()["decode-idle"].load_at
            flip = 0  # the busy one's load keeps changing; the idle one's does not
            while time.monotonic() - idle_since <= 2 * stale_after_s:
                flip ^= 1
                loads[busy] = Load(running=40 + flip)
                assert beating(view, loads, lambda m, running=40 + flip:
                               m["decode-busy"].load.running == running)
            assert view.members()["decode-idle"].load_at == idle_since
            picks = {pairing.choose("sql-lora", NO_AFFINITY, ()).decode.id for _ in range(30)}
            assert picks == {"decode-idle"}
    finally:
        for member in members:
            member.close()
