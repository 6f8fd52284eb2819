"""The registry manager: a busy loop in a side thread that owns membership.

    loop thread   ROUTER (control) ─► decode ─► Membership transition ─► reply
                  timer ─► Membership.tick ─► PUB events, load digests, snapshot swap
                  inproc PULL (wake) ◄─ admin actions from HTTP, shutdown
    HTTP thread   uvicorn: reads `published` (an immutable snapshot swapped by reference)

Nothing but the loop writes membership, so there are no locks on the hot path. A bad
message costs a log line (rate limited), a counter and an error reply; it never stops
the loop and never touches a member.
"""

from __future__ import annotations

import enum
import hmac
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec
import zmq

from registry.detector import DetectorConfig
from registry.membership import OK, Membership, Outcome
from registry.metrics import LoopStats
from registry.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Bye,
    ControlMessage,
    Heartbeat,
    LoadDigest,
    MemberLeft,
    MemberRecord,
    MembershipEvent,
    Register,
    Reply,
    ReplyStatus,
    Report,
    Snapshot,
    Sync,
    control_decoder,
    make_encoder,
    topic_for,
    validate_spec,
)

logger = logging.getLogger(__name__)

DIGEST_PERIOD_S = 0.1  # coalesced load changes go out at most this often
SNAPSHOT_PERIOD_S = 0.5  # the HTTP snapshot picks up load changes at most this often
RECENT_EVENTS = 100  # membership events the HTTP side can show
BATCH_MAX_MESSAGES = 1024  # control messages handled between two ticks
HARD_MESSAGE_CAP_BYTES = 4 * MAX_MESSAGE_BYTES  # libzmq drops the peer beyond this
EVENTS_HWM = 100_000
REJECT_LOG_EVERY_S = 5.0
TOKEN_ENV = "PDREG_TOKEN"
ADMIN_TOKEN_ENV = "PDREG_ADMIN_TOKEN"


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    host: str = "127.0.0.1"
    port: int = 7600
    events_port: int = 7601
    http_port: int = 7680  # -1 disables HTTP
    heartbeat_interval_s: float = 1.0
    lease_s: float = 3.0
    token: str = ""  # registrations must carry it when set
    admin_token: str = ""  # drain/evict must carry it when set

    def detector(self) -> DetectorConfig:
        return DetectorConfig(heartbeat_interval_s=self.heartbeat_interval_s,
                              lease_s=self.lease_s,
                              tick_period_s=min(0.1, self.heartbeat_interval_s / 4))


@dataclass(frozen=True, slots=True)
class Published:
    """What the loop shows the HTTP side: swapped whole, never mutated."""

    epoch: int
    version: int
    members: tuple[MemberRecord, ...]
    heartbeat_interval_s: float
    lease_s: float
    self_preserving: bool
    taken_at: float  # unix time
    recent_events: tuple[MembershipEvent, ...] = ()  # newest last, for the dashboard


class ShutdownState(enum.Enum):
    RUNNING = 0
    REQUESTED = 1
    STOPPED = 2


@dataclass(slots=True)
class _AdminRequest:
    action: Callable[[Membership], Outcome]
    done: Future[Outcome] = field(default_factory=Future)


