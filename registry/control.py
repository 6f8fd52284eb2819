"""The control channel: the registry loop's ROUTER side. Loop thread only.

Per message: frame -> decode -> admission (token, version, spec) or session proof ->
one `Membership` transition -> one reply (a batch's replies leave together, after it). A
refusal is counted by kind, logged at most every REJECT_LOG_EVERY_S, and answered with
REJECTED; it never touches a member.

Messages are dispatched by their exact Struct type (`_handlers`): a type without a
handler is refused, never taken for another. A Sync is answered with a snapshot encoded
once per (models, version) and sent as the same bytes to every requester (`SnapshotCache`).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

import msgspec
import zmq
import zmq.backend

from registry import sessions
from registry.kv_reports import KvReports
from registry.membership import OK, Membership, Outcome
from registry.metrics import LoopStats
from registry.outcome import Refusal, refused
from registry.ratelimit import SyncLimiter
from wire.limits import MAX_MESSAGE_BYTES, NO_PROOF
from wire.protocol import (
    PROTOCOL_VERSION,
    BannedBye,
    Bye,
    ControlMessage,
    Heartbeat,
    KvIndexReport,
    Register,
    Reply,
    ReplyStatus,
    Report,
    Snapshot,
    Sync,
    make_encoder,
)
from wire.validation import validate_spec

logger = logging.getLogger(__name__)

BATCH_MAX_MESSAGES: Final = 1024  # control messages handled between two ticks
_NOBLOCK: Final = int(zmq.NOBLOCK)
_MORE: Final = int(zmq.SNDMORE | zmq.NOBLOCK)
_RCVMORE: Final = int(zmq.RCVMORE)
# The backend's methods, without pyzmq's Python layer (routing-id and group handling,
# option-name lookups): ~1 us a message on the loop's hottest path.
_zmq_recv: Final = zmq.backend.Socket.recv
_zmq_send: Final = zmq.backend.Socket.send
_zmq_get: Final = zmq.backend.Socket.get
_ZERO_COPY_BYTES: Final = 64 * 1024  # below this a copy is cheaper than the bookkeeping
REJECT_LOG_EVERY_S: Final = 5.0
# A cached snapshot is re-encoded when membership changed, or when it is older than this
# (its loads age; digests only carry changes after it).
SNAPSHOT_MAX_AGE_S: Final = 0.5
# ... except that encoding may take at most about 1/SNAPSHOT_REUSE_FACTOR of the loop: a
# snapshot that took E seconds to encode is served for SNAPSHOT_REUSE_FACTOR * E (at most
# SNAPSHOT_REUSE_MAX_S) even if membership moved on meanwhile. A view that subscribed
# before it was encoded applies the events after it; one that did not sees a version
# gap and asks again. At 100k members an encoding takes ~0.1-0.3 s; at 1k, ~1 ms.
SNAPSHOT_REUSE_FACTOR: Final = 10.0
SNAPSHOT_REUSE_MAX_S: Final = 2.0
SNAPSHOT_CACHE_ENTRIES: Final = 64  # model sets remembered (least recently used dropped)

_Handler = Callable[[bytes, ControlMessage, bytes, float], "Outcome | None"]


class ControlChannel:
    def __init__(self, sock: zmq.Socket, membership: Membership, stats: LoopStats, *,
                 epoch: int, token: str, admin_token: str = "",
                 syncs_need_token: bool = False) -> None:
        self.sock = sock
        self.membership = membership
        self.stats = stats
        self.epoch = epoch
        # Each of `token` and `admin_token` may hold several tokens, one per line: all
        # are accepted (old and new, while they rotate).
        tokens = sessions.token_lines(token)
        self._token_keys = [sessions.token_key(t) for t in tokens]
        # Beyond loopback, snapshots go only to holders of a fleet or admin token.
        readers = (*tokens, *sessions.token_lines(admin_token))
        self._sync_keys = [sessions.token_key(t) for t in readers] \
            if syncs_need_token and tokens else []
        self.events_port = 0  # announced in replies, set once bound
        self.http_port = 0
        self._encoder = make_encoder()
        self._syncs = SyncLimiter()
        self._snapshots = SnapshotCache()
        # One handler per message type: returns the outcome to reply with, or None when
        # it answered itself (a Sync gets a snapshot, not a Reply).
        self._handlers: dict[type, _Handler] = {
            Heartbeat: self._on_heartbeat,
            Register: self._on_register,
            Bye: self._on_bye,
            BannedBye: self._on_banned_bye,
            Report: self._on_report,
            Sync: self._on_sync,
            KvIndexReport: self._on_kv_index_report,
        }
        self.kv_reports = KvReports()  # what routers' KV indexes say; shown, never acted on
        self._ok_reply: tuple[float, bytes] = (0.0, b"")  # (interval, encoded OK reply)
        self._replies: list[tuple[bytes, bytes, bool]] = []  # (identity, payload, copy)
        # Called after a message that made membership events (the server publishes them),
        # so an event leaves at once, not after the rest of a batch of up to
        # BATCH_MAX_MESSAGES (~30 ms of heartbeats at 100k members).
        self.on_events: Callable[[], None] = _nothing
        self._last_reject_log = 0.0
        self._rejects_unlogged = 0

    def process(self, now: float, decoder: msgspec.msgpack.Decoder[ControlMessage]) -> int:
        """Handle what is queued, at most BATCH_MAX_MESSAGES (then the loop ticks); how
        many were handled. The replies go out together after the batch (see `_send`)."""
        sock = self.sock
        handled = 0
        try:
            for handled in range(1, BATCH_MAX_MESSAGES + 1):
                try:
                    identity = _zmq_recv(sock, _NOBLOCK)
                except zmq.Again:
                    return handled - 1
                # A ROUTER hands over [identity, frame, ...] whole: the next frame is there.
                payload = _zmq_recv(sock, _NOBLOCK)
                if _zmq_get(sock, _RCVMORE):
                    self._reject(identity, Refusal.FRAMES,
                                 f"expected 1 frame, got {self._discard_rest() + 1}")
                    continue
                if len(payload) > MAX_MESSAGE_BYTES:
                    self._reject(identity, Refusal.OVERSIZED,
                                 f"message of {len(payload)} bytes; limit {MAX_MESSAGE_BYTES}")
                    continue
                try:
                    message = decoder.decode(payload)
                except msgspec.ValidationError as exc:
                    self._reject(identity, Refusal.INVALID, str(exc))
                    continue
                except msgspec.DecodeError as exc:
                    self._reject(identity, Refusal.MALFORMED, str(exc))
                    continue
                self._handle(identity, message, payload, now)
                self._flush_events()
            return handled
        finally:
            self.flush_replies()

    def _discard_rest(self) -> int:
        """Receive the rest of a multipart message; how many frames that was."""
        frames = 1
        while _zmq_get(self.sock, _RCVMORE):
            _zmq_recv(self.sock, _NOBLOCK)
            frames += 1
        return frames

    def _flush_events(self) -> None:
        if self.membership.has_events:
            self.on_events()

    def _handle(self, identity: bytes, message: ControlMessage, payload: bytes,
                 now: float) -> None:
        handler = self._handlers.get(type(message))
        if handler is None:  # decodable, but nothing here serves it: never guess
            self._reject(identity, Refusal.UNHANDLED,
                         f"no handler for {type(message).__name__} messages")
            return
        outcome = handler(identity, message, payload, now)
        if outcome is None:
            return
        if outcome.status is ReplyStatus.REJECTED:
            about = message.spec.id if type(message) is Register else message.id
            self._reject(identity, Refusal(outcome.kind), outcome.reason, about,
                         banned_s=outcome.banned_s)
            return
        self._reply(identity, outcome)

    def _on_heartbeat(self, identity: bytes, message: Heartbeat, payload: bytes,
                      now: float) -> Outcome:
        self.stats.heartbeats += 1
        outcome = self.membership.heartbeat(message, payload, now)
        if outcome.status is not ReplyStatus.OK:  # (DRAIN is an accepted heartbeat)
            self.stats.count_heartbeat_result(outcome.status)
        return outcome

    def _on_register(self, identity: bytes, message: Register, payload: bytes,
                     now: float) -> Outcome | None:
        outcome, key = self._register(message, now)
        self.stats.count_registration(outcome)
        if outcome.session and key:
            self._reply_sealed(identity, outcome, message.nonce, key)
            return None
        return outcome

    def _on_bye(self, identity: bytes, message: Bye, payload: bytes, now: float) -> Outcome:
        return self.membership.bye(message, payload)

    def _on_banned_bye(self, identity: bytes, message: BannedBye, payload: bytes,
                       now: float) -> Outcome:
        return self.membership.banned_bye(message, payload, now)

    def _on_report(self, identity: bytes, message: Report, payload: bytes,
                   now: float) -> Outcome:
        outcome = self.membership.report(message, payload, now)
        self.stats.count_report(outcome)
        return outcome

    def _on_kv_index_report(self, identity: bytes, message: KvIndexReport, payload: bytes,
                            now: float) -> Outcome:
        """A router's KV index per member (registry.kv_reports): shown by /v1/members and
        the dashboard; it changes no member, version or event."""
        membership = self.membership
        refusal = membership.authenticate_router(message.id, message.incarnation, message.seq,
                                                 payload, message.proof)
        if refusal is not None:
            self.stats.kv_reports[refusal.kind or refusal.status.name.lower()] += 1
            return refusal
        kv = self.kv_reports
        interval = membership.timing.heartbeat_interval_s
        wait_s = kv.admit(message.id, message.incarnation, now, interval)
        if wait_s > 0:
            self.stats.kv_reports["limited"] += 1
            return refused(f"one KV index report per {interval:g}s; retry in {wait_s:.2f}s",
                           Refusal.RATE)
        applied = kv.apply(message.id, message.entries, self._kv_incarnation, now)
        kv.sweep(now, self._kv_incarnation, self._router_incarnation)
        self.stats.count_kv_report(applied, kv.held)
        return OK

    def _kv_incarnation(self, member_id: str) -> int | None:
        spec = self.membership.spec_of(member_id)
        return spec.incarnation if spec is not None and spec.kv_events is not None else None

    def _router_incarnation(self, member_id: str) -> int | None:
        spec = self.membership.spec_of(member_id)
        return spec.incarnation if spec is not None else None

    def _on_sync(self, identity: bytes, message: Sync, payload: bytes, now: float) -> None:
        self._send_snapshot(identity, message, now)

    def _register(self, message: Register, now: float) -> tuple[Outcome, bytes]:
        """The outcome, and the key of the fleet token the Register proved (b"" without
        tokens): the reply's session is sealed with that same one."""
        key = b""
        if self._token_keys:
            # The token never travels: a Register proves it (see registry.sessions). One
            # sent in clear is refused too, so no client keeps leaking it.
            if message.token:
                return refused("bad or missing token (a token sent in clear is refused: "
                               "the Register's proof carries it)", Refusal.TOKEN), key
            key = self._proved_with(message)
            if not key:
                return refused("bad or missing token", Refusal.TOKEN), key
        if message.protocol_version != PROTOCOL_VERSION:
            return refused(f"protocol version {message.protocol_version}; this registry "
                           f"speaks {PROTOCOL_VERSION}", Refusal.VERSION), key
        problem = validate_spec(message.spec)
        if problem is not None:
            return refused(problem, Refusal.INVALID), key
        return self.membership.register(message.spec, message.state, message.load, now,
                                        nonce=message.nonce), key

    def _proved_with(self, message: Register) -> bytes:
        """The token key whose proof `message` carries, or b"". Every key is tried, so
        which one matched is not timed."""
        unsealed = self._encoder.encode(msgspec.structs.replace(message, proof=NO_PROOF))
        matched = b""
        for key in self._token_keys:
            if hmac.compare_digest(sessions.register_proof(key, unsealed), message.proof):
                matched = key
        return matched

    def _send_snapshot(self, identity: bytes, sync: Sync, now: float) -> None:
        if sync.protocol_version != PROTOCOL_VERSION:
            self._reject(identity, Refusal.VERSION, f"protocol version {sync.protocol_version}; "
                         f"this registry speaks {PROTOCOL_VERSION}")
            return
        if self._sync_keys and not self._sync_proved(sync):
            self._reject(identity, Refusal.TOKEN, "snapshots need the fleet token (a Sync proved "
                         "with it: MembershipView(token=...), pdreg --token-file)")
            return
        # Charged before encoding, on an estimate from the records it will hold: peers
        # asking for many different model sets (each a fresh encoding) from fresh
        # connections still cannot make the loop encode more than the byte budget.
        estimate = self.membership.count(sync.models) * self._snapshots.bytes_per_record
        wait_s = self._syncs.wait_s(identity, estimate, now)
        if wait_s > 0:
            self._reject(identity, Refusal.RATE, f"too many syncs; retry in {wait_s:.2f}s")
            return
        encoded = self._snapshots.get(self, sync.models, now)
        self.stats.syncs += 1
        self.stats.sync_bytes += len(encoded)
        self._send(identity, encoded, copy=len(encoded) < _ZERO_COPY_BYTES)

    def encode_snapshot(self, models: tuple[str, ...]) -> bytes:
        membership = self.membership
        snapshot = Snapshot(epoch=self.epoch, version=membership.version,
                            members=membership.records(models),
                            heartbeat_interval_s=membership.timing.heartbeat_interval_s,
                            events_port=self.events_port, http_port=self.http_port)
        self.stats.snapshots_encoded += 1
        return self._encoder.encode(snapshot)

    def _sync_proved(self, sync: Sync) -> bool:
        unsealed = self._encoder.encode(msgspec.structs.replace(sync, proof=NO_PROOF))
        matched = False
        for key in self._sync_keys:  # every key, so which one matched is not timed
            matched |= hmac.compare_digest(sessions.sync_proof(key, unsealed), sync.proof)
        return matched

    def _reply(self, identity: bytes, outcome: Outcome) -> None:
        interval = self.membership.timing.heartbeat_interval_s
        if outcome is OK and self._ok_reply[0] == interval:
            # The hot path: nearly every reply is this one, so encode it once.
            self._send(identity, self._ok_reply[1])
            return
        reply = Reply(status=outcome.status, epoch=self.epoch, heartbeat_interval_s=interval,
                      reason=outcome.reason, events_port=self.events_port,
                      http_port=self.http_port, session=outcome.session,
                      drain=outcome.drain, banned_s=outcome.banned_s)
        payload = self._encoder.encode(reply)
        if outcome is OK:
            self._ok_reply = (interval, payload)
        self._send(identity, payload)

    def _reply_sealed(self, identity: bytes, outcome: Outcome, nonce: bytes,
                      key: bytes) -> None:
        """An accepted Register's reply, its session sealed with the fleet token: whoever
        replays the Register gets bytes it cannot open."""
        salt = sessions.new_salt()
        reply = Reply(status=outcome.status, epoch=self.epoch,
                      heartbeat_interval_s=self.membership.timing.heartbeat_interval_s,
                      reason=outcome.reason, events_port=self.events_port,
                      http_port=self.http_port, session_salt=salt,
                      session=sessions.seal_session(key, nonce, salt,
                                                    outcome.session),
                      drain=outcome.drain)
        self._send(identity, self._encoder.encode(reply))

    def _reject(self, identity: bytes, reason: Refusal, detail: str, about: str = "", *,
                banned_s: float = 0.0) -> None:
        """Count, log (rate limited) and answer a refusal."""
        self.stats.count_rejection(reason)
        now = time.monotonic()
        if now - self._last_reject_log > REJECT_LOG_EVERY_S:
            suppressed, self._rejects_unlogged = self._rejects_unlogged, 0
            self._last_reject_log = now
            logger.warning("[registry] rejected message reason=%s%s: %s%s", reason,
                           f" id={about!r}" if about else "", detail[:200],
                           f" ({suppressed} more since the last such line)" if suppressed
                           else "")
        else:
            self._rejects_unlogged += 1
        self._reply(identity, Outcome(ReplyStatus.REJECTED, f"{reason}: {detail}"[:500],
                                      banned_s=banned_s))

    def _send(self, identity: bytes, payload: bytes, *, copy: bool = True) -> None:
        """Queue a reply; `flush_replies` sends the batch's replies together."""
        self._replies.append((identity, payload, copy))

    def flush_replies(self) -> None:
        """Send the queued replies, in order (a peer's replies keep its requests' order).

        Together rather than one per message: a reply to an idle connection costs libzmq a
        command to its I/O thread and a wake-up, and replies sent back to back share one
        (with registry.coalesce, ~20 replies a burst at 20,000 heartbeats/s). Two plain
        sends of the
        backend's `send` cost ~1 us less than `send_multipart` for a small reply (pyzmq
        copies small frames anyway); a snapshot goes zero-copy: every requester's frame
        shares the one encoded buffer.
        """
        replies, self._replies = self._replies, []
        sock = self.sock
        for identity, payload, copy in replies:
            try:
                _zmq_send(sock, identity, _MORE)
                _zmq_send(sock, payload, _NOBLOCK, copy)
            except zmq.Again:
                self.stats.replies_dropped += 1  # that peer stopped reading; it will retry


