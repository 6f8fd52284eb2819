"""Pairing math: tables for each rule, Hypothesis for the invariants."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from registry.client import LiveMember
from router.choice import NO_AFFINITY, Affinity
from router.choosers import (
    SATURATED_SCORE,
    LeastLoaded,
    PowerOfTwo,
    PrefixAffinity,
    RoundRobin,
    prefix_key,
)
from router.policies import KV_FULL_PENALTY_REQS, POLICY_NAMES, make_pairer, score
from router.table import Candidate, PairingTable
from wire.protocol import Endpoints, Load, MemberRecord, MemberSpec, MemberState, Role

NOW = 1000.0


def member(member_id: str, role: Role = Role.PREFILL, *, model: str = "m",
           protocol: str = "vllm-nixl", state: MemberState = MemberState.READY,
           suspect: bool = False, running: int = 0, waiting: int = 0, kv: float = 0.0,
           load_at: float = NOW, zone: str = "", incarnation: int = 1) -> LiveMember:
    spec = MemberSpec(id=member_id, incarnation=incarnation, role=role, model=model,
                      protocol=protocol, endpoints=Endpoints(http="http://127.0.0.1:1"),
                      labels={"zone": zone} if zone else {})
    load = Load(running=running, waiting=waiting, kv_usage=kv)
    record = MemberRecord(spec=spec, state=state, suspect=suspect, load=load)
    return LiveMember(record=record, load=load, load_at=load_at, registry="r")


def view(*members: LiveMember) -> dict[str, LiveMember]:
    return {m.id: m for m in members}


def cand(member_id: str, **kw: object) -> Candidate:
    return Candidate.of(member(member_id, **kw))  # type: ignore[arg-type]


# --- score --------------------------------------------------------------------------------

@pytest.mark.parametrize(("running", "waiting", "kv", "in_flight", "age", "expected"), [
    (0, 0, 0.0, 0, 0.0, 0.0),
    (2, 3, 0.0, 1, 0.0, 6.0),
    (0, 0, 0.5, 0, 0.0, 0.5 * KV_FULL_PENALTY_REQS),
    (1, 0, 1.0, 2, 2.9, 3 + KV_FULL_PENALTY_REQS),
    (1, 0, 0.0, 0, 3.1, SATURATED_SCORE),  # stale load: saturated
    (1, 0, 0.0, 4, 30.0, SATURATED_SCORE + 4),  # still ordered by our own in-flight
])
def test_score_table(running: int, waiting: int, kv: float, in_flight: int, age: float,
                     expected: float) -> None:
    c = cand("a", running=running, waiting=waiting, kv=kv, load_at=NOW - age)
    assert score(c, in_flight, NOW, stale_after_s=3.0) == pytest.approx(expected)


def test_an_unchanged_load_the_registry_confirmed_is_not_stale() -> None:
    """A digest lists only changed loads, so an idle member's load keeps the time it was
    last measured; the registry's confirmation of its model keeps it current."""
    idle = cand("idle", load_at=NOW - 60.0)
    assert score(idle, 0, NOW, stale_after_s=3.0) == SATURATED_SCORE
    assert score(idle, 0, NOW, stale_after_s=3.0, confirmed_at=NOW - 0.5) == 0.0
    assert score(idle, 0, NOW, stale_after_s=3.0, confirmed_at=NOW - 5.0) == SATURATED_SCORE


@pytest.mark.parametrize("policy", ["power_of_two", "peak_ewma", "least_loaded"])
def test_an_idle_member_with_an_unchanged_load_takes_its_share(policy: str) -> None:
    """Two idle prefills, one whose load last changed a minute ago: while the registry
    keeps confirming the model's loads, both take requests (before, the idle one counted
    as saturated and its peer took everything)."""
    t = PairingTable.build(view(member("busy", running=0), member("idle", load_at=NOW - 60),
                                member("d", Role.DECODE)))
    pairer = make_pairer(policy, rng=random.Random(5))
    picks = Counter(pairer.choose(t, "m", now=NOW, in_flight={},  # type: ignore[union-attr]
                                  loads_confirmed_at=NOW - 0.5).prefill.id
                    for _ in range(200))
    assert picks["idle"] > 50 and picks["busy"] > 50, picks


# --- choosers -------------------------------------------------------------------------------

