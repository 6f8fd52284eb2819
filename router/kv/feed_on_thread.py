"""The KV feed on an IO thread of its own, where no event loop drives it (benches and
tests that have no loop). It is told the membership with an inproc PUSH and sleeps in
`poll` until a batch, a replay answer, a membership change, a replay deadline or the
snapshot's deferred swap."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Final

import zmq

from router.kv.follow import RESTART_BACKOFF_S, FeedMember, Subscriptions

__all__ = ["FeedOnThread"]

logger = logging.getLogger(__name__)

_STOP: Final = b"stop"
_UPDATE: Final = b"update"


class FeedOnThread:
    """`tell` and `stop` are the caller's (one at a time: the feed's lock); the rest runs
    on the thread, which owns the subscriptions until it ends."""

    def __init__(self, subs: Subscriptions) -> None:
        self._subs = subs
        self._updates: queue.SimpleQueue[list[FeedMember]] = queue.SimpleQueue()
        inproc = f"inproc://kv-feed-{id(self)}"
        self._wake_in = subs.ctx.socket(zmq.PULL)
        self._wake_in.bind(inproc)
        self._wake = subs.ctx.socket(zmq.PUSH)  # the caller's end
        self._wake.connect(inproc)
        subs.poller.register(self._wake_in)
        self.thread = threading.Thread(target=self._run, name="kv-feed", daemon=True)
        self.thread.start()

    def tell(self, members: list[FeedMember]) -> None:
        self._updates.put(members)
        self._wake.send(_UPDATE)

    def stop(self) -> None:
        self._wake.send(_STOP)

    def join(self) -> None:
        """After `stop`: wait for the thread, then close what it left."""
        self.thread.join(timeout=5.0)
        if self.thread.is_alive():
            logger.error("[kv-feed] the feed thread did not stop in 5s; its sockets are "
                         "left open")
            return
        self._wake.close(linger=0)  # nobody else uses it now: the feed is closed
        self._subs.ctx.term()

    def _run(self) -> None:
        """The supervisor: serve until told to stop; a failed loop drops every member and,
        after RESTART_BACKOFF_S, follows the last membership again from scratch."""
        subs = self._subs
        restarting = False
        try:
            while True:
                try:
                    if restarting:
                        self._follow(list(subs.wanted.values()))
                    self._serve()
                    return
                except Exception:  # meanwhile the router routes by load alone
                    subs.counters.restarts += 1
                    logger.exception("[kv-feed] the feed loop failed; restarting it in "
                                     "%.1fs (every member resyncs)", RESTART_BACKOFF_S)
                    subs.drop_all()
                    restarting = True
                if self._wake_in.poll(int(RESTART_BACKOFF_S * 1000)) \
                        and not self._drain_wakes():
                    return
        finally:
            subs.drop_all()
            subs.poller.close()
            self._wake_in.close(linger=0)

    def _serve(self) -> None:
        """The loop: wait for sockets, read them, check replay deadlines, publish."""
        subs = self._subs
        poller = subs.poller
        while True:
            ready = poller.wait(subs.next_turn_ms())
            if self._wake_in in ready and not self._drain_wakes():
                return
            for sock in ready:
                subs.read_ready(sock)
            subs.check_replay_deadlines()
            subs.publish()

    def _follow(self, members: list[FeedMember]) -> None:
        for m in self._subs.follow(members):
            self._subs.open(m, self._subs.resolve(m))

    def _drain_wakes(self) -> bool:
        """Apply membership updates; False when told to stop."""
        while True:
            try:
                message = self._wake_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if message == _STOP:
                return False
        latest: list[FeedMember] | None = None
        while True:
            try:
                latest = self._updates.get_nowait()
            except queue.Empty:
                break
        if latest is not None:
            self._follow(latest)
        return True
