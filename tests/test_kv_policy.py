"""The `kv` policy's choices, as tables: cache wins until load outweighs it, the load
bound spreads a hot prefix, stale or unsynced indexes claim nothing, conditional
disaggregation, and the fallback to `peak_ewma` where no match can be exact."""

from __future__ import annotations

import math
import random

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_policies import NOW, member, view

from pdreg.testing import wait_until
from router.choice import Affinity
from router.kv.index import KvIndex
from router.kv.keys import block_keys
from router.kv.policy import KvAffinity, make_kv_pairer
from router.kv.routing import KvOptions, KvRouting
from router.latency import LatencyTracker
from router.metrics import RouterMetrics
from router.policies import KV_FULL_PENALTY_REQS, PREFILL_ROLE, make_pairer
from router.table import PairingTable
from wire.kv_events import BlockStored, KVEventBatch
from wire.protocol import KvEventsSpec, Role

BLOCK = 4
PROMPT = list(range(40))  # 10 blocks


def indexed(holdings: dict[str, int]) -> KvIndex:
    """An index where member id holds the first n blocks of PROMPT (LIVE)."""
    index = KvIndex()
    for member_id, n in holdings.items():
        m = index.track(member_id, 1)
        assert m is not None
        m.start_sync()
        m.replay_done(complete=True)
        if n:
            keys = block_keys(PROMPT, BLOCK)[:n]
            m.apply(0, KVEventBatch(0.0, [BlockStored([k ^ 1 for k in keys], None,
                                                      PROMPT[:n * BLOCK], BLOCK, None, "GPU",
                                                      None)]))
    return index


def affinity(prompt: list[int] = PROMPT) -> KvAffinity:
    return KvAffinity(key=12345, prompt_tokens=len(prompt),
                      keys={BLOCK: block_keys(prompt, BLOCK)})


def choose(index: KvIndex, members, in_flight=None, key=None, **kw):
    pairer = make_kv_pairer(index, rng=random.Random(0), **kw)
    table = PairingTable.build(view(*members))
    request = affinity() if key is None else key
    return pairer.choose(table, "m", now=NOW, in_flight=in_flight or {}, affinity=request)


DECODE = member("d", Role.DECODE)


@pytest.mark.parametrize(("holdings", "loads", "in_flight", "expected"), [
    ({"a": 9, "b": 0}, {}, {}, "a"),  # the cache wins
    ({"a": 2, "b": 9}, {}, {}, "b"),  # the longer prefix wins
    ({"a": 9, "b": 0}, {"a": 1}, {}, "a"),  # a stale-looking report does not outweigh it
    ({"a": 9, "b": 0}, {}, {"a": 2}, "b"),  # its queue costs more than it saves
])
def test_prefill_choice(holdings, loads, in_flight, expected):
    members = [member(i, running=loads.get(i, 0)) for i in holdings] + [DECODE]
    pair = choose(indexed(holdings), members, in_flight)
    assert pair is not None and pair.prefill.id == expected
    assert pair.cached_tokens == holdings[expected] * BLOCK and pair.exact


def ring_pick(members, key: int) -> str:
    """Where the `prefix` policy's ring puts `key` among these members."""
    prefills = [m for m in members if m.role is Role.PREFILL]
    pair = make_pairer("prefix", rng=random.Random(0)).choose(
        PairingTable.build(view(*prefills, DECODE)), "m", now=NOW, in_flight={},
        affinity=Affinity(key))
    assert pair is not None
    return pair.prefill.id


@pytest.mark.parametrize("fallback", [1, 2**40, 2**62 + 5])
def test_cached_nowhere_goes_by_the_ring(fallback):
    """Requests sharing a new prefix meet on one prefill (the ring), not on whichever
    queue happened to be shortest."""
    members = [member(i) for i in "abc"] + [DECODE]
    key = KvAffinity(key=fallback, prompt_tokens=len(PROMPT),
                     keys={BLOCK: block_keys(PROMPT, BLOCK)})
    pair = choose(indexed({"a": 0, "b": 0, "c": 0}), members, key=key)
    assert pair is not None and pair.prefill.id == ring_pick(members, fallback)
    assert pair.cached_tokens == 0 and pair.exact


@given(loads=st.lists(st.integers(0, 3), min_size=2, max_size=6),
       kv=st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6), key=st.integers(0, 2**63))