def test_round_robin_cycles() -> None:
    cs = [cand(i) for i in "abc"]
    rr = RoundRobin()
    assert [rr.choose(cs, lambda c: 0, NO_AFFINITY).id for _ in range(6)] == list("abcabc")


def test_power_of_two_never_picks_the_worst_of_two() -> None:
    cs = [cand("a"), cand("b")]
    p2 = PowerOfTwo(random.Random(0))
    loads = {"a": 5.0, "b": 1.0}
    assert {p2.choose(cs, lambda c: loads[c.id], NO_AFFINITY).id for _ in range(50)} == {"b"}


@given(loads=st.lists(st.integers(0, 20), min_size=1, max_size=12), seed=st.integers(0, 99))
def test_power_of_two_never_picks_the_global_worst_when_unique(loads: list[int],
                                                                seed: int) -> None:
    cs = [cand(f"m{i}") for i in range(len(loads))]
    by_id = {c.id: float(v) for c, v in zip(cs, loads, strict=True)}
    pick = PowerOfTwo(random.Random(seed)).choose(cs, lambda c: by_id[c.id], NO_AFFINITY)
    worst = max(loads)
    if len(loads) > 1 and loads.count(worst) == 1:
        assert by_id[pick.id] < worst


@given(loads=st.lists(st.integers(0, 20), min_size=1, max_size=12), seed=st.integers(0, 99))
def test_least_loaded_picks_a_minimum(loads: list[int], seed: int) -> None:
    cs = [cand(f"m{i}") for i in range(len(loads))]
    by_id = {c.id: float(v) for c, v in zip(cs, loads, strict=True)}
    pick = LeastLoaded(random.Random(seed)).choose(cs, lambda c: by_id[c.id], NO_AFFINITY)
    assert by_id[pick.id] == min(loads)


def test_least_loaded_spreads_ties() -> None:
    cs = [cand(i) for i in "abcd"]
    ll = LeastLoaded(random.Random(1))
    assert {ll.choose(cs, lambda c: 0, NO_AFFINITY).id for _ in range(100)} == set("abcd")


def test_prefix_affinity_is_sticky_and_spreads_keys() -> None:
    cs = [cand(f"p{i}") for i in range(4)]
    pa = PrefixAffinity()
    key = Affinity(prefix_key(b"You are a helpful assistant. " * 20))
    first = pa.choose(cs, lambda c: 0, key)
    assert all(pa.choose(cs, lambda c: 0, key) is first for _ in range(20))
    owners = Counter(pa.choose(cs, lambda c: 0, Affinity(prefix_key(f"doc {i}".encode()))).id
                     for i in range(400))
    assert set(owners) == {c.id for c in cs}
    assert min(owners.values()) > 40  # roughly even: 100 each expected


def test_prefix_affinity_spills_when_overloaded_and_returns_when_not() -> None:
    cs = [cand(f"p{i}") for i in range(4)]
    pa = PrefixAffinity()
    key = Affinity(prefix_key(b"shared system prompt"))
    home = pa.choose(cs, lambda c: 0, key)
    loads = {c.id: 0.0 for c in cs}
    loads[home.id] = 10.0  # far above 1.25 x average
    spill = pa.choose(cs, lambda c: loads[c.id], key)
    assert spill.id != home.id
    assert pa.choose(cs, lambda c: loads[c.id], key) is spill  # spill target is stable too
    loads[home.id] = 0.0
    assert pa.choose(cs, lambda c: loads[c.id], key) is home


def test_prefix_affinity_removing_a_member_moves_only_its_keys() -> None:
    cs = [cand(f"p{i}") for i in range(5)]
    pa = PrefixAffinity()
    keys = [Affinity(prefix_key(f"k{i}".encode())) for i in range(300)]
    before = {k: pa.choose(cs, lambda c: 0, k).id for k in keys}
    gone = cs[2].id
    after = {k: pa.choose([c for c in cs if c.id != gone], lambda c: 0, k).id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == gone for k in moved)


def test_prefix_affinity_all_saturated_falls_back_to_least_loaded() -> None:
    cs = [cand(f"p{i}") for i in range(3)]
    loads = {"p0": SATURATED_SCORE + 3, "p1": SATURATED_SCORE + 1, "p2": SATURATED_SCORE + 2}
    assert PrefixAffinity().choose(cs, lambda c: loads[c.id], Affinity(123)).id == "p1"


