"""The router's KV event feed: it follows the members that publish KV events and is the
KV index's only writer (router/kv/index.py is pure; the feed is its I/O).

    router/kv/follow.py          the members' sockets and what they bring (subscribe,
                                 replay, gaps, bad input, the index's snapshot)
    router/kv/feed_on_loop.py    the feed on the caller's asyncio event loop
    router/kv/feed_on_thread.py  the feed on an IO thread of its own

The feed runs where `update` is first called from: on that caller's event loop if it
has one (the router: `update` comes from the loop's membership follower, and the router
calls `drain` as a request arrives, before its choice reads the index), otherwise on a
thread of its own (benches and tests that have no loop). It starts with the first member
to follow: a router whose fleet publishes no KV events (`kv` is the default policy) runs
no thread and opens no socket.

The policy reads the index itself (only a block size learnt from the events, for a spec
that gives none, waits for the snapshot). Should the feed itself fail, it restarts
(`pdreg_router_kv_feed_restarts`) with every member resynced, rather than leave KV-aware
pairing blind until the router restarts.

Trust: whoever can register a member can publish what it likes about its *own* cache;
that attracts traffic to it only within the load bound, and it cannot touch another
member's index.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from router.kv.feed_on_loop import FeedOnLoop, running_loop
from router.kv.feed_on_thread import FeedOnThread
from router.kv.follow import REPLAY_TIMEOUT_S, FeedCounters, FeedMember, Subscriptions
from router.kv.index import KvIndex

__all__ = ["FeedMember", "KvFeed"]


class KvFeed:
    def __init__(self, index: KvIndex, *, allows: Callable[[str], bool] = lambda a: True,
                 clock: Callable[[], float] = time.monotonic,
                 replay_timeout_s: float = REPLAY_TIMEOUT_S) -> None:
        self.index = index
        self.counters = FeedCounters()
        self._allows = allows
        self._clock = clock
        self._replay_timeout_s = replay_timeout_s
        self._driver: FeedOnLoop | FeedOnThread | None = None  # from the first member
        self._closed = False
        # `update` and `close` may come from different threads; a thread's wake is a
        # ZeroMQ socket (not thread-safe), so both use it under this lock.
        self._lock = threading.Lock()

    @property
    def on_loop(self) -> bool:
        """Whether the feed runs on an event loop (else on a thread of its own, or not
        yet: it starts with the first member to follow)."""
        return isinstance(self._driver, FeedOnLoop)

    @property
    def thread(self) -> threading.Thread | None:
        """The feed's own thread, where it runs on one."""
        return self._driver.thread if isinstance(self._driver, FeedOnThread) else None

    def _start(self) -> FeedOnLoop | FeedOnThread:
        subs = Subscriptions(self.index, self.counters, allows=self._allows,
                             clock=self._clock, replay_timeout_s=self._replay_timeout_s)
        loop = running_loop()
        return FeedOnLoop(subs, loop) if loop is not None else FeedOnThread(subs)

    def update(self, members: Iterable[FeedMember]) -> None:
        """The members to follow now (ready, with kv_events); others are dropped. From the
        event loop the feed runs on (any thread for a feed on a thread of its own)."""
        members = list(members)
        with self._lock:
            if self._closed:
                return
            if self._driver is None:
                if not members:
                    return  # nothing to follow, nothing followed yet
                self._driver = self._start()
            driver = self._driver
            if isinstance(driver, FeedOnThread):
                driver.tell(members)
                return
        if running_loop() is driver.loop:
            driver.follow(members)
        else:
            driver.loop.call_soon_threadsafe(driver.follow, members)

    def drain(self) -> None:
        """Apply what the engines sent since the last drain. The router calls it as a
        request arrives, before its choice reads the index, so the choice sees the
        batches that reached the router before the request, and no batch wakes anything
        of its own. On the event loop the feed runs on; nothing on a feed that runs on a
        thread."""
        driver = self._driver
        if isinstance(driver, FeedOnLoop) and not self._closed:
            driver.drain()

    def close(self) -> None:
        """Stop following, close every socket; safe twice, from any thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            driver = self._driver
            if isinstance(driver, FeedOnThread):
                driver.stop()
        if isinstance(driver, FeedOnLoop):
            driver.close()
        elif driver is not None:
            driver.join()
