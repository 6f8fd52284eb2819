"""The router's table, kept from the view's changes, against one built from scratch.

A router of every model at 100k members cannot rebuild its table, or compare every
member, on each update of its view: it follows the ids the view says changed
(registry/view_changes.py, router/table_updater.py). After any sequence of joins,
leaves, state and suspicion flips, new incarnations and load changes, applied one at a
time or several per update (a reader that fell behind), what it holds must be what
`PairingTable.build` makes of the final membership, and so must what follows
membership beside it (`KvRouting.on_members`, `Unroutable.on_members`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from standins_fleet import StaticView, live_member

from registry.client import LiveMember
from registry.view_changes import ChangeTrail
from router.guard import UpstreamPolicy
from router.inflight import InFlight
from router.kv.routing import KvRouting
from router.latency import LatencyTracker
from router.metrics import RouterMetrics
from router.pairing import Pairing
from router.policies import make_pairer
from router.quarantine import Quarantine
from router.table import PairingTable
from router.table_updater import TableUpdater
from router.unroutable import Unroutable
from wire.protocol import KvEventsSpec, Load, MemberState, Role

IDS = [f"m{i}" for i in range(8)]
MODELS = ["a", "b", "c"]
PROTOCOLS = {"vllm-nixl", "sglang"}
SPOKEN = {"vllm-nixl"}  # the router's handshakes: sglang members are left out


@dataclass(frozen=True)
class Op:
    kind: str  # join (a new record, maybe a new incarnation), leave, state, suspect, load
    member_id: str
    role: Role = Role.PREFILL
    model: str = "a"
    protocol: str = "vllm-nixl"
    state: MemberState = MemberState.READY
    queue: int = 0
    kv: bool = False  # publishes KV events
    host: int = 1  # 10.0.0.<host>: 9 is outside the upstream policy


joins = st.builds(Op, st.just("join"), st.sampled_from(IDS), st.sampled_from(list(Role)),
                  st.sampled_from(MODELS), st.sampled_from(sorted(PROTOCOLS)),
                  st.sampled_from(list(MemberState)), st.integers(0, 5), st.booleans(),
                  st.sampled_from([1, 2, 9]))
flips = st.builds(Op, st.sampled_from(["leave", "state", "suspect"]), st.sampled_from(IDS),
                  state=st.sampled_from(list(MemberState)))
loads = st.builds(Op, st.just("load"), st.sampled_from(IDS), queue=st.integers(0, 50))
# Each inner list is one update of the view: several changes at once, as a digest or a
# reader that fell behind sees them.
histories = st.lists(st.lists(st.one_of(joins, flips, loads, loads), min_size=1,
                              max_size=4), max_size=25)


def advance(members: dict[str, LiveMember], update: list[Op], now: float
            ) -> tuple[dict[str, LiveMember], set[str]]:
    """Apply one update of the view to `members`: (the members before it, the ids whose
    member changed)."""
    previous = dict(members)
    for op in update:
        step(members, op, now)
    return previous, {i for i in IDS if previous.get(i) is not members.get(i)}


def step(members: dict[str, LiveMember], op: Op, now: float) -> None:
    held = members.get(op.member_id)
    if op.kind == "join":
        incarnation = held.record.spec.incarnation + 1 if held is not None else 1
        member = live_member(op.member_id, op.role, f"http://10.0.0.{op.host}:8000",
                             model=op.model, protocol=op.protocol, state=op.state,
                             incarnation=incarnation, load_at=now)
        if op.kv:
            kv = KvEventsSpec(endpoint="tcp://127.0.0.1:1", block_size=16,
                              tokenizer=f"tok-{op.model}")
            spec = msgspec.structs.replace(member.record.spec, kv_events=kv)
            member = msgspec.structs.replace(
                member, record=msgspec.structs.replace(member.record, spec=spec))
        members[op.member_id] = member
    elif held is None:
        return
    elif op.kind == "leave":
        del members[op.member_id]
    elif op.kind == "load":  # a digest: the same record, a newer load
        members[op.member_id] = msgspec.structs.replace(
            held, load=Load(running=op.queue), load_at=now)
    else:
        record = held.record
        record = (msgspec.structs.replace(record, state=op.state) if op.kind == "state"
                  else msgspec.structs.replace(record, suspect=not record.suspect))
        members[op.member_id] = msgspec.structs.replace(held, record=record)


def routable_urls(table: PairingTable) -> frozenset[str]:
    return frozenset(c.http for pools in table.pools.values() for pool in pools
                     for c in (*pool.prefills, *pool.decodes))


@given(histories)
def test_the_table_kept_from_changes_is_the_one_built_from_scratch(history):
    members: dict[str, LiveMember] = {}
    updater = TableUpdater("", SPOKEN)
    updater.reset(members)
    mark, looked = 0, frozenset[str]()  # the warm-up's last look (router/warmup.py)
    for now, update in enumerate(history):
        previous, changed = advance(members, update, float(now))
        before = updater.table.pools
        touched = {m.record.spec.model for i in changed
                   for m in (previous.get(i), members.get(i)) if m is not None}
        updater.apply(previous, dict(members), changed)
        expected = PairingTable.build(members, "", SPOKEN)
        assert updater.table == expected
        assert updater.routable_urls() == routable_urls(expected)
        # Every URL routable now and not at the last look is listed as arrived since,
        # and nothing else but URLs that left and came back meanwhile.
        mark, arrived = updater.urls_since(mark)
        assert routable_urls(expected) - looked <= set(arrived) <= routable_urls(expected)
        looked = routable_urls(expected)
        for pools in updater.table.pools.values():  # handshakes read the member's endpoints
            for pool in pools:
                for c in (*pool.prefills, *pool.prefills_suspect, *pool.decodes,
                          *pool.decodes_suspect):
                    assert c.member is members[c.id]
        for model, pools in before.items():  # a change costs its own models' pools
            if model not in touched:
                assert updater.table.pools.get(model) is pools
    updater.reset(dict(members))  # read whole again: nothing became routable
    assert updater.urls_since(mark) == (mark, [])
    assert set(updater.urls_since(0)[1]) == updater.routable_urls()


@given(histories, st.lists(st.sets(st.sampled_from([*MODELS, "z"]), min_size=1),
                           min_size=25, max_size=25))
def test_a_model_read_alone_has_every_load_and_leaves_the_others_waiting(history, reads):
    """Loads wait until their model's pools are read (a request for that model): a read
    of some models between updates gives each the pools `build` makes of it, every
    other model's pools stay the same objects, and the whole table matches at the end."""
    members: dict[str, LiveMember] = {}
    updater = TableUpdater("", SPOKEN)
    updater.reset(members)
    for now, update in enumerate(history):
        previous, changed = advance(members, update, float(now))
        updater.apply(previous, dict(members), changed)
        expected = PairingTable.build(members, "", SPOKEN)
        assert updater.membership.pools.keys() == expected.pools.keys()
        held = updater.membership.pools
        read = reads[now]
        for model in sorted(read):
            assert updater.pools_of(model) == expected.pools.get(model, ())
            assert updater.serves(model) == (model in expected.pools)
        for model, pools in held.items():  # an unread model's pools are not copied
            if model not in read:
                assert updater.membership.pools[model] is pools
    assert updater.table == PairingTable.build(members, "", SPOKEN)


