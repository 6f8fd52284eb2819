"""Registry clients: `MembershipView`, a local copy of membership (ZeroMQ's Clone pattern).

Per registry the view keeps one link (registry/view_links.py: SYNCING, LIVE, AWAY).
Subscribe first, then ask for the snapshot (ZeroMQ Guide ch. 5). What a link holds and
how snapshots and events apply to it is `registry.replica.Replica`, and how several
registries make one view is `registry.merge.Merge`, both pure state; this module owns
the sockets and the timers.

A view learns the event port from a first Sync for the empty topic alone (the routers'
records: a few), subscribes, and asks for the snapshot it follows once the subscription
holds (its first message; SUBSCRIBE_SETTLE_S at most). Taught the port by that snapshot
instead, a view missed every change published before its subscription took hold: at 100k
members one always came, and the gap cost a second 40 MB snapshot. A change missed all
the same (a registry restarted, a subscription dropped) shows as a version gap in the
next event or digest (a digest comes every interval at the latest), and only then does
it sync again. The thread polls until
its next deadline (sync timeout, silence, a carried member's drop), never on a fixed tick.

With `loads_on_demand` (a router), the view follows the loads of the models readers ask
for (`ask`, on each request) and passes over the rest's, fetching them when asked for
(registry/view_demand.py): a router of every model pays for the loads of the models it
serves requests for, not the fleet's.

Readers get a `FrozenMap`: each update shares everything but what changed with the one
before, so an update costs the changed members, not a copy of the whole view.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import msgspec
import zmq

from registry import sessions
from registry.addresses import (
    DEFAULT_REGISTRY,
    REGISTRY_ENV,
    http_base,
    parse_models,
    parse_registries,
    request_snapshot,
)
from registry.frozen_map import FrozenMap
from registry.merge import Merge
from registry.replica import Applied, LiveMember, Replica
from registry.security import ClientCurve
from registry.teardown import Teardown
from registry.view_changes import Changes, ChangeTrail
from registry.view_demand import LoadsOnDemand, event_head_decoder
from registry.view_links import SYNC_TIMEOUT_S, Link, LinkState, LinkStatus
from registry.view_sockets import ViewSockets
from wire.protocol import (
    Event,
    Reply,
    Snapshot,
    Sync,
    event_decoder,
    make_encoder,
    reply_decoder,
    topic_for,
)

__all__ = ["DEFAULT_REGISTRY", "REGISTRY_ENV", "LinkState", "LinkStatus", "LiveMember",
           "MembershipView", "http_base", "parse_models", "parse_registries",
           "request_snapshot"]

logger = logging.getLogger(__name__)

THREAD_STOP_TIMEOUT_S = 10.0  # close() waits this long for the view thread
SYNC_BACKOFF_MAX_S = 2.0
SUBSCRIBE_SETTLE_S = 0.05  # a new subscription's first message, awaited this long at most
EVENTS_RCVHWM = 100_000


class MembershipView:
    """A local, eventually consistent copy of membership from one or more registries.

    A background thread subscribes to each registry's events, takes a snapshot, applies
    newer events and resynchronises on a version gap or a new epoch. Several registries
    are merged (registry/merge.py): a member is in the view while a live registry holds
    it; while every registry is away the last view is kept.

    `report()` needs a member session (only registered routers may report), which a view
    does not have: give it a `reporter`, such as the router's own `Agent.report`.
    """

    def __init__(self, registries: str | Sequence[str] | None = None, *,
                 models: Sequence[str] = (), curve: ClientCurve | None = None,
                 reporter: Callable[[str, int, str], None] | None = None,
                 token: str = "", loads_on_demand: bool = False) -> None:
        self.addresses = parse_registries(registries)
        self.models = tuple(models)
        self.curve = curve
        self.reporter = reporter
        self.token = token  # proves Syncs to a registry beyond loopback (sessions.prove_sync)
        self._sockets = ViewSockets(curve)
        self._links = [Link(i, address, Replica(address, per_model=bool(self.models),
                                                loads_on_demand=loads_on_demand))
                       for i, address in enumerate(self.addresses)]
        self._merge = Merge([link.replica for link in self._links])
        self._demand = LoadsOnDemand(self._merge, token) if loads_on_demand else None
        self._members: FrozenMap[LiveMember] = FrozenMap()
        self._trail: ChangeTrail[LiveMember] = ChangeTrail(self._members)
        self._changed = threading.Condition()
        self._listeners: list[Callable[[Mapping[str, LiveMember]], None]] = []
        self._running = False
        self._teardown = Teardown(self._sockets.destroy)
        self._thread: threading.Thread | None = None
        self._encoder = make_encoder()

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> MembershipView:
        if self._thread is None:  # once: one thread owns the sockets
            self._running = True
            self._thread = threading.Thread(target=self._teardown.owning(self._run),
                                            name="pdreg-view", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread and close every socket, never under the running thread (closed
        from a listener, the thread does on its way out). Safe twice, from any thread."""
        self._running = False
        if not self._sockets.shut():
            return
        thread = self._thread
        if (not self._teardown.close(thread, THREAD_STOP_TIMEOUT_S)
                and thread is not threading.current_thread()):
            logger.warning("[view] the view thread did not stop within %.0fs; it closes "
                           "its sockets when it does", THREAD_STOP_TIMEOUT_S)

    def __enter__(self) -> MembershipView:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reads (any thread) ------------------------------------------------------------

    def members(self) -> Mapping[str, LiveMember]:
        """The current view (immutable; swapped by reference, so free to call per request)."""
        return self._members

    def changes(self, since: int) -> Changes[LiveMember]:
        """The view's version, its members, and the ids changed after version `since`
        (None: not all known, read the members whole): a router's table follows these,
        not the whole view (registry/view_changes.py). Free when nothing changed."""
        return self._trail.since(since)

    def loads(self, model: str, after: int, upto: int) -> frozenset[str] | None:
        """The ids of `model` whose load alone changed in versions (after, upto]: not in
        `changes` (registry/view_changes.py). None: not known any more."""
        return self._trail.loads(model, after, upto)

    def loads_confirmed_at(self, model: str) -> float:
        """When the registries `model`'s members come from last confirmed their loads
        (monotonic; -inf if one never did): a member's load is current as of then, even
        if it has not changed since `LiveMember.load_at`. Per registry, the oldest of
        those (registry/merge.py)."""
        return self._merge.loads_confirmed_at(model)

    def ask(self, model: str) -> None:
        """A reader is about to read `model`'s loads (a request for it). With
        `loads_on_demand`, the view follows them from now until a minute after the last
        ask, the first ask having them fetched (until they come, `model`'s loads are as
        old as `loads_confirmed_at` says). Free enough to call per request."""
        if self._demand is not None and self._demand.ask(model):
            self._sockets.wake()

    def links(self) -> list[LinkStatus]:
        return [LinkStatus(link.address, link.state, link.replica.epoch, link.replica.version,
                           len(link.replica.members), link.replica.snapshots,
                           len(link.replica.missed))
                for link in self._links]

    @property
    def synced(self) -> bool:
        """At least one registry has given us a snapshot."""
        return any(link.replica.synced for link in self._links)

    def wait_for(self, predicate: Callable[[Mapping[str, LiveMember]], bool],
                 timeout: float) -> bool:
        """Block until predicate(members()) is true or timeout; returns whether it was."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self._members), timeout)

    def add_listener(self, callback: Callable[[Mapping[str, LiveMember]], None]) -> None:
        """Call back (from the view's thread) after every change, with the new view."""
        self._listeners.append(callback)

    def report(self, member_id: str, incarnation: int, problem: str) -> None:
        """Tell the registries a member failed a request, through `reporter` (never blocks).

        Without a reporter the report stays local (the router's own quarantine holds).
        """
        if self.reporter is not None:
            self.reporter(member_id, incarnation, problem)
        else:
            logger.debug("[view] no reporter: report on %s stays local", member_id)

    # --- the view thread ---------------------------------------------------------------

    def _run(self) -> None:
        decode_event = event_decoder()
        decode_head = event_head_decoder() if self._demand is not None else None
        decode_reply = reply_decoder()
        while self._running:
            now = time.monotonic()
            changed = False
            for link in self._links:
                changed |= self._check_timers(link, now)
            # Poll until the next deadline; rounded up, as pyzmq truncates to whole ms.
            timeout_ms = math.ceil(max(0.0, self._next_deadline(now) - now) * 1e3)
            ready = self._sockets.poll(timeout_ms)
            now = time.monotonic()
            for link in self._links:
                if link.dealer is not None and link.dealer in ready:
                    changed |= self._read_replies(link, decode_reply, now)
                if link.sub is not None and link.sub in ready:
                    changed |= self._read_events(link, decode_event, decode_head, now)
                if link.loads_dealer is not None and link.loads_dealer in ready:
                    assert self._demand is not None
                    changed |= self._demand.read(link, decode_reply, now)
            if self._demand is not None:
                self._demand.follow(now, self._links)
                for link in self._links:
                    self._demand.fetch(link, link.replica.take_to_fetch(), now,
                                       self._sockets.dealer)
            self._publish(now, changed)

    def _check_timers(self, link: Link, now: float) -> bool:
        changed = link.replica.drop_carried(now)
        if self._demand is not None:
            self._demand.retry(link, now, self._sockets.dealer, self._sockets.close)
        if link.state is LinkState.LIVE and not self._merge.live(link.index, now):
            logger.warning("[view] registry %s silent past its lease (%.1fs): out of the "
                           "merge, resyncing", link.address,
                           self._merge.away_after_s(link.index))
            link.state = LinkState.AWAY
            link.next_sync_at = now
        elif link.state is LinkState.LIVE and link.replica.per_model:
            silent = link.replica.silent_model(now, self._merge.away_after_s(link.index))
            if silent is not None:
                logger.info("[view] %s: model %r silent while we hold members of it: "
                            "resync", link.address, silent)
                self._resync(link, now)
        if link.state is not LinkState.LIVE:
            waiting = link.sync_sent_at and now - link.sync_sent_at < SYNC_TIMEOUT_S
            if not waiting and now >= link.next_sync_at:
                if link.sync_sent_at:
                    # No answer: a DEALER to a dead peer keeps its queue; start afresh.
                    self._reset_dealer(link)
                    link.backoff_s = min(SYNC_BACKOFF_MAX_S, link.backoff_s * 2)
                self._send_sync(link, now)
        return changed

    def _next_deadline(self, now: float) -> float:
        """When `_check_timers` next has something to do for some link."""
        deadline = math.inf
        for link in self._links:
            if link.state is LinkState.LIVE:
                away_after_s = self._merge.away_after_s(link.index)
                deadline = min(deadline, self._merge.heard_at(link.index) + away_after_s)
                if link.replica.per_model:
                    deadline = min(deadline, link.replica.next_silence_at(away_after_s))
            elif link.sync_sent_at:
                deadline = min(deadline, max(link.sync_sent_at + SYNC_TIMEOUT_S,
                                             link.next_sync_at))
            else:
                deadline = min(deadline, link.next_sync_at)
            drop_at = link.replica.next_drop_at()
            if drop_at is not None:
                deadline = min(deadline, drop_at)
            retry_at = LoadsOnDemand.next_retry_at(link)
            if retry_at is not None:
                deadline = min(deadline, retry_at)
        return max(deadline, now)

    def _send_sync(self, link: Link, now: float) -> None:
        if link.dealer is None:
            link.dealer = self._sockets.dealer(link.address)
        encode = self._encoder.encode
        # Not subscribed yet: the empty topic alone, for the event port (see above). Else
        # the models it follows and the empty topic's (routers, planners), as subscribed.
        link.probing = link.sub is None
        models = [""] if link.probing else [*self.models, ""] if self.models else []
        sync = sessions.prove_sync(Sync(models=models), self.token, encode)
        link.dealer.send(encode(sync), zmq.NOBLOCK)
        link.sync_sent_at = now
        link.next_sync_at = now + link.backoff_s
        link.buffered.clear()

    def _reset_dealer(self, link: Link) -> None:
        if link.dealer is not None:
            self._sockets.close(link.dealer)
            link.dealer = None
        link.sync_sent_at = 0.0

    def _subscribe(self, link: Link, events_port: int) -> None:
        if link.sub is not None and link.events_port == events_port:
            return
        if link.sub is not None:
            self._sockets.close(link.sub)
        host = link.address.rpartition(":")[0]
        link.sub = self._sockets.socket(zmq.SUB)
        link.sub.setsockopt(zmq.RCVHWM, EVENTS_RCVHWM)
        if self.models:
            for model in (*self.models, ""):
                link.sub.setsockopt(zmq.SUBSCRIBE, topic_for(model))
        else:
            link.sub.setsockopt(zmq.SUBSCRIBE, b"")
        link.sub.connect(f"tcp://{host}:{events_port}")
        link.events_port = events_port
        self._sockets.polled(link.sub)

    def _read_replies(self, link: Link, decode: msgspec.msgpack.Decoder[Reply | Snapshot],
                      now: float) -> bool:
        changed = False
        while link.dealer is not None:
            try:
                payload = link.dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                message = decode.decode(payload)
            except msgspec.MsgspecError as exc:
                logger.warning("[view] %s: undecodable reply: %s", link.address, exc)
                continue
            self._merge.heard(link.index, now)
            if isinstance(message, Snapshot) and link.probing:
                # Subscribed, the snapshot to follow is asked for once the subscription
                # shows it holds (its first message), or after SUBSCRIBE_SETTLE_S from a
                # registry so quiet that it would miss nothing.
                self._subscribe(link, message.events_port)
                link.sync_sent_at, link.next_sync_at = 0.0, now + SUBSCRIBE_SETTLE_S
            elif isinstance(message, Snapshot):
                changed |= self._apply_snapshot(link, message, now)
            else:  # a refused Sync: rate limited, or another protocol version
                logger.warning("[view] %s refused the sync: %s", link.address, message.reason)
        return changed

    def _apply_snapshot(self, link: Link, snapshot: Snapshot, now: float) -> bool:
        needs_subscription = link.sub is None or link.events_port != snapshot.events_port
        link.sync_sent_at = 0.0
        link.backoff_s = 0.1
        if needs_subscription:
            # This snapshot taught us the port. Subscribe now and use it all the same:
            # whatever changed before the subscription took hold shows as a version gap
            # (the next event, or the next digest within an interval), which resyncs.
            self._subscribe(link, snapshot.events_port)
        replica = link.replica
        replica.apply_snapshot(snapshot, now, time.time())
        link.state = LinkState.LIVE
        self._merge.heard(link.index, now)
        buffered, link.buffered = link.buffered, []
        for event in buffered:
            if event.epoch == replica.epoch and event.version > replica.version:
                self._apply_event(link, event, now)
        logger.debug("[view] %s: snapshot epoch=%d version=%d members=%d", link.address,
                     snapshot.epoch, snapshot.version, len(snapshot.members))
        return True

    def _read_events(self, link: Link, decode: msgspec.msgpack.Decoder[Event],
                     decode_head: msgspec.msgpack.Decoder[Event] | None, now: float) -> bool:
        """`decode_head` (loads on demand): for the topics of models not followed."""
        changed = False
        eager = self._demand.eager_topics if self._demand is not None else frozenset()
        while link.sub is not None:
            try:
                frames = link.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:
                continue
            decoder = decode if decode_head is None or frames[0] in eager else decode_head
            try:
                event = decoder.decode(frames[1])
            except msgspec.MsgspecError as exc:
                logger.warning("[view] %s: undecodable event: %s", link.address, exc)
                continue
            self._merge.heard(link.index, now)
            if link.state is not LinkState.LIVE:
                link.buffered.append(event)
                if link.probing and not link.sync_sent_at:
                    link.next_sync_at = now  # the subscription holds: sync (see above)
                continue
            changed |= self._apply_event(link, event, now)
        return changed

    def _apply_event(self, link: Link, event: Event, now: float) -> bool:
        applied = link.replica.apply(event, now)
        if applied is Applied.GAP:
            self._resync(link, now)
        return applied is Applied.CHANGED

    def _resync(self, link: Link, now: float) -> None:
        link.state = LinkState.SYNCING
        link.next_sync_at = now
        link.sync_sent_at = 0.0

    def _publish(self, now: float, changed: bool) -> None:
        """Merge what changed and hand it to readers. `changed`: something was applied,
        so waiters look again even when the view is the same (a first snapshot of an
        empty registry changes no member and makes the view `synced`)."""
        if not self._merge.update(now):
            if changed:
                with self._changed:
                    self._changed.notify_all()
            return
        view = self._merge.members
        self._trail.publish(view, self._merge.last_changed, self._merge.last_loaded)
        with self._changed:
            self._members = view
            self._changed.notify_all()
        for callback in self._listeners:
            try:
                callback(view)
            except Exception:
                logger.exception("[view] listener failed")
