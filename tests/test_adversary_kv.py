"""Hostile KV event publishers against the router's KV feed, over real ZeroMQ sockets:
each costs its own member's index, never the router's memory, the feed or another
member's index; and joining members cannot multiply how often a prompt is keyed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
from kv_publisher import BLOCK, DRIVERS, FakeEngine, feed_maker
from test_policies import member, view

from pdreg.testing import wait_until
from router.kv.feed import FeedMember, KvFeed
from router.kv.follow import Subscriptions
from router.kv.index import IndexState, KvIndex
from router.kv.keys import block_keys
from router.kv.policy import KvAffinity
from router.kv.routing import KvOptions, KvRouting
from router.metrics import RouterMetrics
from wire.kv_events import BlockStored, KVEventBatch, encode_batch, encode_seq
from wire.protocol import KvEventsSpec, MemberState

WAIT_S = 15.0
A = [1, 2, 3, 4]
B = [5, 6, 7, 8]


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def engines(ctx: zmq.Context) -> Iterator[Callable[[], FakeEngine]]:
    made: list[FakeEngine] = []

    def make() -> FakeEngine:
        made.append(FakeEngine(ctx))
        return made[-1]
    try:
        yield make
    finally:
        for e in made:
            e.close()


@pytest.fixture(params=DRIVERS)
def feeds(request: pytest.FixtureRequest) -> Iterator[Callable[..., KvFeed]]:
    """KvFeed(index, **options) on the router's event loop, or on a thread of its own."""
    with feed_maker(request.param) as make:
        yield make


def holds(index: KvIndex, member_id: str, tokens: list[int]) -> bool:
    m = index.members.get(member_id)
    return m is not None and m.cached_blocks(block_keys(tokens, BLOCK)) == 1


def serving(*engines: FakeEngine, until: Callable[[], bool]) -> bool:
    """Answer the engines' replays until `until` holds (or the deadline)."""
    def step() -> bool:
        for e in engines:
            e.serve_replays()
        return until()
    return wait_until(step, WAIT_S, poll_s=0.02)


