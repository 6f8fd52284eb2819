"""The router's KV event subscriptions: one SUB and one replay DEALER per member.

The feed owns every socket and is the KV index's only writer (router/kv/index.py is
pure; this module is its I/O). It runs where `update` is first called from:

- On that caller's asyncio event loop, if it has one (the router: `update` comes from
  the loop's membership follower). The router calls `drain` as a request arrives,
  before its choice reads the index, and a tick drains every DRAIN_INTERVAL_S what no
  request did: batches are applied by a loop already awake, several at a time, with
  no thread to wake per batch (~2 a request) and no GIL to hand between threads. The
  loop never blocks on the feed: every read is non-blocking, a drain stops after
  MAX_SLICE_S and goes on in a later turn, after what the loop has queued, and a
  member's host name is resolved in the loop's executor.
- Otherwise on an IO thread of its own (benches and tests that have no loop), told the
  membership with an inproc PUSH: it sleeps in `poll` until a batch, a replay answer, a
  membership change or a replay deadline.

After a turn the feed publishes the index's snapshot for the members it touched
(`KvIndex.publish`), which the reporter, /v1/kv and /metrics read: at most every
PUBLISH_INTERVAL_S, within PUBLISH_MAX_DELAY_S of a change, so a burst of batches swaps
it once. The policy reads the index itself (only a block size learnt from the events,
for a spec that gives none, waits for the snapshot).

- A ready member whose spec has `kv_events` is subscribed: SUB to its endpoint (its
  topic), DEALER to its replay endpoint, and a replay from seq 0 for its history.
- A member that leaves, stops being ready, or comes back as a new incarnation loses its
  sockets and its blocks at once (a new incarnation starts again from nothing).
- A gap asks a replay; a replay that does not answer within REPLAY_TIMEOUT_S, or that
  cannot fill the gap, makes the member `unknown` (the index's rules).
- Addresses are resolved here and must pass the router's upstream policy (no link-local,
  and no loopback/private networks unless allowed), as for HTTP: a member's spec cannot
  point the router's sockets anywhere the router may not send traffic. Messages are
  size-capped (MAX_MESSAGE_BYTES) and a batch that fails to decode is counted and
  dropped like a lost one (the gap logic recovers it by replay or says unknown).
- Memory per member is bounded: ZeroMQ queues at most SUB_HWM batches of at most
  MAX_MESSAGE_BYTES, and the index holds at most `--kv-gap-bytes` of batches behind a
  gap before it declares the member unknown (`pdreg_router_kv_gap_overflows`).
- A batch that fails anywhere (decode, or applying it) costs its member only: counted as
  bad, that member's index becomes unknown, every other member's stays. Should the loop
  itself fail, it restarts (`pdreg_router_kv_feed_restarts`) after RESTART_BACKOFF_S with
  every member resynced, rather than leave KV-aware pairing blind until a restart. On
  the event loop, no failure of the feed's reaches the loop.

Trust: whoever can register a member can publish what it likes about its *own* cache;
that attracts traffic to it only within the load bound, and it cannot touch another
member's index.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

import msgspec
import zmq

from router.kv.index import Applied, KvIndex, MemberIndex
from router.kv.sockets import (
    Readiness,
    needs_dns,
    raise_fd_limit,
    recv_frames,
    resolve,
)
from wire.kv_events import REPLAY_END, decode_batch, decode_seq, encode_seq
from wire.protocol import KvEventsSpec

__all__ = ["FeedMember", "KvFeed"]

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_S: Final = 2.0  # a replay socket silent this long cannot fill the gap
# One batch is one scheduler step's events: its token ids (~5 bytes each in msgpack)
# and block hashes. 2 MiB holds a 400k-token step; vLLM's steps are max_num_batched_tokens
# (thousands to tens of thousands) or, without chunked prefill, one prompt.
MAX_MESSAGE_BYTES: Final = 2 * 1024 * 1024
MAX_SOCKETS: Final = 32_768  # per feed: 16k members (bench/bench_kv_scale.py ran 1,000)
# Batches queued per member socket (ZeroMQ counts messages, not bytes): with the size cap,
# at most 256 MiB per member while the thread is behind it. A busy engine sends ~100
# batches a second and the thread reads 256 a wake; one dropped is a gap, replayed.
SUB_HWM: Final = 128
RESTART_BACKOFF_S: Final = 1.0  # before a failed feed loop starts again
MAX_BATCHES_PER_WAKE: Final = 256  # per socket, so one busy member cannot starve others
MAX_BYTES_PER_WAKE: Final = 4 * 1024 * 1024  # nor one sending large batches
# A drain's reads stop after this long and go on later, on the event loop, after what it
# has queued: the interpreter's switch interval, as long as a feed thread could hold the
# GIL before the loop ran again. Not shorter: what a drain leaves is not in the index
# for the choice it was made for (an 8k-token request's batches cost the feed ~1 ms).
MAX_SLICE_S: Final = 0.005
# On the event loop, what no request drains is drained this often: a snapshot swapped
# within PUBLISH_INTERVAL_S + this of a change (under PUBLISH_MAX_DELAY_S), replay
# deadlines met this late at most. An idle router wakes for it, 5 times a second.
DRAIN_INTERVAL_S: Final = 0.2
_POLLIN: Final = int(zmq.POLLIN)  # a plain int: pyzmq's Flag costs Python calls to `&`
# The snapshot other threads read is swapped in by a turn at most this often (a swap per
# batch was a seventh of a wake's work), and one left waiting by a wake of its own within
# PUBLISH_MAX_DELAY_S (a timer wake per deferred swap would cost more than it saves).
PUBLISH_INTERVAL_S: Final = 0.1
PUBLISH_MAX_DELAY_S: Final = 0.5
_STOP: Final = b"stop"
_UPDATE: Final = b"update"


@dataclass(frozen=True, slots=True)
class FeedMember:
    id: str
    incarnation: int
    kv: KvEventsSpec


@dataclass(slots=True)
class _Subscription:
    member: FeedMember
    index: MemberIndex
    sub: zmq.Socket
    dealer: zmq.Socket | None
    replay: str = ""  # the resolved replay address
    replay_deadline: float = 0.0  # monotonic; 0 = no replay outstanding


class FeedCounters:
    """Plain ints the thread bumps and /metrics reads (a torn read is one count off)."""

    def __init__(self) -> None:
        self.batches = self.events = self.bad = self.refused = 0
        self.overflows = 0  # members declared unknown for bytes held behind a gap
        self.restarts = 0  # times the feed loop failed and started again


class KvFeed:
    def __init__(self, index: KvIndex, *, allows: Callable[[str], bool] = lambda a: True,
                 clock: Callable[[], float] = time.monotonic,
                 replay_timeout_s: float = REPLAY_TIMEOUT_S) -> None:
        self.index = index
        self.counters = FeedCounters()
        self._allows = allows
        self._clock = clock
        self._replay_timeout_s = replay_timeout_s
        self._updates: queue.SimpleQueue[list[FeedMember]] = queue.SimpleQueue()
        self._subs: dict[str, _Subscription] = {}
        self._wanted: dict[str, FeedMember] = {}  # the last membership, for a restart
        self._awaiting: dict[str, _Subscription] = {}  # replay deadline set
        self._published_at = 0.0  # monotonic time of the last snapshot swapped in
        self._by_socket: dict[zmq.Socket, _Subscription] = {}
        self._closed = False
        # `update` and `close` may come from different threads; the PUSH end is a ZeroMQ
        # socket (not thread-safe), so both use it under this lock.
        self._wake_lock = threading.Lock()
        # Started by the first member that publishes: a router whose fleet publishes no
        # KV events (`kv` is the default policy) runs no thread and opens no socket.
        self._started = False
        self._poller: Readiness  # an epoll descriptor: made by `_start`
        self._thread: threading.Thread | None = None
        # On an event loop: the loop, its tick, a restart's timer while one waits, whether
        # a drain is queued to go on with what the last one left, and the members whose
        # host names are being resolved off the loop.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._restart: asyncio.TimerHandle | None = None
        self._soon = False
        self._resolving: dict[str, FeedMember] = {}

    @property
    def on_loop(self) -> bool:
        """Whether the feed runs on an event loop (else on a thread of its own, or not
        yet: it starts with the first member to follow)."""
        return self._loop is not None

    def _start(self) -> None:
        self._started = True
        self._ctx = zmq.Context()
        # Two sockets per member: ZeroMQ's default cap (1,023 sockets) would stop at ~500
        # members, and each socket holds file descriptors (its mailbox, its connection).
        self._ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
        raise_fd_limit()
        self._poller = Readiness()
        self._loop = _running_loop()
        if self._loop is not None:
            self._tick = self._loop.call_later(DRAIN_INTERVAL_S, self._on_tick)
            return
        inproc = f"inproc://kv-feed-{id(self)}"
        self._wake_in = self._ctx.socket(zmq.PULL)
        self._wake_in.bind(inproc)
        self._wake = self._ctx.socket(zmq.PUSH)  # the event loop's end
        self._wake.connect(inproc)
        self._poller.register(self._wake_in)
        self._thread = threading.Thread(target=self._run, name="kv-feed", daemon=True)
        self._thread.start()

    # --- the caller's side --------------------------------------------------------------

    def update(self, members: Iterable[FeedMember]) -> None:
        """The members to follow now (ready, with kv_events); others are dropped. From the
        event loop the feed runs on (any thread for a feed on a thread of its own)."""
        members = list(members)
        with self._wake_lock:
            if self._closed:
                return
            if not self._started:
                if not members:
                    return  # nothing to follow, nothing followed yet
                self._start()
            if self._loop is None:
                self._updates.put(members)
                self._wake.send(_UPDATE)
                return
        if _running_loop() is self._loop:
            self._follow(members)
        else:
            self._loop.call_soon_threadsafe(self._follow, members)

    def close(self) -> None:
        """Stop following, close every socket; safe twice, from any thread."""
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
            if not self._started:
                return
            if self._loop is None:
                self._wake.send(_STOP)
        if self._loop is not None:
            self._close_on_loop(self._loop)
            return
        assert self._thread is not None
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            logger.error("[kv-feed] the feed thread did not stop in 5s; its sockets are "
                         "left open")
            return
        self._wake.close(linger=0)  # nobody else uses it now: `update` sees `_closed`
        self._ctx.term()

    # --- on an event loop ---------------------------------------------------------------

    def _follow(self, members: list[FeedMember]) -> None:
        if self._closed:
            return
        if self._restart is not None:  # the restart follows the latest membership
            self._wanted = {m.id: m for m in members}
            return
        self._turn(self._apply_membership, members)

    def drain(self) -> None:
        """Apply what the engines sent since the last drain (MAX_SLICE_S of it at most;
        the rest in a turn of its own). The router calls it as a request arrives, before
        its choice reads the index, so the choice sees the batches that reached the
        router before the request, and no batch wakes anything of its own. On the event
        loop the feed runs on; nothing on a feed that runs on a thread."""
        if self._loop is None or self._closed or self._restart is not None:
            return
        self._turn(self._drain_now)

    def _on_tick(self) -> None:
        """Every DRAIN_INTERVAL_S: what no request drained (an idle router's snapshot,
        replay answers and deadlines)."""
        assert self._loop is not None
        self._tick = self._loop.call_later(DRAIN_INTERVAL_S, self._on_tick)
        self._turn(self._drain_now)

    def _on_soon(self) -> None:
        self._soon = False
        self._turn(self._drain_now)

    def _drain_now(self) -> None:
        """Read the sockets that may have something, for MAX_SLICE_S at most; the rest
        goes on in a turn of its own, after what the loop has queued meanwhile."""
        poller = self._poller
        stop_at = time.perf_counter() + MAX_SLICE_S
        spent = False
        for sock in poller.wait(0):
            if spent:
                poller.later(sock)
                continue
            self._read_ready(sock)
            spent = time.perf_counter() > stop_at
        if poller.pending and not self._soon:
            assert self._loop is not None
            self._soon = True
            self._loop.call_soon(self._on_soon)

    def _turn(self, step: Callable[..., None], *args: object) -> None:
        """One turn on the loop: `step`, then replay deadlines and the snapshot. A
        failure restarts the feed; it never reaches the loop."""
        if self._closed or self._restart is not None:
            return
        try:
            step(*args)
            self._check_replay_deadlines()
            self._publish()
        except Exception:  # meanwhile the router routes by load alone
            self._restart_later()

    def _restart_later(self) -> None:
        self.counters.restarts += 1
        logger.exception("[kv-feed] the feed failed; restarting it in %.1fs (every member "
                         "resyncs)", RESTART_BACKOFF_S)
        try:
            self._drop_all()
        except Exception:
            logger.exception("[kv-feed] dropping every member failed")
        assert self._loop is not None
        self._restart = self._loop.call_later(RESTART_BACKOFF_S, self._restarted)

    def _restarted(self) -> None:
        self._restart = None
        self._turn(self._apply_membership, list(self._wanted.values()))

    def _close_on_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close on the loop's thread: here if this is it or no thread runs the loop,
        else wait (bounded) for the loop to do it."""
        if _running_loop() is loop or not loop.is_running():
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
        for timer in (self._tick, self._restart):
            if timer is not None:
                timer.cancel()
        self._tick = self._restart = None
        self._drop_all()
        self._poller.close()
        self._ctx.term()

    # --- on a thread of its own ---------------------------------------------------------

    def _run(self) -> None:
        """The supervisor: serve until told to stop; a failed loop drops every member and,
        after RESTART_BACKOFF_S, follows the last membership again from scratch."""
        restarting = False
        try:
            while True:
                try:
                    if restarting:
                        self._apply_membership(list(self._wanted.values()))
                    self._serve()
                    return
                except Exception:  # meanwhile the router routes by load alone
                    self.counters.restarts += 1
                    logger.exception("[kv-feed] the feed loop failed; restarting it in "
                                     "%.1fs (every member resyncs)", RESTART_BACKOFF_S)
                    self._drop_all()
                    restarting = True
                if self._wake_in.poll(int(RESTART_BACKOFF_S * 1000)) \
                        and not self._drain_wakes():
                    return
        finally:
            self._drop_all()
            self._poller.close()
            self._wake_in.close(linger=0)

    def _serve(self) -> None:
        """The loop: wait for sockets, read them, check replay deadlines, publish."""
        poller = self._poller
        while True:
            ready = poller.wait(self._poll_timeout_ms())
            if self._wake_in in ready and not self._drain_wakes():
                return
            for sock in ready:
                self._read_ready(sock)
            self._check_replay_deadlines()
            self._publish()

    def _poll_timeout_ms(self) -> int | None:
        """Until the first replay deadline, or the snapshot's next swap if one waits."""
        timeouts = []
        if self.index.unpublished:
            due = self._published_at + PUBLISH_MAX_DELAY_S - time.monotonic()
            timeouts.append(max(0, int(1000 * due) + 1))
        if self._awaiting:
            first = min(s.replay_deadline for s in self._awaiting.values())
            timeouts.append(max(0, int(1000 * (first - self._clock())) + 1))
        return min(timeouts) if timeouts else None

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
            self._apply_membership(latest)
        return True

    # --- either way ---------------------------------------------------------------------

    def _read_ready(self, sock: zmq.Socket) -> None:
        """Read a socket that may have something (a SUB's batches, a replay's answers)."""
        sub = self._by_socket.get(sock)
        if sub is None:
            return
        self.index.touched(sub.member.id)
        try:
            if sock is sub.sub:
                self._read_sub(sub)
            else:
                self._read_replay(sub)
        except zmq.ZMQError:
            raise  # the sockets themselves: the supervisor starts afresh
        except Exception as exc:  # one member's bad input costs that member only
            self._distrust(sub, exc)

    def _publish(self) -> None:
        """Swap in the index's snapshot if PUBLISH_INTERVAL_S passed since the last swap;
        else leave it to a later turn (on a thread, `_poll_timeout_ms` wakes for it by
        PUBLISH_MAX_DELAY_S; on the loop, the tick comes within DRAIN_INTERVAL_S)."""
        now = time.monotonic()
        if now >= self._published_at + PUBLISH_INTERVAL_S:
            self.index.publish()
            self._published_at = now

    def _drop_all(self) -> None:
        for member_id in list(self._subs):
            self._drop(member_id)
        self.index.publish()

    def _distrust(self, state: _Subscription, exc: Exception) -> None:
        """A batch of this member's failed past decoding (in the index): its index
        becomes unknown; the feed and every other member carry on."""
        self.counters.bad += 1
        logger.warning("[kv-feed] %s: a batch failed (%s: %s); its index is unknown now",
                       state.member.id, type(exc).__name__, exc)
        self._deadline(state, 0.0)
        state.index.lose("a batch failed to apply")
        for sock in (state.sub, state.dealer):  # left unread: their edges will not fire
            if sock is not None:
                self._poller.later(sock)

    def _apply_membership(self, members: list[FeedMember]) -> None:
        wanted = self._wanted = {m.id: m for m in members}
        for member_id, sub in list(self._subs.items()):
            m = wanted.get(member_id)
            if m is None or m.incarnation != sub.member.incarnation or m.kv != sub.member.kv:
                self._drop(member_id)
        for member_id, m in wanted.items():
            if member_id not in self._subs:
                self._subscribe(m)
        self.index.retain(self._subs)

    def _subscribe(self, m: FeedMember) -> None:
        """Follow `m`: at once, or on an event loop whose thread must not wait for a name
        server, once its host names are resolved in the loop's executor."""
        loop = self._loop
        names = needs_dns(m.kv.endpoint) \
            or (bool(m.kv.replay_endpoint) and needs_dns(m.kv.replay_endpoint))
        if loop is None or not names:
            self._open(m, *self._resolve(m))
            return
        if self._resolving.get(m.id) == m:
            return  # already asked
        self._resolving[m.id] = m
        resolving = loop.run_in_executor(None, self._resolve, m)
        resolving.add_done_callback(lambda done: self._turn(self._resolved, m, done))

    def _resolve(self, m: FeedMember) -> tuple[str | None, str | None]:
        """Its endpoint and replay endpoint as the upstream policy allows them (None:
        refused, or none)."""
        endpoint = resolve(m.kv.endpoint, self._allows)
        replay = resolve(m.kv.replay_endpoint, self._allows) if m.kv.replay_endpoint else None
        return endpoint, replay

    def _resolved(self, m: FeedMember, done: asyncio.Future[tuple[str | None, str | None]]
                  ) -> None:
        """A member's names came back: follow it if it is still wanted as it was."""
        if self._resolving.get(m.id) is not m:
            return  # asked again since (a new record): that answer counts
        del self._resolving[m.id]
        if self._wanted.get(m.id) == m and m.id not in self._subs:
            self._open(m, *done.result())

    def _open(self, m: FeedMember, endpoint: str | None, replay: str | None) -> None:
        if endpoint is None:
            self.counters.refused += 1
            logger.warning("[kv-feed] %s: KV events endpoint %r refused by the upstream "
                           "policy or unresolvable", m.id, m.kv.endpoint)
            return
        index = self.index.track(m.id, m.incarnation)
        if index is None:  # tracked already (cannot happen after _drop); start afresh
            self.index.forget(m.id)
            index = self.index.track(m.id, m.incarnation)
            assert index is not None
        if m.kv.block_size:
            index.block_size = m.kv.block_size
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.RCVHWM, SUB_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, m.kv.topic.encode())
        sub.connect(endpoint)
        dealer = self._dealer(replay) if replay is not None else None
        state = _Subscription(m, index, sub, dealer, replay=replay or "")
        self._subs[m.id] = state
        self._by_socket[sub] = state
        self._poller.register(sub)
        if dealer is not None:
            self._by_socket[dealer] = state
            self._poller.register(dealer)
        logger.info("[kv-feed] subscribed %s (incarnation %d) at %s", m.id, m.incarnation,
                    endpoint)
        self._ask_replay(state, index.start_sync())

    def _dealer(self, address: str) -> zmq.Socket:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        dealer.setsockopt(zmq.RCVHWM, SUB_HWM)  # a replay waits (TCP), it is not dropped
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        return dealer

    def _reset_dealer(self, state: _Subscription) -> None:
        """A new replay socket after a timeout: a late answer to the old request must not
        be read as the answer to the next one."""
        if state.dealer is None:
            return
        self._poller.unregister(state.dealer)
        self._by_socket.pop(state.dealer, None)
        state.dealer.close(linger=0)
        state.dealer = self._dealer(state.replay)
        self._by_socket[state.dealer] = state
        self._poller.register(state.dealer)

    def _drop(self, member_id: str) -> None:
        state = self._subs.pop(member_id, None)
        self._awaiting.pop(member_id, None)
        self.index.forget(member_id)
        if state is None:
            return
        for sock in (state.sub, state.dealer):
            if sock is not None:
                self._poller.unregister(sock)
                self._by_socket.pop(sock, None)
                sock.close(linger=0)
        logger.info("[kv-feed] dropped %s (incarnation %d)", member_id,
                    state.member.incarnation)

    def _read_sub(self, state: _Subscription) -> None:
        sub = state.sub
        read = 0
        stop_at = time.perf_counter() + MAX_SLICE_S
        for _ in range(MAX_BATCHES_PER_WAKE):
            # A wake usually brings one batch: read it, then ask the socket whether another
            # waits (cheaper than pyzmq's Again, which only a wake with none pays).
            try:
                frames = recv_frames(sub)
            except zmq.Again:
                return
            self._on_batch(state, frames[-2:] if len(frames) >= 2 else frames)
            read += len(frames[-1])
            if read > MAX_BYTES_PER_WAKE:
                break
            if not sub.getsockopt(zmq.EVENTS) & _POLLIN:
                return
            if time.perf_counter() > stop_at:
                break
        self._poller.later(sub)  # not drained: its edge will not fire again

    def _read_replay(self, state: _Subscription) -> None:
        assert state.dealer is not None
        stop_at = time.perf_counter() + MAX_SLICE_S
        for _ in range(MAX_BATCHES_PER_WAKE):
            try:
                frames = state.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # [b"", topic, seq, payload] (vLLM 0.32) or [b"", seq, payload]: from the end.
            if len(frames) >= 2 and frames[-2] == REPLAY_END:
                self._deadline(state, 0.0)
                self._ask_replay(state, state.index.replay_done(complete=True))
            else:
                self._on_batch(state, frames[-2:] if len(frames) >= 2 else frames)
            if time.perf_counter() > stop_at:
                break
        if state.dealer is not None:
            self._poller.later(state.dealer)  # not drained

    def _on_batch(self, state: _Subscription, frames: list[bytes]) -> None:
        try:
            if len(frames) != 2:
                raise ValueError(f"{len(frames)} frames")
            seq = decode_seq(frames[0])
            if seq < 0:
                raise ValueError("negative seq")
            batch = decode_batch(frames[1])
        except (ValueError, msgspec.DecodeError) as exc:
            self.counters.bad += 1
            logger.warning("[kv-feed] %s: bad batch dropped: %s", state.member.id, exc)
            return
        self.counters.batches += 1
        self.counters.events += len(batch.events)
        self._ask_replay(state, state.index.apply(seq, batch, len(frames[1])))

    def _ask_replay(self, state: _Subscription, applied: Applied) -> None:
        if applied is Applied.OVERFLOW:  # unknown now: no replay to wait for
            self.counters.overflows += 1
            logger.warning("[kv-feed] %s: over %d bytes held behind a gap; index unknown",
                           state.member.id, state.index.max_pending_bytes)
            self._deadline(state, 0.0)
            return
        if applied is not Applied.GAP:
            return
        if state.dealer is None:  # no replay socket: the gap cannot be filled
            self._deadline(state, 0.0)
            self._ask_replay(state, state.index.replay_done(complete=False))
            return
        state.dealer.send_multipart([b"", encode_seq(state.index.replay_from)])
        self._poller.later(state.dealer)  # a send may consume the socket's read edge
        self._deadline(state, self._clock() + self._replay_timeout_s)

    def _deadline(self, state: _Subscription, at: float) -> None:
        """Set (or with 0, clear) a member's replay deadline; `_awaiting` holds those set,
        so a wake costs nothing per member that is not replaying (1,000 are followed)."""
        state.replay_deadline = at
        if at:
            self._awaiting[state.member.id] = state
        else:
            self._awaiting.pop(state.member.id, None)

    def _check_replay_deadlines(self) -> None:
        if not self._awaiting:
            return
        now = self._clock()
        for state in list(self._awaiting.values()):
            if now >= state.replay_deadline:
                self.index.touched(state.member.id)
                self._deadline(state, 0.0)
                logger.warning("[kv-feed] %s: replay timed out", state.member.id)
                self._reset_dealer(state)
                self._ask_replay(state, state.index.replay_done(complete=False))



def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