def test_cached_nowhere_never_waits_behind_a_queue(loads, kv, key):
    """A miss computes the whole prompt wherever it lands: it goes where the load (queue
    and KV pressure) is least, to within half a request (the ring only orders the equally
    loaded), never behind a busy prefill while another is free."""
    ids = [f"p{i}" for i in range(len(loads))]
    kv = kv[:len(loads)]
    members = [member(i, running=n, kv=k)
               for i, n, k in zip(ids, loads, kv, strict=True)] + [DECODE]
    request = KvAffinity(key=key, prompt_tokens=len(PROMPT),
                         keys={BLOCK: block_keys(PROMPT, BLOCK)})
    pair = choose(indexed(dict.fromkeys(ids, 0)), members, key=request)
    assert pair is not None and pair.cached_tokens == 0
    load = [n + k * KV_FULL_PENALTY_REQS for n, k in zip(loads, kv, strict=True)]
    assert load[ids.index(pair.prefill.id)] < min(load) + 0.5


def test_replaying_or_other_incarnations_claim_nothing():
    index = indexed({"a": 9, "b": 0})
    index.members["a"].pending[5] = KVEventBatch(0.0, [])  # a hole is open
    pair = choose(index, [member("a"), member("b"), DECODE])
    assert pair is not None and pair.cached_tokens == 0
    assert pair.prefill.id == ring_pick([member("a"), member("b")], 12345)
    index = indexed({"a": 9, "b": 0})
    pair = choose(index, [member("a", incarnation=2), member("b"), DECODE])
    assert pair is not None and pair.cached_tokens == 0  # a restarted: nothing


def test_conditional_disaggregation_serves_on_the_decode():
    """Skip the prefill leg when the decode holds part of the prompt and would compute
    little itself: what its own cache (indexed when it publishes events) does not hold.
    A prompt it holds nothing of keeps its prefill leg, however short."""
    index = indexed({"a": 9, "d": 9})
    almost = PROMPT[:38]  # the decode holds 9 blocks: 2 tokens left to compute
    pair = choose(index, [member("a"), DECODE], key=affinity(almost),
                  disagg_min_uncached_tokens=8)
    assert pair is not None and pair.direct and pair.decode.id == "d"
    assert pair.cached_tokens == 9 * BLOCK  # what the decode, now its own prefill, holds
    pair = choose(indexed({"a": 9}), [member("a"), DECODE], key=affinity(almost),
                  disagg_min_uncached_tokens=8)  # a decode caching nothing: 38 to do
    assert pair is not None and not pair.direct and pair.prefill.id == "a"
    pair = choose(indexed({"a": 0, "d": 0}), [member("a"), DECODE], key=affinity(PROMPT[:6]),
                  disagg_min_uncached_tokens=8)  # short, but the decode holds none of it
    assert pair is not None and not pair.direct and pair.prefill.id == "a"


def slow_a() -> LatencyTracker:
    """Prefill `a` 10x slower than `b` and `c`, as the router measured them."""
    latency = LatencyTracker()
    for member_id, seconds in (("a", 1.0), ("b", 0.1), ("c", 0.1)):
        latency.observe(PREFILL_ROLE, member_id, 1, seconds, NOW)
    return latency


def pairs_of(pairer, members, request, n: int = 200) -> list:
    table = PairingTable.build(view(*members))
    out = []
    for _ in range(n):
        pair = pairer.choose(table, "m", now=NOW, in_flight={}, affinity=request)
        assert pair is not None
        out.append(pair)
    return out


@pytest.mark.parametrize("request_of", [
    lambda: Affinity(7),  # not matched exactly: no tokenizer, a shape we do not tokenize
    lambda: affinity(),  # exact ids, but no prefill publishes: nothing can answer
])
def test_where_nothing_can_answer_it_pairs_as_peak_ewma(request_of):
    """The default policy's choice, pick for pick (same seed, same latency estimates):
    the 10x slower prefill gets a small share, not the ring's third."""
    members = [member(i) for i in "abc"] + [DECODE, member("d2", Role.DECODE)]
    kv = make_kv_pairer(KvIndex(), rng=random.Random(3), latency=slow_a())
    ewma = make_pairer("peak_ewma", rng=random.Random(3), latency=slow_a())
    pairs = pairs_of(kv, members, request_of())
    got = [p.prefill.id for p in pairs]
    assert got == [p.prefill.id for p in pairs_of(ewma, members, Affinity(0))]
    assert got.count("a") < 0.1 * len(got)
    assert not any(p.exact or p.cached_tokens for p in pairs)