# --- the pairing table and pairer ----------------------------------------------------------

def pick(members: dict[str, LiveMember], policy: str = "power_of_two", *, model: str = "m",
         quarantined: dict[str, int] | None = None, in_flight: dict[str, int] | None = None,
         locality: str = "", exclude: tuple[str, ...] = (), seed: int = 0
         ) -> tuple[str, str] | None:
    table = PairingTable.build(members, locality)
    pair = make_pairer(policy, rng=random.Random(seed)).choose(
        table, model, now=NOW, in_flight=in_flight or {}, quarantined=quarantined,
        exclude=exclude)
    return None if pair is None else (pair.prefill.id, pair.decode.id)


P, D, X = Role.PREFILL, Role.DECODE, Role.MIXED


@pytest.mark.parametrize(("case", "members", "expected"), [
    ("simple", [member("p", P), member("d", D)], ("p", "d")),
    ("no decode", [member("p", P)], None),
    ("no prefill", [member("d", D)], None),
    ("other model", [member("p", P), member("d", D, model="other")], None),
    ("protocol mismatch", [member("p", P), member("d", D, protocol="sglang")], None),
    ("joining skipped", [member("p", P), member("d", D, state=MemberState.JOINING)], None),
    ("draining skipped", [member("p", P, state=MemberState.DRAINING), member("d", D)], None),
    ("api server ignored", [member("p", P), member("a", Role.API_SERVER)], None),
    ("suspect fallback P", [member("p", P, suspect=True), member("d", D)], ("p", "d")),
    ("suspect fallback D", [member("p", P), member("d", D, suspect=True)], ("p", "d")),
    ("routable preferred", [member("p1", P, suspect=True), member("p2", P, running=50),
                            member("d", D)], ("p2", "d")),
    ("mixed serves alone", [member("x", X)], ("x", "x")),
    ("mixed as decode", [member("p", P), member("x", X, running=99)], None),  # checked below
    ("protocol picks pool", [member("p", P, protocol="sglang"), member("d1", D),
                             member("d2", D, protocol="sglang")], ("p", "d2")),
])
def test_pairing_table(case: str, members: list[LiveMember],
                       expected: tuple[str, str] | None) -> None:
    got = pick(view(*members))
    if case == "mixed as decode":
        assert got in {("p", "x"), ("x", "x")}
    else:
        assert got == expected, case


def test_quarantine_skips_member_of_that_incarnation_only() -> None:
    ms = view(member("p1", P), member("p2", P, running=9), member("d", D))
    assert pick(ms, "least_loaded") == ("p1", "d")
    assert pick(ms, "least_loaded", quarantined={"p1": 1}) == ("p2", "d")
    assert pick(ms, "least_loaded", quarantined={"p1": 0}) == ("p1", "d")  # old incarnation
    assert pick(ms, quarantined={"p1": 1, "p2": 1}) is None
    assert pick(ms, quarantined={"d": 1}) is None


def test_quarantined_routable_falls_back_to_suspect() -> None:
    ms = view(member("p1", P), member("p2", P, suspect=True), member("d", D))
    assert pick(ms, quarantined={"p1": 1}) == ("p2", "d")


def test_stale_load_counts_as_saturated() -> None:
    ms = view(member("p1", P, load_at=NOW - 10), member("p2", P, running=30), member("d", D))
    assert pick(ms, "least_loaded") == ("p2", "d")


def test_in_flight_adds_to_reported_load() -> None:
    ms = view(member("p1", P, running=1), member("p2", P, running=2), member("d", D))
    assert pick(ms, "least_loaded") == ("p1", "d")
    assert pick(ms, "least_loaded", in_flight={"p1": 5}) == ("p2", "d")


@pytest.mark.parametrize("seed", range(10))
def test_locality_prefers_same_zone_decode(seed: int) -> None:
    ms = view(member("pa", P, zone="a"), member("da", D, zone="a", running=5),
              member("db", D, zone="b"), member("dc", D, zone="b"))
    assert pick(ms, "random", locality="zone", seed=seed) == ("pa", "da")
    # No same-zone decode with a fresh load: anyone will do.
    ms["da"] = member("da", D, zone="a", load_at=NOW - 100)
    assert pick(ms, "least_loaded", locality="zone", seed=seed) in {("pa", "db"), ("pa", "dc")}