def _nothing() -> None:
    pass


class SnapshotCache:
    """Encoded snapshots per model set: encoded once per membership version (and at most
    SNAPSHOT_MAX_AGE_S old, as loads age), then the same bytes for every requester."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        # models -> (version, encoded at, seconds it may be served whatever the version,
        # bytes)
        self._held: OrderedDict[tuple[str, ...], tuple[int, float, float, bytes]] = (
            OrderedDict())
        self._clock = clock  # measures encoding time only
        self.bytes_per_record = 256  # learned from each encoding, for the limiter's estimate

    def get(self, channel: ControlChannel, models: list[str], now: float) -> bytes:
        key = tuple(sorted(set(models)))
        version = channel.membership.version
        held = self._held.get(key)
        if held is not None:
            held_version, encoded_at, reuse_s, encoded = held
            age = now - encoded_at
            if age < reuse_s or (held_version == version and age < SNAPSHOT_MAX_AGE_S):
                self._held.move_to_end(key)
                return encoded
        started = self._clock()
        encoded = channel.encode_snapshot(key)
        records = channel.membership.count(key)
        if records:
            self.bytes_per_record = max(64, len(encoded) // records)
        reuse_s = min(SNAPSHOT_REUSE_MAX_S, SNAPSHOT_REUSE_FACTOR * (self._clock() - started))
        self._held[key] = (version, now, reuse_s, encoded)
        self._held.move_to_end(key)
        while len(self._held) > SNAPSHOT_CACHE_ENTRIES:
            self._held.popitem(last=False)
        return encoded
