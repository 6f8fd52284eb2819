"""The KV feed's sockets and what they bring: one SUB and one replay DEALER per member,
read into the KV index (router/kv/index.py is pure; this is its I/O). Which thread
reads them, and when, is the driver's (router/kv/feed.py).

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
  bad, that member's index becomes unknown, every other member's stays.
- Reads are bounded per turn (MAX_BATCHES_PER_WAKE, MAX_BYTES_PER_WAKE, MAX_SLICE_S per
  socket): a socket not drained is marked to be read again without waiting.

After a turn the driver publishes the index's snapshot (`publish`) for the members it
touched, which the reporter, /v1/kv and /metrics read: at most every
PUBLISH_INTERVAL_S, within PUBLISH_MAX_DELAY_S of a change, so a burst of batches swaps
it once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import msgspec
import zmq

from router.kv.index import Applied, KvIndex, MemberIndex
from router.kv.sockets import Readiness, needs_dns, raise_fd_limit, recv_frames, resolve
from wire.kv_events import REPLAY_END, decode_batch, decode_seq, encode_seq
from wire.protocol import KvEventsSpec

__all__ = ["FeedCounters", "FeedMember", "Subscriptions"]

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_S: Final = 2.0  # a replay socket silent this long cannot fill the gap
# One batch is one scheduler step's events: its token ids (~5 bytes each in msgpack)
# and block hashes. 2 MiB holds a 400k-token step; vLLM's steps are max_num_batched_tokens
# (thousands to tens of thousands) or, without chunked prefill, one prompt.
MAX_MESSAGE_BYTES: Final = 2 * 1024 * 1024
MAX_SOCKETS: Final = 32_768  # per feed: 16k members (bench/bench_kv_scale.py ran 1,000)
# Batches queued per member socket (ZeroMQ counts messages, not bytes): with the size cap,
# at most 256 MiB per member while the feed is behind it. A busy engine sends ~100
# batches a second and the feed reads 256 a turn; one dropped is a gap, replayed.
SUB_HWM: Final = 128
RESTART_BACKOFF_S: Final = 1.0  # before a failed feed starts again (either driver)
MAX_BATCHES_PER_WAKE: Final = 256  # per socket, so one busy member cannot starve others
MAX_BYTES_PER_WAKE: Final = 4 * 1024 * 1024  # nor one sending large batches
# A socket's reads stop after this long and go on later (on the event loop, after what
# it has queued): the interpreter's switch interval, as long as a feed thread could hold
# the GIL before the loop ran again. Not shorter: what a drain leaves is not in the index
# for the choice it was made for (an 8k-token request's batches cost the feed ~1 ms).
MAX_SLICE_S: Final = 0.005
_POLLIN: Final = int(zmq.POLLIN)  # a plain int: pyzmq's Flag costs Python calls to `&`
# The snapshot other threads read is swapped in by a turn at most this often (a swap per
# batch was a seventh of a wake's work), and one left waiting by a turn of its own within
# PUBLISH_MAX_DELAY_S (a timer wake per deferred swap would cost more than it saves).
PUBLISH_INTERVAL_S: Final = 0.1
PUBLISH_MAX_DELAY_S: Final = 0.5


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
    """Plain ints the feed bumps and /metrics reads (a torn read is one count off)."""

    def __init__(self) -> None:
        self.batches = self.events = self.bad = self.refused = 0
        self.overflows = 0  # members declared unknown for bytes held behind a gap
        self.restarts = 0  # times the feed failed and started again


Endpoints = tuple[str | None, str | None]  # a member's endpoint and replay, resolved


class Subscriptions:
    """Every member's sockets, read into the index. Not thread-safe: one driver owns it."""

    def __init__(self, index: KvIndex, counters: FeedCounters, *,
                 allows: Callable[[str], bool], clock: Callable[[], float],
                 replay_timeout_s: float) -> None:
        self.index = index
        self.counters = counters
        self._allows = allows
        self._clock = clock
        self._replay_timeout_s = replay_timeout_s
        self._subs: dict[str, _Subscription] = {}
        self.wanted: dict[str, FeedMember] = {}  # the last membership, for a restart
        self._awaiting: dict[str, _Subscription] = {}  # replay deadline set
        self._published_at = 0.0  # monotonic time of the last snapshot swapped in
        self._by_socket: dict[zmq.Socket, _Subscription] = {}
        self.ctx = zmq.Context()
        # Two sockets per member: ZeroMQ's default cap (1,023 sockets) would stop at ~500
        # members, and each socket holds file descriptors (its mailbox, its connection).
        self.ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
        raise_fd_limit()
        self.poller = Readiness()

    def close(self) -> None:
        """Every member's sockets, then the context (a driver's own sockets first)."""
        self.drop_all()
        self.poller.close()
        self.ctx.term()

    # --- membership ---------------------------------------------------------------------

    def follow(self, members: list[FeedMember]) -> list[FeedMember]:
        """Drop the members gone or changed; returns those to `open` (after `resolve`)."""
        wanted = self.wanted = {m.id: m for m in members}
        for member_id, sub in list(self._subs.items()):
            m = wanted.get(member_id)
            if m is None or m.incarnation != sub.member.incarnation or m.kv != sub.member.kv:
                self._drop(member_id)
        self.index.retain(self._subs)
        return [m for member_id, m in wanted.items() if member_id not in self._subs]

    def wants(self, m: FeedMember) -> bool:
        """`m` is still wanted as it was, and not followed yet (its names came back)."""
        return self.wanted.get(m.id) == m and m.id not in self._subs

    @staticmethod
    def needs_dns(m: FeedMember) -> bool:
        """Resolving `m`'s endpoints may wait for a name server."""
        return needs_dns(m.kv.endpoint) \
            or (bool(m.kv.replay_endpoint) and needs_dns(m.kv.replay_endpoint))

    def resolve(self, m: FeedMember) -> Endpoints:
        """Its endpoint and replay endpoint as the upstream policy allows them (None:
        refused, or none). Any thread: it touches no socket."""
        endpoint = resolve(m.kv.endpoint, self._allows)
        replay = resolve(m.kv.replay_endpoint, self._allows) if m.kv.replay_endpoint else None
        return endpoint, replay

    def open(self, m: FeedMember, endpoints: Endpoints) -> None:
        endpoint, replay = endpoints
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
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.RCVHWM, SUB_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, m.kv.topic.encode())
        sub.connect(endpoint)
        dealer = self._dealer(replay) if replay is not None else None
        state = _Subscription(m, index, sub, dealer, replay=replay or "")
        self._subs[m.id] = state
        self._by_socket[sub] = state
        self.poller.register(sub)
        if dealer is not None:
            self._by_socket[dealer] = state
            self.poller.register(dealer)
        logger.info("[kv-feed] subscribed %s (incarnation %d) at %s", m.id, m.incarnation,
                    endpoint)
        self._ask_replay(state, index.start_sync())

    def _dealer(self, address: str) -> zmq.Socket:
        dealer = self.ctx.socket(zmq.DEALER)
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
        self.poller.unregister(state.dealer)
        self._by_socket.pop(state.dealer, None)
        state.dealer.close(linger=0)
        state.dealer = self._dealer(state.replay)
        self._by_socket[state.dealer] = state
        self.poller.register(state.dealer)

    def drop_all(self) -> None:
        for member_id in list(self._subs):
            self._drop(member_id)
        self.index.publish()

    def _drop(self, member_id: str) -> None:
        state = self._subs.pop(member_id, None)
        self._awaiting.pop(member_id, None)
        self.index.forget(member_id)
        if state is None:
            return
        for sock in (state.sub, state.dealer):
            if sock is not None:
                self.poller.unregister(sock)
                self._by_socket.pop(sock, None)
                sock.close(linger=0)
        logger.info("[kv-feed] dropped %s (incarnation %d)", member_id,
                    state.member.incarnation)

    # --- a turn -------------------------------------------------------------------------

    def read_ready(self, sock: zmq.Socket) -> None:
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
            raise  # the sockets themselves: the driver starts afresh
        except Exception as exc:  # one member's bad input costs that member only
            self._distrust(sub, exc)

    def publish(self) -> None:
        """Swap in the index's snapshot if PUBLISH_INTERVAL_S passed since the last swap;
        else leave it to a later turn (the driver's, by PUBLISH_MAX_DELAY_S)."""
        now = time.monotonic()
        if now >= self._published_at + PUBLISH_INTERVAL_S:
            self.index.publish()
            self._published_at = now

    def next_turn_ms(self) -> int | None:
        """Until the first replay deadline, or the snapshot's next swap if one waits."""
        timeouts = []
        if self.index.unpublished:
            due = self._published_at + PUBLISH_MAX_DELAY_S - time.monotonic()
            timeouts.append(max(0, int(1000 * due) + 1))
        if self._awaiting:
            first = min(s.replay_deadline for s in self._awaiting.values())
            timeouts.append(max(0, int(1000 * (first - self._clock())) + 1))
        return min(timeouts) if timeouts else None

    def check_replay_deadlines(self) -> None:
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
                self.poller.later(sock)

    def _read_sub(self, state: _Subscription) -> None:
        sub = state.sub
        read = 0
        stop_at = time.perf_counter() + MAX_SLICE_S
        for _ in range(MAX_BATCHES_PER_WAKE):
            # A turn usually brings one batch: read it, then ask the socket whether another
            # waits (cheaper than pyzmq's Again, which only a turn with none pays).
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
        self.poller.later(sub)  # not drained: its edge will not fire again

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
            self.poller.later(state.dealer)  # not drained

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
        self.poller.later(state.dealer)  # a send may consume the socket's read edge
        self._deadline(state, self._clock() + self._replay_timeout_s)

    def _deadline(self, state: _Subscription, at: float) -> None:
        """Set (or with 0, clear) a member's replay deadline; `_awaiting` holds those set,
        so a turn costs nothing per member that is not replaying (1,000 are followed)."""
        state.replay_deadline = at
        if at:
            self._awaiting[state.member.id] = state
        else:
            self._awaiting.pop(state.member.id, None)