@given(histories, st.lists(st.sets(st.sampled_from([*MODELS, "z"])), min_size=25,
                           max_size=25), st.sampled_from([2, 1024]))
def test_loads_listed_apart_reach_a_model_when_it_is_read(history, reads, max_steps):
    """A view that lists loads apart, per model (as the real one does): a router's
    pairing follows membership from the changes and takes a model's loads when a
    request reads that model, also when the trail no longer reaches back that far (a
    model unread for long): each read gives what `build` makes of the members."""
    view = StaticView(loads_apart=True, max_steps=max_steps)
    metrics = RouterMetrics()
    latency = LatencyTracker()
    pairing = Pairing(view, make_pairer("least_loaded", latency=latency), locality_label="",
                      protocols=SPOKEN, quarantine=Quarantine(5.0),
                      in_flight=InFlight(metrics.in_flight_of), picks_of=metrics.picks_of,
                      latency=latency, clock=lambda: 0.0)
    members: dict[str, LiveMember] = {}
    for now, update in enumerate(history):
        for op in update:
            step(members, op, float(now))
        view.set(members)
        pairing.follow()
        expected = PairingTable.build(members, "", SPOKEN)
        for model in sorted(reads[now]):
            pools = expected.pools.get(model, ())
            assert pairing.candidates(model) == (
                [c for pool in pools for c in (pool.prefills or pool.prefills_suspect)],
                [c for pool in pools for c in (pool.decodes or pool.decodes_suspect)])
    assert pairing.table() == PairingTable.build(members, "", SPOKEN)