def big_batch(tokens: int) -> bytes:
    """A batch storing `tokens` tokens (about 6 bytes each in msgpack, hashes included)."""
    ids = [70_000 + i % 1000 for i in range(tokens)]
    hashes = list(range(10**6, 10**6 + tokens // BLOCK))
    return encode_batch(KVEventBatch(1.0, [BlockStored(hashes, None, ids, BLOCK, None,
                                                       "GPU", None)]))


def test_batches_piled_behind_a_gap_are_capped_and_the_member_is_unknown_at_once(
        engines, feeds):
    """A publisher keeps a hole open (its replay never answers) and streams 1 MB batches
    behind it: the router holds at most --kv-gap-bytes of them, then gives the member up
    as unknown at once instead of waiting, and keeps what it stores from then on."""
    cap = 2 * 1024 * 1024
    engine = engines()
    index = KvIndex(max_pending_bytes=cap)
    feed = feeds(index, replay_timeout_s=60.0)  # it would wait a minute for the replay
    feed.update([FeedMember("p", 1, engine.spec())])
    engine.publish(0, A, lose=True)
    assert serving(engine, until=lambda: holds(index, "p", A))
    engine.answer_replays = False
    payload = big_batch(150_000)
    assert 512 * 1024 < len(payload) < 1024 * 1024
    peak = 0
    for seq in range(2, 12):  # seq 1 never comes: a hole
        engine.pub.send_multipart([b"", encode_seq(seq), payload])
        engine.serve_replays()
        member = index.members.get("p")
        peak = max(peak, member.pending_bytes if member else 0)
    assert wait_until(lambda: feed.counters.overflows >= 1, WAIT_S)
    assert peak <= cap
    engine.publish(12, B)
    assert wait_until(lambda: holds(index, "p", B), WAIT_S)
    member = index.members["p"]
    assert member.state is IndexState.UNKNOWN and not holds(index, "p", A)
    assert member.pending_bytes <= cap


def _deep_batch(depth: int) -> bytes:
    nested = msgspec.Raw(b"\x91" * depth + b"\xc0")  # [[[...[nil]...]]]
    return encode_batch(KVEventBatch(1.0, [BlockStored(
        [99], None, [1, 1, 1, 1], BLOCK, None, "GPU", None, extra_keys=[nested])]))


def test_one_deep_batch_costs_only_its_member(engines, feeds):
    """extra_keys nested 100,000 deep: a bad batch, counted; the feed lives on,
    the other member's index is untouched and keeps updating."""
    honest, hostile = engines(), engines()
    index = KvIndex()
    feed = feeds(index)
    feed.update([FeedMember("h", 1, honest.spec()), FeedMember("x", 1, hostile.spec())])
    honest.publish(0, A, lose=True)
    hostile.publish(0, A, lose=True)
    assert serving(honest, hostile,
                   until=lambda: holds(index, "h", A) and holds(index, "x", A))
    hostile.pub.send_multipart([b"", encode_seq(1), _deep_batch(100_000)])
    assert wait_until(lambda: feed.counters.bad >= 1, WAIT_S)
    honest.publish(1, B)
    assert serving(honest, hostile, until=lambda: holds(index, "h", B))
    assert holds(index, "h", A) and index.members["h"].state is IndexState.LIVE
    assert feed.on_loop or (feed.thread is not None and feed.thread.is_alive())
    assert feed.counters.restarts == 0


def test_a_batch_that_fails_to_apply_makes_only_its_member_unknown(
        engines, feeds, monkeypatch):
    """Whatever a batch makes the index raise (here: a fault injected into one member's
    index) costs that member's history, not the feed."""
    honest, odd = engines(), engines()
    index = KvIndex()
    feed = feeds(index)
    feed.update([FeedMember("h", 1, honest.spec()), FeedMember("x", 1, odd.spec())])
    honest.publish(0, A, lose=True)
    odd.publish(0, A, lose=True)
    assert serving(honest, odd, until=lambda: holds(index, "h", A) and holds(index, "x", A))
    victim = index.members["x"]

    def fail(*args: object) -> None:
        raise IndexError("a bug an input reached")
    monkeypatch.setattr(victim, "_apply_in_order", fail)
    odd.publish(1, B)
    assert wait_until(lambda: victim.state is IndexState.UNKNOWN, WAIT_S)
    assert not holds(index, "x", A) and feed.counters.bad == 1
    honest.publish(1, B)
    assert serving(honest, odd, until=lambda: holds(index, "h", B))
    assert feed.counters.restarts == 0


def test_a_feed_loop_that_fails_restarts_and_resyncs(engines, feeds, monkeypatch):
    engine = engines()
    index = KvIndex()
    feed = feeds(index)
    failures = [RuntimeError("once")]
    original = Subscriptions.check_replay_deadlines

    def fail_once(subs: Subscriptions) -> None:
        if failures:
            raise failures.pop()
        original(subs)
    monkeypatch.setattr(Subscriptions, "check_replay_deadlines", fail_once)
    feed.update([FeedMember("p", 1, engine.spec())])
    engine.publish(0, A, lose=True)
    assert serving(engine, until=lambda: feed.counters.restarts == 1
                   and holds(index, "p", A))
    engine.publish(1, B)
    assert serving(engine, until=lambda: holds(index, "p", B))
    assert index.members["p"].state is IndexState.LIVE


def _publishing(member_id: str, block_size: int, state: MemberState):
    """A member whose spec says it publishes KV events with this block size."""
    m = member(member_id, state=state)
    kv = KvEventsSpec(endpoint="tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:2",
                      block_size=block_size)
    spec = msgspec.structs.replace(m.record.spec, kv_events=kv)
    return msgspec.structs.replace(m, record=msgspec.structs.replace(m.record, spec=spec))


def test_joining_members_add_no_block_sizes_and_sizes_are_capped_per_model():
    """2,000 joining members, each with its own block size, and six ready ones with five
    sizes: a prompt is keyed for the ready members' sizes only, at most the cap, those
    of the most members."""
    kv = KvRouting(RouterMetrics(), KvOptions(max_block_sizes=2),
                   allows=lambda a: True)
    try:
        joining = [_publishing(f"j{i}", 100 + i, MemberState.JOINING) for i in range(2000)]
        ready = [_publishing(f"r{i}", size, MemberState.READY)
                 for i, size in enumerate([16, 16, 32, 32, 8, 64])]
        kv.on_members(view(*joining, *ready))
        affinity = asyncio.run(kv.affinity({"prompt": list(range(256))}, "m"))
        assert isinstance(affinity, KvAffinity)
        assert sorted(affinity.keys) == [16, 32]
    finally:
        kv.close()
