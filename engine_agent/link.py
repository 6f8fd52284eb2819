"""One registry as an agent's loop sees it: what to send next, and what a reply means.

A link has at most one request in flight, so a reply always answers the last request sent
on it; when a reply is late the DEALER is closed and recreated, because a lost peer would
otherwise leave queued requests whose replies arrive out of step (ZeroMQ Guide ch. 4,
"Lazy Pirate"). Touched only by the agent's loop thread.

Session: the registry's reply to an accepted Register carries the member's session
secret. Heartbeats, reports and the bye are sealed with it (their last field, `proof`)
and numbered with a `seq` that only grows, so no one else can speak for this member.
"""

from __future__ import annotations

import enum
import functools
import logging
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Final

import msgspec
import zmq

from engine_agent.backoff import backoff_delay_s
from registry import sessions
from registry.detector import HEARTBEAT_INTERVAL_S
from registry.security import ClientCurve
from wire.limits import MAX_MESSAGE_BYTES
from wire.protocol import (
    MAX_KV_ENTRIES,
    BannedBye,
    Bye,
    ByeReason,
    Heartbeat,
    KvIndexEntry,
    KvIndexReport,
    Load,
    MemberSpec,
    MemberState,
    Register,
    Reply,
    ReplyStatus,
    Report,
)

logger = logging.getLogger(__name__)

# Until the registry's first reply says otherwise: the registry's own default.
DEFAULT_HEARTBEAT_INTERVAL_S: Final = HEARTBEAT_INTERVAL_S
MIN_HEARTBEAT_INTERVAL_S: Final = 0.01  # guards against a registry dictating a busy loop
MAX_HEARTBEAT_INTERVAL_S: Final = 60.0
MIN_REPLY_TIMEOUT_S: Final = 0.5  # a reply later than this means the registry is unreachable
MAX_REPLY_TIMEOUT_S: Final = 5.0
REPLY_TIMEOUT_INTERVALS: Final = 2.0  # ... or later than this many heartbeat intervals
MAX_PENDING_REPORTS: Final = 64  # per registry; the oldest go first when more pile up

# KV index reports (a router's; see router/kv/reporter.py): a message's entries are cut
# at this size (~300 entries of 22-character ids, well inside MAX_MESSAGE_BYTES), which
# with one report per interval bounds what a router costs the registry's loop even when
# it restates every member (it started, or the registry did). At most
# MAX_PENDING_KV_ENTRIES wait per registry (newest per member kept; beyond that the
# oldest members' go first).
KV_REPORT_MAX_BYTES: Final = 16 * 1024
KV_ENTRY_OVERHEAD_BYTES: Final = 32  # msgpack of an entry, beyond its member id
MAX_PENDING_KV_ENTRIES: Final = 65536

PendingReport = tuple[str, int, str]  # (member id, its incarnation, problem)


class LinkPhase(enum.Enum):
    REGISTERING = "registering"  # next request is a Register
    HEARTBEATING = "heartbeating"  # registered; next request is a Heartbeat (or a report)


class Request(enum.Enum):
    """What the request in flight was: its reply means different things."""

    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    REPORT = "report"
    KV_REPORT = "kv_report"