def test_a_load_reaches_only_the_model_read():
    """A digest for two models: reading one swaps its loads in; the other's pools are
    the objects they were until it is read."""
    members = {"a-p": live_member("a-p", Role.PREFILL, "http://10.0.0.1:8000", model="a"),
               "b-p": live_member("b-p", Role.PREFILL, "http://10.0.0.2:8000", model="b")}
    updater = TableUpdater("", SPOKEN)
    updater.reset(members)
    b_before = updater.pools_of("b")
    previous = dict(members)
    for member_id in members:
        members[member_id] = msgspec.structs.replace(members[member_id],
                                                     load=Load(running=7), load_at=1.0)
    updater.apply(previous, dict(members), set(members))
    assert updater.pools_of("a")[0].prefills[0].queue == 7
    assert updater.membership.pools["b"] is b_before  # b's loads still wait
    assert updater.pools_of("b")[0].prefills[0].queue == 7


@given(histories)
def test_what_follows_membership_beside_the_table_matches_a_fresh_read(history):
    """The router's pairing, over a view that hands out its changes, and the `kv`
    policy's and the upstream guard's followers it feeds, against fresh ones told the
    final membership whole."""
    view = StaticView()
    latency = LatencyTracker()
    metrics = RouterMetrics()
    kv = KvRouting(metrics, allows=lambda a: True)
    fed: list[list[object]] = []
    kv.feed.update = lambda follow: fed.append(sorted(f.id for f in follow))  # no sockets
    unroutable = Unroutable(UpstreamPolicy.build("10.0.0.0/30"), "10.0.0.0/30")

    def on_members(members, moved):
        kv.on_members(members, moved)
        unroutable.on_members(members, moved)
        unroutable.warnings()  # (kept until the refused members change)

    pairing = Pairing(view, make_pairer("least_loaded", latency=latency), locality_label="",
                      protocols=SPOKEN, quarantine=Quarantine(5.0),
                      in_flight=InFlight(metrics.in_flight_of), picks_of=metrics.picks_of,
                      latency=latency, clock=lambda: 0.0, on_members=on_members)
    members: dict[str, LiveMember] = {}
    for now, update in enumerate(history):
        for op in update:
            step(members, op, float(now))
        view.set(members)
        assert pairing.table() == PairingTable.build(members, "", SPOKEN)
        for member_id in members:  # served a request (what the router can time)
            latency.observe("prefill", member_id, 1, 0.5, float(now))
    # The kv policy's followers, counted from the members alone (decodes are followed
    # only under conditional disaggregation, on by default).
    engines = {m.record.spec.model for m in members.values()
               if m.record.spec.role is not Role.API_SERVER}
    skipped = (Role.API_SERVER,) if kv.publishers.follow_decodes \
        else (Role.API_SERVER, Role.DECODE)
    publishers = sorted((m.record.spec for m in members.values()
                         if m.record.spec.kv_events is not None
                         and m.record.spec.role not in skipped),
                        key=lambda spec: spec.id)
    ready = {m.record.spec.id for m in members.values()
             if m.record.state is MemberState.READY}
    assert sorted(kv.models()) == sorted(engines)
    assert {model: info.members for model, info in kv.publishers.models.items()} == {
        model: tuple(s.id for s in publishers if s.model == model)
        for model in {s.model for s in publishers}}
    # Block sizes come from the ready publishers alone (joining ones add none).
    assert all(info.tokenizer_source == f"tok-{model}" and info.block_sizes
               == ((16,) if any(i in ready for i in info.members) else ())
               for model, info in kv.publishers.models.items())
    followed = sorted(m.id for m in members.values() if m.record.state is MemberState.READY
                      and m.record.spec in publishers)
    assert (fed or [[]])[-1] == followed
    whole = Unroutable(UpstreamPolicy.build("10.0.0.0/30"), "10.0.0.0/30")
    whole.on_members(members)
    assert unroutable.members == whole.members
    assert unroutable.warnings() == whole.warnings()
    assert {i for _, i in latency.estimates()} <= set(members)  # the gone are forgotten


def test_a_reader_far_behind_reads_the_members_whole():
    """The trail is bounded: a reader older than what it holds is told to read all."""
    trail: ChangeTrail[int] = ChangeTrail({}, max_steps=3)
    for i in range(5):
        trail.publish({"x": i}, ["x"])
    assert trail.since(5).changed == frozenset()
    assert trail.since(2).changed == frozenset({"x"})
    assert trail.since(1).changed is None and trail.since(-1).changed is None
    assert trail.since(1).members == {"x": 4}
