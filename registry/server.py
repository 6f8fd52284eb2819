"""The registry manager: a busy loop in a side thread that owns membership.

    loop thread   ROUTER (control) ─► decode ─► Membership transition ─► reply
                  timer ─► Membership.tick ─► PUB events, load digests
                  a reader's request ─► snapshot build and swap
                  above 2,000 messages/s: a 1 ms pause between turns (registry.coalesce)
                  inproc PULL (wake) ◄─ admin actions from HTTP, shutdown
    HTTP thread   uvicorn: reads `published` (an immutable snapshot swapped by reference),
                  and for /metrics `figures` (counts, copied on demand: no member walk)
    ZAP thread    with CURVE: pyzmq's authenticator admits only allowed client keys

Nothing but the loop writes membership, so there are no locks on the hot path. A bad
message costs a log line (rate limited), a counter and an error reply; it never stops
the loop and never touches a member.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from registry.coalesce import Coalescer
from registry.config import DEFAULT_MAX_MEMBERS, RegistryConfig
from registry.control import BATCH_MAX_MESSAGES, ControlChannel
from registry.fleet_stats import FleetFigures
from registry.kv_reports import KvSummary
from registry.membership import Membership, Outcome
from registry.metrics import PER_MEMBER_SERIES_MAX, LoopStats
from registry.on_demand import OnDemand
from registry.published import Published
from registry.publisher import Publisher
from registry.security import CurveServer, is_loopback
from registry.store.metrics import StoreStats
from registry.store.records import RegistryEntry
from registry.store.sync import StoreSync, open_store
from registry.store.url import parse_store_url
from registry.teardown import Teardown
from serving.lifecycle import ServingThread, ShutdownState
from wire.limits import MAX_MESSAGE_BYTES
from wire.protocol import MemberRecord, ReplyStatus, control_decoder

__all__ = ["DEFAULT_MAX_MEMBERS", "HARD_MESSAGE_CAP_BYTES", "SNAPSHOT_PERIOD_S",
           "RegistryConfig", "RegistryServer"]

logger = logging.getLogger(__name__)

DIGEST_PERIOD_S = 0.1  # coalesced load changes go out at most this often
LOOP_STOP_TIMEOUT_S = 10.0  # close() waits this long for the loop to stop
# The HTTP side's snapshot is built on demand: a reader that finds it older than the
# membership (or than SNAPSHOT_PERIOD_S, for load changes) asks the loop for a new one.
# Building costs O(members) (~5-90 ms at 100k), so with nobody reading (the usual case for
# a big fleet between dashboard visits and API reads) the loop builds none; with readers,
# builds are at least SNAPSHOT_COST_FACTOR times their own duration apart (and
# SNAPSHOT_MIN_PERIOD_S), so they take at most about a tenth of the loop. A reader waits
# for the new one (at most SNAPSHOT_WAIT_S), so it sees every change acknowledged before
# its read.
SNAPSHOT_PERIOD_S = 0.5
SNAPSHOT_MIN_PERIOD_S = 0.02
SNAPSHOT_COST_FACTOR = 10.0
SNAPSHOT_WAIT_S = 1.0
SNAPSHOT_REFRESH_SLICE = 2048  # stale records rebuilt per loop turn before a build (~2 ms)
# At start, how long the registry waits for its store to say what it holds before it
# serves anyway (an etcd that is down must not keep membership down).
STORE_START_WAIT_S = 5.0
class _HasVersion(Protocol):
    @property
    def version(self) -> int: ...


_Versioned = TypeVar("_Versioned", bound=_HasVersion)
_Result = TypeVar("_Result")
_ON_DEMAND = {"max_age_s": SNAPSHOT_PERIOD_S, "min_gap_s": SNAPSHOT_MIN_PERIOD_S,
              "cost_factor": SNAPSHOT_COST_FACTOR, "wait_s": SNAPSHOT_WAIT_S}
# /metrics reads `figures` instead: counts the membership keeps as members change, copied
# on demand by the same rules (a reader sees every change acknowledged before its read),
# at O(roles x models x heartbeat slots), not O(members), and without a snapshot.
HARD_MESSAGE_CAP_BYTES = 4 * MAX_MESSAGE_BYTES  # libzmq drops the peer beyond this
# /healthz answers 503 once the loop has not turned for this many heartbeat intervals
# (at least HEALTHZ_MIN_STALL_S): the loop wakes every tick (<= 0.1 s), so that long
# without a turn is a stuck or dead loop, and a liveness probe should restart it.
HEALTHZ_STALL_INTERVALS = 5.0
HEALTHZ_MIN_STALL_S = 5.0
_HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                       | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@dataclass(slots=True)
class _AdminRequest:
    action: Callable[[Membership, float], Any]
    done: Future[Any] = field(default_factory=Future)


class RegistryServer:
    """Owns the sockets, the loop thread and the HTTP thread. `close()` is safe twice."""

    def __init__(self, config: RegistryConfig | None = None) -> None:
        self.config = config or RegistryConfig()
        self.epoch = secrets.randbits(62)
        self.stats = LoopStats()
        self.store_url = parse_store_url(self.config.store)
        self.store_stats = StoreStats(kind=self.store_url.kind.value)
        self._store = open_store(self.store_url, self.config.store_options, self.store_stats)
        self.store: StoreSync | None = None  # set by start(), once the ports are known
        self._membership = Membership(self.epoch, self.config.detector(),
                                      limits=self.config.limits(),
                                      wall_offset=time.time() - time.monotonic(),
                                      deadband=self.config.deadband())
        self._ctx = zmq.Context(io_threads=self.config.io_threads)
        self._curve = CurveServer(self._ctx, self.config.curve) if self.config.curve else None
        # Without CURVE the same ZAP handler still limits new connections per address.
        self._zap = self._curve or CurveServer(self._ctx, None)
        self._control = self._ctx.socket(zmq.ROUTER)
        self._events = self._ctx.socket(zmq.PUB)
        wake_address = f"inproc://pdreg-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_lock = threading.Lock()  # the PUSH end's wakers; STOPPED is set under it
        self._admin: queue.SimpleQueue[_AdminRequest] = queue.SimpleQueue()
        self._state = ShutdownState.RUNNING
        self._teardown = Teardown(self._close_sockets)
        self._loop_thread: threading.Thread | None = None
        self._http: ServingThread | None = None
        self._turned_at = time.monotonic()  # the loop's last turn, for /healthz
        # What the HTTP side reads, built by the loop when a reader finds it stale.
        self._snapshot: OnDemand[Published] = OnDemand(
            Published(self.epoch, 0, (), self.config.heartbeat_interval_s,
                      self.config.lease_s, False, time.time()), **_ON_DEMAND)
        self._figures: OnDemand[FleetFigures] = OnDemand(
            self._membership.figures(time.monotonic(), PER_MEMBER_SERIES_MAX), **_ON_DEMAND)
        self._monitors: list[zmq.Socket] = []
        for sock in (self._control, self._events, self._wake_rx, self._wake_tx):
            sock.setsockopt(zmq.LINGER, 0)
        self._control.setsockopt(zmq.MAXMSGSIZE, HARD_MESSAGE_CAP_BYTES)
        self._channel = ControlChannel(self._control, self._membership, self.stats,
                                       epoch=self.epoch, token=self.config.token,
                                       admin_token=self.config.admin_token,
                                       syncs_need_token=not is_loopback(self.config.host))
        self._publisher = Publisher(self._events, self.stats, self.epoch)
        self.changes = self._publisher.changes  # what dashboard streams follow
        self._channel.kv_reports.on_changes = self._publisher.kv_changed
        self._channel.on_events = self._publish_events
        _split_io_threads(self._control, self._events, self.config.io_threads)
        for sock in (self._control, self._events):
            self._zap.secure(sock)
            if self._curve is not None:
                self._monitors.append(sock.get_monitor_socket(_HANDSHAKE_FAILURES))
        self._wake_rx.bind(wake_address)
        self._wake_tx.connect(wake_address)
        self.control_port = 0
        self.events_port = 0
        self.http_port = 0

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> RegistryServer:
        """Bind, serve HTTP and start the loop. On a started registry it does nothing: a
        second loop thread on the same sockets would make libzmq abort the process."""
        if self._loop_thread is not None:
            return self
        host = self.config.host
        self.control_port = _bind(self._control, host, self.config.port)
        self.events_port = _bind(self._events, host, self.config.events_port)
        if self.config.http_port >= 0:
            from registry.http import create_app  # FastAPI only when HTTP is wanted
            from registry.http_guard import guarded_protocol

            config = self.config
            app = create_app(self, admin_token=config.admin_token, read_token=config.token,
                             exposed=not is_loopback(host))
            # The guarded protocol: a request must arrive whole within a deadline
            # (slowloris); HTTPS when given a certificate and its key.
            self._http = ServingThread(app, host, config.http_port, name="pdreg-registry-http",
                                       runner_options={"http": guarded_protocol(),
                                                       "ssl_certfile": config.tls_cert or None,
                                                       "ssl_keyfile": config.tls_key or None},
                                       ).start()
            self.http_port = self._http.port
        self._channel.events_port, self._channel.http_port = self.events_port, self.http_port
        self._start_store()
        self._snapshot.built(self._publisher.snapshot(self._membership, time.monotonic()),
                             time.monotonic())
        self._turned_at = time.monotonic()
        self._loop_thread = threading.Thread(target=self._teardown.owning(self._run_busy_loop),
                                             name="pdreg-registry", daemon=True)
        self._loop_thread.start()
        logger.info("[registry] serving control=%s events=%d http=%s epoch=%d curve=%s "
                    "token=%s store=%s", self.control_address, self.events_port,
                    self.http_url or "off", self.epoch, "on" if self._curve else "off",
                    "on" if self.config.token else "off", self.store_url)
        return self

    def _start_store(self) -> None:
        """Start following the store, and apply what it holds before the loop takes its
        first message: a cordoned or drained member that registers at once is held as
        such from its first record. A store that does not answer within STORE_START_WAIT_S
        delays nothing further (its intents apply when it does)."""
        host = _url_host(self.config.advertised_host())
        scheme = "https" if self.config.tls_cert else "http"
        own = RegistryEntry(id=self.config.registry_id or f"{host}:{self.control_port}",
                            control=f"{host}:{self.control_port}",
                            events_port=self.events_port,
                            http=f"{scheme}://{host}:{self.http_port}" if self._http else "",
                            epoch=self.epoch, started_at=time.time())
        self.store = StoreSync(self._store, self.submit, own, self.store_stats).start()
        if not self.store.wait_loaded(STORE_START_WAIT_S):
            logger.warning("[registry] store %s did not answer within %.0fs; serving "
                           "without its intents until it does", self.store_url,
                           STORE_START_WAIT_S)
        self._process_admin(time.monotonic())  # the loop is not running yet: apply here

    def close(self) -> None:
        """Loop, HTTP, then sockets: never under a running thread (registry/teardown.py)."""
        with self._wake_lock:
            if self._state is not ShutdownState.RUNNING:
                return
            self._state = ShutdownState.REQUESTED
        logger.info("[shutdown] registry: start")
        if self.store is not None:
            self.store.close()  # first: this registry leaves the replica set at once
        self._wake()
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=LOOP_STOP_TIMEOUT_S)
        for held in (self._snapshot, self._figures):  # readers waiting for a build
            held.stop()
        if self._http is not None:
            self._http.close()
        with self._wake_lock:
            self._state = ShutdownState.STOPPED
        if not self._teardown.close(self._loop_thread, 0.0):
            logger.warning("[shutdown] registry: the loop outlived close(); it closes up")

    def _close_sockets(self) -> None:
        if self._curve is not None:
            for sock in (self._control, self._events):
                sock.disable_monitor()
        self._zap.stop()
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
        scheme = "https" if self.config.tls_cert else "http"
        return f"{scheme}://{_url_host(self.config.host)}:{self.http_port}" if self._http else ""

    # --- what other threads may call ---------------------------------------------------

    @property
    def published(self) -> Published:
        """The loop's latest snapshot; when it is behind the membership or older than
        SNAPSHOT_PERIOD_S, a new one (waiting at most SNAPSHOT_WAIT_S for the loop)."""
        return self._read(self._snapshot)

    @property
    def figures(self) -> FleetFigures:
        """The membership's counts for /metrics and /healthz, as `published` (the same
        freshness and waits) but O(roles x models) to copy: reading them never makes the
        loop build a snapshot or walk the members."""
        return self._read(self._figures)

    def _read(self, held: OnDemand[_Versioned]) -> _Versioned:
        if (self._state is not ShutdownState.RUNNING or self._loop_thread is None
                or threading.current_thread() is self._loop_thread):
            return held.value  # nobody to build a new one (or the builder asking)
        version = self._membership.version
        return held.read(lambda value: value.version == version, self._wake)

    @property
    def kv_index(self) -> Mapping[str, KvSummary]:
        """Per member, what routers report of their KV indexes (registry.kv_reports)."""
        return self._channel.kv_reports.view

    def members(self) -> dict[str, MemberRecord]:
        return {record.spec.id: record for record in self.published.members}

    def loop_stall_s(self) -> float:
        """Seconds since the loop last turned (ticks come at least every 0.1 s)."""
        return max(0.0, time.monotonic() - self._turned_at)

    def loop_stall_limit_s(self) -> float:
        """A stall longer than this makes /healthz answer 503."""
        return max(HEALTHZ_MIN_STALL_S,
                   HEALTHZ_STALL_INTERVALS * self._snapshot.value.heartbeat_interval_s)

    def submit(self, action: Callable[[Membership, float], _Result]) -> Future[_Result]:
        """Run `action(membership, now)` on the loop thread (admin actions, the store's
        changes, questions the HTTP side asks of membership)."""
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
        for monitor in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        membership = self._membership
        decoder = control_decoder()  # one typed decoder, owned by this thread
        now = time.monotonic()
        next_digest = next_pulse = now
        snapshot, figures = self._snapshot, self._figures
        coalescer = Coalescer(self.config.coalesce_s)
        while self._state is ShutdownState.RUNNING:
            handled = 0
            # 1) Poll until the next deadline (never forever). The pulse is no deadline
            # of its own: it rides on the first digest at or after it.
            deadline = min(membership.next_deadline(now), next_digest,
                           snapshot.due_at(), figures.due_at())
            # Rounded up: pyzmq truncates to whole milliseconds (a 0 would spin).
            timeout_ms = math.ceil(max(0.0, (deadline - time.monotonic()) * 1e3))
            ready = dict(poller.poll(timeout_ms))
            now = self._turned_at = time.monotonic()
            self.stats.loop_lateness_s = max(0.0, now - deadline) if not ready else 0.0
            # 2) Handle what arrived.
            try:
                if self._control in ready:
                    handled = self._channel.process(now, decoder)
                if self._wake_rx in ready:
                    self._process_admin(now)
                if self._monitors:
                    self._count_handshake_failures(ready)
                # 3) Tick the detector, then publish what changed.
                membership.tick(now)
                self.stats.lag_compensated_s = membership.last_lag_s
                self._publish_events()
                if now >= next_digest:
                    self._publisher.digests(membership, now, pulse=now >= next_pulse)
                    if now >= next_pulse:
                        next_pulse = now + membership.timing.heartbeat_interval_s
                    next_digest = now + DIGEST_PERIOD_S
                # A snapshot asked for: first the records heartbeats made stale, a slice
                # per turn (all of them at once is ~0.1 s at 100k), then the build.
                if (snapshot.wanted(now)
                        and membership.refresh_some_records(SNAPSHOT_REFRESH_SLICE) == 0):
                    started = time.monotonic()
                    self.stats.snapshot_builds.observe(
                        snapshot.built(self._publisher.snapshot(membership, now), started))
                if figures.wanted(now):
                    figures.built(membership.figures(now, PER_MEMBER_SERIES_MAX),
                                  time.monotonic())
            except Exception:
                # A bug in one step must not take membership down with it.
                self.stats.loop_errors += 1
                logger.exception("[registry] loop step failed; continuing")
            self.stats.turns.observe(time.monotonic() - now)
            pause_s = coalescer.pause_after(handled, handled >= BATCH_MAX_MESSAGES, now)
            self.stats.coalescing = coalescer.active
            if pause_s:
                time.sleep(pause_s)
        self._drain_admin_on_shutdown()

    def _publish_events(self) -> None:
        """Membership events out on the PUB socket (after each message that made some, and
        after each tick)."""
        self._publisher.events(self._membership.take_events())

    def _count_handshake_failures(self, ready: dict[zmq.Socket, int]) -> None:
        for monitor in self._monitors:
            while monitor in ready:
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.stats.handshake_failures += 1
                logger.debug("[registry] CURVE handshake failed: %s", event)

    def _process_admin(self, now: float) -> None:
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
                request.done.set_result(request.action(self._membership, now))
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

    # --- plumbing ----------------------------------------------------------------------

    def _wake(self) -> None:
        with self._wake_lock:
            if self._state is not ShutdownState.STOPPED:
                # A full pipe of wakes: the loop is woken already.
                with contextlib.suppress(zmq.Again):
                    self._wake_tx.send(b"", zmq.NOBLOCK)


def _split_io_threads(control: zmq.Socket, events: zmq.Socket, io_threads: int) -> None:
    """With two or more libzmq I/O threads, the control socket's connections get the first
    and the PUB fan-out the others (ZMQ_AFFINITY, set before bind): heartbeats coming in
    never queue behind copies of events to every router, nor the other way round."""
    if io_threads < 2:
        return
    control.setsockopt(zmq.AFFINITY, 1)
    events.setsockopt(zmq.AFFINITY, ((1 << io_threads) - 1) & ~1)


def _bind(sock: zmq.Socket, host: str, port: int) -> int:
    sock.bind(f"tcp://{_url_host(host)}:{port or '*'}")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    return int(endpoint.rsplit(":", 1)[1])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
