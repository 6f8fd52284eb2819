"""`Agent`: what an engine embeds to be a member of the fleet.

A background thread owns one ZeroMQ DEALER per registry and runs a small loop per
registry link: register, heartbeat at the interval the registry dictates, re-register at
once on UNKNOWN (the registry restarted), give up on STALE or REJECTED, and back off with
jitter while a registry does not answer. The caller's thread never touches a socket:
`set_state` and `stop` only set fields and wake the loop through a pipe, so a slow or
absent registry can never block the engine.

Wire: one frame each way (see registry.protocol). A link has at most one request in
flight, so a reply always answers the last request sent on that link; when a reply is
late the DEALER is closed and recreated, because a lost peer would otherwise leave
queued requests whose replies arrive out of step (ZeroMQ Guide ch. 4, "Lazy Pirate").
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq

from registry.client import parse_registries
from registry.protocol import (
    MAX_MESSAGE_BYTES,
    Bye,
    ByeReason,
    Heartbeat,
    Load,
    MemberSpec,
    MemberState,
    Register,
    Reply,
    ReplyStatus,
    Role,
    make_encoder,
    reply_decoder,
    role_name,
    validate_spec,
)

__all__ = [
    "Agent", "default_member_id", "new_incarnation", "wait_for_idle",
]

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0  # until the registry's first reply says otherwise
MIN_HEARTBEAT_INTERVAL_S = 0.01  # guards against a registry dictating a busy loop
MAX_HEARTBEAT_INTERVAL_S = 60.0
MIN_REPLY_TIMEOUT_S = 0.5  # a reply later than this means the registry is unreachable
MAX_REPLY_TIMEOUT_S = 5.0
REPLY_TIMEOUT_INTERVALS = 2.0  # ... or later than this many heartbeat intervals
BACKOFF_BASE_S = 0.1  # first retry after an unanswered request
BACKOFF_MAX_S = 3.0  # exponential backoff is capped here (jitter keeps half to all of it)
BYE_TIMEOUT_S = 0.5  # stop() waits this long for registries to acknowledge bye
MAX_POLL_S = 1.0  # the loop never polls longer than this, even with nothing due
DRAIN_POLL_S = 0.05  # how often drain() asks in_flight()
DRAIN_QUIET_S = 0.5  # in_flight() must read 0 this long before a drain is done
THREAD_JOIN_MARGIN_S = 2.0
LOOP_ERROR_PAUSE_S = 0.1  # after an unexpected error, so a persistent one cannot spin


def default_member_id(role: Role, advertise_host: str, port: int) -> str:
    """The stable id of a serving endpoint: several instances per host differ by port."""
    return f"{role_name(role)}-{advertise_host}-{port}"


def new_incarnation() -> int:
    """A new incarnation per process start: a newer process gets a larger number."""
    return time.time_ns()



class LinkPhase(enum.Enum):
    REGISTERING = "registering"  # next request is a Register
    HEARTBEATING = "heartbeating"  # registered; next request is a Heartbeat
    GAVE_UP = "gave_up"  # STALE or REJECTED: this registry will not take us


class ShutdownState(enum.Enum):
    RUNNING = "running"
    REQUESTED = "requested"  # stop() was called; the loop says bye and exits
    STOPPED = "stopped"


@dataclass
class _Link:
    """One registry as the agent's loop sees it. Touched only by the loop thread."""

    address: str
    socket: zmq.Socket | None = None
    phase: LinkPhase = LinkPhase.REGISTERING
    in_flight_since: float | None = None  # monotonic send time of the unanswered request
    in_flight_state: MemberState | None = None  # the state that request announced
    next_send_at: float = 0.0  # monotonic
    interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    failures: int = 0  # consecutive unanswered requests
    registered: bool = False  # the last reply was OK
    seq: int = 0

    @property
    def reply_timeout_s(self) -> float:
        return min(MAX_REPLY_TIMEOUT_S,
                   max(MIN_REPLY_TIMEOUT_S, REPLY_TIMEOUT_INTERVALS * self.interval_s))