@dataclass
class Link:
    address: str
    member_id: str  # for log lines
    nonce: bytes = field(default_factory=sessions.new_nonce)  # for this process's life
    socket: zmq.Socket | None = None
    phase: LinkPhase = LinkPhase.REGISTERING
    in_flight: Request | None = None
    in_flight_since: float | None = None  # monotonic send time of the unanswered request
    in_flight_state: MemberState | None = None  # the state that request announced
    next_send_at: float = 0.0  # monotonic
    interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    failures: int = 0  # consecutive unanswered requests
    registered: bool = False  # the last reply was OK
    session: bytes = b""
    seq: int = 0
    refusals: int = 0  # consecutive refused Registers (logged loudly only the first time)
    _token: str = ""  # the fleet token the last Register was proved with
    reports: deque[PendingReport] = field(
        default_factory=lambda: deque(maxlen=MAX_PENDING_REPORTS))
    # KV index entries to send, newest per member (the registry takes one report per
    # interval: `kv_next_at`); a refused or lost one is healed by the rolling refresh.
    kv_pending: dict[str, KvIndexEntry] = field(default_factory=dict)
    kv_next_at: float = 0.0  # monotonic
    kv_refusals: int = 0  # consecutive refused KV reports (logged loudly only the first)

    def add_kv(self, entries: list[KvIndexEntry]) -> None:
        pending = self.kv_pending
        for entry in entries:
            pending[entry.member_id] = entry  # an update keeps its place in the queue
        while len(pending) > MAX_PENDING_KV_ENTRIES:
            del pending[next(iter(pending))]

    def kv_due(self, now: float) -> bool:
        return bool(self.kv_pending) and now >= self.kv_next_at

    @property
    def reply_timeout_s(self) -> float:
        return min(MAX_REPLY_TIMEOUT_S,
                   max(MIN_REPLY_TIMEOUT_S, REPLY_TIMEOUT_INTERVALS * self.interval_s))

    @property
    def idle(self) -> bool:
        return self.in_flight_since is None

    # --- requests ----------------------------------------------------------------------

    def request(self, spec: MemberSpec, token: str, state: MemberState, load: Load,
                encoder: msgspec.msgpack.Encoder, now: float = 0.0) -> list[bytes]:
        """The next request's frames: a Register, a queued Report, a KV index report that
        is due (`now`), or a Heartbeat."""
        if self.phase is LinkPhase.REGISTERING:
            self.in_flight = Request.REGISTER
            register = Register(spec=spec, nonce=self.nonce, state=state, load=load)
            if token:
                # The token never travels: the Register carries a proof made with it.
                proof = sessions.register_proof(_token_key(token), encoder.encode(register))
                register = msgspec.structs.replace(register, proof=proof)
                self._token = token
            return [encoder.encode(register)]
        self.seq += 1
        if self.reports:
            member, incarnation, problem = self.reports.popleft()
            self.in_flight = Request.REPORT
            return self._signed(encoder, Report(
                id=spec.id, incarnation=spec.incarnation, seq=self.seq, member=member,
                member_incarnation=incarnation, problem=problem))
        if self.kv_due(now):
            self.in_flight = Request.KV_REPORT
            self.kv_next_at = now + self.interval_s
            return self._signed(encoder, KvIndexReport(
                id=spec.id, incarnation=spec.incarnation, seq=self.seq,
                entries=self._take_kv()))
        self.in_flight = Request.HEARTBEAT
        return self._signed(encoder, Heartbeat(id=spec.id, incarnation=spec.incarnation,
                                               seq=self.seq, state=state, load=load))

    def _take_kv(self) -> list[KvIndexEntry]:
        """The oldest pending entries that fit one message."""
        pending, taken, size = self.kv_pending, [], 0
        for member_id in pending:
            size += len(member_id) + KV_ENTRY_OVERHEAD_BYTES
            if size > KV_REPORT_MAX_BYTES or len(taken) == MAX_KV_ENTRIES:
                break
            taken.append(member_id)
        return [pending.pop(member_id) for member_id in taken]

    def bye(self, spec: MemberSpec, reason: ByeReason,
            encoder: msgspec.msgpack.Encoder) -> list[bytes]:
        self.seq += 1
        return self._signed(encoder, Bye(id=spec.id, incarnation=spec.incarnation,
                                         seq=self.seq, reason=reason))

    def banned_bye(self, spec: MemberSpec, ban_s: float,
                   encoder: msgspec.msgpack.Encoder) -> list[bytes]:
        """The bye of a member an operator banned: this registry holds the ban too."""
        self.seq += 1
        return self._signed(encoder, BannedBye(id=spec.id, incarnation=spec.incarnation,
                                               seq=self.seq, ban_s=ban_s))

    def _signed(self, encoder: msgspec.msgpack.Encoder, message: object) -> list[bytes]:
        return [sessions.seal(self.session, encoder.encode(message))]

    # --- replies -----------------------------------------------------------------------

    def on_reply(self, reply: Reply, now: float, rng: random.Random) -> None:
        sent, sent_state = self.in_flight, self.in_flight_state
        self.in_flight = None
        self.in_flight_since = None
        if self.failures:
            logger.info("[agent] registry %s answers again after %d unanswered requests",
                        self.address, self.failures)
            self.failures = 0
        self.interval_s = min(MAX_HEARTBEAT_INTERVAL_S,
                              max(MIN_HEARTBEAT_INTERVAL_S, reply.heartbeat_interval_s))
        status = reply.status
        if status is ReplyStatus.OK:
            self._on_ok(reply, sent, sent_state, now)
        elif status is ReplyStatus.UNKNOWN:
            # The registry restarted (or expired us): register again right away.
            logger.info("[agent] registry %s does not know id=%s; registering again",
                        self.address, self.member_id)
            self._register_again(now)
        elif status is ReplyStatus.STALE or sent is Request.REGISTER:
            # STALE: the registry holds a newer incarnation of this id. It may be an
            # impostor's, or ours after a partition; either way this process still
            # serves, so it keeps asking (the id comes back once the other one leaves).
            # A refused Register (token, ban, cap, an id still held by a live process):
            # the cause may pass (a token rotated, a ban or lease ran out). So register
            # again, backing off to BACKOFF_MAX_S, and say so loudly once per streak.
            self.refusals += 1
            log = logger.error if self.refusals == 1 else logger.debug
            log("[agent] registry %s refused id=%s: %s %s; registering again with backoff",
                self.address, self.member_id, status.name, reply.reason)
            self._register_again(now + backoff_delay_s(self.refusals, rng))
        elif sent is Request.REPORT:
            logger.warning("[agent] registry %s refused a report from id=%s: %s",
                           self.address, self.member_id, reply.reason)
        elif sent is Request.KV_REPORT:
            # Its entries are lost; the reporter's rolling refresh sends them again.
            self.kv_refusals += 1
            log = logger.warning if self.kv_refusals == 1 else logger.debug
            log("[agent] registry %s refused a KV index report from id=%s: %s",
                self.address, self.member_id, reply.reason)
        else:
            # A refused heartbeat: our session is not what the registry holds. Take a
            # session again (the nonce proves the registration is ours), not too fast.
            self.failures += 1
            logger.error("[agent] registry %s refused a heartbeat of id=%s: %s; registering "
                         "again", self.address, self.member_id, reply.reason)
            self._register_again(now + backoff_delay_s(self.failures, rng))

    def _on_ok(self, reply: Reply, sent: Request | None, sent_state: MemberState | None,
               now: float) -> None:
        if sent is Request.REPORT:
            return  # accepted (or about a member the registry no longer holds)
        if sent is Request.KV_REPORT:
            self.kv_refusals = 0
            return
        if sent is Request.REGISTER:
            self.session = reply.session
            if reply.session_salt:  # sealed with the fleet token
                self.session = sessions.open_session(_token_key(self._token), self.nonce,
                                                     reply.session_salt, reply.session)
            self.refusals = 0
            logger.info("[agent] registered id=%s at %s state=%s interval=%.2fs",
                        self.member_id, self.address,
                        sent_state.name.lower() if sent_state else "?", self.interval_s)
        self.phase = LinkPhase.HEARTBEATING
        self.registered = True
        self.next_send_at = now + self.interval_s

    def on_no_reply(self, now: float, rng: random.Random) -> None:
        self.failures += 1
        delay = backoff_delay_s(self.failures, rng)
        log = logger.warning if self.failures == 1 else logger.debug
        log("[agent] no reply from registry %s in %.1fs (attempt %d); retrying in %.2fs",
            self.address, self.reply_timeout_s, self.failures, delay)
        # Fresh socket: the old one may hold queued requests for a lost peer.
        self.close_socket()
        self.in_flight = None
        self.in_flight_since = None
        self.registered = False
        self.next_send_at = now + delay

    def _register_again(self, at: float) -> None:
        self.phase = LinkPhase.REGISTERING
        self.registered = False
        self.next_send_at = at

    # --- socket ------------------------------------------------------------------------

    def open_socket(self, context: zmq.Context, curve: ClientCurve | None) -> zmq.Socket:
        if self.socket is None:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            if curve is not None:
                curve.apply(sock)
            sock.connect(f"tcp://{self.address}")
            self.socket = sock
        return self.socket

    def close_socket(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
            self.socket = None


@functools.lru_cache(maxsize=4)
def _token_key(token: str) -> bytes:
    return sessions.token_key(token)


@dataclass
class PollPlan:
    """What the next poll waits for: links with a request in flight, and a timeout."""

    timeout_s: float
    links: list[Link] = field(default_factory=list)

    def watch(self, link: Link, timeout_s: float) -> None:
        self.links.append(link)
        self.wait_until(timeout_s)

    def wait_until(self, timeout_s: float) -> None:
        self.timeout_s = min(self.timeout_s, max(0.0, timeout_s))
