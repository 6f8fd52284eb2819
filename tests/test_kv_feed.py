"""The router's KV feed over real ZeroMQ sockets: a test-owned engine publisher that can
lose batches, answer replays or not; the index replays, or says unknown, never lies."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
from kv_publisher import BLOCK, DRIVERS, FakeEngine, FeedLoop, feed_maker

from pdreg.testing import wait_until
from router.kv import feed_on_loop, follow
from router.kv.feed import FeedMember, KvFeed
from router.kv.index import IndexState, KvIndex
from router.kv.keys import block_keys
from wire.kv_events import encode_seq

WAIT_S = 15.0


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def engine(ctx: zmq.Context) -> Iterator[FakeEngine]:
    e = FakeEngine(ctx)
    try:
        yield e
    finally:
        e.close()


@pytest.fixture
def index() -> KvIndex:
    return KvIndex()


@pytest.fixture(params=DRIVERS)
def make_feed(request: pytest.FixtureRequest, index: KvIndex
              ) -> Iterator[Callable[..., KvFeed]]:
    """KvFeed(index, **options) on the router's event loop, or on a thread of its own;
    closed after the test (before the engine's sockets)."""
    with feed_maker(request.param) as make:
        yield lambda **options: make(index, **options)


def run_until(engine: FakeEngine, predicate, keep_from: int = 0) -> bool:
    def step() -> bool:
        if engine.router is not None:
            engine.serve_replays(keep_from)
        return bool(predicate())
    return wait_until(step, WAIT_S, poll_s=0.02)


A = [1, 2, 3, 4]
B = [5, 6, 7, 8]
C = [9, 9, 9, 9]


def state(index: KvIndex) -> IndexState | None:
    """The member's index state (None until the feed thread has subscribed)."""
    m = index.members.get("p")
    return None if m is None else m.state


def next_seq(index: KvIndex) -> int | None:
    m = index.members.get("p")
    return None if m is None else m.next_seq


def live_with(index: KvIndex, tokens: list[int]):
    return lambda: (state(index) is IndexState.LIVE
                    and index.cached_blocks("p", 1, block_keys(tokens, BLOCK)) == 1)


def test_history_then_a_lost_batch_is_replayed(engine, index, make_feed):
    engine.publish(0, A, lose=True)  # before the router came: only the replay has it
    feed = make_feed(replay_timeout_s=5.0)
    feed.update([FeedMember("p", 1, engine.spec())])
    assert run_until(engine, live_with(index, A))
    engine.publish(1, B, lose=True)  # lost on the way
    # Publish until the SUB is connected (slow joiner): seq 2, resent as a duplicate.
    assert run_until(engine, lambda: (engine.publish(2, C) or True)
                     and next_seq(index) == 3)
    assert run_until(engine, live_with(index, B))
    assert index.members["p"].gaps >= 1 and index.members["p"].replays >= 1
    assert feed.counters.batches >= 1
    feed.close()
    feed.close()  # safe twice (and the fixture closes it again)


def test_a_gap_the_replay_cannot_fill_is_unknown(engine, index, make_feed):
    feed = make_feed(replay_timeout_s=5.0)
    feed.update([FeedMember("p", 1, engine.spec())])
    assert run_until(engine, lambda: state(index) is IndexState.LIVE)
    assert run_until(engine, lambda: (engine.publish(0, A) or True)
                     and next_seq(index) == 1)
    engine.publish(1, B, lose=True)
    del engine.buffer[1]  # and gone from the engine's replay buffer too
    assert run_until(engine, lambda: (engine.publish(2, C) or True)
                     and state(index) is IndexState.UNKNOWN, keep_from=2)
    # Unknown is a lower bound: what came before the hole is no longer claimed.
    assert index.cached_blocks("p", 1, block_keys(A, BLOCK)) == 0
    assert index.cached_blocks("p", 1, block_keys(C, BLOCK)) == 1


def test_silent_replay_times_out_to_unknown_and_leaving_drops_blocks(engine, index, make_feed):
    engine.answer_replays = False
    feed = make_feed(replay_timeout_s=0.3)
    feed.update([FeedMember("p", 1, engine.spec())])
    assert run_until(engine, lambda: state(index) is IndexState.UNKNOWN)
    feed.update([])
    assert wait_until(lambda: "p" not in index.members, WAIT_S)


def test_endpoints_the_upstream_policy_refuses_are_not_connected(engine, index, make_feed):
    feed = make_feed(allows=lambda address: False)
    feed.update([FeedMember("p", 1, engine.spec())])
    assert wait_until(lambda: feed.counters.refused == 1, WAIT_S)
    assert "p" not in index.members


def test_garbage_is_counted_and_changes_nothing(engine, index, make_feed):
    feed = make_feed(replay_timeout_s=5.0)
    feed.update([FeedMember("p", 1, engine.spec())])
    assert run_until(engine, lambda: state(index) is IndexState.LIVE)

    def garbage() -> bool:
        engine.pub.send_multipart([b"", b"\x00" * 8, b"\xc1not msgpack"])
        engine.pub.send_multipart([b"only one frame"])
        return feed.counters.bad >= 2
    assert wait_until(garbage, WAIT_S)
    assert index.members["p"].state is IndexState.LIVE and not index.members["p"].blocks


def test_the_snapshot_catches_up_with_a_burst_and_no_batch_after_it(engine, index, make_feed):
    """What /v1/kv, /metrics and the reporter read (`published`) is swapped in at most
    every PUBLISH_INTERVAL_S: a burst's last batch still shows there, with nothing after
    it to carry it, within PUBLISH_MAX_DELAY_S."""
    feed = make_feed(replay_timeout_s=5.0)
    feed.update([FeedMember("p", 1, engine.spec())])
    assert run_until(engine, lambda: state(index) is IndexState.LIVE)

    def burst() -> bool:  # back to back, repeated until the SUB is connected
        engine.publish(0, A)
        engine.publish(1, B)
        engine.publish(2, C)
        return next_seq(index) == 3
    assert run_until(engine, burst)

    def shown() -> bool:
        stats = index.published.members.get("p")
        return stats is not None and stats.next_seq == 3 and stats.blocks == 3
    assert wait_until(shown, WAIT_S)
    assert feed.counters.batches >= 3


# --- on the router's event loop -----------------------------------------------------------


@pytest.fixture
def feed_loop() -> Iterator[FeedLoop]:
    loop = FeedLoop()
    try:
        yield loop
    finally:
        loop.close()


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def connected(engine: FakeEngine, index: KvIndex) -> bool:
    """Past the slow joiner: seq 0 is published until the feed has applied it."""
    return run_until(engine, lambda: (engine.publish(0, A) or True) and next_seq(index) == 1)


def test_on_the_routers_loop_batches_apply_with_no_thread_of_the_feeds_own(
        engine, index, feed_loop):
    """The router calls `update` on its event loop: the feed runs there (no `kv-feed`
    thread to wake per batch) and a burst longer than one drain's slice is applied
    whole, a slice at a time, the loop serving other callbacks between them."""
    feed = KvFeed(index, replay_timeout_s=5.0)
    try:
        feed_loop.call(feed.update, [FeedMember("p", 1, engine.spec())])
        assert feed.on_loop
        assert "kv-feed" not in {t.name for t in threading.enumerate()}
        assert connected(engine, index)
        seen: set[int | None] = set()  # the index's next seq at each turn of the loop's
        deadline = time.monotonic() + WAIT_S

        def other_work() -> None:  # a callback of the loop's own, requeued each turn
            seen.add(next_seq(index))
            if next_seq(index) != 101 and time.monotonic() < deadline:
                feed_loop.loop.call_soon(other_work)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(feed_on_loop, "MAX_SLICE_S", 0.0)  # one batch a turn
            patch.setattr(follow, "MAX_SLICE_S", 0.0)
            feed_loop.loop.call_soon_threadsafe(other_work)
            for seq in range(1, 101):
                engine.publish(seq, [seq, seq, seq, seq])
            assert run_until(engine, lambda: next_seq(index) == 101)
        assert state(index) is IndexState.LIVE and feed.counters.bad == 0
        assert index.cached_blocks("p", 1, block_keys([100] * 4, BLOCK)) == 1
        assert any(1 < n < 101 for n in seen if n is not None)  # it ran mid-burst
    finally:
        feed.close()  # from this thread: the loop closes it


def test_a_request_drains_what_reached_the_router_before_its_choice(
        engine, index, feed_loop, monkeypatch):
    """With no tick (an hour apart), what the router's requests drain is all the index
    learns: batches and replay answers both."""
    monkeypatch.setattr(feed_on_loop, "DRAIN_INTERVAL_S", 3600.0)
    feed = KvFeed(index, replay_timeout_s=5.0)
    try:
        feed_loop.call(feed.update, [FeedMember("p", 1, engine.spec())])

        def requests_until(predicate: Callable[[], bool]) -> bool:
            return run_until(engine, lambda: feed_loop.call(feed.drain) or predicate())
        assert requests_until(lambda: state(index) is IndexState.LIVE)  # a replay answer
        assert requests_until(lambda: (engine.publish(0, A) or True)
                              and next_seq(index) == 1)
        engine.publish(1, B)
        assert requests_until(live_with(index, B))
    finally:
        feed.close()


def test_malformed_frames_on_the_loop_are_counted_and_the_loop_serves_on(
        engine, index, feed_loop):
    feed = KvFeed(index, replay_timeout_s=5.0)
    try:
        feed_loop.call(feed.update, [FeedMember("p", 1, engine.spec())])
        assert connected(engine, index)

        def garbage() -> bool:
            engine.pub.send_multipart([b"", b"\x00" * 8, b"\xc1not msgpack"])
            engine.pub.send_multipart([b"", encode_seq(1), b"\x93" + b"\xff" * 64])
            return feed.counters.bad >= 2
        assert wait_until(garbage, WAIT_S)
        assert feed_loop.call(lambda: "served") == "served"
        engine.publish(1, B)
        assert run_until(engine, live_with(index, B))
        assert feed.counters.restarts == 0
    finally:
        feed.close()


def test_a_host_name_is_resolved_off_the_loop_and_a_member_gone_meanwhile_is_not_followed(
        engine, index, feed_loop, monkeypatch):
    """Resolving a member's host name may wait for a name server: the loop must not. A
    member that left while its name was being resolved is not subscribed when the
    answer comes."""
    spec = engine.spec()
    named = msgspec.structs.replace(
        spec, endpoint=spec.endpoint.replace("127.0.0.1", "localhost"),
        replay_endpoint=spec.replay_endpoint.replace("127.0.0.1", "localhost"))
    release = threading.Event()
    resolved_on: list[str] = []
    real_resolve = follow.resolve

    def slow_resolve(address: str, allows: Callable[[str], bool]) -> str | None:
        resolved_on.append(threading.current_thread().name)
        release.wait(WAIT_S)
        return real_resolve(address, allows)
    monkeypatch.setattr(follow, "resolve", slow_resolve)
    feed = KvFeed(index, replay_timeout_s=5.0)
    try:
        feed_loop.call(feed.update, [FeedMember("p", 1, named)])
        assert wait_until(lambda: resolved_on, WAIT_S)
        assert feed_loop.call(lambda: "served") == "served"  # while the name resolves
        feed_loop.call(feed.update, [])
        release.set()
        assert wait_until(lambda: len(resolved_on) == 2, WAIT_S)
        assert feed_loop.call(lambda: dict(feed._driver.resolving)) == {}
        assert "p" not in index.members
        feed_loop.call(feed.update, [FeedMember("p", 1, named)])  # back: followed
        assert run_until(engine, lambda: state(index) is IndexState.LIVE)
        assert "feed-loop" not in resolved_on
    finally:
        feed.close()


def test_feeds_closed_on_the_loop_or_from_another_thread_leave_no_descriptor(
        engine, feed_loop):
    def cycle(i: int) -> None:
        index = KvIndex()
        feed = KvFeed(index, replay_timeout_s=5.0)
        feed_loop.call(feed.update, [FeedMember("p", 1, engine.spec())])
        assert run_until(engine, lambda: state(index) is IndexState.LIVE)
        if i % 2:
            feed_loop.call(feed.close)
        else:
            feed.close()
        feed.close()  # safe twice
        assert not index.members
    cycle(0)
    cycle(1)  # warm: lazily made pools and the loop's own descriptors
    before = descriptors()
    for i in range(6):
        cycle(i)
    assert descriptors() == before
