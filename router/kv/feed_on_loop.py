"""The KV feed on the router's event loop: batches applied by a loop already awake,
several at a time, with no thread to wake per batch (~2 a request) and no GIL to hand
between threads.

The router calls `drain` as a request arrives, before its choice reads the index, and a
tick drains every DRAIN_INTERVAL_S what no request did. The loop never blocks on the
feed: every read is non-blocking, a drain stops after MAX_SLICE_S and goes on in a later
turn, after what the loop has queued, and a member's host names are resolved in the
loop's executor. A failure drops every member and, after RESTART_BACKOFF_S, follows the
last membership again (`pdreg_router_kv_feed_restarts`); none reaches the loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Final

from router.kv.follow import (
    MAX_SLICE_S,
    RESTART_BACKOFF_S,
    Endpoints,
    FeedMember,
    Subscriptions,
)

__all__ = ["FeedOnLoop", "running_loop"]

logger = logging.getLogger(__name__)

# What no request drains is drained this often: a snapshot swapped within
# PUBLISH_INTERVAL_S + this of a change (under PUBLISH_MAX_DELAY_S), replay deadlines
# met this late at most. An idle router wakes for it, 5 times a second.
DRAIN_INTERVAL_S: Final = 0.2


class FeedOnLoop:
    """Everything but `close` runs on `loop`'s thread."""

    def __init__(self, subs: Subscriptions, loop: asyncio.AbstractEventLoop) -> None:
        self._subs = subs
        self.loop = loop
        self._closed = False
        self._tick: asyncio.TimerHandle | None = loop.call_later(DRAIN_INTERVAL_S,
                                                                 self._on_tick)
        self._restart: asyncio.TimerHandle | None = None  # while a restart waits
        self._soon = False  # a drain is queued to go on with what the last one left
        self.resolving: dict[str, FeedMember] = {}  # host names resolved off the loop

    def follow(self, members: list[FeedMember]) -> None:
        if self._restart is not None:  # the restart follows the latest membership
            self._subs.wanted = {m.id: m for m in members}
            return
        self._turn(self._follow_now, members)

    def drain(self) -> None:
        """Apply what the engines sent since the last drain (MAX_SLICE_S of it at most;
        the rest in a turn of its own)."""
        self._turn(self._drain_now)

    def _on_tick(self) -> None:
        """Every DRAIN_INTERVAL_S: what no request drained (an idle router's snapshot,
        replay answers and deadlines)."""
        self._tick = self.loop.call_later(DRAIN_INTERVAL_S, self._on_tick)
        self._turn(self._drain_now)

    def _on_soon(self) -> None:
        self._soon = False
        self._turn(self._drain_now)

    def _drain_now(self) -> None:
        """Read the sockets that may have something, for MAX_SLICE_S at most; the rest
        goes on in a turn of its own, after what the loop has queued meanwhile."""
        poller = self._subs.poller
        stop_at = time.perf_counter() + MAX_SLICE_S
        spent = False
        for sock in poller.wait(0):
            if spent:
                poller.later(sock)
                continue
            self._subs.read_ready(sock)
            spent = time.perf_counter() > stop_at
        if poller.pending and not self._soon:
            self._soon = True
            self.loop.call_soon(self._on_soon)

    def _turn(self, step: Callable[..., None], *args: object) -> None:
        """One turn: `step`, then replay deadlines and the snapshot. A failure restarts
        the feed; it never reaches the loop."""
        if self._closed or self._restart is not None:
            return
        try:
            step(*args)
            self._subs.check_replay_deadlines()
            self._subs.publish()
        except Exception:  # meanwhile the router routes by load alone
            self._restart_later()

    def _restart_later(self) -> None:
        self._subs.counters.restarts += 1
        logger.exception("[kv-feed] the feed failed; restarting it in %.1fs (every member "
                         "resyncs)", RESTART_BACKOFF_S)
        try:
            self._subs.drop_all()
        except Exception:
            logger.exception("[kv-feed] dropping every member failed")
        self._restart = self.loop.call_later(RESTART_BACKOFF_S, self._restarted)

    def _restarted(self) -> None:
        self._restart = None
        self._turn(self._follow_now, list(self._subs.wanted.values()))

    # --- membership ---------------------------------------------------------------------

    def _follow_now(self, members: list[FeedMember]) -> None:
        for m in self._subs.follow(members):
            self._open(m)

    def _open(self, m: FeedMember) -> None:
        """Follow `m`: at once, or, where that would wait for a name server, once its host
        names are resolved in the loop's executor."""
        if not self._subs.needs_dns(m):
            self._subs.open(m, self._subs.resolve(m))
            return
        if self.resolving.get(m.id) == m:
            return  # already asked
        self.resolving[m.id] = m
        resolving = self.loop.run_in_executor(None, self._subs.resolve, m)
        resolving.add_done_callback(lambda done: self._turn(self._resolved, m, done))

    def _resolved(self, m: FeedMember, done: asyncio.Future[Endpoints]) -> None:
        """A member's names came back: follow it if it is still wanted as it was."""
        if self.resolving.get(m.id) is not m:
            return  # asked again since (a new record): that answer counts
        del self.resolving[m.id]
        if self._subs.wants(m):
            self._subs.open(m, done.result())

    # --- closing ------------------------------------------------------------------------

    def close(self) -> None:
        """Close on the loop's thread: here if this is it or no thread runs the loop,
        else wait (bounded) for the loop to do it. Any thread."""
        loop = self.loop
        if running_loop() is loop or not loop.is_running():
            self._release()
            return
        done = threading.Event()

        def release() -> None:
            try:
                self._release()
            finally:
                done.set()
        try:
            loop.call_soon_threadsafe(release)
        except RuntimeError:  # the loop closed meanwhile: nobody else touches the sockets
            self._release()
            return
        if not done.wait(5.0):
            logger.error("[kv-feed] the event loop did not close the feed in 5s; its "
                         "sockets are left open")

    def _release(self) -> None:
        self._closed = True
        for timer in (self._tick, self._restart):
            if timer is not None:
                timer.cancel()
        self._tick = self._restart = None
        self._subs.close()


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
