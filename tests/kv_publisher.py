"""A test-owned KV event publisher over real ZeroMQ sockets: a PUB and a replay ROUTER
the test drives (which seqs go out, which are lost, whether replays are answered); and
the router's KV feed made to run as the router runs it (on its uvloop event loop) or on
a thread of its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvloop
import zmq

from router.kv.feed import KvFeed
from router.kv.index import KvIndex
from router.kv.keys import block_keys
from wire.kv_events import REPLAY_END, BlockStored, KVEventBatch, encode_batch, encode_seq
from wire.protocol import KvEventsSpec

BLOCK = 4


class FakeEngine:
    """PUB + replay ROUTER, driven by the test: `publish(seq, ...)` numbers as told."""

    def __init__(self, ctx: zmq.Context, replay: bool = True) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = ctx.socket(zmq.ROUTER) if replay else None
        if self.router is not None:
            self.router.bind("tcp://127.0.0.1:0")
        self.buffer: dict[int, bytes] = {}
        self.answer_replays = True

    def spec(self) -> KvEventsSpec:
        replay = self.router.getsockopt(zmq.LAST_ENDPOINT).decode() if self.router else ""
        return KvEventsSpec(self.pub.getsockopt(zmq.LAST_ENDPOINT).decode(), replay,
                            block_size=BLOCK)

    def batch(self, seq: int, tokens: list[int], parent: int | None = None) -> bytes:
        keys = block_keys(tokens, BLOCK)
        payload = encode_batch(KVEventBatch(1.0, [BlockStored(
            [k + 1 for k in keys], parent, tokens, BLOCK, None, "GPU", None)]))
        self.buffer[seq] = payload
        return payload

    def publish(self, seq: int, tokens: list[int], *, lose: bool = False) -> None:
        payload = self.batch(seq, tokens)
        if not lose:
            self.pub.send_multipart([b"", encode_seq(seq), payload])

    def serve_replays(self, keep_from: int = 0) -> None:
        """Answer every waiting replay request from the buffer (seq >= keep_from)."""
        assert self.router is not None
        while self.router.poll(0):
            client, _, start = self.router.recv_multipart()
            if not self.answer_replays:
                continue
            first = int.from_bytes(start, "big")
            for seq in sorted(self.buffer):
                if seq >= max(first, keep_from):
                    self.router.send_multipart([client, b"", b"", encode_seq(seq),
                                                self.buffer[seq]])
            self.router.send_multipart([client, b"", b"", REPLAY_END, b""])

    def close(self) -> None:
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)


# Where a feed runs: "loop" is the router's way (`update` called on its event loop),
# "thread" a thread of the feed's own (no loop: benches, tools).
DRIVERS = ("loop", "thread")


class FeedLoop:
    """A uvloop event loop in a daemon thread, as the router's; `call` runs a function
    on it and returns its result."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="feed-loop")
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        async def on_loop() -> Any:
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(on_loop(), self.loop).result(10.0)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        self.loop.close()


@contextmanager
def feed_maker(driver: str) -> Iterator[Callable[..., KvFeed]]:
    """`make(index, **options)` -> a KvFeed run by `driver`; closed (from the test's
    thread) after the test, before the engines' sockets. With "loop", the feed's
    `update` is called on the loop, as the router calls it."""
    loop = FeedLoop() if driver == "loop" else None
    feeds: list[KvFeed] = []

    def make(index: KvIndex, **options: Any) -> KvFeed:
        feed = KvFeed(index, **options)
        if loop is not None:
            update = feed.update
            feed.update = lambda members: loop.call(update, members)  # type: ignore[method-assign]
        feeds.append(feed)
        return feed
    try:
        yield make
    finally:
        for feed in feeds:
            feed.close()
        if loop is not None:
            loop.close()
    # Each ran where it was meant to: the loop's feeds on the loop, the others not.
    assert all(feed.on_loop == (loop is not None) for feed in feeds if feed._driver is not None)