def test_syncing_or_replaying_publishers_fall_back_to_peak_ewma():
    index = indexed({"a": 9, "b": 0})
    index.members["a"].pending[5] = KVEventBatch(0.0, [])  # a hole is open
    index.members["b"].synced = False  # its first replay has not answered
    members = [member("a"), member("b"), DECODE]
    pair = choose(index, members)
    assert pair is not None and not pair.exact and pair.cached_tokens == 0


def test_mixed_fleet_publishers_are_matched_the_rest_hold_nothing():
    """`a` publishes and holds the prompt, `b` and `c` publish nothing: the choice is by
    cost; the silent ones count as caching nothing, and still win on a shorter queue."""
    members = [member(i) for i in "abc"] + [DECODE]
    pair = choose(indexed({"a": 9}), members)
    assert pair is not None and pair.prefill.id == "a" and pair.exact
    assert pair.cached_tokens == 9 * BLOCK
    pair = choose(indexed({"a": 1}), members, in_flight={"a": 1})
    assert pair is not None and pair.prefill.id in "bc" and pair.exact


def test_the_load_bound_spills_a_hot_prefix():
    """Three prefills, one holding the prompt with two of our requests queued: at twice
    the average (+1) it is over the bound, whatever its cache saves."""
    members = [member(i) for i in "abc"] + [DECODE]
    index = indexed({"a": 9, "b": 0, "c": 0})
    pair = choose(index, members, in_flight={"a": 1})
    assert pair is not None and pair.prefill.id == "a"  # within the bound: the cache wins
    pair = choose(index, members, in_flight={"a": 2})
    assert pair is not None and pair.prefill.id != "a"
    assert pair.cached_tokens == 0



def publishing(member_id: str, role: Role = Role.PREFILL):
    """A ready member whose spec says it publishes KV events (nobody listens there)."""
    m = member(member_id, role)
    kv = KvEventsSpec(endpoint="tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:2",
                      block_size=BLOCK)
    spec = msgspec.structs.replace(m.record.spec, kv_events=kv)
    return msgspec.structs.replace(m, record=msgspec.structs.replace(m.record, spec=spec))


@pytest.mark.parametrize(("disagg", "followed"), [(0, {"p"}), (64, {"p", "d"})])
def test_decodes_are_followed_only_for_conditional_disaggregation(disagg, followed):
    """A decode's cache matters only when it may serve a prompt alone: otherwise its
    events would cost the router for nothing."""
    kv = KvRouting(RouterMetrics(), KvOptions(disagg_min_uncached_tokens=disagg),
                   allows=lambda a: True)
    try:
        kv.on_members(view(publishing("p"), publishing("d", Role.DECODE)))
        assert wait_until(lambda: set(kv.index.members) == followed, 10)
    finally:
        kv.close()


@pytest.mark.parametrize("d2_running", [0, 1, 2, 5])
def test_conditional_disaggregation_finds_the_conversations_decode(d2_running):
    """A decode keeps the KV it pulls, so the next turn goes to the decode holding the
    conversation (and is served there alone), not to whichever decode power-of-two drew;
    unless that decode's queue is over `prefix`'s bound: then peak_ewma's pick stands."""
    index = indexed({"a": 9, "d1": 0, "d2": 9})
    members = [member("a"), member("d1", Role.DECODE),
               member("d2", Role.DECODE, running=d2_running)]
    table = PairingTable.build(view(*members))
    within = d2_running + 1 <= math.ceil(1.25 * (d2_running + 1) / 2)
    for seed in range(8):
        pairs = [make_kv_pairer(index, rng=random.Random(seed), disagg_min_uncached_tokens=n
                                ).choose(table, "m", now=NOW, in_flight={},
                                         affinity=affinity(PROMPT[:38])) for n in (8, 0)]
        assert pairs[0] is not None and pairs[1] is not None
        expected = "d2" if within else pairs[1].decode.id  # peak_ewma's own pick
        assert pairs[0].decode.id == expected and pairs[0].direct == (expected == "d2")