def wait_for_idle(in_flight: Callable[[], int], timeout_s: float, member_id: str,
                  quiet_s: float = DRAIN_QUIET_S) -> bool:
    """Wait until in_flight() has read 0 for `quiet_s` in a row, or timeout_s passes.

    The quiet period covers requests a router sent just before it saw DRAINING, and
    requests an engine's HTTP server holds before its scheduler counts them. Returns
    whether the work drained (idle at the deadline counts). A raising in_flight() counts
    as "not yet" (logged once).
    """
    deadline = time.monotonic() + max(0.0, timeout_s)
    pause = threading.Event()
    failed = False
    idle_since: float | None = None
    while True:
        try:
            busy = int(in_flight()) > 0
        except Exception:
            if not failed:
                logger.exception("[agent] drain id=%s: in_flight() failed", member_id)
            failed = True
            busy = True
        now = time.monotonic()
        idle_since = None if busy else (idle_since if idle_since is not None else now)
        if idle_since is not None and now - idle_since >= quiet_s:
            logger.info("[agent] drain id=%s done", member_id)
            return True
        if now >= deadline:
            if idle_since is not None:
                return True
            logger.warning("[agent] drain id=%s timed out after %.1fs", member_id, timeout_s)
            return False
        pause.wait(DRAIN_POLL_S)


def backoff_delay_s(failures: int, rng: random.Random) -> float:
    """Exponential backoff with 'equal jitter': half the step fixed, half random."""
    step = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** max(0, failures - 1))
    return step / 2 + rng.uniform(0, step / 2)