class RegistryServer:
    """Owns the sockets, the loop thread and the HTTP thread. `close()` is safe twice."""

    def __init__(self, config: RegistryConfig | None = None) -> None:
        self.config = config or RegistryConfig()
        self.epoch = secrets.randbits(62)
        self.stats = LoopStats()
        self._membership = Membership(self.epoch, self.config.detector(),
                                      wall_offset=time.time() - time.monotonic())
        self._ctx = zmq.Context()
        self._control = self._ctx.socket(zmq.ROUTER)
        self._events = self._ctx.socket(zmq.PUB)
        wake_address = f"inproc://pdreg-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_lock = threading.Lock()  # the PUSH end is shared by HTTP and close()
        self._admin: queue.SimpleQueue[_AdminRequest] = queue.SimpleQueue()
        self._state = ShutdownState.RUNNING
        self._loop_thread: threading.Thread | None = None
        self._http: _HttpThread | None = None
        self._encoder = make_encoder()
        self._published = Published(self.epoch, 0, (), self.config.heartbeat_interval_s,
                                    self.config.lease_s, False, time.time())
        self._last_reject_log = 0.0
        self._ok_reply: tuple[float, bytes] = (0.0, b"")  # (interval, encoded OK reply)
        self._recent_events: deque[MembershipEvent] = deque(maxlen=RECENT_EVENTS)
        for sock in (self._control, self._events, self._wake_rx, self._wake_tx):
            sock.setsockopt(zmq.LINGER, 0)
        self._control.setsockopt(zmq.MAXMSGSIZE, HARD_MESSAGE_CAP_BYTES)
        self._events.setsockopt(zmq.SNDHWM, EVENTS_HWM)
        self._wake_rx.bind(wake_address)
        self._wake_tx.connect(wake_address)
        self.control_port = 0
        self.events_port = 0
        self.http_port = 0

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> RegistryServer:
        host = self.config.host
        self.control_port = _bind(self._control, host, self.config.port)
        self.events_port = _bind(self._events, host, self.config.events_port)
        if self.config.http_port >= 0:
            from registry.http import create_app  # FastAPI only when HTTP is wanted

            self._http = _HttpThread(create_app(self), host, self.config.http_port)
            self.http_port = self._http.start()
        self._publish_snapshot(time.monotonic())
        self._loop_thread = threading.Thread(target=self._run_busy_loop, name="pdreg-registry",
                                             daemon=True)
        self._loop_thread.start()
        logger.info("[registry] serving control=%s events=%d http=%s epoch=%d",
                    self.control_address, self.events_port, self.http_url or "off", self.epoch)
        return self

    def close(self) -> None:
        if self._state is ShutdownState.STOPPED:
            return
        logger.info("[shutdown] registry: start")
        self._state = ShutdownState.REQUESTED
        self._wake()
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=5)
        if self._http is not None:
            self._http.stop()
        self._state = ShutdownState.STOPPED
        self._ctx.destroy(linger=0)
        logger.info("[shutdown] registry: done")

    def __enter__(self) -> RegistryServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def control_address(self) -> str:
        return f"{_url_host(self.config.host)}:{self.control_port}"

    @property
    def http_url(self) -> str:
        return f"http://{_url_host(self.config.host)}:{self.http_port}" if self._http else ""

    # --- what other threads may call ---------------------------------------------------

    @property
    def published(self) -> Published:
        return self._published

    def members(self) -> dict[str, MemberRecord]:
        return {record.spec.id: record for record in self._published.members}

    def submit(self, action: Callable[[Membership], Outcome]) -> Future[Outcome]:
        """Run `action` on the loop thread (admin actions); the future gets its outcome."""
        request = _AdminRequest(action)
        if self._state is not ShutdownState.RUNNING:
            request.done.set_result(Outcome(ReplyStatus.REJECTED, "registry shutting down"))
            return request.done
        self._admin.put(request)
        self._wake()
        return request.done

    # --- the loop ----------------------------------------------------------------------

    def _run_busy_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._control, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        membership = self._membership
        decoder = control_decoder()  # one typed decoder, owned by this thread
        now = time.monotonic()
        next_digest = next_pulse = now
        next_snapshot = now + SNAPSHOT_PERIOD_S
        while self._state is ShutdownState.RUNNING:
            # 1) Poll until the next deadline (never forever).
            deadline = min(membership.next_deadline(now), next_digest, next_pulse)
            timeout_ms = max(0.0, (deadline - time.monotonic()) * 1e3)
            ready = dict(poller.poll(timeout_ms))
            now = time.monotonic()
            self.stats.loop_lateness_s = max(0.0, now - deadline) if not ready else 0.0
            # 2) Handle what arrived.
            try:
                if self._control in ready:
                    self._process_control(now, decoder)
                if self._wake_rx in ready:
                    self._process_admin()
                # 3) Tick the detector, then publish what changed.
                membership.tick(now)
                self.stats.lag_compensated_s = membership.last_lag_s
                changed = self._publish_events(membership.take_events())
                if now >= next_digest:
                    self._publish_digests(now, pulse=now >= next_pulse)
                    if now >= next_pulse:
                        next_pulse = now + membership.timing.heartbeat_interval_s
                    next_digest = now + DIGEST_PERIOD_S
                if changed or now >= next_snapshot:
                    self._publish_snapshot(now)
                    next_snapshot = now + SNAPSHOT_PERIOD_S
            except Exception:
                # A bug in one step must not take membership down with it.
                self.stats.loop_errors += 1
                logger.exception("[registry] loop step failed; continuing")
        self._drain_admin_on_shutdown()

    def _process_control(self, now: float,
                         decoder: msgspec.msgpack.Decoder[ControlMessage]) -> None:
        for _ in range(BATCH_MAX_MESSAGES):
            try:
                frames = self._control.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._reject(frames[0], "frames", f"expected 1 frame, got {len(frames) - 1}")
                continue
            identity, payload = frames
            if len(payload) > MAX_MESSAGE_BYTES:
                self._reject(identity, "oversized",
                             f"message of {len(payload)} bytes; limit {MAX_MESSAGE_BYTES}")
                continue
            try:
                message = decoder.decode(payload)
            except msgspec.ValidationError as exc:
                self._reject(identity, "invalid", str(exc))
                continue
            except msgspec.DecodeError as exc:
                self._reject(identity, "malformed", str(exc))
                continue
            self._handle(identity, message, now)

    def _handle(self, identity: bytes, message: ControlMessage, now: float) -> None:
        membership = self._membership
        stats = self.stats
        if type(message) is Heartbeat:  # the hot path first
            stats.heartbeats += 1
            outcome = membership.heartbeat(message.id, message.incarnation, message.state,
                                           message.load, now)
            if outcome.status is not ReplyStatus.OK:
                stats.count_heartbeat_result(outcome.status)
        elif type(message) is Register:
            outcome = self._register(message, now)
            stats.count_registration(outcome)
        elif type(message) is Bye:
            outcome = membership.bye(message.id, message.incarnation, message.reason)
        elif type(message) is Report:
            stats.reports += 1
            outcome = membership.report(message.id, message.incarnation, now)
        else:  # Sync
            self._send_snapshot(identity, message)
            return
        if outcome.status is ReplyStatus.REJECTED:
            self._reject(identity, "refused", outcome.reason)
            return
        self._reply(identity, outcome)

    def _register(self, message: Register, now: float) -> Outcome:
        token = self.config.token
        if token and not hmac.compare_digest(message.token.encode(), token.encode()):
            return Outcome(ReplyStatus.REJECTED, "bad or missing token")
        if message.protocol_version != PROTOCOL_VERSION:
            return Outcome(ReplyStatus.REJECTED,
                           f"protocol version {message.protocol_version}; this registry "
                           f"speaks {PROTOCOL_VERSION}")
        problem = validate_spec(message.spec)
        if problem is not None:
            return Outcome(ReplyStatus.REJECTED, problem)
        return self._membership.register(message.spec, message.state, message.load, now)

    def _reply(self, identity: bytes, outcome: Outcome) -> None:
        interval = self._membership.timing.heartbeat_interval_s
        if outcome is OK and self._ok_reply[0] == interval:
            # The hot path: nearly every reply is this one, so encode it once.
            self._send(identity, self._ok_reply[1])
            return
        payload = self._encode_reply(outcome)
        if outcome is OK:
            self._ok_reply = (interval, payload)
        self._send(identity, payload)

    def _encode_reply(self, outcome: Outcome) -> bytes:
        reply = Reply(status=outcome.status, epoch=self.epoch,
                      heartbeat_interval_s=self._membership.timing.heartbeat_interval_s,
                      reason=outcome.reason, events_port=self.events_port,
                      http_port=self.http_port)
        return self._encoder.encode(reply)

    def _reject(self, identity: bytes, reason: str, detail: str) -> None:
        self.stats.count_rejection(reason)
        now = time.monotonic()
        if now - self._last_reject_log > REJECT_LOG_EVERY_S:
            self._last_reject_log = now
            logger.warning("[registry] rejected message reason=%s: %s", reason, detail[:200])
        self._reply(identity, Outcome(ReplyStatus.REJECTED, f"{reason}: {detail}"[:500]))

    def _send_snapshot(self, identity: bytes, sync: Sync) -> None:
        membership = self._membership
        snapshot = Snapshot(epoch=self.epoch, version=membership.version,
                            members=membership.records(sync.models),
                            heartbeat_interval_s=membership.timing.heartbeat_interval_s,
                            events_port=self.events_port, http_port=self.http_port)
        self.stats.syncs += 1
        self._send(identity, self._encoder.encode(snapshot))

    def _send(self, identity: bytes, payload: bytes) -> None:
        try:
            self._control.send_multipart((identity, payload), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.stats.replies_dropped += 1  # that peer stopped reading; it will retry

    def _process_admin(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while True:
            try:
                request = self._admin.get_nowait()
            except queue.Empty:
                return
            try:
                request.done.set_result(request.action(self._membership))
            except Exception as exc:  # an admin bug answers the caller, not the loop
                logger.exception("[registry] admin action failed")
                request.done.set_exception(exc)

    def _drain_admin_on_shutdown(self) -> None:
        while True:
            try:
                request = self._admin.get_nowait()
            except queue.Empty:
                return
            request.done.set_result(Outcome(ReplyStatus.REJECTED, "registry shutting down"))

    # --- publishing --------------------------------------------------------------------

    def _publish_events(self, events: list[MembershipEvent]) -> bool:
        encode = self._encoder.encode
        for event in events:
            model = event.model if isinstance(event, MemberLeft) else event.member.spec.model
            self._events.send_multipart((topic_for(model), encode(event)), copy=False)
            self.stats.count_event(event)
            self._recent_events.append(event)
        return bool(events)

    def _publish_digests(self, now: float, *, pulse: bool) -> None:
        membership = self._membership
        digests = membership.take_load_digests(now)
        if pulse:
            # Every model's topic hears from us each interval, changes or not, and so does
            # the empty topic: subscribers use it to see the registry is alive and current.
            for model in membership.models() | {""}:
                digests.setdefault(model, [])
        interval = membership.timing.heartbeat_interval_s
        encode = self._encoder.encode
        for model, loads in digests.items():
            digest = LoadDigest(self.epoch, membership.version, model, loads, interval)
            self._events.send_multipart((topic_for(model), encode(digest)), copy=False)
        self.stats.digests += len(digests)

    def _publish_snapshot(self, now: float) -> None:
        membership = self._membership
        self._published = Published(
            epoch=self.epoch,
            version=membership.version,
            members=tuple(membership.records()),
            heartbeat_interval_s=membership.timing.heartbeat_interval_s,
            lease_s=membership.timing.lease_s,
            self_preserving=membership.self_preserving,
            taken_at=now + membership.wall_offset,
            recent_events=tuple(self._recent_events),
        )

    # --- plumbing ----------------------------------------------------------------------

    def _wake(self) -> None:
        with self._wake_lock:
            if self._state is not ShutdownState.STOPPED:
                self._wake_tx.send(b"", zmq.NOBLOCK)


class _HttpThread:
    """uvicorn on a socket we bind ourselves, so port 0 works and the port is known."""

    def __init__(self, app: object, host: str, port: int) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(512)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]},
                                        name="pdreg-registry-http", daemon=True)

    def start(self) -> int:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError("registry HTTP did not start within 10 s")
            time.sleep(0.01)
        return self._sock.getsockname()[1]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()


def _bind(sock: zmq.Socket, host: str, port: int) -> int:
    sock.bind(f"tcp://{_url_host(host)}:{port or '*'}")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    return int(endpoint.rsplit(":", 1)[1])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def config_from_env(config: RegistryConfig) -> RegistryConfig:
    """Fill tokens from the environment when flags left them empty."""
    from dataclasses import replace

    return replace(config,
                   token=config.token or os.environ.get(TOKEN_ENV, ""),
                   admin_token=config.admin_token or os.environ.get(ADMIN_TOKEN_ENV, ""))

