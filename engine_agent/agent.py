"""`Agent`: what an engine embeds to be a member of the fleet.

A background thread owns one ZeroMQ DEALER per registry and runs a small loop per
registry link (`engine_agent.link`): register, heartbeat at the interval the registry
dictates, re-register at once on UNKNOWN (the registry restarted), re-register with
backoff on STALE or a refused registration (an impostor's incarnation or a ban does not
end this process's membership for good), and back off with jitter while a registry does
not answer. The
caller's thread never touches a ZeroMQ socket: `set_state`, `report` and `stop` only set
fields and wake the loop through a socket pair, so a slow or absent registry can never
block the engine.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import zmq

from engine_agent.backoff import BACKOFF_MAX_S, backoff_delay_s
from engine_agent.drain import wait_for_idle
from engine_agent.identity import api_server_spec, default_member_id, new_incarnation
from engine_agent.link import (
    MAX_PENDING_REPORTS,
    Link,
    LinkPhase,
    PendingReport,
    PollPlan,
    Request,
)
from engine_agent.load_reader import LoadReader
from registry.client import parse_registries
from registry.security import ClientCurve
from serving.lifecycle import ShutdownState
from wire.limits import MAX_PROBLEM_CHARS
from wire.protocol import (
    ByeReason,
    KvIndexEntry,
    Load,
    MemberSpec,
    MemberState,
    Reply,
    make_encoder,
    reply_decoder,
    role_name,
)
from wire.validation import validate_spec

__all__ = [
    "BACKOFF_MAX_S", "Agent", "api_server_spec", "backoff_delay_s", "default_member_id",
    "new_incarnation",
    "wait_for_idle",
]

logger = logging.getLogger(__name__)

BYE_TIMEOUT_S = 0.5  # stop() waits this long for registries to acknowledge bye
MAX_POLL_S = 1.0  # the loop never polls longer than this, even with nothing due
THREAD_JOIN_MARGIN_S = 2.0
LOOP_ERROR_PAUSE_S = 0.1  # after an unexpected error, so a persistent one cannot spin


class Agent:
    """Registers `spec` with every registry and heartbeats until stopped.

    Thread-safe front, background thread behind: every public method returns at once
    (except `drain`, which waits for the caller's own in-flight work, and `stop`, which
    waits at most `BYE_TIMEOUT_S` plus a margin). `curve` makes every socket a CURVE
    client of the registries (`registry.security.ClientCurve`).
    """

    def __init__(self, spec: MemberSpec, *, registries: str | Sequence[str] | None = None,
                 load: Callable[[], Load] = Load, token: str = "",
                 state: MemberState = MemberState.JOINING,
                 curve: ClientCurve | None = None) -> None:
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
        self._load = LoadReader(load)
        self._token = token
        self._curve = curve
        self._state = MemberState(state)
        # An operator drained this member at one of its registries: DRAINING from now on,
        # whatever the owner sets, so every registry (and a restarted one) reports it.
        self._admin_drained = False
        self._bye_reason = ByeReason.SHUTDOWN
        # An operator banned this id at one of its registries: (seconds, monotonic time
        # told). The bye passes the ban on to every registry that holds a session.
        self._ban: tuple[float, float] | None = None
        self._shutdown = ShutdownState.RUNNING
        self._links = [Link(address, spec.id) for address in self._addresses]
        self._reports: queue.SimpleQueue[PendingReport] = queue.SimpleQueue()
        self._kv_reports: queue.SimpleQueue[list[KvIndexEntry]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stop_lock = threading.Lock()
        # A socket pair, not os.pipe(): once closed (under `_stop_lock`, which sends take),
        # a late wake-up fails on the object, not on a descriptor the process reused.
        self._wake_rx, self._wake_tx = socket.socketpair()
        self._wake_rx.setblocking(False)
        self._wake_tx.setblocking(False)
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
        logger.info("[agent] start id=%s incarnation=%d role=%s registries=%s curve=%s",
                    self._spec.id, self._spec.incarnation, role_name(self._spec.role),
                    ",".join(self._addresses), "on" if self._curve else "off")
        return self

    def set_state(self, state: MemberState) -> None:
        """Announce a new state; the loop sends a heartbeat right away."""
        state = MemberState(state)
        if state is self._state:
            return
        if self._admin_drained and state is not MemberState.DRAINING:
            logger.info("[agent] state id=%s stays draining (an operator drained it), not %s",
                        self._spec.id, state.name.lower())
            return
        logger.info("[agent] state id=%s %s -> %s", self._spec.id,
                    self._state.name.lower(), state.name.lower())
        self._state = state
        self._wake()

    def report(self, member_id: str, incarnation: int, problem: str) -> None:
        """Tell every registry that a member failed a request; never blocks.

        Proved with this member's sessions: registries accept reports only from
        `api_server` members (routers). At most MAX_PENDING_REPORTS wait per registry.
        """
        self._reports.put((member_id, incarnation, problem[:MAX_PROBLEM_CHARS]))
        self._wake()

    def report_kv(self, entries: list[KvIndexEntry]) -> bool:
        """Hand a router's KV index entries (changes, refresh slices) to every registry;
        never blocks. Each registry gets at most one KV report per heartbeat interval
        (newest entry per member kept meanwhile). False once the agent is stopping.

        Proved with this member's sessions: registries take them only from `api_server`
        members (routers), and only show them (registry/kv_reports.py).
        """
        if self._shutdown is not ShutdownState.RUNNING:
            return False
        if entries:
            self._kv_reports.put(list(entries))
            self._wake()
        return True

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
            self._close_wake()
            return
        self._wake()
        thread.join(BYE_TIMEOUT_S + THREAD_JOIN_MARGIN_S)
        if thread.is_alive():
            logger.warning("[agent] stop id=%s: loop thread did not exit in time", self._spec.id)
        else:
            self._close_wake()

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
                link.close_socket()
                link.registered = False
            context.term()
            self._shutdown = ShutdownState.STOPPED

    def _send_due(self, context: zmq.Context,
                  encoder: msgspec.msgpack.Encoder) -> PollPlan:
        """Time out late requests, send what is due, and plan the next poll."""
        self._take_reports()
        now = time.monotonic()
        plan = PollPlan(timeout_s=MAX_POLL_S)
        load: Load | None = None
        for link in self._links:
            if not link.idle:
                assert link.in_flight_since is not None
                late_at = link.in_flight_since + link.reply_timeout_s
                if now >= late_at:
                    link.on_no_reply(now, self._rng)
                else:
                    plan.watch(link, late_at - now)
                    continue
            # A state change or a failure report goes out at once, not at the next interval
            # (a KV index report as soon as the registry takes the next one).
            urgent = link.registered and link.failures == 0 and (
                link.in_flight_state is not self._state or bool(link.reports)
                or link.kv_due(now))
            if now < link.next_send_at and not urgent:
                plan.wait_until(link.next_send_at - now)
                if link.registered and link.kv_pending and link.kv_next_at > now:
                    plan.wait_until(link.kv_next_at - now)
                continue
            if load is None:
                load = self._load.read()  # once per round, shared by every due link
            state = self._state
            frames = link.request(self._spec, self._token, state, load, encoder, now)
            sock = link.open_socket(context, self._curve)
            # A full queue counts as unanswered: the socket is recreated when the reply is late.
            with contextlib.suppress(zmq.Again):
                sock.send_multipart(frames, zmq.NOBLOCK)
            link.in_flight_since = now
            link.in_flight_state = state
            plan.watch(link, link.reply_timeout_s)
        return plan

    def _receive(self, plan: PollPlan, decoder: msgspec.msgpack.Decoder) -> None:
        poller = zmq.Poller()
        # By its descriptor: pyzmq reports a plain socket by its fd, not the object, so
        # testing for the object never drains the wake-up and the loop spins.
        wake_fd = self._wake_rx.fileno()
        poller.register(wake_fd, zmq.POLLIN)
        for link in plan.links:
            if link.socket is not None:
                poller.register(link.socket, zmq.POLLIN)
        # Rounded up: pyzmq truncates to whole ms (a 0 spins the last ms before a beat).
        events = dict(poller.poll(math.ceil(max(0.0, plan.timeout_s) * 1000)))
        if wake_fd in events:
            self._drain_wake()
        for link in plan.links:
            if link.socket is not None and link.socket in events:
                self._on_frames(link, link.socket.recv_multipart(zmq.NOBLOCK), decoder)

    def _on_frames(self, link: Link, frames: list[bytes],
                   decoder: msgspec.msgpack.Decoder) -> None:
        try:
            reply = decoder.decode(frames[-1])
        except (msgspec.DecodeError, IndexError) as exc:
            logger.warning("[agent] bad reply from %s: %s", link.address, exc)
            link.in_flight = link.in_flight_since = None
            link.next_send_at = time.monotonic() + link.interval_s
            return
        if not isinstance(reply, Reply):
            logger.warning("[agent] unexpected %s from %s", type(reply).__name__, link.address)
            return
        link.on_reply(reply, time.monotonic(), self._rng)
        # What an operator told one registry, passed on to every registry by this member
        # (each one hears from it, a restarted one too). Only a registry this member
        # talks to, over its CURVE-checked socket, can say either.
        if reply.drain and not self._admin_drained:
            logger.warning("[agent] registry %s: an operator drained id=%s; draining at "
                           "every registry", link.address, self._spec.id)
            self.set_state(MemberState.DRAINING)
            self._admin_drained = True
        # Also while saying bye: a late Register reply may be the one that says it.
        if reply.banned_s > 0 and (self._ban is None or reply.banned_s > self._ban[0]):
            self._ban = (reply.banned_s, time.monotonic())
            if self._shutdown is ShutdownState.RUNNING:
                logger.error("[agent] registry %s: id=%s is banned for %.0fs (an operator "
                             "evicted it); passing the ban on to every registry and "
                             "registering no more", link.address, self._spec.id,
                             reply.banned_s)
                self._shutdown = ShutdownState.REQUESTED  # the loop says bye, then exits

    def _say_bye(self, context: zmq.Context, encoder: msgspec.msgpack.Encoder,
                 decoder: msgspec.msgpack.Decoder) -> None:
        deadline = time.monotonic() + BYE_TIMEOUT_S
        self._finish_registrations(deadline, decoder)
        waiting: dict[zmq.Socket, int] = {}  # socket -> replies still expected
        for link in self._links:
            if link.phase is not LinkPhase.HEARTBEATING or not link.session:
                continue  # never registered there (or gave up): nothing to remove
            sock = link.open_socket(context, self._curve)
            try:
                sock.send_multipart(self._bye_frames(link, encoder), zmq.NOBLOCK)
            except zmq.Again:
                continue
            waiting[sock] = 1 if link.idle else 2
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
                    "banned" if self._ban else self._bye_reason.name.lower(),
                    f" (no answer from {','.join(skipped)})" if skipped else "")

    def _bye_frames(self, link: Link, encoder: msgspec.msgpack.Encoder) -> list[bytes]:
        if self._ban is None:
            return link.bye(self._spec, self._bye_reason, encoder)
        ban_s, told_at = self._ban
        # What is left of the ban: a registry that hears it later holds it no longer.
        left_s = max(0.0, ban_s - (time.monotonic() - told_at))
        return link.banned_bye(self._spec, left_s, encoder)

    def _finish_registrations(self, deadline: float, decoder: msgspec.msgpack.Decoder) -> None:
        """Wait (until `deadline`) for Registers still in flight: a bye needs the session
        their replies bring, or the registry would hold us until the lease runs out."""
        while time.monotonic() < deadline:
            pending = [link for link in self._links
                       if link.in_flight is Request.REGISTER and link.socket is not None]
            if not pending:
                return
            poller = zmq.Poller()
            for link in pending:
                poller.register(link.socket, zmq.POLLIN)
            ready = dict(poller.poll(max(0.0, deadline - time.monotonic()) * 1000))
            for link in pending:
                if link.socket in ready:
                    self._on_frames(link, link.socket.recv_multipart(zmq.NOBLOCK), decoder)

    # --- helpers --------------------------------------------------------------------

    def _take_reports(self) -> None:
        """Hand queued failure and KV index reports to every registry link."""
        while True:
            try:
                entries = self._kv_reports.get_nowait()
            except queue.Empty:
                break
            for link in self._links:
                link.add_kv(entries)
        while True:
            try:
                report = self._reports.get_nowait()
            except queue.Empty:
                return
            for link in self._links:
                if len(link.reports) == MAX_PENDING_REPORTS:
                    logger.warning("[agent] %s: %d reports pending; dropping the oldest",
                                   link.address, MAX_PENDING_REPORTS)
                link.reports.append(report)

    def _wake(self) -> None:
        # A full buffer means a wake-up is pending anyway; a closed one means we stopped.
        with self._stop_lock, contextlib.suppress(OSError):
            self._wake_tx.send(b"\0")

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_rx.recv(4096)

    def _close_wake(self) -> None:
        with self._stop_lock:
            self._wake_rx.close()
            self._wake_tx.close()