class Agent:
    """Registers `spec` with every registry and heartbeats until stopped.

    Thread-safe front, background thread behind: every public method returns at once
    (except `drain`, which waits for the caller's own in-flight work, and `stop`, which
    waits at most `BYE_TIMEOUT_S` plus a margin).
    """

    def __init__(self, spec: MemberSpec, *, registries: str | Sequence[str] | None = None,
                 load: Callable[[], Load] = Load, token: str = "",
                 state: MemberState = MemberState.JOINING) -> None:
        # Check the spec the way the registry will, so a mistake fails here with a clear
        # message instead of as a REJECTED reply in a log.
        try:
            spec = msgspec.convert(msgspec.to_builtins(spec), MemberSpec)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid member spec: {exc}") from None
        problem = validate_spec(spec)
        if problem:
            raise ValueError(f"invalid member spec: {problem}")
        self._spec = spec
        self._addresses = parse_registries(registries)
        self._load_fn = load
        self._token = token
        self._state = MemberState(state)
        self._bye_reason = ByeReason.SHUTDOWN
        self._shutdown = ShutdownState.RUNNING
        self._last_good_load = Load()
        self._load_failed = False  # log a failing callback once per failure streak
        self._links = [_Link(address) for address in self._addresses]
        self._thread: threading.Thread | None = None
        self._stop_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._rng = random.Random()

    # --- public front ---------------------------------------------------------------

    @property
    def spec(self) -> MemberSpec:
        return self._spec

    @property
    def state(self) -> MemberState:
        return self._state

    @property
    def registries(self) -> list[str]:
        return list(self._addresses)

    @property
    def registered(self) -> bool:
        """The last reply of at least one registry was OK."""
        return any(link.registered for link in self._links)

    @property
    def heartbeat_interval_s(self) -> float:
        """The shortest interval any registry dictated (the default before any reply)."""
        return min(link.interval_s for link in self._links)

    def start(self) -> Agent:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(
            target=self._run, name=f"pdreg-agent-{self._spec.id}", daemon=True)
        self._thread.start()
        logger.info("[agent] start id=%s incarnation=%d role=%s registries=%s",
                    self._spec.id, self._spec.incarnation, role_name(self._spec.role),
                    ",".join(self._addresses))
        return self

    def set_state(self, state: MemberState) -> None:
        """Announce a new state; the loop sends a heartbeat right away."""
        state = MemberState(state)
        if state is self._state:
            return
        logger.info("[agent] state id=%s %s -> %s", self._spec.id,
                    self._state.name.lower(), state.name.lower())
        self._state = state
        self._wake()

    def drain(self, in_flight: Callable[[], int], timeout_s: float) -> bool:
        """DRAINING, wait until in_flight() is 0 or timeout_s passes, then bye.

        Returns whether the work drained. A raising in_flight() counts as "not yet".
        """
        self.set_state(MemberState.DRAINING)
        drained = wait_for_idle(in_flight, timeout_s, self._spec.id)
        self.stop(ByeReason.SHUTDOWN)
        return drained

    def stop(self, reason: ByeReason = ByeReason.SHUTDOWN) -> None:
        """Say bye to every registry (skipping those that do not answer quickly) and close.

        Safe to call more than once; only the first call's reason is sent.
        """
        with self._stop_lock:
            if self._shutdown is not ShutdownState.RUNNING:
                return
            self._bye_reason = ByeReason(reason)
            self._shutdown = ShutdownState.REQUESTED
        thread = self._thread
        if thread is None:
            self._shutdown = ShutdownState.STOPPED
            self._close_pipe()
            return
        self._wake()
        thread.join(BYE_TIMEOUT_S + THREAD_JOIN_MARGIN_S)
        if thread.is_alive():
            logger.warning("[agent] stop id=%s: loop thread did not exit in time", self._spec.id)
        else:
            self._close_pipe()

    def __enter__(self) -> Agent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- loop (background thread) ---------------------------------------------------

    def _run(self) -> None:
        context = zmq.Context()
        encoder = make_encoder()
        decoder = reply_decoder()  # one decoder per thread
        pause = threading.Event()
        try:
            while self._shutdown is ShutdownState.RUNNING:
                try:
                    plan = self._send_due(context, encoder)
                    self._receive(plan, decoder)
                except Exception:
                    # One bad step never kills the loop (nor the engine): log, breathe, go on.
                    logger.exception("[agent] loop step failed id=%s; continuing",
                                     self._spec.id)
                    pause.wait(LOOP_ERROR_PAUSE_S)
            self._say_bye(context, encoder, decoder)
        except Exception:
            logger.exception("[agent] bye id=%s failed", self._spec.id)
        finally:
            for link in self._links:
                self._close_socket(link)
                link.registered = False
            context.term()
            self._shutdown = ShutdownState.STOPPED

    def _send_due(self, context: zmq.Context,
                  encoder: msgspec.msgpack.Encoder) -> _PollPlan:
        """Time out late requests, send what is due, and plan the next poll."""
        now = time.monotonic()
        plan = _PollPlan(timeout_s=MAX_POLL_S)
        load: Load | None = None
        for link in self._links:
            if link.phase is LinkPhase.GAVE_UP:
                continue
            if link.in_flight_since is not None:
                late_at = link.in_flight_since + link.reply_timeout_s
                if now >= late_at:
                    self._on_no_reply(link, now)
                else:
                    plan.watch(link, late_at - now)
                    continue
            # A state change is announced at once rather than at the next interval.
            state_changed = link.registered and link.in_flight_state is not self._state
            if now < link.next_send_at and not (state_changed and link.failures == 0):
                plan.wait_until(link.next_send_at - now)
                continue
            if load is None:
                load = self._read_load()  # once per round, shared by every due link
            self._send(context, encoder, link, now, load)
            plan.watch(link, link.reply_timeout_s)
        return plan

    def _receive(self, plan: _PollPlan, decoder: msgspec.msgpack.Decoder) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        for link in plan.links:
            if link.socket is not None:
                poller.register(link.socket, zmq.POLLIN)
        events = dict(poller.poll(max(0.0, plan.timeout_s) * 1000))
        if self._wake_r in events:
            self._drain_pipe()
        for link in plan.links:
            if link.socket is not None and link.socket in events:
                self._on_frames(link, link.socket.recv_multipart(zmq.NOBLOCK), decoder)

    def _send(self, context: zmq.Context, encoder: msgspec.msgpack.Encoder, link: _Link,
              now: float, load: Load | None) -> None:
        state = self._state
        if link.phase is LinkPhase.REGISTERING:
            message: Register | Heartbeat = Register(
                spec=self._spec, state=state, load=load or self._last_good_load,
                token=self._token)
        else:
            link.seq += 1
            message = Heartbeat(id=self._spec.id, incarnation=self._spec.incarnation,
                                seq=link.seq, state=state, load=load or self._last_good_load)
        if link.socket is None:
            link.socket = self._open_socket(context, link.address)
        # A full queue counts as unanswered: the socket is recreated when the reply is late.
        with contextlib.suppress(zmq.Again):
            link.socket.send(encoder.encode(message), zmq.NOBLOCK)
        link.in_flight_since = now
        link.in_flight_state = state

    def _on_frames(self, link: _Link, frames: list[bytes],
                   decoder: msgspec.msgpack.Decoder) -> None:
        sent_state = link.in_flight_state
        link.in_flight_since = None
        try:
            reply = decoder.decode(frames[-1])
        except (msgspec.DecodeError, IndexError) as exc:
            logger.warning("[agent] bad reply from %s: %s", link.address, exc)
            link.next_send_at = time.monotonic() + link.interval_s
            return
        if not isinstance(reply, Reply):
            logger.warning("[agent] unexpected %s from %s", type(reply).__name__, link.address)
            return
        self._on_reply(link, reply, sent_state)

    def _on_reply(self, link: _Link, reply: Reply, sent_state: MemberState | None) -> None:
        now = time.monotonic()
        if link.failures:
            logger.info("[agent] registry %s answers again after %d unanswered requests",
                        link.address, link.failures)
            link.failures = 0
        link.interval_s = min(MAX_HEARTBEAT_INTERVAL_S,
                              max(MIN_HEARTBEAT_INTERVAL_S, reply.heartbeat_interval_s))
        if reply.status is ReplyStatus.OK:
            if link.phase is LinkPhase.REGISTERING:
                logger.info("[agent] registered id=%s at %s state=%s interval=%.2fs",
                            self._spec.id, link.address,
                            sent_state.name.lower() if sent_state else "?", link.interval_s)
            link.phase = LinkPhase.HEARTBEATING
            link.registered = True
            link.next_send_at = now + link.interval_s
        elif reply.status is ReplyStatus.UNKNOWN:
            # The registry restarted (or expired us): register again right away.
            logger.info("[agent] registry %s does not know id=%s; registering again",
                        link.address, self._spec.id)
            link.phase = LinkPhase.REGISTERING
            link.registered = False
            link.next_send_at = now
        else:
            # STALE: a newer incarnation of this id exists, so this process is superseded.
            # REJECTED: bad token or invalid spec; retrying would only repeat it.
            logger.error("[agent] registry %s refused id=%s incarnation=%d: %s %s; "
                         "no more heartbeats to it", link.address, self._spec.id,
                         self._spec.incarnation, reply.status.name, reply.reason)
            link.phase = LinkPhase.GAVE_UP
            link.registered = False

    def _on_no_reply(self, link: _Link, now: float) -> None:
        link.failures += 1
        delay = backoff_delay_s(link.failures, self._rng)
        log = logger.warning if link.failures == 1 else logger.debug
        log("[agent] no reply from registry %s in %.1fs (attempt %d); retrying in %.2fs",
            link.address, link.reply_timeout_s, link.failures, delay)
        # Fresh socket: the old one may hold queued requests for a lost peer.
        self._close_socket(link)
        link.in_flight_since = None
        link.registered = False
        link.next_send_at = now + delay

    def _say_bye(self, context: zmq.Context, encoder: msgspec.msgpack.Encoder,
                 decoder: msgspec.msgpack.Decoder) -> None:
        bye = encoder.encode(Bye(id=self._spec.id, incarnation=self._spec.incarnation,
                                 reason=self._bye_reason))
        waiting: dict[zmq.Socket, int] = {}  # socket -> replies still expected
        for link in self._links:
            if link.phase is LinkPhase.GAVE_UP or not (link.registered or link.socket):
                continue
            if link.socket is None:
                link.socket = self._open_socket(context, link.address)
            try:
                link.socket.send(bye, zmq.NOBLOCK)
            except zmq.Again:
                continue
            waiting[link.socket] = 2 if link.in_flight_since is not None else 1
        deadline = time.monotonic() + BYE_TIMEOUT_S
        poller = zmq.Poller()
        for sock in waiting:
            poller.register(sock, zmq.POLLIN)
        while waiting:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                break
            for sock, _ in poller.poll(remaining_s * 1000):
                sock.recv_multipart(zmq.NOBLOCK)
                waiting[sock] -= 1
                if waiting[sock] == 0:
                    del waiting[sock]
                    poller.unregister(sock)
        skipped = [link.address for link in self._links if link.socket in waiting]
        logger.info("[agent] bye id=%s reason=%s%s", self._spec.id,
                    self._bye_reason.name.lower(),
                    f" (no answer from {','.join(skipped)})" if skipped else "")

    # --- helpers --------------------------------------------------------------------

    def _read_load(self) -> Load:
        """The callback's load, validated; the last good one if it raises or is invalid."""
        try:
            load = self._load_fn()
            # Struct constructors do not check constraints; the registry's decoder does,
            # so an out-of-range figure would get the whole heartbeat refused.
            load = msgspec.convert(msgspec.to_builtins(load), Load)
        except Exception as exc:
            if not self._load_failed:
                logger.warning("[agent] load callback failed (%s: %s); sending the last "
                               "good load", type(exc).__name__, exc)
            self._load_failed = True
            return self._last_good_load
        self._load_failed = False
        self._last_good_load = load
        return load

    @staticmethod
    def _open_socket(context: zmq.Context, address: str) -> zmq.Socket:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.connect(f"tcp://{address}")
        return sock

    @staticmethod
    def _close_socket(link: _Link) -> None:
        if link.socket is not None:
            link.socket.close(linger=0)
            link.socket = None

    def _wake(self) -> None:
        # A full pipe means a wake-up is pending anyway; a closed one means we stopped.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _drain_pipe(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self._wake_r, 4096)

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class _PollPlan:
    """What the next poll waits for: links with a request in flight, and a timeout."""

    timeout_s: float
    links: list[_Link] = field(default_factory=list)

    def watch(self, link: _Link, timeout_s: float) -> None:
        self.links.append(link)
        self.wait_until(timeout_s)

    def wait_until(self, timeout_s: float) -> None:
        self.timeout_s = min(self.timeout_s, max(0.0, timeout_s))