def test_exclude_avoids_tried_members_unless_nobody_else() -> None:
    ms = view(member("p1", P), member("p2", P), member("d", D))
    assert pick(ms, exclude=("p1",)) == ("p2", "d")
    assert pick(ms, exclude=("p1", "p2", "d")) in {("p1", "d"), ("p2", "d")}


def test_round_robin_pairs_cycle() -> None:
    ms = view(member("p1", P), member("p2", P), member("d1", D), member("d2", D))
    table = PairingTable.build(ms)
    pairer = make_pairer("round_robin")
    got = [pairer.choose(table, "m", now=NOW, in_flight={}) for _ in range(4)]
    assert [(g.prefill.id, g.decode.id) for g in got if g] == [
        ("p1", "d1"), ("p2", "d2"), ("p1", "d1"), ("p2", "d2")]


def test_models_lists_only_servable_models() -> None:
    ms = view(member("p", P), member("d", D), member("p2", P, model="lonely"),
              member("x", X, model="mix"))
    assert sorted(PairingTable.build(ms).models()) == ["m", "mix"]
    assert sorted(PairingTable.build(ms).models({"d": 1})) == ["mix"]


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown policy 'best'"):
        make_pairer("best")


# --- invariants over random fleets ---------------------------------------------------------

member_strategy = st.builds(
    lambda i, role, model, proto, state, suspect, running, age, zone: member(
        f"m{i}", role, model=model, protocol=proto, state=state, suspect=suspect,
        running=running, load_at=NOW - age, zone=zone),
    st.integers(0, 30), st.sampled_from([P, D, X, Role.API_SERVER]),
    st.sampled_from(["m", "n"]), st.sampled_from(["vllm-nixl", "sglang"]),
    st.sampled_from(list(MemberState)), st.booleans(), st.integers(0, 10),
    st.sampled_from([0.0, 1.0, 10.0]), st.sampled_from(["", "a", "b"]))


@given(fleet=st.lists(member_strategy, max_size=25), policy=st.sampled_from(POLICY_NAMES),
       quarantine=st.sets(st.integers(0, 30), max_size=5), seed=st.integers(0, 9))
def test_pair_invariants(fleet: list[LiveMember], policy: str, quarantine: set[int],
                         seed: int) -> None:
    ms = view(*fleet)
    quarantined = {f"m{i}": 1 for i in quarantine}
    got = pick(ms, policy, quarantined=quarantined, locality="zone", seed=seed)
    ready = [m for m in ms.values() if m.record.state is MemberState.READY
             and m.model == "m" and m.id not in quarantined]

    def can(m: LiveMember, roles: tuple[Role, ...]) -> bool:
        return m.role in roles
    servable = any(
        can(p, (P, X)) and can(d, (D, X)) and p.record.spec.protocol == d.record.spec.protocol
        for p in ready for d in ready)
    if got is None:
        assert not servable
        return
    assert servable
    p, d = ms[got[0]], ms[got[1]]
    assert p in ready and d in ready
    assert p.role in (P, X) and d.role in (D, X)
    assert p.record.spec.protocol == d.record.spec.protocol
    if p.role is X:
        assert p is d
    # Suspect members are used only when no routable one of that role exists in the pool.
    proto = p.record.spec.protocol
    for chosen, roles in ((p, (P, X)), (d, (D, X))):
        if chosen.record.suspect and chosen is not p:
            assert not any(m for m in ready if m.role in roles and not m.record.suspect
                           and m.record.spec.protocol == proto)


def test_session_affinity_keeps_a_conversation_on_one_pair() -> None:
    fleet = view(*(member(f"p{i}", P) for i in range(4)), *(member(f"d{i}", D) for i in range(4)))
    table = PairingTable.build(fleet, "")
    pairer = make_pairer("session")

    def pair_of(session: str) -> tuple[str, str]:
        pair = pairer.choose(table, "m", now=NOW, in_flight={},
                              affinity=pairer.affinity(session, {}))
        assert pair is not None
        return pair.prefill.id, pair.decode.id

    sessions = [f"chat-{i}" for i in range(40)]
    first = {s: pair_of(s) for s in sessions}
    assert all(pair_of(s) == first[s] for s in sessions)  # every turn, the same pair
    assert len({p for p, _ in first.values()}) > 1  # sessions spread over prefills
    assert len({d for _, d in first.values()}) > 1  # ... and over decodes
